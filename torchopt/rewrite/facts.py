"""What torchopt learns about one text while it analyses it, kept in one object per text.

The rules' prefilters all read CPython's ``ast`` of the file, and the rules themselves walk the same
LibCST subtrees over and over; computing those once per text and sharing them is what keeps a run
fast. They live in a :class:`SourceFacts` that the engine makes for each text it analyses (each pass
of a rewrite is a new text) and drops when it is done, so nothing learnt about one file can answer a
question about the next one, even when a new object reuses an old one's ``id()``.

Rules reach it as ``RuleContext.facts``. Helpers that are handed only the text (a rule's
``could_match``) or only a node (``syntax.walk``) reach it through :func:`facts_for` and
:func:`current_facts`: the engine marks the text it is analysing with :func:`analysing`, a context
variable, so the mark is private to the thread or task that set it and gone when it returns.
"""

from __future__ import annotations

import ast
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Hashable, Iterator, TypeVar

import libcst as cst

T = TypeVar("T")

_ANALYSING: ContextVar["SourceFacts | None"] = ContextVar("torchopt_text_being_analysed", default=None)


class SourceFacts:
    """Facts about one text: CPython's parse of it, facts derived from the text (``derived``) and,
    once LibCST has parsed it (``module``), facts about that tree's nodes (``about_node``)."""

    __slots__ = ("text", "module", "children", "_python_ast", "_derived", "_by_node")

    def __init__(self, text: str, module: cst.Module | None = None) -> None:
        self.text = text
        self.module = module
        # id(node) -> (node, its children): the hottest of the node facts, read by metadata.children_of
        self.children: dict[int, tuple[cst.CSTNode, tuple[cst.CSTNode, ...]]] = {}
        self._python_ast: ast.Module | BaseException | None = None
        self._derived: dict[Hashable, object] = {}
        # (what, id(node)) -> (node, value): keyed by id (a node's __hash__ is a Python call); the entry
        # holds its node, so an id reused by another node while the text is analysed never matches.
        self._by_node: dict[tuple, tuple[cst.CSTNode, object]] = {}

    @property
    def python_ast(self) -> ast.Module | BaseException:
        """CPython's AST of the text, or the exception ``ast.parse`` raised (SyntaxError, ValueError for
        NUL bytes, RecursionError/MemoryError for pathological nesting): parsed once for every rule's
        prefilter and the engine's syntax check."""
        if self._python_ast is None:
            try:
                self._python_ast = ast.parse(self.text)
            except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as exc:
                self._python_ast = exc
        return self._python_ast

    def derived(self, what: Hashable, make: Callable[[], T]) -> T:
        """``make()``, computed the first time ``what`` is asked about this text."""
        try:
            return self._derived[what]  # type: ignore[return-value]  # what make() gave for this key: a T
        except KeyError:
            value = self._derived[what] = make()
            return value

    def about_node(self, what: tuple, node: cst.CSTNode, make: Callable[[], T]) -> T:
        """``make()``, computed once per ``node`` of this text's tree and kind of fact ``what``."""
        key = what + (id(node),)
        hit = self._by_node.get(key)
        if hit is None or hit[0] is not node:
            hit = self._by_node[key] = (node, make())
        return hit[1]  # type: ignore[return-value]  # what make() gave for this key and node: a T


# The facts of the text the engine is analysing in this thread or task, if any (None). Bound to the
# context variable's own method: rules walk trees through it millions of times per run.
current_facts: Callable[[], "SourceFacts | None"] = _ANALYSING.get


def facts_for(text: str) -> SourceFacts:
    """The facts of ``text``: the engine's when it is analysing this very text, else a fresh object
    that lives as long as its caller keeps it (a prefilter called on its own computes what it needs)."""
    current = _ANALYSING.get()
    if current is not None and current.text is text:
        return current
    return SourceFacts(text)


def source_of(module: cst.Module) -> str:
    """The text of ``module``: the text it was parsed from when it is the module being analysed, else
    LibCST's ``module.code``, which generates the whole file again (a tenth of a second for a 4,000-line
    file, paid by every rule that asked)."""
    current = _ANALYSING.get()
    if current is not None and current.module is module:
        return current.text
    return module.code


@contextmanager
def analysing(text: str, module: cst.Module | None = None) -> Iterator[SourceFacts]:
    """Mark ``text`` (and the LibCST ``module`` parsed from it) as the one being analysed until the
    block ends. Inside a block for the same text, the same facts are reused (and given the module)."""
    current = _ANALYSING.get()
    if (
        current is not None
        and current.text is text
        and (module is None or current.module is None or current.module is module)
    ):
        if module is not None:
            current.module = module
        yield current
        return
    facts = SourceFacts(text, module)
    token = _ANALYSING.set(facts)
    try:
        yield facts
    finally:
        _ANALYSING.reset(token)
