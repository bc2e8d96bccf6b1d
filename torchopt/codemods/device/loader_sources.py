"""Where a loop's loader comes from when it is not built next to the loop: a parameter of a function
whose every call in the file passes a DataLoader, or a ``self.`` attribute set from one in the class.

The training loop of many scripts sits in ``def train(model, device, train_loader)`` or a trainer
method that iterates ``self.train_data``; the DataLoader is built elsewhere in the same file. The
answer is all-or-nothing: one call site or assignment that cannot be followed means "not known"."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import Assignment, ScopeProvider

from torchopt.analysis.arguments import has_star, keyword, positional
from torchopt.analysis.names import callee, param_annotation
from torchopt.analysis.syntax import walk
from torchopt.analysis.transfers import DATALOADERS
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

_MAX_DEPTH = 4


def loader_calls(rule: Rule, expr: cst.BaseExpression, depth: int = 0) -> list[cst.Call]:
    """The DataLoader calls ``expr`` can hold; [] when any of its sources is something else."""
    if depth > _MAX_DEPTH:
        return []
    if isinstance(expr, cst.Call):
        if callee(rule, expr) in DATALOADERS:
            return [expr]
        fn = _local_function(rule, expr)
        if fn is None:
            return []
        # Only `return DataLoader(...)` itself: a helper that returns a name may hand back anything.
        returns = [n.value for n in walk(fn.body) if isinstance(n, cst.Return)]
        if not returns or not all(isinstance(v, cst.Call) and callee(rule, v) in DATALOADERS for v in returns):
            return []
        return _all(rule, returns, depth)
    if isinstance(expr, cst.Name):
        return _all(rule, _definitions(rule, expr), depth)
    attr = _self_attribute(rule, expr)
    if attr is not None:
        cls, name = attr
        return _all(rule, _attribute_values(cls, name), depth)
    return []


def _all(rule: Rule, sources: list[cst.BaseExpression | None] | None, depth: int) -> list[cst.Call]:
    if not sources:
        return []
    out: list[cst.Call] = []
    for src in sources:
        calls = loader_calls(rule, src, depth + 1) if src is not None else []
        if not calls:
            return []
        out.extend(calls)
    return out


def _definitions(rule: Rule, name: cst.Name) -> list[cst.BaseExpression | None] | None:
    """What ``name`` is bound to: assigned values, and for a parameter the arguments of every call."""
    try:
        scope = rule.get_metadata(ScopeProvider, name)
    except KeyError:
        return None
    if scope is None or name.value not in scope:
        return None
    out: list[cst.BaseExpression | None] = []
    for a in scope[name.value]:
        if not isinstance(a, Assignment):
            return None
        node = a.node
        parent = rule.get_metadata(ParentProvider, node, None)
        if isinstance(node, cst.Param):
            args = _arguments(rule, node)
            if args is None:
                return None
            out.extend(args)
        elif isinstance(parent, cst.AssignTarget) and parent.target is node:
            stmt = rule.get_metadata(ParentProvider, parent, None)
            out.append(stmt.value if isinstance(stmt, cst.Assign) else None)
        elif isinstance(parent, cst.AnnAssign) and parent.target is node:
            out.append(parent.value)
        else:
            return None
    return out


def _arguments(rule: Rule, param: cst.Param) -> list[cst.BaseExpression] | None:
    """The expressions passed for ``param`` at every call of its function in the file (a module
    function, or a class's ``__init__`` called through the class name); None if the function is
    used any other way, never called, or called with ``*args``/``**kwargs``."""
    params = rule.get_metadata(ParentProvider, param, None)
    fn = rule.get_metadata(ParentProvider, params, None)
    if not isinstance(fn, cst.FunctionDef) or param not in params.params:
        return None
    index = list(params.params).index(param)
    owner = rule.get_metadata(ParentProvider, fn, None)
    if isinstance(owner, cst.IndentedBlock):
        owner = rule.get_metadata(ParentProvider, owner, None)
    if isinstance(owner, cst.ClassDef):
        if fn.name.value != "__init__":
            return None
        name, index = owner.name.value, index - 1
    elif isinstance(owner, cst.Module):
        name = fn.name.value
    else:
        return None
    if index < 0:
        return None
    out: list[cst.BaseExpression] = []
    for ref in walk(rule.ctx.module, cross_scopes=True):
        if not (isinstance(ref, cst.Name) and ref.value == name) or ref is fn.name:
            continue
        if isinstance(owner, cst.ClassDef) and ref is owner.name:
            continue
        call = rule.get_metadata(ParentProvider, ref, None)
        if _other_name(rule, ref, call, owner if isinstance(owner, cst.ClassDef) else fn):
            continue
        if not (isinstance(call, cst.Call) and call.func is ref) or has_star(call):
            return None
        passed = keyword(call, param.name.value)
        pos = positional(call)
        if passed is None and index < len(pos):
            passed = pos[index]
        if passed is None:
            return None
        out.append(passed.value)
    return out or None


def _other_name(rule: Rule, ref: cst.Name, parent: cst.CSTNode | None, binding: cst.CSTNode) -> bool:
    """``ref`` spells the name but is not a reference to ``binding`` (the function or class): ``model.train``,
    a keyword ``train=``, a method ``def train(self)`` of some class, a parameter ``train`` and its uses."""
    if isinstance(parent, cst.Attribute) and parent.attr is ref:
        return True
    if isinstance(parent, cst.Arg) and parent.keyword is ref:
        return True
    if isinstance(parent, cst.Param) and parent.name is ref:
        return True
    try:
        scope = rule.get_metadata(ScopeProvider, ref)
    except KeyError:
        scope = None
    if (
        scope is not None
        and ref.value in scope
        and not any(isinstance(a, Assignment) and a.node is binding for a in scope[ref.value])
    ):
        return True  # a local of the same name (`def __init__(self, train): ... train=train`) shadows it
    if isinstance(parent, cst.FunctionDef) and parent.name is ref:
        return isinstance(rule.get_metadata(ParentProvider, parent, None), cst.IndentedBlock)
    return False


def _local_function(rule: Rule, call: cst.Call) -> cst.FunctionDef | None:
    """The module-level ``def`` a plain call ``f(...)`` runs, when ``f`` is bound only by it."""
    if not isinstance(call.func, cst.Name):
        return None
    try:
        scope = rule.get_metadata(ScopeProvider, call.func)
    except KeyError:
        return None
    if scope is None or call.func.value not in scope:
        return None
    # A builtin (`list`, `zip`) is bound without a node of this file: it is not a local def.
    defs = [a.node if isinstance(a, Assignment) else None for a in scope[call.func.value]]
    if len(defs) == 1 and isinstance(defs[0], cst.FunctionDef):
        return defs[0]
    return None


def _self_attribute(rule: Rule, expr: cst.BaseExpression) -> tuple[cst.ClassDef, str] | None:
    """(class, ``X``) for ``self.X`` read in a method of a class (``self``: the first parameter)."""
    if not (isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name)):
        return None
    cur: cst.CSTNode | None = expr
    while cur is not None and not isinstance(cur, cst.FunctionDef):
        cur = rule.get_metadata(ParentProvider, cur, None)
    if cur is None or not cur.params.params or cur.params.params[0].name.value != expr.value.value:
        return None
    body = rule.get_metadata(ParentProvider, cur, None)
    cls = rule.get_metadata(ParentProvider, body, None)
    return (cls, expr.attr.value) if isinstance(cls, cst.ClassDef) else None


def _attribute_values(cls: cst.ClassDef, attr: str) -> list[cst.BaseExpression | None] | None:
    """Every value assigned to ``self.<attr>`` in the methods of ``cls``; None if it is also
    assigned some other way (augmented, unpacked, through another name)."""
    out: list[cst.BaseExpression | None] = []
    for fn in cls.body.body:
        if not isinstance(fn, cst.FunctionDef) or not fn.params.params:
            continue
        me = fn.params.params[0].name.value
        for n in walk(fn.body):
            if isinstance(n, cst.Assign):
                for t in n.targets:
                    if _is_self_attr(t.target, me, attr):
                        if len(n.targets) != 1:
                            return None
                        out.append(n.value)
                    elif any(_is_self_attr(x, me, attr) for x in walk(t.target)):
                        return None
            elif isinstance(n, (cst.AugAssign, cst.AnnAssign)) and _is_self_attr(n.target, me, attr):
                if isinstance(n, cst.AugAssign):
                    return None
                out.append(n.value)
    return out or None


def _is_self_attr(node: cst.CSTNode, me: str, attr: str) -> bool:
    return (
        isinstance(node, cst.Attribute)
        and isinstance(node.value, cst.Name)
        and node.value.value == me
        and node.attr.value == attr
    )


def int_device_attribute(rule: Rule, expr: cst.BaseExpression) -> bool:
    """``self.gpu_id`` whose every assignment in the class is an ``int``: a literal, ``int(...)``,
    or a parameter annotated ``int`` (``.to(0)`` is the first GPU)."""
    attr = _self_attribute(rule, expr)
    if attr is None:
        return False
    values = _attribute_values(*attr)
    if not values:
        return False
    for v in values:
        if isinstance(v, cst.Integer):
            continue
        if isinstance(v, cst.Call) and isinstance(v.func, cst.Name) and v.func.value == "int":
            continue
        if isinstance(v, cst.Name) and param_annotation(rule, v) == "int":
            continue
        return False
    return True
