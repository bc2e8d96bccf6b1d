"""Text positions and edits for the language server, without pygls (so they are unit-testable).

Offsets are indexes into the Python string (code points). Lines are split the way LSP and LibCST
split them (``\\r\\n``, ``\\r``, ``\\n``; not ``str.splitlines``, which also splits on form feeds and
U+2028). Columns on the wire are counted in the negotiated position encoding: UTF-16 code units
(the LSP default), UTF-8 bytes or code points (UTF-32).
"""

from __future__ import annotations

import ast
import bisect
import difflib
import io
import re
import tokenize
from dataclasses import dataclass

from torchopt.rewrite import suppress

UTF8, UTF16, UTF32 = "utf-8", "utf-16", "utf-32"
_BREAK = re.compile(r"\r\n|\r|\n")


def units(s: str, encoding: str) -> int:
    """Length of ``s`` in the client's code units."""
    if s.isascii() or encoding == UTF32:
        return len(s)
    if encoding == UTF8:
        return len(s.encode("utf-8", "surrogatepass"))
    return len(s) + sum(1 for c in s if ord(c) > 0xFFFF)


def chars_for_units(line: str, n: int, encoding: str) -> int:
    """How many code points of ``line`` the first ``n`` client units cover (clamped to the line;
    a position inside a character counts as before it)."""
    if line.isascii() or encoding == UTF32:
        return max(0, min(n, len(line)))
    used = 0
    for i, c in enumerate(line):
        step = units(c, encoding)
        if used + step > n:
            return i
        used += step
    return len(line)


class Lines:
    """Line starts of a text, for offset <-> (line, column) conversion."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.starts = [0] + [m.end() for m in _BREAK.finditer(text)]

    def __len__(self) -> int:
        return len(self.starts)

    def line(self, i: int) -> str:
        """Line ``i`` (0-based) without its line break."""
        if i < 0 or i >= len(self.starts):
            return ""
        end = self.starts[i + 1] if i + 1 < len(self.starts) else len(self.text)
        return self.text[self.starts[i] : end].rstrip("\r\n")

    def offset(self, line: int, col: int) -> int:
        """Offset of (0-based line, code-point column), clamped to the text."""
        if line < 0:
            return 0
        if line >= len(self.starts):
            return len(self.text)
        return self.starts[line] + max(0, min(col, len(self.line(line))))

    def position(self, offset: int) -> tuple[int, int]:
        """(0-based line, code-point column) of an offset."""
        offset = max(0, min(offset, len(self.text)))
        i = bisect.bisect_right(self.starts, offset) - 1
        return i, offset - self.starts[i]

    # client units ---------------------------------------------------------------------------

    def to_client(self, line: int, col: int, encoding: str) -> tuple[int, int]:
        return line, units(self.line(line)[:col], encoding)

    def offset_to_client(self, offset: int, encoding: str) -> tuple[int, int]:
        return self.to_client(*self.position(offset), encoding)

    def from_client(self, line: int, character: int, encoding: str) -> int:
        """Offset of a client position (line past the end -> end of text)."""
        if line >= len(self.starts):
            return len(self.text)
        return self.offset(line, chars_for_units(self.line(line), character, encoding))


def apply_change(text: str, start: tuple[int, int] | None, end: tuple[int, int] | None, new: str, encoding: str) -> str:
    """Apply one `didChange` content change (no range: the whole text)."""
    if start is None or end is None:
        return new
    if "\r" in text:
        lines = Lines(text)
        a = lines.from_client(*start, encoding)
        b = lines.from_client(*end, encoding)
    else:  # the common case: no need to split the whole text (90 ms for 1.5 MB) for one keystroke
        a = _from_client_lf(text, *start, encoding)
        b = _from_client_lf(text, *end, encoding)
    if b < a:
        a, b = b, a
    return text[:a] + new + text[b:]


def _from_client_lf(text: str, line: int, character: int, encoding: str) -> int:
    """``Lines(text).from_client(line, character, encoding)`` for a text whose only line break is
    ``\\n``, finding that one line's start with ``str.find`` rather than every line's."""
    if line < 0:
        return 0
    start = 0
    for _ in range(line):
        start = text.find("\n", start) + 1
        if start == 0:
            return len(text)  # a line past the end
    end = text.find("\n", start)
    end = len(text) if end < 0 else end
    return start + chars_for_units(text[start:end], character, encoding)


@dataclass(frozen=True)
class Edit:
    """Replace ``old[start:end]`` with ``text`` (offsets into the old text)."""

    start: int
    end: int
    text: str


def minimal_edits(old: str, new: str) -> list[Edit]:
    """Small non-overlapping edits that turn ``old`` into ``new``: a line diff, then each changed
    block trimmed to the characters that differ. Never one whole-document replacement (unless
    every line changed)."""
    if old == new:
        return []
    a = old.splitlines(keepends=True)
    b = new.splitlines(keepends=True)
    # Common head and tail lines first: fixes are local and this keeps difflib's work small.
    head = 0
    while head < len(a) and head < len(b) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < len(a) - head and tail < len(b) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    mid_a, mid_b = a[head : len(a) - tail], b[head : len(b) - tail]
    offsets = [0]
    for line in a:
        offsets.append(offsets[-1] + len(line))
    sm = difflib.SequenceMatcher(None, mid_a, mid_b, autojunk=len(mid_b) > 400)
    out: list[Edit] = []
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op == "equal":
            continue
        start = offsets[head + i1]
        old_chunk = "".join(mid_a[i1:i2])
        new_chunk = "".join(mid_b[j1:j2])
        p = 0
        limit = min(len(old_chunk), len(new_chunk))
        while p < limit and old_chunk[p] == new_chunk[p]:
            p += 1
        s = 0
        while s < limit - p and old_chunk[-1 - s] == new_chunk[-1 - s]:
            s += 1
        out.append(Edit(start + p, start + len(old_chunk) - s, new_chunk[p : len(new_chunk) - s]))
    return out


def apply_edits(text: str, edits: list[Edit]) -> str:
    for e in sorted(edits, key=lambda e: e.start, reverse=True):
        text = text[: e.start] + e.text + text[e.end :]
    return text


# Suppression comments ---------------------------------------------------------------------------

_NOQA_CODES = re.compile(r"#\s*noqa:\s*[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*", re.I)
_IGNORE_CODES = re.compile(r"#\s*torchopt:\s*ignore\[[^\]]*?(?=\s*\])", re.I)


def _comments(text: str) -> dict[int, tokenize.TokenInfo]:
    """0-based line -> the comment token that ends it."""
    out: dict[int, tokenize.TokenInfo] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out[tok.start[0] - 1] = tok
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return out


def _ignore_on(text: str, lines: Lines, line: int, code: str, comments: dict[int, tokenize.TokenInfo]) -> Edit | None:
    content = lines.line(line)
    start = lines.starts[line] if line < len(lines) else len(text)
    tok = comments.get(line)
    edit = None
    if tok is not None:
        col = tok.start[1]
        # A noqa comment (codes A1, ...) or a torchopt ignore comment already there: add the code to its list.
        for pattern in (_NOQA_CODES, _IGNORE_CODES):
            m = pattern.search(tok.string)
            if m:
                at = start + col + m.end()
                sep = ", " if pattern is _NOQA_CODES or m.group(0).rstrip()[-1] != "[" else ""
                edit = Edit(at, at, sep + code)
                break
    if edit is None:
        stripped = content.rstrip()
        if stripped.endswith("\\"):  # a comment cannot follow a line continuation
            return None
        edit = Edit(start + len(stripped), start + len(content), f"  # noqa: {code}")
    # Only if the comment really lands on that line and suppresses the code there (not inside a
    # multi-line string) and the file still compiles.
    new = apply_edits(text, [edit])
    if not suppress.is_suppressed(suppress.parse(new), code, (line + 1,)):
        return None
    try:
        compile(new, "<torchopt-lsp>", "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    except (SyntaxError, ValueError):
        return None
    return edit


def ignore_edit(text: str, code: str, lines_to_try: tuple[int, ...]) -> Edit | None:
    """The edit that adds ``# noqa: CODE`` (merged into an existing suppression comment) to the
    first of ``lines_to_try`` (0-based) where it works."""
    lines = Lines(text)
    comments = _comments(text)
    for line in dict.fromkeys(lines_to_try):
        edit = _ignore_on(text, lines, line, code, comments)
        if edit is not None:
            return edit
    return None
