"""Where a place in one text is in another text it was edited into: positions through an edit.

The engine fixes a file in passes, and a fix found in a later pass is found on that pass's text.
Listings must name the place in the file the user has open, so each pass's positions are carried
back through the edits of the passes before it. The validator uses the same map forwards, to find
in the rewritten text the expression a fix wrote in place of an expression of the original.

The map is a diff: lines first (unchanged lines map one to one), then, inside a changed run of
lines, lines compared without their indentation and characters within them. A position in
unchanged text maps exactly; a position inside changed text maps to where that change starts.
"""

from __future__ import annotations

import bisect
import functools
import re
from dataclasses import dataclass
from difflib import SequenceMatcher

_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")
# Character diffs are quadratic in the worst case: a changed run larger than this (product of the
# two lengths) is one replaced block.
_CHAR_DIFF_LIMIT = 4_000_000


def lines_of(text: str) -> list[str]:
    """The lines of ``text`` with their endings, split as LibCST counts lines (\\n, \\r\\n, \\r)."""
    return _LINE.findall(text)


@dataclass(frozen=True)
class _Op:
    equal: bool
    a1: int
    a2: int
    b1: int
    b2: int


class LineIndex:
    """(line, column) <-> offset in one text; lines and columns are 1-based, columns in characters."""

    def __init__(self, text: str) -> None:
        self.starts = [0]
        for line in lines_of(text):
            self.starts.append(self.starts[-1] + len(line))
        self.size = len(text)
        self.open_end = bool(text) and not text.endswith(("\n", "\r"))

    def offset(self, line: int, column: int) -> int:
        line = min(max(line, 1), len(self.starts))
        return min(self.starts[line - 1] + max(column, 1) - 1, self.size)

    def position(self, offset: int) -> tuple[int, int]:
        offset = min(max(offset, 0), self.size)
        i = bisect.bisect_right(self.starts, offset) - 1
        if i == len(self.starts) - 1 and i > 0 and self.open_end:
            i -= 1  # the end of a last line without a line ending is on that line
        return i + 1, offset - self.starts[i] + 1


def _char_ops(a: str, b: str, a0: int, b0: int) -> list[_Op]:
    if not a or not b or len(a) * len(b) > _CHAR_DIFF_LIMIT:
        return [_Op(False, a0, a0 + len(a), b0, b0 + len(b))]
    sm = SequenceMatcher(None, a, b, autojunk=False)
    return [_Op(tag == "equal", a0 + i1, a0 + i2, b0 + j1, b0 + j2) for tag, i1, i2, j1, j2 in sm.get_opcodes()]


def _block_ops(a_lines: list[str], b_lines: list[str], a0: int, b0: int) -> list[_Op]:
    """A changed run of lines: pair lines that differ only in indentation (a block moved under a
    `with`), then diff characters within the pairs and within what is left."""
    sm = SequenceMatcher(None, [x.strip() for x in a_lines], [x.strip() for x in b_lines], autojunk=False)
    out: list[_Op] = []
    a_off = [a0]
    for x in a_lines:
        a_off.append(a_off[-1] + len(x))
    b_off = [b0]
    for x in b_lines:
        b_off.append(b_off[-1] + len(x))
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                out += _char_ops(a_lines[i1 + k], b_lines[j1 + k], a_off[i1 + k], b_off[j1 + k])
        else:
            out += _char_ops("".join(a_lines[i1:i2]), "".join(b_lines[j1:j2]), a_off[i1], b_off[j1])
    return out


class TextMap:
    """Offsets and positions of text ``a`` mapped into text ``b`` (``a`` edited into ``b``, or
    back). ``exact`` results say the place is a boundary in both texts: the character there (or,
    for an end, before it) is unchanged, or a change starts (ends) exactly there."""

    def __init__(self, a: str, b: str) -> None:
        self.a, self.b = a, b

    @functools.cached_property
    def a_index(self) -> LineIndex:
        return LineIndex(self.a)

    @functools.cached_property
    def b_index(self) -> LineIndex:
        return LineIndex(self.b)

    @functools.cached_property
    def ops(self) -> list[_Op]:
        a_lines, b_lines = lines_of(self.a), lines_of(self.b)
        sm = SequenceMatcher(None, a_lines, b_lines, autojunk=False)
        a_off, b_off = self.a_index.starts, self.b_index.starts
        ops: list[_Op] = []
        for tag, i1, i2, j1, j2 in sm.get_opcodes():
            if tag == "equal":
                ops.append(_Op(True, a_off[i1], a_off[i2], b_off[j1], b_off[j2]))
            else:
                ops += _block_ops(a_lines[i1:i2], b_lines[j1:j2], a_off[i1], b_off[j1])
        return [op for op in ops if op.a1 != op.a2 or op.b1 != op.b2]

    @functools.cached_property
    def _a_starts(self) -> list[int]:
        return [op.a1 for op in self.ops]

    def _op_at(self, offset: int) -> _Op | None:
        """The operation covering character ``offset`` of ``a`` (insertions cover nothing of ``a``)."""
        i = bisect.bisect_right(self._a_starts, offset) - 1
        while i >= 0 and self.ops[i].a1 == self.ops[i].a2:
            i -= 1
        if i < 0:
            return None
        op = self.ops[i]
        return op if op.a1 <= offset < op.a2 else None

    def start(self, offset: int) -> tuple[int, bool]:
        """Where a span starting at ``offset`` of ``a`` starts in ``b``."""
        op = self._op_at(offset)
        if op is None:  # at the very end of ``a``
            return len(self.b), True
        if op.equal:
            return op.b1 + offset - op.a1, True
        return op.b1, offset == op.a1

    def end(self, offset: int) -> tuple[int, bool]:
        """Where a span ending (exclusively) at ``offset`` of ``a`` ends in ``b``."""
        if offset <= 0:
            return 0, True
        op = self._op_at(offset - 1)
        if op is None:
            return len(self.b), True
        if op.equal:
            return op.b1 + offset - op.a1, True
        return op.b2, offset == op.a2

    def position(self, line: int, column: int) -> tuple[int, int]:
        """(line, column) of ``a`` -> (line, column) of ``b``."""
        return self.b_index.position(self.start(self.a_index.offset(line, column))[0])

    def end_position(self, line: int, column: int) -> tuple[int, int]:
        return self.b_index.position(self.end(self.a_index.offset(line, column))[0])
