"""The shapes of a Python loop over a tensor's rows that TOP610 recognises (`range(x.size(0))`,
`range(len(x))`, `x`, `enumerate(x)`), and the batched form of a loop that only sums a per-row term."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from torchopt.analysis.syntax import walk
from torchopt.codemods.sync.row_loop_tensors import FunctionScope
from torchopt.rewrite.rule import Rule

# Reductions over every element: summing per-row terms of one is not the same reduction of the batch.
_FULL_REDUCTIONS = {"sum", "mean", "max", "min", "norm", "prod", "std", "var", "all", "any", "amax", "amin"}


@dataclass(frozen=True)
class RowLoop:
    """A loop that visits one row of `tensor` per iteration: `index` names the row number, `row` the row."""

    node: cst.For
    tensor: str
    index: str | None
    row: str | None


def row_header(
    rule: Rule, it: cst.BaseExpression, target: cst.BaseExpression, scope: FunctionScope
) -> tuple[str, str | None, str | None] | None:
    """(tensor, index name, row name) of `range(x.size(0))`, `range(len(x))`, `x`, `enumerate(x)`."""
    if (
        isinstance(it, cst.Call)
        and isinstance(it.func, cst.Name)
        and it.func.value == "range"
        and len(it.args) == 1
        and isinstance(target, cst.Name)
    ):
        tensor = _first_dim_of(it.args[0].value, scope)
        return (tensor, target.value, None) if tensor else None
    if isinstance(it, cst.Name) and it.value in scope.sure and isinstance(target, cst.Name):
        return it.value, None, target.value
    if (
        isinstance(it, cst.Call)
        and isinstance(it.func, cst.Name)
        and it.func.value == "enumerate"
        and len(it.args) == 1
        and isinstance(it.args[0].value, cst.Name)
        and it.args[0].value.value in scope.sure
        and isinstance(target, cst.Tuple)
        and len(target.elements) == 2
        and all(isinstance(e.value, cst.Name) for e in target.elements)
    ):
        index, row = (e.value.value for e in target.elements if isinstance(e.value, cst.Name))
        return it.args[0].value.value, index, row
    return None


def _first_dim_of(bound: cst.BaseExpression, scope: FunctionScope) -> str | None:
    """`x` for `x.size(0)`, `x.shape[0]`, `len(x)` (the last only for a name surely holding a tensor)."""
    if (
        isinstance(bound, cst.Call)
        and isinstance(bound.func, cst.Attribute)
        and bound.func.attr.value == "size"
        and len(bound.args) == 1
        and isinstance(bound.args[0].value, cst.Integer)
        and bound.args[0].value.value == "0"
        and isinstance(bound.func.value, cst.Name)
        and bound.func.value.value in scope.tensors
    ):
        return bound.func.value.value
    if (
        isinstance(bound, cst.Subscript)
        and isinstance(bound.value, cst.Attribute)
        and bound.value.attr.value == "shape"
        and isinstance(bound.value.value, cst.Name)
        and bound.value.value.value in scope.tensors
        and len(bound.slice) == 1
        and isinstance(bound.slice[0].slice, cst.Index)
        and isinstance(bound.slice[0].slice.value, cst.Integer)
        and bound.slice[0].slice.value.value == "0"
    ):
        return bound.value.value.value
    if (
        isinstance(bound, cst.Call)
        and isinstance(bound.func, cst.Name)
        and bound.func.value == "len"
        and len(bound.args) == 1
        and isinstance(bound.args[0].value, cst.Name)
        and bound.args[0].value.value in scope.sure
    ):
        return bound.args[0].value.value
    return None


def indexes_row(node: cst.CSTNode, index: str, scope: FunctionScope) -> bool:
    """`t[i]` (or `t[i, ...]`) for a tensor `t` of the function."""
    if not (
        isinstance(node, cst.Subscript)
        and isinstance(node.value, cst.Name)
        and node.value.value in scope.tensors
        and node.slice
        and isinstance(node.slice[0].slice, cst.Index)
    ):
        return False
    first = node.slice[0].slice.value
    return isinstance(first, cst.Name) and first.value == index


def batched_sum(rule: Rule, loop: RowLoop, scope: FunctionScope) -> str | None:
    """`acc = acc + E` / `acc += E` as the loop's only statement: the batched form, or None."""
    body = loop.node.body
    if loop.node.orelse is not None or not isinstance(body, cst.IndentedBlock) or len(body.body) != 1:
        return None
    line = body.body[0]
    if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
        return None
    stmt = line.body[0]
    if (
        isinstance(stmt, cst.AugAssign)
        and isinstance(stmt.operator, cst.AddAssign)
        and isinstance(stmt.target, cst.Name)
    ):
        acc, term = stmt.target.value, stmt.value
    elif (
        isinstance(stmt, cst.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0].target, cst.Name)
        and isinstance(stmt.value, cst.BinaryOperation)
        and isinstance(stmt.value.operator, cst.Add)
        and isinstance(stmt.value.left, cst.Name)
        and stmt.value.left.value == stmt.targets[0].target.value
    ):
        acc, term = stmt.value.left.value, stmt.value.right
    else:
        return None
    batched = vectorised(rule, term, loop.index, loop.row, loop.tensor, scope)
    if batched is None or any(isinstance(n, cst.Name) and n.value == acc for n in walk(term, cross_scopes=True)):
        return None
    return f"{acc} = {acc} + {batched}"


def vectorised(
    rule: Rule, term: cst.BaseExpression, index: str | None, row: str | None, tensor: str, scope: FunctionScope
) -> str | None:
    """The sum over rows of `term` as a batched expression: every `t[i]` (or the row) becomes the
    whole tensor, then a full `.sum()` already covers the rows and anything else gets `.sum(0)`."""
    replaced = term.visit(_WholeTensor(index, row, tensor, scope))
    assert isinstance(replaced, cst.BaseExpression)
    names = {n.value for n in walk(replaced, cross_scopes=True) if isinstance(n, cst.Name)}
    if replaced.deep_equals(term) or (index and index in names) or (row and row in names):
        return None  # the loop variable is used other than as a row
    text = rule.ctx.module.code_for_node(replaced)
    reductions = [
        n
        for n in walk(replaced, cross_scopes=True)
        if isinstance(n, cst.Call)
        and isinstance(n.func, cst.Attribute)
        and n.func.attr.value in _FULL_REDUCTIONS
        and not n.args
    ]
    if not reductions:
        atom = isinstance(replaced, (cst.Name, cst.Attribute, cst.Subscript, cst.Call)) and not replaced.lpar
        return f"{text}.sum(0)" if atom else f"({text}).sum(0)"
    outer = replaced
    if (
        len(reductions) == 1
        and reductions[0] is outer
        and isinstance(outer, cst.Call)
        and isinstance(outer.func, cst.Attribute)
        and outer.func.attr.value == "sum"
    ):
        return text
    return None


class _WholeTensor(cst.CSTTransformer):
    """`t[i]` -> `t` for the loop index `i`, and the row name -> the tensor."""

    def __init__(self, index: str | None, row: str | None, tensor: str, scope: FunctionScope) -> None:
        super().__init__()
        self.index, self.row, self.tensor, self.scope = index, row, tensor, scope

    def leave_Subscript(self, original_node: cst.Subscript, updated_node: cst.Subscript) -> cst.BaseExpression:
        if self.index and len(original_node.slice) == 1 and indexes_row(original_node, self.index, self.scope):
            return updated_node.value
        return updated_node

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        return cst.Name(self.tensor) if self.row and original_node.value == self.row else updated_node
