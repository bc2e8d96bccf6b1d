"""What a receiver of ``.zero_grad()`` / ``.parameters()`` is, and where a file reads ``.grad``."""

from __future__ import annotations

from typing import TypeGuard

import libcst as cst

from torchopt.analysis.names import callee, qualified_names, reaching_values
from torchopt.analysis.models import nn_module_classes
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

OPTIM = "optimizer"
MODULE = "module"
OTHER = "other"  # resolved to something that is not a torch optimizer or module
UNKNOWN = "unknown"

_CHAIN = {"to", "cuda", "cpu", "train", "eval", "float", "double", "half", "bfloat16", "requires_grad_"}


def strip_chain(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``Net().to(device).train()`` -> ``Net()``."""
    while (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Attribute)
        and isinstance(expr.func.value, cst.Call)
        and expr.func.attr.value in _CHAIN
    ):
        expr = expr.func.value
    return expr


def module_classes(rule: Rule) -> set[str]:
    """Names of classes defined in the file that derive (transitively, in the file) from a torch.nn
    class: ``nn.Module`` or any of its subclasses (``nn.Sequential``, ``nn.Linear``...)."""
    return set(nn_module_classes(rule))


def _value_kind(rule: Rule, value: cst.BaseExpression | None, modules: set[str]) -> str:
    if value is None:
        return UNKNOWN
    base = strip_chain(value)
    if not isinstance(base, cst.Call) or isinstance(base.func, cst.Call):
        return UNKNOWN
    q = callee(rule, base)
    if q is not None:
        last = q.rsplit(".", 1)[-1]
        if q.startswith("torch.optim.") and "lr_scheduler" not in q and last[:1].isupper():
            return OPTIM
        if q.startswith("torch.nn.") and last[:1].isupper():
            return MODULE
        return OTHER
    if isinstance(base.func, cst.Name) and base.func.value in modules:
        return MODULE
    names = qualified_names(rule, base.func)
    if any(n.startswith("torchvision.models.") for n in names):
        return MODULE
    return OTHER if names else UNKNOWN


def enclosing_class(rule: Rule, node: cst.CSTNode) -> cst.ClassDef | None:
    cur: cst.CSTNode | None = node
    while cur is not None:
        cur = rule.get_metadata(ParentProvider, cur, None)
        if isinstance(cur, cst.ClassDef):
            return cur
    return None


def receiver_kind(rule: Rule, expr: cst.BaseExpression, modules: set[str]) -> str:
    """OPTIM, MODULE, OTHER or UNKNOWN for the object a method is called on."""
    if isinstance(expr, cst.Name):
        if expr.value == "self":
            cls = enclosing_class(rule, expr)
            return MODULE if cls is not None and cls.name.value in modules else UNKNOWN
        values = reaching_values(rule, expr)
        if not values:
            return UNKNOWN
        kinds = {_value_kind(rule, v, modules) for v in values}
    elif isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name) and expr.value.value == "self":
        cls = enclosing_class(rule, expr)
        if cls is None:
            return UNKNOWN
        kinds = set()
        for n in walk(cls, cross_scopes=True):
            if isinstance(n, cst.Assign):
                for t in n.targets:
                    tt = t.target
                    if (
                        isinstance(tt, cst.Attribute)
                        and isinstance(tt.value, cst.Name)
                        and tt.value.value == "self"
                        and tt.attr.value == expr.attr.value
                    ):
                        kinds.add(_value_kind(rule, n.value, modules))
        if not kinds:
            return UNKNOWN
    else:
        return UNKNOWN
    if OTHER in kinds:
        return OTHER
    return kinds.pop() if len(kinds) == 1 else UNKNOWN


def _is_none_test(node: cst.CSTNode) -> TypeGuard[cst.Comparison]:
    return (
        isinstance(node, cst.Comparison)
        and len(node.comparisons) == 1
        and isinstance(node.comparisons[0].operator, (cst.Is, cst.IsNot))
        and isinstance(node.comparisons[0].comparator, cst.Name)
        and node.comparisons[0].comparator.value == "None"
    )


def _guarded(rule: Rule, attr: cst.Attribute) -> bool:
    """Inside ``if <same>.grad is not None:`` (its body)."""
    code = rule.ctx.module.code_for_node(attr)
    cur: cst.CSTNode = attr
    while True:
        parent = rule.get_metadata(ParentProvider, cur, None)
        if parent is None or isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return False
        if isinstance(parent, cst.If) and cur is parent.body and _is_none_test(parent.test):
            test = parent.test
            assert isinstance(test, cst.Comparison)
            if isinstance(test.comparisons[0].operator, cst.IsNot) and rule.ctx.module.code_for_node(test.left) == code:
                return True
        if isinstance(parent, (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)) and cur is not parent.for_in:
            comp: cst.CompFor | None = parent.for_in
            while comp is not None:
                for cond in comp.ifs:
                    t = cond.test
                    if (
                        _is_none_test(t)
                        and isinstance(t.comparisons[0].operator, cst.IsNot)
                        and rule.ctx.module.code_for_node(t.left) == code
                    ):
                        return True
                comp = comp.inner_for_in
        if (
            isinstance(parent, cst.BooleanOperation)
            and isinstance(parent.operator, cst.And)
            and cur is parent.right
            and _is_none_test(parent.left)
        ):
            if rule.ctx.module.code_for_node(parent.left.left) == code:
                return True
        cur = parent


def grad_reads(rule: Rule, exclude: cst.CSTNode | None = None) -> list[cst.Attribute]:
    """Reads of ``<x>.grad`` that would break (AttributeError on None) once gradients are set to
    None: not an assignment target, not a ``<x>.grad is [not] None`` test, not guarded by one,
    not ``autograd.grad(...)``, and not inside ``exclude``."""
    skip = {id(n) for n in walk(exclude, cross_scopes=True)} if exclude is not None else set()
    out = []
    for n in walk(rule.ctx.module, cross_scopes=True):
        if not isinstance(n, cst.Attribute) or n.attr.value != "grad" or id(n) in skip:
            continue
        parent = rule.get_metadata(ParentProvider, n, None)
        if isinstance(parent, cst.Call) and parent.func is n:
            continue
        if isinstance(parent, (cst.AssignTarget, cst.Del)) or (
            isinstance(parent, cst.Comparison) and _is_none_test(parent)
        ):
            continue
        if _guarded(rule, n):
            continue
        out.append(n)
    return out
