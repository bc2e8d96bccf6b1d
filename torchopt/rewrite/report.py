"""Reports: diagnostics as text (ruff-like), json, sarif or github annotations, and run summaries."""
from __future__ import annotations

import json
from collections import Counter
from typing import Iterable, Sequence

from torchopt import __version__
from torchopt.rewrite.engine import Diagnostic

FORMATS = ("text", "json", "sarif", "github")
DOCS_URL = "https://github.com/torchopt/torchopt/blob/main/docs/rules/{code}.md"


def marker(d: Diagnostic) -> str:
    if d.fix is None:
        return ""
    return "[*] " if d.fix.safety == "safe" else "[unsafe fix] "


def text_line(d: Diagnostic) -> str:
    return f"{d.path}:{d.line}:{d.column}: {d.code} {marker(d)}{d.message}"


def render(diags: Sequence[Diagnostic], fmt: str, fixed: Iterable[Diagnostic] = ()) -> str:
    diags = sorted(diags, key=Diagnostic.sort_key)
    if fmt == "text":
        return "".join(text_line(d) + "\n" for d in diags)
    if fmt == "json":
        rows = [dict(d.to_json(), fixed=False) for d in diags]
        rows += [dict(d.to_json(), fixed=True) for d in sorted(fixed, key=Diagnostic.sort_key)]
        return json.dumps(rows, indent=2) + "\n"
    if fmt == "github":
        out = []
        for d in diags:
            msg = d.message.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
            out.append(
                f"::warning title=torchopt ({d.code}),file={d.path},line={d.line},col={d.column},"
                f"endLine={d.end_line},endColumn={d.end_column}::{d.code} {msg}\n"
            )
        return "".join(out)
    if fmt == "sarif":
        return json.dumps(sarif(diags), indent=2) + "\n"
    raise ValueError(f"unknown output format {fmt!r}")


def sarif(diags: Sequence[Diagnostic]) -> dict:
    from torchopt.rewrite.registry import all_rules

    rules = all_rules()
    used = sorted({d.code for d in diags})
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "torchopt",
                "version": __version__,
                "informationUri": "https://github.com/torchopt/torchopt",
                "rules": [{
                    "id": c,
                    "name": rules[c].name,
                    "shortDescription": {"text": rules[c].summary()},
                    "helpUri": DOCS_URL.format(code=c),
                } for c in used],
            }},
            "results": [{
                "ruleId": d.code,
                "level": "warning" if d.fix is not None else "note",
                "message": {"text": d.message},
                "locations": [{"physicalLocation": {
                    "artifactLocation": {"uri": d.path.replace("\\", "/")},
                    "region": {"startLine": d.line, "startColumn": d.column,
                               "endLine": d.end_line, "endColumn": d.end_column},
                }}],
            } for d in diags],
        }],
    }


def per_code(diags: Iterable[Diagnostic]) -> str:
    counts = Counter(d.code for d in diags)
    return ", ".join(f"{c} ×{n}" for c, n in sorted(counts.items()))


def plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}{'es' if word.endswith(('s', 'x', 'sh', 'ch')) else 's'}"
