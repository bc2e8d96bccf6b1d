"""Helpers shared by the padding rules: torch.nn classes by name, integer constants, padding maths."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee, reaching_values
from torchopt.analysis.arguments import keyword, positional
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import remembered
from torchopt.rewrite.rule import Option, Rule

OPTION_MULTIPLE = Option(
    "multiple",
    int,
    8,
    "pad sizes to a multiple of this (8 for fp16/bf16 Tensor Cores, 64 for the best GEMM tiling)",
    choices=(8, 64),
)


def last_name(func: cst.BaseExpression) -> str | None:
    """``Linear`` for ``nn.Linear`` or ``Linear``: a cheap test before resolving names."""
    if isinstance(func, cst.Attribute):
        return func.attr.value
    if isinstance(func, cst.Name):
        return func.value
    return None


def nn_class(rule: Rule, call: cst.Call, among: frozenset[str] | set[str] | None = None) -> str | None:
    """``Linear`` for a call of ``torch.nn.Linear`` / ``torch.nn.modules.linear.Linear``; else None.
    With ``among``, calls whose last name is not in it are rejected without resolving anything
    (an import alias such as ``from torch.nn import Linear as L`` is then missed)."""
    if among is not None and last_name(call.func) not in among:
        return None
    name = callee(rule, call)
    if not name:
        return None
    parts = name.split(".")
    if parts[:2] != ["torch", "nn"]:
        return None
    if len(parts) == 3 or (len(parts) == 5 and parts[2] == "modules"):
        return parts[-1]
    return None


def arg(call: cst.Call, index: int, name: str) -> cst.Arg | None:
    """The argument bound to parameter ``name`` (positional ``index``) of ``call``."""
    kw = keyword(call, name)
    if kw is not None:
        return kw
    pos = positional(call)
    return pos[index] if index < len(pos) else None


def int_const(rule: Rule, expr: cst.BaseExpression | None, depth: int = 0) -> int | None:
    """The value of an integer expression made of literals, names bound only to such expressions,
    and ``+ - * //``; None when it is not known."""
    if expr is None or depth > 6:
        return None
    if isinstance(expr, cst.Integer):
        return int(expr.evaluated_value)
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        v = int_const(rule, expr.expression, depth + 1)
        return None if v is None else -v
    if isinstance(expr, cst.BinaryOperation):
        a = int_const(rule, expr.left, depth + 1)
        b = int_const(rule, expr.right, depth + 1)
        if a is None or b is None:
            return None
        op = expr.operator
        if isinstance(op, cst.Add):
            return a + b
        if isinstance(op, cst.Subtract):
            return a - b
        if isinstance(op, cst.Multiply):
            return a * b
        if isinstance(op, cst.FloorDivide) and b != 0:
            return a // b
        return None
    if isinstance(expr, cst.Name):
        values = reaching_values(rule, expr)
        if not values or any(v is None for v in values):
            return None
        known = {int_const(rule, v, depth + 1) for v in values}
        if len(known) == 1:
            return known.pop()
    return None


def int_names(module: cst.Module) -> frozenset[str]:
    """Names assigned somewhere in the file to an integer-looking expression: an over-approximation
    of the names ``int_const`` can evaluate, found without scope analysis (which costs seconds on
    a large file). Worked out once per parse while the engine analyses the file."""
    return remembered(("int names",), module, lambda: _int_names(module))


def _int_names(module: cst.Module) -> frozenset[str]:
    out: set[str] = set()
    for n in walk(module, cross_scopes=True):
        if isinstance(n, cst.Assign) and _int_looking(n.value, None):
            for t in n.targets:
                if isinstance(t.target, cst.Name):
                    out.add(t.target.value)
        elif isinstance(n, cst.AnnAssign) and isinstance(n.target, cst.Name) and _int_looking(n.value, None):
            out.add(n.target.value)
    return frozenset(out)


def _int_looking(expr: cst.BaseExpression | None, names: frozenset[str] | None) -> bool:
    if isinstance(expr, cst.Integer):
        return True
    if isinstance(expr, cst.Name):
        return names is None or expr.value in names
    if isinstance(expr, cst.UnaryOperation):
        return _int_looking(expr.expression, names)
    if isinstance(expr, cst.BinaryOperation):
        return _int_looking(expr.left, names) and _int_looking(expr.right, names)
    return False


def maybe_int(rule: Rule, expr: cst.BaseExpression | None) -> bool:
    """Cheap test: could ``int_const`` know the value of ``expr``?"""
    return _int_looking(expr, int_names(rule.ctx.module))


def padded(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def pad_formula(expr_code: str, multiple: int) -> str:
    return f"(({expr_code} + {multiple - 1}) // {multiple}) * {multiple}"


def is_pad_formula(expr: cst.BaseExpression | None) -> bool:
    """``((x + 7) // 8) * 8`` (any multiple): a size that is already padded."""
    if not (
        isinstance(expr, cst.BinaryOperation)
        and isinstance(expr.operator, cst.Multiply)
        and isinstance(expr.right, cst.Integer)
    ):
        return False
    m = int(expr.right.evaluated_value)
    inner = expr.left
    if not (
        isinstance(inner, cst.BinaryOperation)
        and isinstance(inner.operator, cst.FloorDivide)
        and isinstance(inner.right, cst.Integer)
        and int(inner.right.evaluated_value) == m
    ):
        return False
    add = inner.left
    return (
        isinstance(add, cst.BinaryOperation)
        and isinstance(add.operator, cst.Add)
        and isinstance(add.right, cst.Integer)
        and int(add.right.evaluated_value) == m - 1
    )


def code(rule: Rule, node: cst.CSTNode) -> str:
    return " ".join(rule.ctx.module.code_for_node(node).split())


def names_in(node: cst.CSTNode) -> set[str]:
    return {n.value for n in walk(node, cross_scopes=True) if isinstance(n, cst.Name)}


def self_attr(node: cst.CSTNode | None, self_name: str = "self") -> str | None:
    """``X`` for ``self.X``."""
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == self_name:
        return node.attr.value
    return None
