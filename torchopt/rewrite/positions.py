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

    def __init__(self, state: _State, node: cst.CSTNode, start_node: cst.CSTNode | None,
                 end_node: cst.CSTNode | None) -> None:
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
