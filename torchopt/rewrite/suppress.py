"""Suppression comments: `# noqa`, `# noqa: TOP101,TOP102`, `# torchopt: ignore[TOP101]`."""

from __future__ import annotations

import io
import re
import tokenize

ALL = "*"
_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?", re.I)
_IGNORE = re.compile(r"#\s*torchopt:\s*ignore(?:\[(?P<codes>[^\]]*)\])?", re.I)


def _codes(raw: str | None) -> set[str]:
    if raw is None:
        return {ALL}
    return {c.strip().upper() for c in re.split(r"[\s,]+", raw) if c.strip()}


def parse(text: str) -> dict[int, set[str]]:
    """Line number (1-based) -> suppressed codes (``ALL`` for a bare comment)."""
    out: dict[int, set[str]] = {}
    if "noqa" not in text and "torchopt:" not in text:
        return out
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return out
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        for pattern in (_NOQA, _IGNORE):
            for m in pattern.finditer(tok.string):
                out.setdefault(tok.start[0], set()).update(_codes(m.group("codes")))
    return out


def is_suppressed(table: dict[int, set[str]], code: str, lines: tuple[int, ...]) -> bool:
    for line in lines:
        codes = table.get(line)
        if codes and (ALL in codes or any(code.startswith(c) for c in codes)):
            return True
    return False


def comment_for(code: str) -> str:
    return f"# torchopt: ignore[{code}]"
