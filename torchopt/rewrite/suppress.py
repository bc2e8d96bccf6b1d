"""Suppression comments: `# noqa`, `# noqa: TOP101,TOP102`, `# torchopt: ignore[TOP101]`."""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass
from typing import Callable, Iterable

ALL = "*"
# The code of torchopt's own finding for a suppression that suppresses nothing (ruff's RUF100).
UNUSED_CODE = "TOP001"
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
    return matching(table, code, lines) is not None


def matching(table: dict[int, set[str]], code: str, lines: Iterable[int]) -> tuple[int, str] | None:
    """The (line, entry) of the suppression that silences ``code`` reported on ``lines``, if any."""
    for line in lines:
        codes = table.get(line)
        if not codes:
            continue
        if ALL in codes:
            return line, ALL
        entry = next((c for c in sorted(codes) if code.startswith(c)), None)
        if entry is not None:
            return line, entry
    return None


@dataclass(frozen=True)
class Unused:
    """A suppression comment's directive with torchopt codes that suppress nothing: where it is, the
    codes, and the edit that removes them: columns ``start``:``end`` of ``line`` (its line ending
    included) become ``replacement``."""

    line: int
    column: int  # 0-based, in characters: the directive
    end_column: int
    unused: tuple[str, ...]
    unknown: tuple[str, ...]
    start: int
    end: int
    replacement: str

    def message(self) -> str:
        parts = [
            f"{what}: {', '.join(f'`{c}`' for c in codes)}"
            for what, codes in (("unused", self.unused), ("unknown", self.unknown))
            if codes
        ]
        return f"Unused suppression ({'; '.join(parts)})"


def unused(
    text: str, used: set[tuple[int, str]], enabled: frozenset[str], known: Callable[[str], bool]
) -> list[Unused]:
    """The directives whose torchopt codes suppressed nothing in this run (``used`` holds the
    (line, entry) pairs that did), or name no rule (``known``). Left alone: codes of other tools,
    a bare ``# noqa`` (other linters read it too), and codes of rules not enabled in this run (a run
    with a narrower selection must not call a suppression the full run needs unused)."""
    if "noqa" not in text and "torchopt:" not in text:
        return []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return []
    table = parse(text)
    out = []
    for tok in tokens:
        if tok.type != tokenize.COMMENT or is_suppressed(table, UNUSED_CODE, (tok.start[0],)):
            continue
        for pattern in (_NOQA, _IGNORE):
            for m in pattern.finditer(tok.string):
                found = _unused_in(tok, m, pattern is _IGNORE, used, enabled, known)
                if found is not None:
                    out.append(found)
    return out


def _unused_in(tok, m, ours: bool, used, enabled, known) -> Unused | None:
    line = tok.start[0]
    raw = m.group("codes")
    if raw is None:
        if not ours or (line, ALL) in used:  # a bare noqa comment may serve another linter
            return None
        listed: list[str] = []
        bad, unknown = [ALL], []
    else:
        listed = [c.strip() for c in re.split(r"[\s,]+", raw) if c.strip()]
        tops = [c for c in listed if c.upper().startswith("TOP")]
        unknown = [c for c in tops if not known(c.upper())]
        bad = [
            c
            for c in tops
            if c not in unknown and (line, c.upper()) not in used and any(e.startswith(c.upper()) for e in enabled)
        ]
        if not bad and not unknown:
            return None
    kept = [c for c in listed if c not in bad and c not in unknown]
    col, comment = tok.start[1], tok.string
    head, tail = comment[: m.start()], comment[m.end() :]
    replacement = ""
    if kept:
        start, end = col + m.start("codes"), col + m.end("codes")
        replacement = ", ".join(kept)
    elif not head.strip() and not tail.strip() and not tok.line[:col].strip():  # a line of its own goes
        start, end = 0, len(tok.line)
    elif not head.strip() and not tail.strip():  # the whole comment goes, and the spaces before it
        start, end = len(tok.line[:col].rstrip()), col + len(comment)
    elif not tail.strip():  # "a note, then the directive" keeps the note
        start, end = col + len(head.rstrip()), col + len(comment)
    elif not head.strip():  # "the directive, then a note" keeps the note
        start, end = col, col + len(comment) - len(tail.lstrip())
        replacement = "" if tail.lstrip().startswith("#") else "# "
    else:
        start, end = col + m.start(), col + m.end()
    return Unused(
        line=line,
        column=col + m.start(),
        end_column=col + m.end(),
        unused=tuple(c.upper() if c != ALL else "torchopt: ignore" for c in bad if c),
        unknown=tuple(c.upper() for c in unknown),
        start=start,
        end=end,
        replacement=replacement,
    )


def remove_unused(text: str, found: list[Unused]) -> str:
    """``text`` with the edits of ``found`` (one per directive, never overlapping) made."""
    lines = text.splitlines(keepends=True)
    for u in sorted(found, key=lambda u: (u.line, u.start), reverse=True):
        raw = lines[u.line - 1]
        lines[u.line - 1] = raw[: u.start] + u.replacement + raw[u.end :]
    return "".join(lines)


def comment_for(code: str) -> str:
    return f"# torchopt: ignore[{code}]"


def _closed_lines(tokens: list[tokenize.TokenInfo]) -> set[int]:
    """Lines a comment cannot end: inside a multi-line string or continued by a backslash."""
    out: set[int] = set()
    for tok in tokens:
        if tok.start[0] < tok.end[0] and tok.type not in (tokenize.NEWLINE, tokenize.NL):
            out.update(range(tok.start[0], tok.end[0]))
    return out


def add_comments(text: str, wanted: list[tuple[str, tuple[int, ...]]]) -> tuple[str, int]:
    """``text`` with each ``(code, lines)`` suppressed by a comment on the first of ``lines`` that can
    hold one (``is_suppressed`` reads those lines): the code joins the list of a ``# noqa: ...`` or
    ``# torchopt: ignore[...]`` already there, else ``# noqa: CODE`` follows the line (and any comment
    it has, kept as it is). Returns the text and how many codes were added (a finding no line can
    hold a comment for is left as it is)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return text, 0
    closed = _closed_lines(tokens)
    comments = {tok.start[0]: tok for tok in tokens if tok.type == tokenize.COMMENT}
    lines = text.splitlines(keepends=True)
    per_line: dict[int, set[str]] = {}
    for code, where in wanted:
        line = next((n for n in where if n not in closed and 0 < n <= len(lines)), None)
        if line is not None and not lines[line - 1].rstrip("\r\n").endswith("\\"):
            per_line.setdefault(line, set()).add(code)
    added = 0
    for line, codes in per_line.items():
        raw = lines[line - 1]
        body = raw.rstrip("\r\n")
        ending = raw[len(body) :]
        tok = comments.get(line)
        listed = None
        if tok is not None:
            listed = next((m for p in (_IGNORE, _NOQA) for m in p.finditer(tok.string) if m.group("codes")), None)
        if tok is not None and listed is not None:
            new = sorted(codes - _codes(listed.group("codes")))
            at = tok.start[1] + listed.end("codes")
            body = body[:at] + "".join(f", {c}" for c in new) + body[at:]
        else:
            new = sorted(codes)
            body = body.rstrip() + f"  # noqa: {', '.join(new)}"
        added += len(new)
        lines[line - 1] = body + ending
    return "".join(lines), added
