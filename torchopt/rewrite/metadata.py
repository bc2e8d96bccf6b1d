"""Cheaper stand-ins for LibCST metadata that rules ask for on most files.

LibCST's ParentNodeProvider and QualifiedNameProvider each run a full visitor over the module; on a
large file that costs more than the parse. A parent map built from ``children`` and qualified names
read straight from the scope analysis give the same answers for a fraction of the time.
"""
from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from typing import Iterator

import libcst as cst
from libcst.metadata import BaseMetadataProvider, QualifiedName, ScopeProvider


_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def unordered_children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The same nodes as ``node.children``, read straight from the dataclass fields, not in source
    order. ``children`` runs a visitor that rebuilds the node; this is several times cheaper."""
    out: list[cst.CSTNode] = []
    for name in _field_names(type(node)):
        value = getattr(node, name)
        k = _kind(type(value))
        if k == 1:
            out.append(value)
        elif k == 2:
            out.extend(v for v in value if _kind(type(v)) == 1)
    return out


# ``CSTNode.children`` rebuilds the node through a visitor on every access, and rules walk subtrees
# through it again and again (it was the largest single cost on real code). The children of a node
# are its node-valued fields, in the order its ``_visit_and_replace_children`` visits them; that order
# is fixed per class and per set of non-empty fields, so it is learned once from the slow property and
# then read straight from the fields. Anything it cannot learn exactly falls back to the slow path.
_SLOW_CHILDREN = cst.CSTNode.children.fget  # type: ignore[attr-defined]
_ORDER: dict[tuple[type, tuple[str, ...]], tuple[str, ...] | None] = {}


_KIND: dict[type, int] = {}  # 1: a node, 2: a tuple or list, 0: anything else (CSTNode is an ABC: isinstance is slow)


def _kind(t: type) -> int:
    k = _KIND.get(t)
    if k is None:
        k = _KIND[t] = 1 if issubclass(t, cst.CSTNode) else 2 if issubclass(t, (tuple, list)) else 0
    return k


# While the engine analyses one file, children are also remembered per node (rules walk the same
# subtrees many times); the memo holds the nodes, so ids cannot be reused, and is dropped afterwards.
_MEMO: dict[cst.CSTNode, tuple[cst.CSTNode, ...]] | None = None


@contextmanager
def children_memo() -> Iterator[None]:
    global _MEMO
    outer = _MEMO
    if outer is None:
        _MEMO = {}
    try:
        yield
    finally:
        if outer is None:
            _MEMO = None


def ordered_children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """Exactly ``node.children`` (same nodes, same order), several times cheaper."""
    memo = _MEMO
    if memo is not None:
        hit = memo.get(node)
        if hit is None:
            hit = memo[node] = tuple(_ordered_children(node))
        return list(hit)
    return _ordered_children(node)


def _ordered_children(node: cst.CSTNode) -> list[cst.CSTNode]:
    cls = type(node)
    present = []
    values = {}
    for name in _field_names(cls):
        value = getattr(node, name)
        k = _kind(type(value))
        if k == 1:
            present.append(name)
            values[name] = (value,)
        elif k == 2 and value:
            items = tuple(v for v in value if _kind(type(v)) == 1)
            if items:
                present.append(name)
                values[name] = items
    sig = (cls, tuple(present))
    try:
        order = _ORDER[sig]
    except KeyError:
        slow = list(_SLOW_CHILDREN(node))
        _ORDER[sig] = _learn(node, present, slow)
        return slow
    if order is None:
        return list(_SLOW_CHILDREN(node))
    if len(order) == 1:
        return list(values[order[0]])
    out: list[cst.CSTNode] = []
    for name in order:
        out.extend(values[name])
    return out


def _learn(node: cst.CSTNode, present: list[str], slow: list[cst.CSTNode]) -> tuple[str, ...] | None:
    owner: dict[int, str] = {}
    count = 0
    for name in present:
        value = getattr(node, name)
        items = [value] if _kind(type(value)) == 1 else [v for v in value if _kind(type(v)) == 1]
        for item in items:
            if id(item) in owner:
                return None  # one node in two places: cannot tell the fields apart
            owner[id(item)] = name
            count += 1
    if count != len(slow):
        return None
    order: list[str] = []
    for child in slow:
        name = owner.get(id(child))
        if name is None:
            return None
        if not order or order[-1] != name:
            if name in order:
                return None  # a field visited in two runs: not a plain field order
            order.append(name)
    return tuple(order) if set(order) == set(present) else None


def install_fast_children() -> None:
    """Make ``CSTNode.children`` use :func:`ordered_children` (same result, process-wide).
    ``TORCHOPT_SLOW_CHILDREN=1`` keeps LibCST's own (to rule this out when hunting a bug)."""
    if os.environ.get("TORCHOPT_SLOW_CHILDREN") == "1":
        return
    if cst.CSTNode.children.fget is not ordered_children:  # type: ignore[attr-defined]
        cst.CSTNode.children = property(ordered_children, doc=cst.CSTNode.children.__doc__)  # type: ignore[method-assign]


class ParentProvider(BaseMetadataProvider[cst.CSTNode]):
    """node -> its parent, like ParentNodeProvider (the module has none)."""

    def _gen_impl(self, module: cst.Module) -> None:
        table = self._computed
        stack: list[cst.CSTNode] = [module]
        while stack:
            node = stack.pop()
            for child in unordered_children(node):
                table[child] = node
                stack.append(child)


def qualified_names(visitor: cst.MetadataDependent, node: cst.CSTNode) -> set[QualifiedName]:
    """What QualifiedNameProvider would say for ``node``, straight from its scope."""
    try:
        scope = visitor.get_metadata(ScopeProvider, node, None)
    except KeyError:
        return set()
    if scope is None:
        return set()
    try:
        return set(scope.get_qualified_names_for(node))
    except Exception:  # nodes the scope cannot name (e.g. parts of a decorator) have none
        return set()
