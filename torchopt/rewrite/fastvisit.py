"""A read-only traversal for LibCST visitors that does not rebuild the tree.

``CSTNode.visit`` runs a node's ``_visit_and_replace_children``, which constructs (and validates) a
fresh copy of every node even for a plain ``CSTVisitor`` that can change nothing, and then throws the
copy away. On the files rules actually analyse, that copying was the largest share of the time spent
in scope analysis and in the rules' batched walk.

For visitors (not transformers) ``visit`` is replaced by a walk that makes exactly the same calls in
exactly the same order: ``on_visit``, then for each field in the order ``_visit_and_replace_children``
visits them ``on_visit_attribute``, the field's nodes, ``on_leave_attribute``, and finally
``on_leave``. The field order of a node class (for each combination of which fields hold a node, a
sequence or neither) is learned once from LibCST itself by running ``_visit_and_replace_children`` with
a recording visitor, and is used only when the recording is explained by it exactly; anything else
keeps LibCST's own path. Attribute callbacks are skipped only for node classes for which the visitor
has no ``visit_<Class>_<field>``/``leave_<Class>_<field>`` method, where they do nothing.

Nothing here changes LibCST by itself: ``torchopt.rewrite.speedups`` installs :func:`fast_visit` as
``CSTNode.visit``. ``tests/test_libcst_fast_paths.py``
compares the full event sequence of both walks over real modules.
"""

from __future__ import annotations

import abc
import dis
import re
from operator import attrgetter
from types import CodeType, FunctionType, MethodType
from typing import Any, Callable, Mapping, MutableMapping
from weakref import WeakKeyDictionary

import libcst as cst
from libcst._batched_visitor import _BatchedCSTVisitor

_ORIGINAL_VISIT = cst.CSTNode.visit
_DEFAULT_VISIT_ATTR = (cst.CSTVisitor.on_visit_attribute, cst.CSTVisitor.on_leave_attribute)

# (node class, field value kinds) -> field names in visit order, or None: use LibCST's own path.
_PLAN: dict[tuple, tuple[str, ...] | None] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}
_KIND: dict[type, int] = {}  # 1: node, 2: tuple/list, 0: anything else
_ATTR_METHOD = re.compile(r"^(?:visit|leave)_([A-Za-z]+)_[a-z_]+$")


def _kind(t: type) -> int:
    k = _KIND.get(t)
    if k is None:
        k = _KIND[t] = 1 if issubclass(t, cst.CSTNode) else 2 if issubclass(t, (tuple, list)) else 0
    return k


def _fields(cls: type[cst.CSTNode]) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(cls.__dataclass_fields__)
    return names


class _Recorder(cst.CSTVisitor):
    """Records what ``_visit_and_replace_children`` does for one node, without descending."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, Any]] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.events.append(("node", node))
        return False

    def on_leave(self, original_node: cst.CSTNode) -> None:
        pass

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        self.events.append(("enter", attribute))

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        self.events.append(("leave", attribute))


def _learn(node: cst.CSTNode) -> tuple[str, ...] | None:
    rec = _Recorder()
    try:
        _ORIGINAL_VISIT_CHILDREN(node, rec)
    except Exception:  # noqa: BLE001 - an odd node: leave it to LibCST
        return None
    order: list[str] = []
    ev = rec.events
    i = 0
    while i < len(ev):
        what, name = ev[i]
        if what != "enter" or not isinstance(name, str) or not hasattr(node, name):
            return None
        value = getattr(node, name)
        k = _kind(type(value))
        expected = [value] if k == 1 else list(value) if k == 2 else []
        if k == 2 and any(_kind(type(v)) != 1 for v in expected):
            return None
        i += 1
        for child in expected:
            if i >= len(ev) or ev[i][0] != "node" or ev[i][1] is not child:
                return None
            i += 1
        if i >= len(ev) or ev[i] != ("leave", name):
            return None
        i += 1
        order.append(name)
    return tuple(order)


def _ORIGINAL_VISIT_CHILDREN(node: cst.CSTNode, visitor: cst.CSTVisitor) -> None:
    node._visit_and_replace_children(visitor)  # noqa: SLF001


_GETTERS: dict[type, Any] = {}


def _getter(cls: type[cst.CSTNode]) -> Any:
    fields = _fields(cls)
    get: Callable[[cst.CSTNode], tuple[Any, ...]]
    if len(fields) == 1:
        only = attrgetter(fields[0])
        get = _GETTERS[cls] = lambda node: (only(node),)
    elif not fields:
        get = _GETTERS[cls] = lambda node: ()
    else:
        get = _GETTERS[cls] = attrgetter(*fields)
    return get


_UNIFORM: dict[type, bool] = {}
_CLASS_PLAN: dict[type, tuple[str, ...] | None] = {}


def _uniform(cls: type[cst.CSTNode]) -> bool:
    """Whether ``cls._visit_and_replace_children`` is straight-line code: then it visits the same
    fields in the same order for every node of the class (LibCST's ``visit_optional`` and friends
    call the attribute callbacks even for an absent value), and one plan serves the class. Read from
    its bytecode (no jump, no exception handler, nor in the code it nests), which costs far less than
    reading its source."""
    try:
        return _UNIFORM[cls]
    except KeyError:
        pass
    code = getattr(cls._visit_and_replace_children, "__code__", None)  # noqa: SLF001
    ok = _UNIFORM[cls] = code is not None and _straight(code)
    return ok


_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


def _straight(code: CodeType) -> bool:
    if getattr(code, "co_exceptiontable", b""):  # try/except/with (Python 3.11+)
        return False
    if any(op in _JUMPS for op in code.co_code[::2]):  # if, for, while, and/or, match, ...
        return False
    return all(_straight(c) for c in code.co_consts if isinstance(c, CodeType))


def _plan(node: cst.CSTNode) -> tuple[str, ...] | None:
    cls = type(node)
    try:
        return _CLASS_PLAN[cls]
    except KeyError:
        pass
    if _uniform(cls):
        plan = _CLASS_PLAN[cls] = _learn(node)
        return plan
    get = _GETTERS.get(cls) or _getter(cls)
    try:
        sig = (cls, tuple(map(_KIND.__getitem__, map(type, get(node)))))
    except KeyError:  # a value type not seen yet
        sig = (cls, tuple(_kind(type(v)) for v in get(node)))
    try:
        return _PLAN[sig]
    except KeyError:
        plan = _PLAN[sig] = _learn(node)
        return plan


_PLAN_OF = _plan

# Per visitor class: the node class names it has attribute methods for (None: it overrides the
# attribute callbacks, so always call them).
_HOOKS: MutableMapping[type, frozenset[str] | None] = WeakKeyDictionary()  # local classes come and go


def _hooks(visitor: cst.CSTVisitor) -> frozenset[str] | None:
    t = type(visitor)
    try:
        return _HOOKS[t]
    except KeyError:
        pass
    if (t.on_visit_attribute, t.on_leave_attribute) != _DEFAULT_VISIT_ATTR:
        h = None
    else:
        h = frozenset(m.group(1) for k in dir(t) if (m := _ATTR_METHOD.match(k)))
    _HOOKS[t] = h
    return h


_TABLES: MutableMapping[type, tuple[dict | None, dict | None]] = WeakKeyDictionary()


def _tables(visitor: cst.CSTVisitor) -> tuple[dict | None, dict | None]:
    """Per-class method tables, filled as classes are met: for ``on_visit`` when the visitor keeps
    LibCST's default (dispatch to ``visit_<Class>``), likewise for ``on_leave``; None for a callback
    the visitor overrides (scope analysis overrides only ``on_leave``), which is then called as is."""
    t = type(visitor)
    try:
        return _TABLES[t]
    except KeyError:
        tabs = _TABLES[t] = (
            {} if t.on_visit is cst.CSTVisitor.on_visit else None,
            {} if t.on_leave is cst.CSTVisitor.on_leave else None,
        )
        return tabs


def _method(vtype: type, prefix: str, cls: type) -> Any:
    fn = getattr(vtype, prefix + cls.__name__, None)
    return None if fn is None or getattr(fn, "_is_no_op", False) else fn


def _walk(
    node: cst.CSTNode, visitor: cst.CSTVisitor, hooks: frozenset[str] | None, tabs: tuple[dict | None, dict | None]
) -> None:
    cls = type(node)
    visits = tabs[0]
    if visits is None:
        descend = visitor.on_visit(node)
    else:
        try:
            fn = visits[cls]
        except KeyError:
            fn = visits[cls] = _method(type(visitor), "visit_", cls)
        descend = fn is None or fn(visitor, node) is not False
    if descend:
        plan = _PLAN_OF(node)
        if plan is None:
            _ORIGINAL_VISIT_CHILDREN(node, visitor)  # its children come back through fast_visit
        else:
            attrs = hooks is None or cls.__name__ in hooks
            for name in plan:
                if attrs:
                    visitor.on_visit_attribute(node, name)
                value = getattr(node, name)
                k = _KIND.get(type(value)) or _kind(type(value))
                if k == 1:
                    _walk(value, visitor, hooks, tabs)
                elif k == 2:
                    for child in value:
                        _walk(child, visitor, hooks, tabs)
                if attrs:
                    visitor.on_leave_attribute(node, name)
    leaves = tabs[1]
    if leaves is None:
        visitor.on_leave(node)
    else:
        try:
            fn = leaves[cls]
        except KeyError:
            fn = leaves[cls] = _method(type(visitor), "leave_", cls)
        if fn is not None:
            fn(visitor, node)


def _walk_batched(node: cst.CSTNode, visitor: _BatchedCSTVisitor, table: dict) -> None:
    """``_walk`` for LibCST's batched visitor, with its per-node method lookups done once per class."""
    cls = type(node)
    entry = table.get(cls)
    if entry is None:
        entry = table[cls] = _batched_entry(visitor, cls)
    visits, leaves, attrs = entry
    before = visitor.before_visit
    if before is not None:
        before(node)
    for v in visits:
        v(node)
    plan = _PLAN_OF(node)
    if plan is None:
        _ORIGINAL_VISIT_CHILDREN(node, visitor)
    else:
        for name in plan:
            if attrs:
                for v in attrs.get(("visit", name), ()):
                    v(node)
            value = getattr(node, name)
            k = _KIND.get(type(value)) or _kind(type(value))
            if k == 1:
                _walk_batched(value, visitor, table)
            elif k == 2:
                for child in value:
                    _walk_batched(child, visitor, table)
            if attrs:
                for v in attrs.get(("leave", name), ()):
                    v(node)
    for v in leaves:
        v(node)
    after = visitor.after_leave
    if after is not None:
        after(node)


def _batched_entry(visitor: _BatchedCSTVisitor, cls: type[cst.CSTNode]) -> tuple:
    methods = visitor.visitor_methods
    name = cls.__name__
    attrs: dict[tuple[str, str], list] = {}
    prefix_v, prefix_l = f"visit_{name}_", f"leave_{name}_"
    for key, fns in methods.items():
        if key.startswith(prefix_v) and key[len(prefix_v) :] in _fields(cls):
            attrs[("visit", key[len(prefix_v) :])] = fns
        elif key.startswith(prefix_l) and key[len(prefix_l) :] in _fields(cls):
            attrs[("leave", key[len(prefix_l) :])] = fns
    return (tuple(methods.get(f"visit_{name}", ())), tuple(methods.get(f"leave_{name}", ())), attrs or None)


def _module_only(node: cst.CSTNode, visitor: _BatchedCSTVisitor) -> bool:
    return (
        type(node) is cst.Module
        and visitor.before_visit is None
        and visitor.after_leave is None
        and all(k in ("visit_Module", "leave_Module") for k in visitor.visitor_methods)
    )


def fast_visit(self: cst.CSTNode, visitor: Any) -> Any:
    """``CSTNode.visit``: the read-only walk for visitors, LibCST's own for transformers."""
    if not isinstance(visitor, cst.CSTVisitor):
        return _ORIGINAL_VISIT(self, visitor)
    if type(visitor) is _BatchedCSTVisitor:
        if _module_only(self, visitor):
            # Batchable metadata providers such as ScopeProvider only have ``visit_Module`` (which
            # runs their own visitor): nothing below the module would call anything.
            for v in visitor.visitor_methods.get("visit_Module", ()):
                v(self)
            for v in visitor.visitor_methods.get("leave_Module", ()):
                v(self)
        else:
            _walk_batched(self, visitor, {})
    else:
        _walk(self, visitor, _hooks(visitor), _tables(visitor))
    return self


# ------------------------------------------------------------------ isinstance on node classes
# LibCST's node classes are ABCs, so every ``isinstance(x, cst.Call)`` that is not an exact match runs
# ``ABCMeta.__instancecheck__``, a Python frame, and a test against a tuple runs one per class
# (LibCST's scope analysis tests every node it leaves against eighteen). LibCST registers no virtual
# subclasses and defines no ``__subclasshook__``, so the answer is plain inheritance, which ``type``'s
# own checks give directly.


class PlainChecks(abc.ABCMeta):
    """ABCMeta (abstract node classes stay abstract) with ``type``'s instance and subclass checks."""

    __instancecheck__ = type.__instancecheck__
    __subclasscheck__ = type.__subclasscheck__


def node_classes() -> list[type]:
    """``cst.CSTNode`` and every class below it."""
    out: list[type] = []
    stack: list[type] = [cst.CSTNode]
    seen: set[type] = set()
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.add(cls)
            out.append(cls)
            stack.extend(cls.__subclasses__())
    return out


def plain_isinstance() -> Callable[[], None]:
    """Give every LibCST node class that is a plain ABC (empty registry, no ``__subclasshook__``)
    :class:`PlainChecks` as its metaclass; returns what puts ABCMeta back."""
    registry = getattr(abc, "_get_dump", None)  # CPython's view of an ABC's registered subclasses
    changed = [
        cls
        for cls in node_classes()
        if type(cls) is abc.ABCMeta
        and registry is not None
        and not registry(cls)[0]
        and "__subclasshook__" not in cls.__dict__
    ]
    for cls in changed:
        cls.__class__ = PlainChecks

    def undo() -> None:
        for cls in changed:
            cls.__class__ = abc.ABCMeta

    return undo


# --- the visitor methods of a batched visitor ------------------------------------------------------

_ORIGINAL_GET_VISITORS = cst.BatchableCSTVisitor.get_visitors
_PREFIXES = ("visit_", "leave_")
# visitor class -> names of its visitor methods: they are class attributes, the same for every instance
_VISITOR_NAMES: MutableMapping[type, tuple[str, ...]] = WeakKeyDictionary()


def fast_get_visitors(self: cst.BatchableCSTVisitor) -> Mapping[str, Callable[..., Any]]:
    """What ``BatchableCSTVisitor.get_visitors`` returns (the bound ``visit_*``/``leave_*`` methods that
    are not no-op stubs), without ``inspect.getmembers``: that reads every one of the thousands of
    stubs LibCST's visitor classes define, as a bound method, on every instance (a metadata provider
    per file: about a millisecond each). The names are found once per class in the classes' own
    dictionaries; an instance whose own attributes could change the answer (a method, or a name the
    class answers with) gets LibCST's own."""
    cls = type(self)
    names = _VISITOR_NAMES.get(cls)
    if names is None:
        names = _VISITOR_NAMES[cls] = _class_visitor_names(self)
    own = getattr(self, "__dict__", None)
    if own and any(type(v) is MethodType or n in names or n.startswith(_PREFIXES) for n, v in own.items()):
        return _ORIGINAL_GET_VISITORS(self)
    return {name: getattr(self, name) for name in names}


def _class_visitor_names(visitor: cst.BatchableCSTVisitor) -> tuple[str, ...]:
    """The class attributes ``inspect.getmembers`` keeps: each name's first definition along the
    class's MRO; a plain function is judged by its own name and no-op mark (what its bound method
    shows), anything else (a classmethod, a property, a value) by looking it up as LibCST does."""
    seen: set[str] = set()
    out = []
    for klass in type(visitor).__mro__:
        for name, value in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if type(value) is FunctionType:
                if value.__name__.startswith(_PREFIXES) and not getattr(value, "_is_no_op", False):
                    out.append(name)
                continue
            member = getattr(visitor, name, None)
            if (
                type(member) is MethodType
                and member.__name__.startswith(_PREFIXES)
                and not getattr(member, "_is_no_op", False)
            ):
                out.append(name)
    return tuple(sorted(out))
