"""Rule pages, generated from the rule classes: docs/rules/CODE.md and `torchopt rule CODE`.

Regenerate the committed pages with `python -m torchopt.rewrite.ruledoc docs/rules`.
"""

from __future__ import annotations

import inspect
import re
import os
import sys

from torchopt.rewrite.registry import RULE_PACKAGE, all_rules, source_path
from torchopt.rewrite.rule import TAG_MEANING, Invalid, Rule, Safety, Tag, Valid


def _fence(src: str) -> str:
    return "```python\n" + src.rstrip("\n") + "\n```\n"


def _template(message: str) -> str:
    return re.sub(r"\{(\w+)\}", r"<\1>", message)


def _messages(rule: type[Rule], src: str) -> list[str]:
    """What the rule actually says about an example (so the page shows real messages)."""
    from torchopt.rewrite.config import Settings
    from torchopt.rewrite.engine import check_source

    diags = check_source(src, Settings(select=(rule.code,))).diagnostics
    return [f"{d.line}:{d.column}: {d.message}" for d in diags if d.code == rule.code]


def render(rule: type[Rule]) -> str:
    doc = inspect.cleandoc(rule.__doc__ or "")
    invalid = [e for e in rule.examples if isinstance(e, Invalid)]
    valid = [e for e in rule.examples if isinstance(e, Valid)]
    tags = sorted({t for e in invalid for t in e.unsafe_tags})
    if rule.safety is Safety.DISPLAY:
        fix = "display-only (no automatic fix)"
    elif rule.safety is Safety.SAFE:
        fix = "safe" + (f"; unsafe in some cases ({', '.join(tags)})" if tags else "")
    else:
        fix = "unsafe" + (f" ({', '.join(tags)})" if tags else "") + ": applied only with `--unsafe-fixes`"
    lines = [
        f"# {rule.code} `{rule.name}`",
        "",
        f"*Family:* {rule.family} · *Fix:* {fix}"
        + (
            f" · *Needs:* PyTorch ≥ {rule.min_torch[0]}.{rule.min_torch[1]} (not run when `target-torch` is older)"
            if rule.min_torch
            else ""
        ),
        "",
        f"Source: {source_path(rule)}",
        "",
        f"*Message:* {_template(rule.message)}",
        "",
        doc,
        "",
    ]
    if tags:
        lines += ["## What an unsafe fix changes", ""]
        lines += [f"- **{t}**: {TAG_MEANING[Tag(t)]}." for t in tags]
        lines += ["", "Apply these with `--unsafe-fixes`, or promote the code with `extend-safe-fixes`.", ""]
    if rule.yields_to:
        lines += ["## One finding per problem", ""]
        lines += [f"Stays silent where {c} reports on the same code: {why}." for c, why in rule.yields_to.items()]
        lines += ["A suppression of either code on that line silences the problem.", ""]
    if rule.options:
        lines += ["## Options", "", f"Set under `[tool.torchopt.rules.{rule.code}]`:", ""]
        for o in rule.options:
            choice = f" (one of {', '.join(map(repr, o.choices))})" if o.choices else ""
            lines.append(f"- `{o.name}` ({o.type.__name__}, default `{o.default!r}`){choice}: {o.help}")
        lines.append("")
    lines += ["## Tested examples", ""]
    for e in invalid:
        note = f" {e.note}" if e.note else ""
        lines.append(f"Flagged.{note}")
        lines.append("")
        lines.append(_fence(e.src))
        lines += [f"> {m}" for m in _messages(rule, e.src)] + [""]
        if e.after is not None:
            how = f"With `--unsafe-fixes` ({', '.join(e.unsafe_tags)}):" if e.unsafe_tags else "Fixed:"
            lines += [how, "", _fence(e.after)]
        else:
            lines += ["(no automatic fix)", ""]
    for example in valid:
        note = f" {example.note}" if example.note else ""
        lines += [f"Not flagged.{note}", "", _fence(example.src)]
    lines += ["Suppress on one line with `# noqa: " + rule.code + "` or `# torchopt: ignore[" + rule.code + "]`.", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def render_index() -> str:
    lines = [
        "# Rules",
        "",
        "Generated from the rule classes; `torchopt rule CODE` prints the same pages.",
        "",
        "| code | name | fix | summary |",
        "|---|---|---|---|",
    ]
    for code, rule in all_rules().items():
        lines.append(f"| [{code}]({code}.md) | `{rule.name}` | {rule.safety.value} | {rule.summary()} |")
    topics = shared_topics()
    if topics:
        lines += [
            "",
            "## Topics handled by another rule",
            "",
            "These tuning-guide topics have no code of their own: the rules named here cover them.",
            "",
            "| topic | handled by | how |",
            "|---|---|---|",
        ]
        lines += [
            f"| {topic} | {', '.join(f'[{c}]({c}.md)' for c in codes)} | {how} |"
            for topic, (codes, how) in topics.items()
        ]
    return "\n".join(lines) + "\n"


def shared_topics() -> dict[str, tuple[tuple[str, ...], str]]:
    """Topics with no rule of their own, declared by the rule package as
    ``SHARED_TOPICS = {"topic": (("TOP401",), "how"), ...}``, so a reader who looks for the topic in
    the index finds the rule that covers it. The package is named, not imported by name: the engine
    knows no rule."""
    import importlib

    pkg = importlib.import_module(RULE_PACKAGE)
    return dict(getattr(pkg, "SHARED_TOPICS", {}))


def pages() -> dict[str, str]:
    out = {f"{code}.md": render(rule) for code, rule in all_rules().items()}
    out["README.md"] = render_index()
    return out


def write(folder: str) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    want = pages()
    for name in os.listdir(folder):
        if name.endswith(".md") and name not in want:
            os.remove(os.path.join(folder, name))
    for name, text in want.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
    return sorted(want)


if __name__ == "__main__":
    written = write(sys.argv[1] if len(sys.argv) > 1 else "docs/rules")
    print(f"wrote {len(written)} pages")
