"""Rewritten statements laid out in the project's style (torchopt/rewrite/style.py), touching only the
lines a fix changed.

After a pass, the lines of the new text that differ from the old one are the fix's. Each statement
holding one of them (for a compound statement: its header) is put in the formatter's layout: joined
onto one line when it fits there (unless a magic trailing comma keeps it exploded), split like ruff
format and black split when it does not (torchopt/rewrite/wrap.py), and the strings on its changed
lines take the project's quotes. A comment that only a new statement carries goes on the line above
it rather than making the line too long, and a statement that now follows the imports directly is
separated from them by a blank line, as isort does. Statements the fix did not change are left as
they are, however they are laid out.
"""

from __future__ import annotations

import ast
import difflib
import io
import keyword
import re
import tokenize

from torchopt.rewrite.style import Style
from torchopt.rewrite.wrap import Wrapper, tokens

_COMPOUND = (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While, ast.If)
_STRING = re.compile(r"""^([rRbBuUfF]{0,2})(['"])(.*)\2$""", re.S)


def physical_lines(text: str) -> list[str]:
    """The lines of ``text`` as Python counts them (``str.splitlines`` also splits at form feeds and
    other characters that end no line of code)."""
    return re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z", text)


class LineDiff:
    """Which lines of ``new`` a rewrite of ``old`` changed, and where the others were in ``old``."""

    def __init__(self, old: list[str], new: list[str]) -> None:
        lo = 0
        while lo < len(old) and lo < len(new) and old[lo] == new[lo]:
            lo += 1
        hi = 0
        while hi < len(old) - lo and hi < len(new) - lo and old[-1 - hi] == new[-1 - hi]:
            hi += 1
        self.old, self.lo, self.shift = old, lo, len(old) - len(new)
        self.changed: set[int] = set()  # 0-based lines of ``new``
        self.equal: list[tuple[int, int, int]] = []  # (first new line, last + 1, offset to its old line)
        a, b = old[lo : len(old) - hi], new[lo : len(new) - hi]
        for tag, i1, _i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if tag in ("replace", "insert"):
                self.changed.update(range(lo + j1, lo + j2))
            elif tag == "equal":
                self.equal.append((lo + j1, lo + j2, i1 - j1))
        self.end = len(new) - hi

    def old_next_is_blank(self, j: int) -> bool:
        """Whether the line after line ``j`` of ``new`` was blank (or the end) in ``old``."""
        if j < self.lo:
            k = j
        elif j >= self.end:
            k = j + self.shift
        else:
            k = next((j + off for first, last, off in self.equal if first <= j < last), -1)
            if k < 0:
                return False
        return k + 1 >= len(self.old) or not self.old[k + 1].strip()


def dominant_quote(text: str) -> str:
    counts = {'"': 0, "'": 0}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.STRING:
                m = _STRING.match(tok.string)
                if m and not m.group(3).startswith(m.group(2) * 2):
                    counts[m.group(2)] += 1
    except (tokenize.TokenError, SyntaxError):
        pass
    return "'" if counts["'"] > counts['"'] else '"'


def requote(line: str, quote: str) -> str:
    """The single-line strings of ``line`` in ``quote`` where that needs no escape."""
    toks = tokens(line.strip())
    if toks is None:
        return line
    offset = len(line) - len(line.lstrip())
    out = line
    for t in reversed(toks):
        m = _STRING.match(t.text) if t.kind == tokenize.STRING else None
        if m is None or m.group(2) == quote or m.group(3).startswith(m.group(2) * 2):
            continue
        body = m.group(3)
        if "'" in body or '"' in body or "\\" in body:
            continue
        new = f"{m.group(1)}{quote}{body}{quote}"
        out = out[: offset + t.start] + new + out[offset + t.end :]
    return out


def _header_end(node: ast.stmt) -> int:
    """The last line of a compound statement's header (its ``:`` line, before any comment below)."""
    if isinstance(node, (ast.With, ast.AsyncWith)):
        parts: list[ast.expr] = [i.context_expr for i in node.items]
        parts += [i.optional_vars for i in node.items if i.optional_vars is not None]
    elif isinstance(node, (ast.For, ast.AsyncFor)):
        parts = [node.target, node.iter]
    else:
        assert isinstance(node, (ast.While, ast.If))
        parts = [node.test]
    return max(p.end_lineno or p.lineno for p in parts)


def _units(tree: ast.Module) -> list[tuple[int, int, int]]:
    """(first line, 1, last line), 1-based, of every simple statement and compound header."""
    out: list[tuple[int, int, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, _COMPOUND):
            out.append((node.lineno, 1, _header_end(node)))
        elif isinstance(node, ast.stmt) and not hasattr(node, "body"):
            out.append((node.lineno, 1, node.end_lineno or node.lineno))
    return out


def _join(lines: list[str], magic: bool) -> tuple[str, str] | None:
    """The statement on one line and its trailing comment; None when a comment or a string inside it
    spans lines (such a statement keeps its layout). Without the magic trailing comma, a trailing
    comma goes (not the one of a one-element tuple)."""
    text = "".join(line.strip() + "\n" for line in lines)
    rows = text.split("\n")
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    code: list[str] = []
    comment = ""
    prev: tokenize.TokenInfo | None = None
    brackets: list[list[int]] = []  # per open bracket: [is a parenthesised expression, commas]
    for tok in toks:
        if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT):
            continue
        if tok.start[0] != tok.end[0] or comment:
            return None
        if tok.type == tokenize.COMMENT:
            if tok.start[0] != len(lines):
                return None
            comment = tok.string
            continue
        if prev is not None:
            if prev.end[0] == tok.start[0]:
                code.append(rows[tok.start[0] - 1][prev.end[1] : tok.start[1]])
            elif prev.string not in "([{" and tok.string not in ")]}":
                code.append(" ")
        if tok.type == tokenize.OP and tok.string in ")]}" and brackets:
            tuple_paren, commas = brackets.pop()
            if not magic and prev is not None and prev.string == "," and not (tuple_paren and commas == 1):
                while code and code.pop() != ",":
                    pass
        elif tok.type == tokenize.OP and tok.string in "([{":
            call = prev is not None and (
                prev.string in ")]" or (prev.type == tokenize.NAME and not keyword.iskeyword(prev.string))
            )
            brackets.append([int(tok.string == "(" and not call), 0])
        elif tok.string == "," and brackets:
            brackets[-1][1] += 1
        code.append(tok.string)
        prev = tok
    return "".join(code).rstrip(), comment


class _Pass:
    def __init__(self, old: str, new: str, style: Style, indent_unit: str) -> None:
        self.lines = physical_lines(new)
        self.diff = LineDiff(physical_lines(old), self.lines)
        self.changed = self.diff.changed
        self.style = style
        self.quote_char = {"double": '"', "single": "'"}.get(style.quote) or dominant_quote(old)
        self.wrapper = Wrapper(style.line_length, indent_unit, style.magic_trailing_comma)

    def unit(self, first: int, last: int) -> None:
        """Lay out lines first..last (0-based, inclusive) when the fix changed one of them."""
        if not any(i in self.changed for i in range(first, last + 1)):
            return
        lines = self.lines[first : last + 1]
        eol = "\r\n" if lines[-1].endswith("\r\n") else "\n"
        joined = _join(lines, self.style.magic_trailing_comma)
        if joined is None and len(lines) > 1:
            return  # a comment inside, or a string over several lines: the layout stays
        for i in range(first, last + 1):
            if i in self.changed:
                body = self.lines[i].rstrip("\r\n")
                self.lines[i] = requote(body, self.quote_char) + self.lines[i][len(body) :]
        if joined is None:
            return
        lines = self.lines[first : last + 1]
        indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())]
        code, comment = _join(lines, self.style.magic_trailing_comma) or joined
        code = self.wrapper.unparen(code)
        out = []
        toks = tokens(code)
        if toks is None:
            return
        if comment and all(i in self.changed for i in range(first, last + 1)):
            if not self.wrapper.fits(indent, f"{code}  {comment}"):
                out.append(indent + comment)  # a new statement's comment goes above it, not past the margin
                comment = ""
        out.extend(self.wrapper.wrap(code, indent, f"  {comment}" if comment else ""))
        if out != [line.rstrip("\r\n") for line in lines]:
            self.lines[first : last + 1] = [line + eol for line in out]

    def blank_before(self, first: int, count: int) -> None:
        """isort's blank line between the imports and a statement the fix put right after them: where
        the last import was followed by a blank line before the fix."""
        if first in self.changed and first - 1 not in self.changed and self.diff.old_next_is_blank(first - 1):
            eol = "\r\n" if self.lines[first - 1].endswith("\r\n") else "\n"
            self.lines[first:first] = [eol] * count


def _after_imports(tree: ast.Module) -> list[tuple[int, int, int]]:
    """(first line, 0, blank lines it needs) of a module-level statement right after an import."""
    out = []
    for prev, nxt in zip(tree.body, tree.body[1:]):
        if isinstance(prev, (ast.Import, ast.ImportFrom)) and not isinstance(nxt, (ast.Import, ast.ImportFrom)):
            first = min([nxt.lineno] + [d.lineno for d in getattr(nxt, "decorator_list", [])])
            if first == (prev.end_lineno or prev.lineno) + 1:
                defines = isinstance(nxt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                out.append((first, 0, 2 if defines else 1))
    return out


def restyle(old: str, new: str, style: Style, indent_unit: str = "    ") -> str:
    """``new`` (a rewrite of ``old``) with the statements the rewrite changed in ``style``."""
    p = _Pass(old, new, style, indent_unit)
    if not p.changed:
        return new
    try:
        tree = ast.parse(new)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return new  # the engine's own check reports it
    units = _units(tree)
    starts: dict[int, int] = {}
    for first, kind, _last in units:
        starts[first] = starts.get(first, 0) + kind
    # bottom up, so that a statement laid out anew moves no line still to come
    for first, kind, last in sorted(units + _after_imports(tree), reverse=True):
        if kind == 0:
            p.blank_before(first - 1, last)
        elif starts[first] == 1 and last >= first:  # one statement per line (not `a = 1; b = 2`)
            p.unit(first - 1, last - 1)
    out = "".join(p.lines)
    if out == new:
        return new
    try:  # the layout never changes what the code means: the same syntax tree, or no layout at all
        same = ast.dump(ast.parse(out)) == ast.dump(tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        same = False
    return out if same else new
