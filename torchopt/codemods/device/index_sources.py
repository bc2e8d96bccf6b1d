"""TOP101's index form through names: ``i = torch.arange(n)[:, None] * s`` ... ``x[(i - j).long()]``.

An index computed on the host from torch factories (through rearranging chains, casts, arithmetic
with Python numbers and names assigned once and read once, in one function) is copied to ``x``'s
device at every indexing. Creating every factory it comes from on ``x.device`` computes the index on
the device instead; that is only written when ``x`` is a plain name whose every binding comes before
each factory (so ``x.device`` can be read there and names the same tensor as at the index).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import Assignment, ScopeProvider

from torchopt.analysis.arguments import keyword
from torchopt.analysis.layout_chains import REARRANGING, chain_root
from torchopt.analysis.names import bindings_of
from torchopt.analysis.placement import Kind, placements
from torchopt.analysis.transfers import start_of
from torchopt.analysis.values import CAST_METHODS
from torchopt.codemods.device.factory_tables import INDEX_FACTORIES
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

_ARITHMETIC = (cst.Add, cst.Subtract, cst.Multiply, cst.Divide, cst.FloorDivide)
_DEPTH = 12


@dataclass
class Sources:
    """The factory calls an index is computed from, with their kinds; ``names``: the names it passes
    through (for the message); ``arithmetic``: whether values are computed on the way."""

    factories: list[tuple[cst.Call, str]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    arithmetic: bool = False


def index_sources(rule, expr: cst.BaseExpression, scope: object) -> Sources | None:
    """The host factories ``expr`` is computed from, when it is computed from nothing else (Python
    numbers aside) and passes through at least one name; None otherwise."""
    out = Sources()
    if not _walk(rule, expr, scope, out, 0) or not out.factories or not out.names:
        return None
    return out


def _walk(rule, expr: cst.BaseExpression, scope: object, out: Sources, depth: int) -> bool:
    if depth > _DEPTH:
        return False
    chain = chain_root(expr)
    if chain is not None:
        expr = chain[0]
    if isinstance(expr, cst.Name):
        return _through_name(rule, expr, scope, out, depth)
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        out.arithmetic = True
        return _walk(rule, expr.expression, scope, out, depth + 1)
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, _ARITHMETIC):
        out.arithmetic = True
        sides = [expr.left, expr.right]
        scalars = [s for s in sides if placements(rule).value(s).kind is Kind.SCALAR]
        rest = [s for s in sides if not any(s is x for x in scalars)]
        return bool(rest) and all(_walk(rule, s, scope, out, depth + 1) for s in rest)
    if not isinstance(expr, cst.Call):
        return False
    func = expr.func
    if isinstance(func, cst.Attribute) and func.attr.value in CAST_METHODS and not expr.args:
        return _walk(rule, func.value, scope, out, depth + 1)
    if isinstance(func, cst.Attribute) and func.attr.value in REARRANGING:
        return False  # (a chain on something chain_root did not take)
    found = rule.factory_of(expr)
    if found is None:
        return False
    kind = found[0]
    if kind not in INDEX_FACTORIES or keyword(expr, "device") is not None or rule.requires_grad(expr):
        return False
    if rule.factory_blockers(kind, expr) or rule._skipped_arguments(kind, expr):
        return False
    if kind == "tensor" and rule._is_tensor_data(expr):
        return False
    out.factories.append((expr, kind))
    return True


def _through_name(rule, name: cst.Name, scope: object, out: Sources, depth: int) -> bool:
    """A name of the same function bound once, by ``name = value``, and read only here."""
    try:
        if rule.get_metadata(ScopeProvider, name) is not scope:
            return False
    except KeyError:
        return False
    bindings = bindings_of(rule, name)
    if not bindings or len(bindings) != 1 or not isinstance(bindings[0], Assignment):
        return False
    binding = bindings[0]
    if len(binding.references) != 1:
        return False
    target = rule.get_metadata(ParentProvider, binding.node, None)
    stmt = rule.get_metadata(ParentProvider, target, None) if isinstance(target, cst.AssignTarget) else None
    if not isinstance(stmt, cst.Assign) or len(stmt.targets) != 1:
        return False
    out.names.append(name.value)
    return _walk(rule, stmt.value, scope, out, depth + 1)


def device_reads_before(rule: Rule, base: cst.Name, factories: list[tuple[cst.Call, str]]) -> bool:
    """Every binding of ``base`` comes before every factory: ``base.device`` read at a factory names
    the tensor that is indexed (a parameter is bound before the body)."""
    bindings = bindings_of(rule, base)
    if not bindings:
        return False
    first = min(start_of(rule, call) for call, _ in factories)
    for b in bindings:
        if not isinstance(b, Assignment):
            return False
        node = b.node
        if isinstance(node, cst.Param):
            continue
        if not isinstance(node, cst.CSTNode) or start_of(rule, node) >= first:
            return False
    return True


class _Rewrite(cst.CSTTransformer):
    def __init__(self, new: dict[int, cst.Call]) -> None:
        self.new = new

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        return self.new.get(id(original_node), updated_node)


def rewritten(fn: cst.FunctionDef, new: dict[int, cst.Call]) -> cst.FunctionDef:
    """``fn`` with the calls of ``new`` (by ``id`` of the original node) replaced."""
    out = fn.visit(_Rewrite(new))
    assert isinstance(out, cst.FunctionDef)
    return out
