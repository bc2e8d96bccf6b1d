"""Reports: diagnostics as text (ruff-like), json, sarif or github annotations, and run summaries."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import PurePath
from typing import Callable, Iterable, Sequence
from urllib.parse import quote

from torchopt import __version__
from torchopt.rewrite import source
from torchopt.rewrite.engine import Diagnostic

FORMATS = ("text", "json", "sarif", "github")
DOCS_URL = "https://github.com/torchopt/torchopt/blob/main/docs/rules/{code}.md"


def marker(d: Diagnostic) -> str:
    if d.fix is None:
        return ""
    return "[*] " if d.fix.safety == "safe" else "[unsafe fix] "


def location(d: Diagnostic) -> str:
    """``path:line:column``, or ``path:cell N:line:column`` in a notebook (as ruff writes it)."""
    cell = f"cell {d.cell}:" if d.cell is not None else ""
    return f"{d.path}:{cell}{d.line}:{d.column}"


def text_line(d: Diagnostic) -> str:
    return f"{location(d)}: {d.code} {marker(d)}{d.message}"


def render(
    diags: Sequence[Diagnostic],
    fmt: str,
    fixed: Iterable[Diagnostic] = (),
    edits: Callable[[Diagnostic], list[dict] | None] = lambda d: None,
) -> str:
    """``edits``: the edits of a diagnostic's fix, for the JSON rows (None: not known)."""
    diags = sorted(diags, key=Diagnostic.sort_key)
    if fmt == "text":
        return "".join(text_line(d) + "\n" for d in diags)
    if fmt == "json":
        import json

        rows = [dict(d.to_json(edits(d)), fixed=False) for d in diags]
        rows += [dict(d.to_json(), fixed=True) for d in sorted(fixed, key=Diagnostic.sort_key)]
        return json.dumps(rows, indent=2) + "\n"
    if fmt == "github":
        out = []
        for d in diags:
            title, path = _gh_property(f"torchopt ({d.code})"), _gh_property(d.path)
            out.append(
                f"::warning title={title},file={path},line={d.line},col={d.column},"
                f"endLine={d.end_line},endColumn={d.end_column}::{_gh_data(_gh_message(d))}\n"
            )
        return "".join(out)
    if fmt == "sarif":
        import json

        return json.dumps(sarif(diags), indent=2) + "\n"
    raise ValueError(f"unknown output format {fmt!r}")


def _gh_message(d: Diagnostic) -> str:
    return f"{d.code} {d.message}" if d.cell is None else f"cell {d.cell}: {d.code} {d.message}"


def _gh_data(text: str) -> str:
    """A workflow command's message: GitHub's runner decodes these three escapes (a raw newline
    would end the command early)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_property(text: str) -> str:
    """A workflow command property (``file=``, ``title=``): ``,`` separates properties and ``::``
    starts the message, so both are escaped too."""
    return _gh_data(text).replace(":", "%3A").replace(",", "%2C")


def sarif_uri(path: str) -> str:
    """``artifactLocation.uri`` must be a URI reference: absolute paths become ``file:`` URIs,
    relative ones a percent-encoded relative reference (so ``#``, ``%``, spaces, non-ASCII and a
    leading ``C:`` cannot be read as a fragment, an escape or a scheme)."""
    pure = PurePath(path)
    if pure.is_absolute():
        return pure.as_uri()
    return quote(os.fsencode(pure.as_posix()), safe="/")


def sarif(diags: Sequence[Diagnostic]) -> dict:
    from torchopt.rewrite.registry import all_rules

    rules = all_rules()
    used = sorted({d.code for d in diags})
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [
            {
                # Columns are counted in characters (code points), not SARIF's default UTF-16 units.
                "columnKind": "unicodeCodePoints",
                "tool": {
                    "driver": {
                        "name": "torchopt",
                        "version": __version__,
                        "informationUri": "https://github.com/torchopt/torchopt",
                        "rules": [
                            {
                                "id": c,
                                "name": rules[c].name,
                                "shortDescription": {"text": rules[c].summary()},
                                "helpUri": DOCS_URL.format(code=c),
                            }
                            for c in used
                        ],
                    }
                },
                "results": [
                    {
                        "ruleId": d.code,
                        "level": "warning" if d.fix is not None else "note",
                        "message": {"text": d.message if d.cell is None else f"cell {d.cell}: {d.message}"},
                        "locations": [
                            {
                                "physicalLocation": {
                                    "artifactLocation": {"uri": sarif_uri(d.path)},
                                    "region": {
                                        "startLine": d.line,
                                        "startColumn": d.column,
                                        "endLine": d.end_line,
                                        "endColumn": d.end_column,
                                    },
                                }
                            }
                        ],
                    }
                    for d in diags
                ],
            }
        ],
    }


def statistics(diags: Sequence[Diagnostic], fmt: str) -> str:
    """`check --statistics`: how many diagnostics each code has, most first (as ruff's)."""
    counts = Counter(d.code for d in diags)
    fixable = {d.code for d in diags if d.fix is not None and d.fix.safety == "safe"}
    names = {d.code: d.name for d in diags}
    rows = sorted(counts.items(), key=lambda cn: (-cn[1], cn[0]))
    if fmt == "json":
        import json

        out = [{"code": c, "name": names[c], "count": n, "fixable": c in fixable} for c, n in rows]
        return json.dumps(out, indent=2) + "\n"
    width = max((len(str(n)) for _, n in rows), default=1)
    return "".join(f"{n:>{width}}\t{c}\t{'[*] ' if c in fixable else ''}{names[c]}\n" for c, n in rows)


def fixed_per_file(results: Iterable) -> str:
    """`check --fix --show-fixes`: the fixes applied, per file and code."""
    lines = []
    for r in results:
        if not r.applied:
            continue
        lines.append(f"{source.shown(r.path)}:")
        for code, n in sorted(Counter(d.code for d in r.applied).items()):
            name = next(d.name for d in r.applied if d.code == code)
            lines.append(f"    {n} × {code} ({name})")
    total = sum(len(r.applied) for r in results)
    return f"Fixed {plural(total, 'diagnostic')}:\n" + "\n".join(lines)


def per_code(diags: Iterable[Diagnostic]) -> str:
    counts = Counter(d.code for d in diags)
    return ", ".join(f"{c} ×{n}" for c, n in sorted(counts.items()))


def plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}{'es' if word.endswith(('s', 'x', 'sh', 'ch')) else 's'}"
