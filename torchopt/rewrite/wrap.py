"""Line splitting the way ruff format and black split a statement that is too long, for one logical
line at a time (the statement joined onto one line first).

The shapes: the last bracket whose contents are not empty is split, its contents on the next line
one level deeper (``f(\\n    a, b\\n)``), or one element per line with a trailing comma when they do
not fit either; a trailer is skipped while the line up to its bracket would still be too long. The
right-hand side of an assignment or a ``return`` with more than one operator of its loosest kind (a
method chain ``a(x).b().c()``, a sum ``a + b + c``) is put in parentheses instead, and split at those
operators when it does not fit inside them. A trailing comma already in a bracket keeps it one
element per line (the "magic trailing comma", unless the project turns it off).
"""

from __future__ import annotations

import io
import keyword
import tokenize
from dataclasses import dataclass

OPEN, CLOSE = "([{", ")]}"
_PRIORITY = {
    ",": 18,
    "if": 16,
    "else": 16,
    "and": 14,
    "or": 14,
    "not": 0,
    "<": 10,
    ">": 10,
    "==": 10,
    "!=": 10,
    "<=": 10,
    ">=": 10,
    "in": 10,
    "is": 10,
    "|": 9,
    "^": 8,
    "&": 7,
    "<<": 6,
    ">>": 6,
    "+": 5,
    "-": 5,
    "*": 4,
    "/": 4,
    "//": 4,
    "%": 4,
    "@": 4,
    "**": 1,
}
DOT = 1


@dataclass(frozen=True)
class Tok:
    kind: int
    text: str
    start: int
    end: int


def tokens(code: str) -> list[Tok] | None:
    """The tokens of one line of code, or None when it is not one complete line."""
    try:
        raw = list(tokenize.generate_tokens(io.StringIO(code + "\n").readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return None
    out = []
    for t in raw:
        if t.type in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT):
            continue
        if t.start[0] != 1 or t.end[0] != 1:
            return None
        out.append(Tok(t.type, t.string, t.start[1], t.end[1]))
    return out


def _pairs(toks: list[Tok]) -> list[tuple[int, int]] | None:
    """(open, close) token indices of the outermost brackets, in order."""
    stack: list[int] = []
    out = []
    for i, t in enumerate(toks):
        if t.kind == tokenize.OP and t.text in OPEN:
            stack.append(i)
        elif t.kind == tokenize.OP and t.text in CLOSE:
            if not stack:
                return None
            j = stack.pop()
            if not stack:
                out.append((j, i))
    return out if not stack else None


def _depth0(toks: list[Tok], lo: int, hi: int) -> list[int]:
    """Indices in [lo, hi) of tokens outside every bracket."""
    depth, out = 0, []
    for i in range(lo, hi):
        t = toks[i]
        if t.kind == tokenize.OP and t.text in OPEN:
            depth += 1
        elif t.kind == tokenize.OP and t.text in CLOSE:
            depth -= 1
        elif depth == 0:
            out.append(i)
    return out


def _is_call(toks: list[Tok], open_i: int) -> bool:
    prev = toks[open_i - 1] if open_i else None
    return prev is not None and (
        prev.text in CLOSE or (prev.kind == tokenize.NAME and not keyword.iskeyword(prev.text))
    )


def _is_subscript(toks: list[Tok], open_i: int) -> bool:
    if toks[open_i].text != "[" or open_i == 0:
        return False
    prev = toks[open_i - 1]
    return prev.text in (")", "]") or (prev.kind == tokenize.NAME and not keyword.iskeyword(prev.text))


class Wrapper:
    def __init__(self, line_length: int, indent_unit: str, magic_trailing_comma: bool) -> None:
        self.width = line_length
        self.unit = indent_unit
        self.magic = magic_trailing_comma

    def fits(self, indent: str, text: str) -> bool:
        return len(indent) + len(text) <= self.width

    def has_magic_comma(self, toks: list[Tok]) -> bool:
        if not self.magic:
            return False
        for i in range(1, len(toks)):
            if toks[i].text in CLOSE and toks[i - 1].text == ",":
                opener = self._opener(toks, i)
                if opener is None:
                    continue
                if toks[opener].text == "(" and len(_commas(toks, opener, i)) == 1 and not _is_call(toks, opener):
                    continue  # `(a,)` is a one-element tuple, not a request to explode
                return True
        return False

    @staticmethod
    def _opener(toks: list[Tok], close: int) -> int | None:
        depth = 0
        for j in range(close, -1, -1):
            if toks[j].text in CLOSE and toks[j].kind == tokenize.OP:
                depth += 1
            elif toks[j].text in OPEN and toks[j].kind == tokenize.OP:
                depth -= 1
                if depth == 0:
                    return j
        return None

    def wrap(self, code: str, indent: str, trail: str = "") -> list[str]:
        """``code`` (one line, no indent) as lines at ``indent``; ``trail`` ends the last line."""
        toks = tokens(code)
        if toks is None or not toks:
            return [indent + code + trail]
        if self.fits(indent, code + trail) and not self.has_magic_comma(toks):
            return [indent + code + trail]
        pairs = _pairs(toks)
        if pairs is None:
            return [indent + code + trail]
        rhs, end = _rhs_start(toks), len(toks)
        if toks[0].text == "with" and toks[-1].text == ":":
            if not any(toks[i].text in (",", "as") for i in _depth0(toks, 1, len(toks))):
                rhs, end = 1, len(toks) - 1  # one context manager: its expression is the value
        if rhs is not None:
            lines = self._optional_parens(code, toks, rhs, end, indent, trail)
            if lines is not None:
                return lines
        return self._split_last_bracket(code, toks, pairs, indent, trail)

    def _split_last_bracket(
        self, code: str, toks: list[Tok], pairs: list[tuple[int, int]], indent: str, trail: str
    ) -> list[str]:
        candidates = [(o, c) for o, c in reversed(pairs) if c > o + 1]
        if not candidates:
            return [indent + code + trail]
        chosen = candidates[0]
        if not self.has_magic_comma(toks[chosen[0] : chosen[1] + 1]):
            for o, c in candidates:
                if len(indent) + len(code) - toks[c].start + len(trail) > self.width and (o, c) != candidates[0]:
                    break  # the tail from here on would not fit on the closing line
                if self.fits(indent, code[: toks[o].end]):
                    chosen = (o, c)
                    break
        o, c = chosen
        head, body, tail = code[: toks[o].end], code[toks[o].end : toks[c].start].strip(), code[toks[c].start :]
        inner = indent + self.unit
        body_toks = toks[o + 1 : c]
        commas = [i - o - 1 for i in _commas(toks, o, c)]
        magic = self.magic and body_toks and body_toks[-1].text == ","
        literal = (
            bool(commas) and not _is_call(toks, o) and not _is_subscript(toks, o) and not _comprehension(body_toks)
        )
        if self.fits(inner, body) and not magic and not self.has_magic_comma(body_toks) and not literal:
            lines = [inner + body]
        elif _comprehension(body_toks):
            cuts = [body_toks[0].start, *_comprehension(body_toks), toks[c].start]
            lines = [line for lo, hi in zip(cuts, cuts[1:]) for line in self.wrap(code[lo:hi].strip(), inner)]
        elif not commas:
            lines = self.wrap(body, inner)
        elif not _is_call(toks, o) and not _is_subscript(toks, o):
            # a list, tuple, set or dict display that does not fit goes one element per line
            lines = self._one_per_line(code, toks, o, c, inner, add_comma=True)
        else:
            lines = self._one_per_line(code, toks, o, c, inner, add_comma=not _is_subscript(toks, o))
        return [indent + head, *lines, *self.wrap(tail.strip(), indent, trail)]

    def unparen(self, code: str) -> str:
        """``code`` without the redundant parentheses around an assignment's or a ``return``'s value
        or a lone ``with`` item, which ruff and black remove."""
        toks = tokens(code)
        if not toks:
            return code
        if toks[0].text == "with":
            start = 1
            ends = [i for i in _depth0(toks, 1, len(toks)) if toks[i].text in (":", "as")]
            end = ends[0] if ends else len(toks)
        else:
            rhs = _rhs_start(toks)
            if rhs is None or toks[0].text == "assert":
                return code
            start, end = rhs, len(toks)
        if end - start < 3 or toks[start].text != "(" or self._opener(toks, end - 1) != start:
            return code
        inside = _depth0(toks, start + 1, end - 1)
        if any(toks[i].text in (",", "for", "async", "yield", ":=", "*", "**") for i in inside):
            return code  # a tuple, a generator, a yield or a walrus needs them
        return (
            code[: toks[start].start] + code[toks[start].end : toks[end - 1].start].strip() + code[toks[end - 1].end :]
        )

    def _one_per_line(self, code: str, toks: list[Tok], o: int, c: int, inner: str, add_comma: bool) -> list[str]:
        bounds = [toks[o].end] + [toks[i].end for i in _commas(toks, o, c)]
        ends = [toks[i].start for i in _commas(toks, o, c)] + [toks[c].start]
        lines: list[str] = []
        for k, (lo, hi) in enumerate(zip(bounds, ends)):
            element = code[lo:hi].strip()
            if not element:
                continue
            last = k == len(bounds) - 1
            lines.extend(self.wrap(element, inner, "," if (add_comma or not last) else ""))
        return lines

    def _optional_parens(
        self, code: str, toks: list[Tok], rhs: int, end: int, indent: str, trail: str
    ) -> list[str] | None:
        """The value (tokens rhs..end) in parentheses (black's "optional parentheses"), or None to
        split at its last bracket instead."""
        priority, at = _loosest(toks, rhs, end)
        stop = toks[end].start if end < len(toks) else len(code)
        body, tail = code[toks[rhs].start : stop].strip(), code[stop:].strip()
        comma = priority == _PRIORITY[","]
        inner = indent + self.unit
        head = code[: toks[rhs].start].rstrip() + " ("
        if priority == 0 and not any(t.text in OPEN for t in toks[rhs:end]):
            # no operator and nothing to split at: parentheses help only when the value then fits
            fits = self.fits(inner, body)
            return [indent + head, inner + body, indent + ")" + tail + trail] if fits else None
        if priority == 0 or (comma and toks[0].text == "return") or (len(at) == 1 and priority == DOT):
            return None  # a returned bare tuple keeps its shape: ruff splits inside its last element
        if len(at) == 1 and not comma:
            if toks[end - 1].text in CLOSE:
                opener = self._opener(toks, end - 1)
                earlier = opener is not None and any(t.text in OPEN for t in toks[rhs:opener])
                if opener is not None and (earlier or self.fits(indent, code[: toks[opener].end])):
                    return None
        if toks[rhs].text in OPEN and self._opener(toks, end - 1) == rhs:
            return None  # already one bracket
        if self.fits(inner, body) and not comma:
            lines = [inner + body]
        else:  # split at the loosest operator; a tuple goes one element per line, with its trailing comma
            lines = []
            cuts = [toks[rhs].start] + [toks[i].start for i in at] + [stop]
            for lo, hi in zip(cuts, cuts[1:]):
                piece = code[lo:hi].strip()
                lines.extend(self.wrap(piece.lstrip(",").strip(), inner, "," if comma else ""))
        return [indent + head, *lines, indent + ")" + tail + trail]


def _commas(toks: list[Tok], o: int, c: int) -> list[int]:
    return [i for i in _depth0(toks, o + 1, c) if toks[i].text == ","]


def _comprehension(toks: list[Tok]) -> list[int]:
    """Where the ``for`` and ``if`` clauses of a comprehension start (empty for anything else)."""
    at = _depth0(toks, 0, len(toks))
    fors = [i for i in at if toks[i].text == "for" and toks[i].kind == tokenize.NAME]
    if not fors:
        return []
    clauses = [i for i in at if i >= fors[0] and toks[i].kind == tokenize.NAME and toks[i].text in ("for", "if")]
    # `async for`, and an `if` of a conditional expression inside the `for` target cannot occur at depth 0
    return [toks[i - 1].start if i and toks[i - 1].text == "async" else toks[i].start for i in clauses]


def _rhs_start(toks: list[Tok]) -> int | None:
    """The first token of an assignment's value, a ``return``'s, or an ``assert``'s message (its test
    when it has none), when the line is one of those."""
    if toks[0].text == "return" and len(toks) > 1:
        return 1
    if toks[0].text == "assert" and len(toks) > 1:
        commas = [i for i in _depth0(toks, 1, len(toks)) if toks[i].text == ","]
        return commas[0] + 1 if commas and commas[0] + 1 < len(toks) else 1
    for i in _depth0(toks, 0, len(toks)):
        t = toks[i]
        if t.kind == tokenize.OP and (t.text == "=" or (t.text.endswith("=") and t.text[:-1] in _PRIORITY)):
            return i + 1 if i + 1 < len(toks) else None
        if t.kind == tokenize.NAME and keyword.iskeyword(t.text):
            return None  # `with`, `for`, `if`, `lambda`...: not an assignment
    return None


def _loosest(toks: list[Tok], lo: int, hi: int) -> tuple[int, list[int]]:
    """The priority of the loosest operator outside brackets in tokens lo..hi, and where each is."""
    found: dict[int, list[int]] = {}
    for i in _depth0(toks, lo, hi):
        t = toks[i]
        if i == lo:
            continue
        if t.text == "." and toks[i - 1].text in CLOSE:
            found.setdefault(DOT, []).append(i)
        elif t.text in _PRIORITY and (t.kind == tokenize.OP or keyword.iskeyword(t.text)) and _PRIORITY[t.text]:
            if t.text in ("+", "-", "*", "**") and (toks[i - 1].kind == tokenize.OP and toks[i - 1].text not in CLOSE):
                continue  # a sign or an unpacking star
            found.setdefault(_PRIORITY[t.text], []).append(i)
    if not found:
        return 0, []
    best = max(found)
    return best, found[best]
