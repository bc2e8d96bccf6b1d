"""Checkpoints a program writes and reads back itself (part of the model lifecycle).

A *round-trip checkpoint* of a module ``m``: the program saves ``m.state_dict()`` with
``torch.save(obj, path)`` (``obj`` the state dict itself, or a dict or a ``dict(...)`` that holds it,
directly or through a name bound to one) and loads ``torch.load(path)`` back into ``m`` itself with
``m.load_state_dict(...)`` (the loaded object itself, or an item of it, directly or through a name
bound to one), with the same path expression, or hands the path and ``m`` itself to one helper
(`restart_from_checkpoint(os.path.join(out, "checkpoint.pth"), state_dict=m)`, whose loading the file
does not show: it may load into ``m``). The resume checkpoint of a training script is one:
the keys it writes are the keys it reads, into the same (possibly wrapped) module, so how the keys
are spelled matters to nobody in the file. ``round_trip(rule, call)`` answers for a
``m.state_dict()`` or ``m.load_state_dict(...)`` call; anything the file does not show (a path
that differs, a load from a name bound twice) is not a round trip.
"""

from __future__ import annotations

import libcst as cst
from libcst.metadata import Assignment, ScopeProvider

from torchopt.analysis.names import callee, dotted
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider, remembered
from torchopt.rewrite.rule import Rule


def round_trip(rule: Rule, call: cst.Call) -> bool:
    """Whether ``call`` (``m.state_dict()`` or ``m.load_state_dict(...)``) is half of a round-trip
    checkpoint of ``m`` (module docstring)."""
    if not isinstance(call.func, cst.Attribute):
        return False
    key = dotted(call.func.value)
    if key is None:
        return False
    saves, loads = remembered(("round-trip-checkpoints",), rule.ctx.module, lambda: _collect(rule))
    meth = call.func.attr.value
    if meth == "state_dict":
        paths = {p for c, k, p in saves if c is call}
        return bool(paths) and paths <= {p for k, p in loads if k == key}
    if meth == "load_state_dict":
        paths = {p for c, k, p in loads_of(rule, call)}
        return bool(paths) and paths <= {p for _, k, p in saves if k == key}
    return False


def loads_of(rule: Rule, call: cst.Call) -> list[tuple[cst.Call, str, str]]:
    """``(call, module, path)`` for a ``module.load_state_dict(...)`` whose argument comes from ``torch.load(path)``."""
    if not isinstance(call.func, cst.Attribute) or not call.args:
        return []
    key = dotted(call.func.value)
    path = _loaded_path(rule, call.args[0].value)
    return [(call, key, path)] if key is not None and path is not None else []


def _collect(rule: Rule) -> tuple[list[tuple[cst.Call, str, str]], list[tuple[str, str]]]:
    saves: list[tuple[cst.Call, str, str]] = []
    loads: list[tuple[str, str]] = []
    handed: list[cst.Call] = []
    module = rule.ctx.module
    for n in walk(module, cross_scopes=True):
        if not isinstance(n, cst.Call) or not isinstance(n.func, (cst.Name, cst.Attribute)):
            continue
        if isinstance(n.func, cst.Attribute) and n.func.attr.value == "load_state_dict":
            loads += [(k, p) for _, k, p in loads_of(rule, n)]
            continue
        if len(n.args) < 2 or callee(rule, n) != "torch.save":
            handed.append(n)
            continue
        path = module.code_for_node(n.args[1].value)
        for obj in _values(rule, n.args[0].value):
            for sd in walk(obj):
                if (
                    isinstance(sd, cst.Call)
                    and isinstance(sd.func, cst.Attribute)
                    and sd.func.attr.value == "state_dict"
                    and not sd.args
                    and (key := dotted(sd.func.value)) is not None
                ):
                    saves.append((sd, key, path))
    paths = {p for _, _, p in saves}
    for n in handed:  # a helper given a saved path and a module: it may load one into the other
        given = [module.code_for_node(a.value) for a in n.args]
        for path in paths & set(given):
            loads += [(k, path) for k in given if any(k == key for _, key, _ in saves)]
    return saves, loads


def _values(rule: Rule, expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    """``expr``, or what every binding of the name ``expr`` assigns (nothing when one is not an assignment)."""
    if not isinstance(expr, cst.Name):
        return [expr]
    out: list[cst.BaseExpression] = []
    for a in _bindings(rule, expr):
        value = _assigned(rule, a)
        if value is None:
            return []
        out.append(value)
    return out


def _loaded_path(rule: Rule, expr: cst.BaseExpression) -> str | None:
    """The path expression of the ``torch.load(path)`` that ``expr`` (or its item ``expr[...]``) reads."""
    while isinstance(expr, cst.Subscript):
        expr = expr.value
    values = _values(rule, expr)
    paths = set()
    for v in values:
        while isinstance(v, cst.Subscript):
            v = v.value
        if not isinstance(v, cst.Call) or not v.args or callee(rule, v) != "torch.load":
            return None
        paths.add(rule.ctx.module.code_for_node(v.args[0].value))
    return paths.pop() if len(paths) == 1 else None


def _bindings(rule: Rule, name: cst.Name) -> list:
    try:
        scope = rule.get_metadata(ScopeProvider, name)
    except KeyError:
        return []
    if scope is None or name.value not in scope:
        return []
    return list(scope[name.value])


def _assigned(rule: Rule, a: object) -> cst.BaseExpression | None:
    node = getattr(a, "node", None)
    if not isinstance(a, Assignment) or node is None:
        return None
    parent = rule.get_metadata(ParentProvider, node, None)
    if isinstance(parent, cst.AssignTarget) and parent.target is node:
        stmt = rule.get_metadata(ParentProvider, parent, None)
        return stmt.value if isinstance(stmt, cst.Assign) else None
    return None
