"""Which values can require grad, for the inference rules (TOP801 no_grad for evaluation code,
TOP802 inference_mode in pure inference scripts, TOP803 missing `model.eval()` / `model.train()`)."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import callee
from torchopt.codemods.inference.eval_code import EvalRule
from torchopt.rewrite.metadata import ParentProvider

# Results that never require grad, whatever they are computed from.
_GRAD_FREE_METHODS = {
    "item",
    "tolist",
    "numpy",
    "detach",
    "argmax",
    "argmin",
    "long",
    "int",
    "bool",
    "short",
    "byte",
    "size",
    "dim",
    "numel",
    "nonzero",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "isnan",
    "isfinite",
    "isinf",
    "count_nonzero",
    "__len__",
    "keys",
    "argsort",
}
_GRAD_FREE_BUILTINS = {"float", "int", "len", "str", "round", "bool", "print", "range", "repr", "format"}
_GRAD_FREE_TORCH = {
    "torch.argmax",
    "torch.argmin",
    "torch.bincount",
    "torch.eq",
    "torch.isnan",
    "torch.isfinite",
    "torch.zeros",
    "torch.ones",
    "torch.full",
    "torch.arange",
    "torch.tensor",
    "torch.zeros_like",
    "torch.ones_like",
    "torch.empty",
    "torch.count_nonzero",
}


class _GradFree:
    """Whether values can require grad: decided from the expression, following names to every
    definition in their scope (loop targets over data count as data)."""

    def __init__(self, rule: EvalRule) -> None:
        self.rule = rule
        self._names: dict[int, bool] = {}

    def expr(self, e: cst.BaseExpression | cst.From | None, depth: int = 0) -> bool:
        """Whether ``e`` never requires grad; a ``yield from`` (From) is not known not to."""
        if e is None or depth > 6:
            return e is None
        if isinstance(
            e,
            (
                cst.Integer,
                cst.Float,
                cst.Imaginary,
                cst.SimpleString,
                cst.ConcatenatedString,
                cst.FormattedString,
                cst.Comparison,
                cst.Lambda,
            ),
        ):
            return True
        if isinstance(e, cst.Name):
            return e.value in ("None", "True", "False") or self.name(e, depth)
        if isinstance(e, (cst.Tuple, cst.List, cst.Set)):
            return all(self.expr(x.value, depth + 1) for x in e.elements)
        if isinstance(e, cst.Dict):
            return all(isinstance(x, cst.DictElement) and self.expr(x.value, depth + 1) for x in e.elements)
        if isinstance(e, cst.BinaryOperation):
            return self.expr(e.left, depth + 1) and self.expr(e.right, depth + 1)
        if isinstance(e, cst.UnaryOperation):
            return self.expr(e.expression, depth + 1)
        if isinstance(e, cst.BooleanOperation):
            return self.expr(e.left, depth + 1) and self.expr(e.right, depth + 1)
        if isinstance(e, cst.IfExp):
            return self.expr(e.body, depth + 1) and self.expr(e.orelse, depth + 1)
        if isinstance(e, cst.Subscript):
            return self.expr(e.value, depth + 1)
        if isinstance(e, cst.Attribute):
            return e.attr.value in ("shape", "dtype", "device", "ndim") or self.expr(e.value, depth + 1)
        if isinstance(e, cst.Call):
            args_free = all(self.expr(a.value, depth + 1) for a in e.args)
            if isinstance(e.func, cst.Attribute):
                if e.func.attr.value in _GRAD_FREE_METHODS:
                    return True
                q = callee(self.rule, e)
                if q is not None:
                    return q in _GRAD_FREE_TORCH or args_free
                return self.expr(e.func.value, depth + 1) and args_free
            if isinstance(e.func, cst.Name) and e.func.value in _GRAD_FREE_BUILTINS:
                return True
            q = callee(self.rule, e)
            if q is not None:
                return q in _GRAD_FREE_TORCH or args_free
            return False
        return False

    def name(self, n: cst.Name, depth: int) -> bool:
        try:
            scope = self.rule.get_metadata(ScopeProvider, n)
        except KeyError:
            return False
        if scope is None or n.value not in scope:
            return False
        key = id(scope) ^ hash(n.value)
        if key in self._names:
            return self._names[key]
        self._names[key] = False  # recursion guard
        ok = True
        for a in scope[n.value]:
            if not self._definition(getattr(a, "node", None), depth):
                ok = False
                break
        self._names[key] = ok
        return ok

    def _definition(self, node: cst.CSTNode | None, depth: int) -> bool:
        if node is None or isinstance(node, (cst.Param, cst.Import, cst.ImportFrom)):
            return isinstance(node, (cst.Import, cst.ImportFrom))
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            return True
        get = self.rule.get_metadata
        cur = node
        for _ in range(8):
            parent = get(ParentProvider, cur, None)
            if parent is None:
                return False
            if isinstance(parent, cst.AssignTarget):
                stmt = get(ParentProvider, parent, None)
                return isinstance(stmt, cst.Assign) and self.expr(stmt.value, depth + 1)
            if isinstance(parent, (cst.AugAssign, cst.AnnAssign)) and cur is parent.target:
                return self.expr(parent.value, depth + 1)
            if isinstance(parent, cst.For) and cur is parent.target:
                return not self.rule.forward_calls(parent.iter)  # batches of data
            if isinstance(parent, cst.CompFor) and cur is parent.target:
                return self.expr(parent.iter, depth + 1) or not self.rule.forward_calls(parent.iter)
            if isinstance(parent, (cst.WithItem, cst.NamedExpr, cst.ExceptHandler)):
                return False
            if not isinstance(parent, (cst.Tuple, cst.List, cst.Element, cst.StarredElement)):
                return False
            cur = parent
        return False
