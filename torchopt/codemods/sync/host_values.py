"""Values that provably live on the host (Python numbers, CPU tensors): reading or branching on
them costs no device synchronisation, whatever the step-loop analysis guessed about their names."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import Assignment, PositionProvider, ScopeProvider

from torchopt.analysis.names import callee, dotted, param_annotation
from torchopt.analysis.values import classify_device
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

# Builtins and itertools helpers whose result is host data when their arguments are.
_HOST_BUILTINS = {
    "range",
    "len",
    "int",
    "float",
    "bool",
    "abs",
    "round",
    "min",
    "max",
    "sum",
    "list",
    "tuple",
    "reversed",
    "sorted",
    "zip",
    "enumerate",
    "count",
    "itertools.count",
    "tqdm",
    "tqdm.tqdm",
}
_HOST_METHODS = {"item", "tolist"}  # the value they return is a Python number or list
_HOST_ANNOTATIONS = {"int", "float", "bool"}
# Factories that build a tensor on the CPU unless given a device.
_CPU_FACTORIES = {
    "torch.randint",
    "torch.rand",
    "torch.randn",
    "torch.randperm",
    "torch.tensor",
    "torch.zeros",
    "torch.ones",
    "torch.arange",
    "torch.empty",
    "torch.full",
    "torch.linspace",
}
_DEPTH = 6


def is_host_value(rule: Rule, expr: cst.BaseExpression, depth: int = 0) -> bool:
    """True when ``expr`` is a Python number (or container of them) built from literals, loop
    counters, `range`/`itertools.count`, `.item()`/`.tolist()` results or int-annotated parameters."""
    if depth > _DEPTH:
        return False
    if isinstance(expr, (cst.Integer, cst.Float)):
        return True
    if isinstance(expr, cst.UnaryOperation):
        return is_host_value(rule, expr.expression, depth + 1)
    if isinstance(expr, cst.BinaryOperation):
        return is_host_value(rule, expr.left, depth + 1) and is_host_value(rule, expr.right, depth + 1)
    if isinstance(expr, cst.Subscript):
        return is_host_value(rule, expr.value, depth + 1)
    if isinstance(expr, (cst.List, cst.Tuple)):
        return all(is_host_value(rule, e.value, depth + 1) for e in expr.elements)
    if isinstance(expr, cst.Call):
        return _host_call(rule, expr, depth)
    if isinstance(expr, cst.Name):
        return _host_name(rule, expr, depth)
    return False


def is_cpu_tensor(rule: Rule, expr: cst.BaseExpression) -> bool:
    """A tensor made by a torch factory on the CPU right here (`torch.randint(16, 128, ()).item()`)."""
    if not isinstance(expr, cst.Call) or callee(rule, expr) not in _CPU_FACTORIES:
        return False
    for arg in expr.args:
        if arg.keyword is not None and arg.keyword.value == "device":
            return classify_device(rule, arg.value).is_cpu
        if arg.star:
            return False
    return True


def _host_call(rule: Rule, call: cst.Call, depth: int) -> bool:
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value in _HOST_METHODS and not call.args:
        return True
    name = dotted(func) or ""
    if name in _HOST_BUILTINS:
        return all(is_host_value(rule, a.value, depth + 1) for a in call.args if a.keyword is None)
    return False


def _host_name(rule: Rule, name: cst.Name, depth: int) -> bool:
    if param_annotation(rule, name) in _HOST_ANNOTATIONS:
        return True
    try:
        scope = rule.get_metadata(ScopeProvider, name)
    except KeyError:
        return False
    if scope is None or name.value not in scope:
        return False
    assignments = list(scope[name.value])
    if not assignments or not all(isinstance(a, Assignment) for a in assignments):
        return False
    assignments = _last_before(rule, name, assignments)
    for a in assignments:
        if not isinstance(a, Assignment) or not _host_binding(rule, a.node, depth):
            return False
    return True


def _last_before(rule: Rule, name: cst.Name, assignments: list) -> list:
    """When every binding precedes the use in the text, only the latest one reaches straight-line
    code (`times = torch.linspace(...)` then `times = times.tolist()`); otherwise all of them."""
    try:
        use = rule.get_metadata(PositionProvider, name).start
        spots = [(rule.get_metadata(PositionProvider, a.node).start, a) for a in assignments]
    except KeyError:
        return assignments
    key = lambda p: (p.line, p.column)  # noqa: E731
    if all(key(p) < key(use) for p, _ in spots):
        return [max(spots, key=lambda s: key(s[0]))[1]]
    return assignments


def _host_binding(rule: Rule, node: cst.CSTNode, depth: int) -> bool:
    """Whether the binding of a name at ``node`` (its target) gives it a host value."""
    cur = node
    parent = rule.get_metadata(ParentProvider, cur, None)
    while isinstance(parent, (cst.Tuple, cst.List, cst.Element)):
        cur, parent = parent, rule.get_metadata(ParentProvider, parent, None)
    if isinstance(parent, cst.AssignTarget):
        stmt = rule.get_metadata(ParentProvider, parent, None)
        return isinstance(stmt, cst.Assign) and is_host_value(rule, stmt.value, depth + 1)
    if isinstance(parent, cst.AugAssign) and parent.target is cur:
        return is_host_value(rule, parent.value, depth + 1)
    if isinstance(parent, cst.For) and parent.target is cur:
        it = parent.iter
        target = parent.target
        if isinstance(it, cst.Call) and dotted(it.func) == "enumerate" and isinstance(target, (cst.Tuple, cst.List)):
            # The counter is an int; the element is host data only if the iterable is.
            if target.elements and target.elements[0].value is node:
                return True
        return is_host_value(rule, it, depth + 1)
    return False
