"""LibCST's ``PositionProvider``, computed the same way for a fraction of the cost.

Positions come from generating the module's code and noting where each node starts and ends. LibCST
builds two ``CodePosition`` objects and a ``CodeRange`` (frozen dataclasses) for every node, goes
through a generator-based context manager for every syntactic position and a regex for every token,
and then copies the whole table: on the files rules analyse that was a quarter of the time. Here the
same walk stores plain tuples, and a ``CodeRange`` is built only for the nodes somebody asks about
(the findings, a few rule checks). Same values: ``tests/test_libcst_fast_paths.py`` compares every
node. ``torchopt.rewrite.speedups`` installs :func:`fast_gen` as ``PositionProvider._gen``; importing
this module changes nothing.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any, Iterator, Literal

import libcst as cst
from libcst._nodes.internal import CodegenState
from libcst.metadata import CodePosition, CodeRange, PositionProvider

_NEWLINE = re.compile(r"\r\n?|\n")
_ORIGINAL_GEN = PositionProvider._gen  # noqa: SLF001


class _State(CodegenState):
    """``PositionProvidingCodegenState`` with positions kept as tuples keyed by node id."""

    def __init__(self, module: cst.Module, table: dict[int, tuple]) -> None:
        super().__init__(default_indent=module.default_indent, default_newline=module.default_newline)
        self.line = 1  # one-indexed
        self.column = 0  # zero-indexed
        self.stack: list[tuple[int, int]] = []
        self.table = table

    def _advance(self, value: str) -> None:
        if "\n" in value or "\r" in value:
            segments = _NEWLINE.split(value)
            self.line += len(segments) - 1
            self.column = len(segments[-1])
        else:
            self.column += len(value)

    def add_indent_tokens(self) -> None:
        self.tokens.extend(self.indent_tokens)
        for token in self.indent_tokens:
            self._advance(token)

    def add_token(self, value: str) -> None:
        self.tokens.append(value)
        self._advance(value)

    def before_codegen(self, node: cst.CSTNode) -> None:
        self.stack.append((self.line, self.column))

    def after_codegen(self, node: cst.CSTNode) -> None:
        start = self.stack.pop()
        key = id(node)
        if key not in self.table:  # a syntactic position recorded already wins
            self.table[key] = (node, start[0], start[1], self.line, self.column)

    # LibCST types this hook as returning its own generator-based context manager; its callers only
    # enter and exit what it returns, which _Syntactic does without a generator.
    def record_syntactic_position(  # type: ignore[override]  # a context manager all the same (above)
        self, node: cst.CSTNode, *, start_node: cst.CSTNode | None = None, end_node: cst.CSTNode | None = None
    ) -> "_Syntactic":
        return _Syntactic(self, node, start_node, end_node)


class _Syntactic:
    """The context manager ``record_syntactic_position`` returns (a class, not a generator)."""

    __slots__ = ("state", "node", "start_node", "end_node", "start")

    def __init__(
        self, state: _State, node: cst.CSTNode, start_node: cst.CSTNode | None, end_node: cst.CSTNode | None
    ) -> None:
        self.state, self.node, self.start_node, self.end_node = state, node, start_node, end_node

    def __enter__(self) -> None:
        self.start = (self.state.line, self.state.column)

    def __exit__(self, *exc: object) -> Literal[False]:
        st = self.state
        table = st.table
        if self.start_node is not None:
            sl, sc = table[id(self.start_node)][1:3]
        else:
            sl, sc = self.start
        if self.end_node is not None:
            el, ec = table[id(self.end_node)][3:5]
        else:
            el, ec = st.line, st.column
        table[id(self.node)] = (self.node, sl, sc, el, ec)
        return False


class Ranges(Mapping):
    """node -> CodeRange, built on first access. Holds the module, so node ids stay unique."""

    __slots__ = ("_table", "_made", "_module")

    def __init__(self, table: dict[int, tuple], module: cst.Module) -> None:
        self._table = table
        self._made: dict[int, CodeRange] = {}
        self._module = module

    def __getitem__(self, node: Any) -> CodeRange:
        key = id(node)
        made = self._made.get(key)
        if made is not None:
            return made
        entry = self._table.get(key)
        if entry is None or entry[0] is not node:
            raise KeyError(node)
        made = self._made[key] = CodeRange(CodePosition(entry[1], entry[2]), CodePosition(entry[3], entry[4]))
        return made

    def get(self, node: Any, default: Any = None) -> Any:
        try:
            return self[node]
        except KeyError:
            return default

    def __contains__(self, node: object) -> bool:
        entry = self._table.get(id(node))
        return entry is not None and entry[0] is node

    def __iter__(self) -> Iterator[cst.CSTNode]:
        return (entry[0] for entry in self._table.values())

    def __len__(self) -> int:
        return len(self._table)


def fast_gen(self: PositionProvider, wrapper: Any) -> Mapping[cst.CSTNode, Any]:
    if type(self) is not PositionProvider:  # a subclass may compute something else
        return _ORIGINAL_GEN(self, wrapper)
    table: dict[int, tuple] = {}
    module = wrapper.module
    module._codegen(_State(module, table))  # noqa: SLF001
    return Ranges(table, module)


# ------------------------------------------------------------------ positions of a few nodes
# Rules and the engine need positions only for a few nodes: the findings, a loop named in a message.
# A top-level statement's code starts at column 0 of a line that CPython's parse of the same text gives
# (its first token's line, less the blank and comment lines LibCST keeps in front of it), so only the
# statements that hold an asked-for node are generated, each from its own line, once; the rest of the
# file is not. Each generated statement is checked against the text at that line, and anything
# unexpected (a node outside the module's statements, a layout the line count does not explain, code
# that does not match) falls back to the whole file's positions.


class LazyPositions(Mapping):
    """node -> CodeRange for one parse, like ``wrapper.resolve(PositionProvider)``, generating only the
    top-level statements that hold the nodes asked about."""

    def __init__(self, wrapper: Any, text: str, tree: object) -> None:
        self._wrapper = wrapper
        self._module: cst.Module = wrapper.module
        self._text = text
        self._starts = _statement_lines(self._module, tree) if isinstance(tree, ast.Module) else None
        self._offsets: list[int] | None = None
        self._index_of: dict[int, int] | None = None  # id(statement) -> its index in the module's body
        self._parents: Mapping[cst.CSTNode, cst.CSTNode] = {}
        self._generated: set[int] = set()
        self._table: dict[int, tuple] = {}
        self._ranges = Ranges(self._table, self._module)
        self._whole: Mapping[cst.CSTNode, Any] | None = None

    def whole(self) -> Mapping[cst.CSTNode, Any]:
        if self._whole is None:
            self._whole = self._wrapper.resolve(PositionProvider)
        return self._whole

    def __getitem__(self, node: Any) -> Any:
        if self._whole is None and self._starts is not None:
            if node in self._ranges:
                return self._ranges[node]
            index = self._statement_of(node)
            if index is not None and index not in self._generated and self._generate(index):
                if node in self._ranges:
                    return self._ranges[node]
        return self.whole()[node]

    def get(self, node: Any, default: Any = None) -> Any:
        try:
            return self[node]
        except KeyError:
            return default

    def __contains__(self, node: object) -> bool:
        return self.get(node) is not None

    def __iter__(self) -> Iterator[cst.CSTNode]:
        return iter(self.whole())

    def __len__(self) -> int:
        return len(self.whole())

    def _statement_of(self, node: cst.CSTNode) -> int | None:
        """The index of the top-level statement that holds ``node``, through the parent map (one walk
        of the tree, shared with the rules that ask for parents)."""
        from torchopt.rewrite.metadata import ParentProvider

        if self._index_of is None:
            self._parents = self._wrapper.resolve(ParentProvider)
            self._index_of = {id(stmt): i for i, stmt in enumerate(self._module.body)}
        parents = self._parents
        cur: cst.CSTNode | None = node
        while cur is not None:
            index = self._index_of.get(id(cur))
            if index is not None and self._module.body[index] is cur:
                return index
            cur = parents.get(cur)
        return None

    def _generate(self, index: int) -> bool:
        """Generate statement ``index`` from its own line; False when it does not read exactly like
        the text there (then the whole file answers)."""
        self._generated.add(index)
        if self._offsets is None:
            self._offsets = [0]
            for text_line in self._text.splitlines(keepends=True):
                self._offsets.append(self._offsets[-1] + len(text_line))
        assert self._starts is not None
        line = self._starts[index]
        if not 1 <= line < len(self._offsets):
            return False
        table: dict[int, tuple] = {}
        state = _State(self._module, table)
        state.line = line
        self._module.body[index]._codegen(state)  # noqa: SLF001
        code = "".join(state.tokens)
        start = self._offsets[line - 1]
        if self._text[start : start + len(code)] != code:
            return False
        self._table.update(table)
        return True


def _statement_lines(module: cst.Module, tree: ast.Module) -> list[int] | None:
    """The line each top-level statement's code starts on (its leading blank/comment lines
    included); None when LibCST's statements and CPython's cannot be matched one to one."""
    lines = []
    body = tree.body
    i = 0
    for stmt in module.body:
        if i >= len(body):
            return None
        first = body[i]
        i += len(stmt.body) if isinstance(stmt, cst.SimpleStatementLine) else 1
        line = first.lineno
        before = len(stmt.leading_lines)
        decorators = getattr(stmt, "decorators", ())
        if decorators:
            line = min([d.lineno for d in getattr(first, "decorator_list", ())] or [line])
            before += len(decorators[0].leading_lines)
        lines.append(line - before)
    return lines if i == len(body) else None


def positions_for(wrapper: Any, text: str, tree: object) -> Mapping[cst.CSTNode, Any]:
    """Positions for the module of ``wrapper``: computed statement by statement as nodes are asked
    about when the fast positions are installed and nobody has computed the whole file yet, else
    the whole file's (LibCST's own code, or what a rule already asked for)."""
    if PositionProvider._gen is not fast_gen or PositionProvider in getattr(wrapper, "_metadata", ()):  # noqa: SLF001
        return wrapper.resolve(PositionProvider)
    return LazyPositions(wrapper, text, tree)


def file_positions(facts: Any, wrapper: Any) -> Mapping[cst.CSTNode, Any]:
    """The positions of the module being analysed (``facts``: its SourceFacts), one mapping per parse,
    shared by the rules that ask and by the engine's report."""
    return facts.derived(("positions", id(wrapper)), lambda: positions_for(wrapper, facts.text, facts.python_ast))
