"""Jupyter notebooks (``.ipynb``): their code cells seen as one Python program, and fixes written back
into the cells they belong to.

The program is the code cells in order, each after a marker comment that names it, so that a loader
built in one cell and iterated in another is one program to the rules. IPython syntax (line magics
such as ``%timeit``, shell escapes such as ``!pip``, ``x = !ls``, help ``obj?`` and the first line of
``%%time``-like cell magics) is masked by a neutral statement before parsing and restored, byte for
byte, afterwards; cells run by another language (``%%bash``, ``%%writefile``, ...) are left out.

Writing back splices the new ``source`` value of each changed cell into the notebook's JSON text in
the layout the file already uses; every other byte (outputs, metadata, indentation, key order, the
final newline) stays as it was, and the result is decoded again to check that only those sources
changed."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from torchopt.rewrite.engine import Diagnostic
from torchopt.rewrite.source import SourceError, blake2b

SUFFIX = ".ipynb"

# Cell magics whose body is Python run in the notebook's namespace; any other cell magic makes the
# cell another language's.
PYTHON_CELL_MAGICS = frozenset({"time", "timeit", "capture", "prun", "debug"})

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_HELP = re.compile(r"\?{1,2}[\w.]+|[\w.]+\?{1,2}")  # `obj?`, `obj.attr??`, `?obj`
_ASSIGN_MAGIC = re.compile(r"([ \t]*)([A-Za-z_][\w.]*(?:[ \t]*,[ \t]*[A-Za-z_][\w.]*)*[ \t]*=[ \t]*)[!%]")


class NotebookError(Exception):
    """The notebook cannot be read or written back exactly; the message is one line, for the user."""


def is_notebook(path: str) -> bool:
    return path.lower().endswith(SUFFIX)


@dataclass
class Cell:
    number: int  # 1-based position among all the notebook's cells, as editors count them
    start: int  # offsets of the `source` value in the JSON text
    end: int
    text: str  # the source, joined
    is_list: bool  # `source` is a list of lines (the usual form) rather than one string


@dataclass
class Notebook:
    raw: str
    data: dict
    cells: list[Cell]  # the Python code cells, in order
    token: str  # marks cell boundaries and masked lines in the program; absent from the notebook
    program: str
    masked: list[str]  # original lines (with their newline) of the masked IPython syntax

    # reading ------------------------------------------------------------------------------------

    @classmethod
    def load(cls, raw: str) -> "Notebook":
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise NotebookError(f"not a notebook: invalid JSON ({exc})") from None
        cells = data.get("cells") if isinstance(data, dict) else None
        if not isinstance(cells, list):
            raise NotebookError("not a notebook: no `cells` list (nbformat 4 is supported)")
        spans = _source_spans(raw)
        if len(spans) != len(cells):
            raise NotebookError("the notebook's JSON has repeated keys; left unchanged")
        token = _token(raw)
        nb = cls(raw, data, [], token, "", [])
        parts: list[str] = []
        for i, (cell, span) in enumerate(zip(cells, spans)):
            if not isinstance(cell, dict) or cell.get("cell_type") != "code" or span is None:
                continue
            src = cell.get("source")
            if isinstance(src, list) and all(isinstance(s, str) for s in src):
                text, is_list = "".join(src), True
            elif isinstance(src, str):
                text, is_list = src, False
            else:
                raise NotebookError(f"cell {i + 1}: `source` is neither text nor a list of lines")
            body = nb._mask(text)
            if body is None:  # another language's cell
                continue
            nb.cells.append(Cell(i + 1, span[0], span[1], text, is_list))
            parts.append(f"# {token}:{len(nb.cells) - 1}\n{body}")
        nb.program = "".join(parts)
        return nb

    def language(self) -> str:
        meta = self.data.get("metadata")
        meta = meta if isinstance(meta, dict) else {}
        for key, field in (("kernelspec", "language"), ("language_info", "name")):
            value = meta.get(key, {}).get(field) if isinstance(meta.get(key), dict) else None
            if isinstance(value, str):
                return value.lower()
        return "python"

    def _mask(self, text: str) -> str | None:
        """The cell as Python, every IPython line replaced by a statement carrying its index; None
        for a cell run by another language."""
        lines = text.splitlines(keepends=True)
        if lines and lines[-1][-1:] not in ("\n", "\r"):
            lines[-1] += "\n"
        first = lines[0].lstrip() if lines else ""
        if first.startswith("%%"):
            name = first[2:].split(None, 1)[0] if first[2:].strip() else ""
            if name not in PYTHON_CELL_MAGICS:
                return None
        starts = _logical_starts(lines)
        out, carry = [], None
        for i, line in enumerate(lines):
            if carry is not None:  # the continuation lines of a masked line
                out.append(self._masked(line, carry, "pass"))
                carry = carry if _continues(line) else None
                continue
            magic = _ipython(line) if i in starts else None
            if magic is None:
                out.append(line)
                continue
            indent, stmt = magic
            out.append(self._masked(line, indent, stmt))
            carry = indent if _continues(line) else None
        return "".join(out)

    def _masked(self, line: str, indent: str, stmt: str) -> str:
        self.masked.append(line)
        return f"{indent}{stmt}  # {self.token}!{len(self.masked) - 1}\n"

    # mapping back -------------------------------------------------------------------------------

    def _markers(self, program: str) -> list[tuple[int, int]]:
        """(line of the marker, index into ``cells``) for every boundary marker of ``program``."""
        pat = re.compile(rf"^# {self.token}:(\d+)[ \t]*$")
        out = []
        for n, line in enumerate(program.splitlines(), start=1):
            m = pat.match(line)
            if m:
                out.append((n, int(m.group(1))))
        return out

    def place(self, diags: list[Diagnostic], program: str) -> list[Diagnostic]:
        """``diags`` (positions in ``program``) with their positions in cells."""
        markers = self._markers(program)
        if not markers:
            return diags

        def where(line: int) -> tuple[int, int]:
            at, index = markers[0]
            for m_line, m_index in markers:
                if m_line >= line:
                    break
                at, index = m_line, m_index
            return self.cells[index].number, max(1, line - at)

        out = []
        for d in diags:
            cell, line = where(d.line)
            end_cell, end_line = where(d.end_line)
            end_col = d.end_column
            if end_cell != cell:  # a finding never spans cells; keep the end inside its own
                end_line, end_col = line, d.column
            out.append(dataclasses.replace(d, line=line, end_line=end_line, end_column=end_col, cell=cell))
        return out

    def place_reason(self, reason: str) -> str:
        """A parse error's `line N` given as the cell and the line in it."""
        m = re.search(r"\bline (\d+)", reason)
        if not m or not self.cells:
            return reason
        probe = Diagnostic("", "", "", "", int(m.group(1)), 1, int(m.group(1)), 1)
        placed = self.place([probe], self.program)[0]
        return reason[: m.start()] + f"cell {placed.cell}, line {placed.line}" + reason[m.end() :]

    def split(self, program: str) -> list[str]:
        """``program`` (a fixed version of ``self.program``) cut back into the cells' new sources,
        with the IPython lines restored."""
        markers = self._markers(program)
        if [i for _, i in markers] != list(range(len(self.cells))):
            raise NotebookError("a fix would move code across cells; left unchanged")
        lines = program.splitlines(keepends=True)
        restore = re.compile(rf"#[ \t]*{self.token}!(\d+)[ \t]*$")
        seen: set[int] = set()
        bodies = []
        bounds = [m for m, _ in markers] + [len(lines) + 1]
        for k, cell in enumerate(self.cells):
            # lines before the first marker (an import put at the very top) belong to the first cell
            begin = 0 if k == 0 else bounds[k]
            body = []
            for line in lines[begin : bounds[k + 1] - 1]:
                if begin == 0 and k == 0 and line.rstrip("\r\n") == f"# {self.token}:0":
                    continue
                m = restore.search(line.rstrip("\r\n"))
                if m:
                    index = int(m.group(1))
                    if index in seen or index >= len(self.masked):
                        raise NotebookError("a fix changed an IPython line; left unchanged")
                    seen.add(index)
                    line = self.masked[index]
                body.append(line)
            text = "".join(body)
            if not cell.text.endswith(("\n", "\r")) and text.endswith("\n"):
                text = text[:-2] if text.endswith("\r\n") else text[:-1]
            bodies.append(text)
        if len(seen) != len(self.masked):
            raise NotebookError("a fix removed an IPython line; left unchanged")
        return bodies

    # writing ------------------------------------------------------------------------------------

    def write(self, program: str) -> tuple[str, list[tuple[Cell, str]]]:
        """The notebook's JSON text with ``program``'s cells, and the (cell, new source) pairs that changed."""
        changed = [(c, new) for c, new in zip(self.cells, self.split(program)) if new != c.text]
        ascii_only = self.raw.isascii()
        out, pos = [], 0
        for cell, new in changed:
            out.append(self.raw[pos : cell.start])
            out.append(_source_value(self.raw[cell.start : cell.end], new, cell.is_list, ascii_only))
            pos = cell.end
        out.append(self.raw[pos:])
        raw = "".join(out)
        if not _same_but_sources(self.data, raw, {c.number - 1: (new, c.is_list) for c, new in changed}):
            raise NotebookError("the fixed notebook would not read back as written; left unchanged")
        return raw, changed


def as_script(path: str, text: str) -> str:
    """``text`` itself, or for a notebook the Python script `torchopt validate` runs: the code cells
    in order, each IPython line replaced by `pass` with the line as a comment."""
    if not is_notebook(path):
        return text
    try:
        nb = Notebook.load(text)
    except NotebookError as exc:
        raise SourceError(str(exc)) from None
    return re.sub(
        rf"(?m)^([ \t]*)(.*?)[ \t]*#[ \t]*{nb.token}!(\d+)[ \t]*$",
        lambda m: f"{m.group(1)}pass  # {nb.masked[int(m.group(3))].strip()}",
        re.sub(rf"(?m)^# {nb.token}:(\d+)[ \t]*$", lambda m: f"# cell {nb.cells[int(m.group(1))].number}", nb.program),
    )


# IPython syntax -----------------------------------------------------------------------------------


def _ipython(line: str) -> tuple[str, str] | None:
    """(indentation, neutral statement) when ``line`` starts a logical line in IPython syntax."""
    stripped = line.strip()
    indent = line[: len(line) - len(line.lstrip())]
    if not stripped or stripped.startswith("#"):
        return None
    if stripped[0] in "%!" or _HELP.fullmatch(stripped):
        return indent, "pass"
    m = _ASSIGN_MAGIC.match(line)
    if m:
        return indent, m.group(2).strip() + " ..."
    return None


def _continues(line: str) -> bool:
    return line.rstrip("\r\n").endswith("\\")


def _logical_starts(lines: list[str]) -> set[int]:
    """Indices of the lines that begin a logical line: not inside brackets, a string or after a
    backslash (so a `%` that continues an expression is never taken for a magic)."""
    starts, depth, quote, cont = set(), 0, "", False
    for n, line in enumerate(lines):
        if depth == 0 and not quote and not cont:
            starts.add(n)
        cont = False
        i, end = 0, len(line)
        while i < end:
            ch = line[i]
            if quote:
                if ch == "\\":
                    i += 2
                    continue
                if line.startswith(quote, i):
                    i += len(quote)
                    quote = ""
                    continue
                i += 1
                continue
            if ch == "#":
                break
            if ch in "\"'":
                quote = ch * 3 if line.startswith(ch * 3, i) else ch
                i += len(quote)
                continue
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth = max(0, depth - 1)
            elif ch == "\\" and line[i + 1 : i + 2] in ("\n", "\r", ""):
                cont = True
            i += 1
        if len(quote) == 1 and not cont:  # an unterminated one-line string ends with its line
            quote = "" if not line.rstrip("\r\n").endswith("\\") else quote
    return starts


# The JSON text ------------------------------------------------------------------------------------


def _token(raw: str) -> str:
    seed = raw.encode("utf-8", "surrogatepass")
    while True:
        token = "nb" + blake2b(seed, digest_size=8).hexdigest()
        if token not in raw:
            return token
        seed += b"."


def _skip(raw: str, i: int) -> int:
    m = _WS.match(raw, i)
    return m.end() if m else i


def _expect(raw: str, i: int, ch: str) -> int:
    if raw[i : i + 1] != ch:
        raise NotebookError(f"not a notebook: expected {ch!r} at offset {i}")
    return i + 1


def _value_end(raw: str, i: int) -> int:
    try:
        return _DECODER.raw_decode(raw, i)[1]
    except ValueError as exc:
        raise NotebookError(f"not a notebook: invalid JSON ({exc})") from None


def _members(raw: str, i: int):
    """Walk a JSON object at ``i``: yield (key, value start, value end)."""
    i = _skip(raw, _expect(raw, _skip(raw, i), "{"))
    if raw[i : i + 1] == "}":
        return
    while True:
        key, i = _DECODER.raw_decode(raw, i)
        i = _skip(raw, _expect(raw, _skip(raw, i), ":"))
        end = _value_end(raw, i)
        yield key, i, end
        i = _skip(raw, end)
        if raw[i : i + 1] == "}":
            return
        i = _skip(raw, _expect(raw, i, ","))


def _source_spans(raw: str) -> list[tuple[int, int] | None]:
    """For each element of the top-level `cells` list, the offsets of its `source` value."""
    spans: list[tuple[int, int] | None] = []
    for key, start, _end in _members(raw, 0):
        if key != "cells":
            continue
        spans = []
        i = _skip(raw, _expect(raw, start, "["))
        while raw[i : i + 1] != "]":
            end = _value_end(raw, i)
            found = [(s, e) for k, s, e in _members(raw, i) if k == "source"] if raw[i] == "{" else []
            spans.append(found[-1] if found else None)
            i = _skip(raw, end)
            if raw[i : i + 1] == ",":
                i = _skip(raw, i + 1)
    return spans


def _source_value(old: str, text: str, is_list: bool, ascii_only: bool) -> str:
    """``text`` as a `source` value laid out like ``old``, the value it replaces."""

    def dump(s: str) -> str:
        return json.dumps(s, ensure_ascii=ascii_only)

    if not is_list:
        return dump(text)
    items = [dump(line) for line in text.splitlines(keepends=True)]
    if not items:
        return "[]"
    inner = old[1:-1]
    first = _skip(inner, 0)
    if inner.strip() and "\n" in inner[:first]:  # one line per element, as Jupyter writes it
        lead, tail = inner[:first], inner[len(inner.rstrip(" \t\n\r")) :]
        return "[" + lead + ("," + lead).join(items) + tail + "]"
    return "[" + ", ".join(items) + "]"


def _same_but_sources(data: Any, raw: str, sources: dict[int, tuple[str, bool]]) -> bool:
    try:
        again = json.loads(raw)
    except ValueError:
        return False
    expected = json.loads(json.dumps(data))
    for index, (text, is_list) in sources.items():
        expected["cells"][index]["source"] = text.splitlines(keepends=True) if is_list else text
    return again == expected
