"""TOP829 `autograd-variable`: Removes the `torch.autograd.Variable(t)` wrapper: since PyTorch 0.4 it returns the tensor."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.names import reaching_values
from torchopt.analysis.syntax import has_comments
from torchopt.analysis.syntax import in_version_guard
from torchopt.rewrite.metadata import ParentProvider
from torchopt.codemods.deprecated import FAMILY
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class AutogradVariable(Rule):
    """## What it does
    Removes the `torch.autograd.Variable(t)` wrapper, a leftover of PyTorch before 0.4, where
    tensors and Variables were merged.

    ## Why is this slow
    A leftover of the Variable/Tensor split that costs a Python call per use and confuses readers
    into thinking the value is special.

    ## Example
    ```python
    from torch.autograd import Variable

    x = Variable(batch.cuda())
    ```

    ## Use instead
    ```python
    from torch.autograd import Variable

    x = batch.cuda()
    ```

    ## Fix safety
    `Variable(t)` returns `t.detach()`: a new tensor on the same memory that does not require
    grad (and a `TypeError` when `t` is no tensor). Removing it is safe when `t` is a tensor that
    does not require grad: a torch factory without `requires_grad=True`, `x.data`, `x.detach()`,
    `x.new_zeros(...)` and the other `new*` constructors, moves, casts, views and arithmetic of
    such tensors, and names only ever bound to them. Otherwise (a parameter, a batch whose origin
    the file does not show, a model output) the fix is unsafe (semantics): when `t` requires grad,
    gradients that stopped at `Variable(t)` now flow into `t`. `Variable(t, requires_grad=True)`
    (it makes a new leaf) and `volatile=` (ignored since 0.4) are reported without a fix. The
    now-unused import is left for your import cleaner.
    """

    code = "TOP829"
    name = "autograd-variable"
    family = FAMILY
    message = "`Variable(...)` is a leftover of PyTorch before 0.4"
    fix_title = "Drop the `Variable(...)` wrapper"
    safety = Safety.SAFE
    prefilter = ("Variable",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(
            text, ("torch.autograd.Variable", "torch.autograd.variable.Variable")
        )

    examples = (
        Invalid(
            "import torch\nfrom torch.autograd import Variable\n\nx = Variable(torch.ones(2)) * 2\n",
            after="import torch\nfrom torch.autograd import Variable\n\nx = torch.ones(2) * 2\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\na = torch.ones(2)\ny = torch.autograd.Variable(a + 1).sum()\n",
            after="import torch\n\na = torch.ones(2)\ny = (a + 1).sum()\n",
            runnable=True,
        ),
        Invalid(
            "import torch\nfrom torch.autograd import Variable\n\nw = Variable(torch.zeros(3), requires_grad=True)\n",
            after=None,
            note="makes a leaf that requires grad: reported without a fix",
        ),
        Invalid(
            "import torch\nfrom torch.autograd import Variable\n\nx = torch.ones(2)\nx = Variable(x)\ny = x * 2\n",
            after="import torch\nfrom torch.autograd import Variable\n\nx = torch.ones(2)\ny = x * 2\n",
            note="`x = Variable(x)` would leave `x = x`: the line goes",
            runnable=True,
        ),
        Invalid(
            "import torch\nfrom torch.autograd import Variable\n\n\ndef features(model, x):\n    return Variable(model(x))\n",
            after="import torch\nfrom torch.autograd import Variable\n\n\ndef features(model, x):\n    return model(x)\n",
            unsafe="semantics",
            note="a model's output requires grad: `Variable(...)` stopped the gradients there",
        ),
        Invalid(
            "from torch.autograd import Variable\n\n\ndef as_variable(obj):\n    return Variable(obj)\n",
            after="from torch.autograd import Variable\n\n\ndef as_variable(obj):\n    return obj\n",
            unsafe="semantics",
            note="`obj` may be no tensor (then `Variable(obj)` raises) or require grad",
        ),
        Valid("import torch\n\nw = torch.zeros(3, requires_grad=True)\n", runnable=True),
        Valid("import tensorflow as tf\n\nv = tf.Variable(1.0)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) not in ("torch.autograd.Variable", "torch.autograd.variable.Variable"):
            return
        if in_version_guard(self, node):
            return
        if len(node.args) != 1 or node.args[0].keyword is not None or node.args[0].star or has_comments(node):
            self.report(node)
            return
        value = node.args[0].value
        line = self._self_assignment(node, value)
        if line is not None:
            # `x = Variable(x)` without the wrapper is `x = x`: the whole line goes, or (alone in its
            # block, or with a comment) it is reported for a hand edit
            if isinstance(line, cst.SimpleStatementLine):
                grad_free = _grad_free(self, value, 0)
                self.report(
                    node,
                    replacement=cst.RemovalSentinel.REMOVE,
                    target=line,
                    safety=None if grad_free else Safety.UNSAFE,
                    tags=() if grad_free else (Tag.SEMANTICS,),
                    note="" if grad_free else _UNSAFE_NOTE,
                )
            else:
                self.report(node)
            return
        if not isinstance(value, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) and not value.lpar:
            value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        grad_free = _grad_free(self, node.args[0].value, 0)
        self.report(
            node,
            replacement=value.with_changes(lpar=[*node.lpar, *value.lpar], rpar=[*value.rpar, *node.rpar])
            if node.lpar
            else value,
            safety=None if grad_free else Safety.UNSAFE,
            tags=() if grad_free else (Tag.SEMANTICS,),
            note="" if grad_free else _UNSAFE_NOTE,
        )

    def _self_assignment(self, node: cst.Call, value: cst.BaseExpression) -> cst.SimpleStatementLine | bool | None:
        """The line ``x = Variable(x)`` that ``node`` is the whole value of (without the wrapper it
        would read ``x = x``): the line when it can go (one statement, no comment, not alone in its
        block), True when it cannot, None when ``node`` is not such a value."""
        assign = self.get_metadata(ParentProvider, node, None)
        if not (
            isinstance(assign, cst.Assign)
            and assign.value is node
            and len(assign.targets) == 1
            and isinstance(value, cst.Name)
            and isinstance(assign.targets[0].target, cst.Name)
            and assign.targets[0].target.value == value.value
        ):
            return None
        line = self.get_metadata(ParentProvider, assign, None)
        block = self.get_metadata(ParentProvider, line, None) if isinstance(line, cst.SimpleStatementLine) else None
        if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
            return True
        if any(empty.comment is not None for empty in line.leading_lines) or line.trailing_whitespace.comment:
            return True
        if not isinstance(block, (cst.IndentedBlock, cst.Module)) or len(block.body) < 2:
            return True
        return line


_UNSAFE_NOTE = (
    "`Variable(t)` is `t.detach()`: if `t` requires grad, gradients now flow into it; if it is no tensor, "
    "the `TypeError` is gone"
)
# Calls that make a new tensor that does not require grad (unless `requires_grad=True` is passed).
_FACTORIES = frozenset(
    f"torch.{n}"
    for n in (
        "zeros ones empty full rand randn randint randperm arange linspace logspace eye tensor as_tensor "
        "from_numpy zeros_like ones_like empty_like full_like rand_like randn_like randint_like Tensor "
        "FloatTensor DoubleTensor HalfTensor LongTensor IntTensor ByteTensor BoolTensor "
        "cuda.FloatTensor cuda.LongTensor cuda.ByteTensor cuda.DoubleTensor cuda.HalfTensor "
        "autograd.Variable autograd.variable.Variable"
    ).split()
)
# Methods whose result never requires grad, whatever the receiver.
_FRESH = frozenset({"detach", "new", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"})
# Methods whose result requires grad only when the receiver does.
_KEEP = frozenset(
    "cuda cpu to long float double half int bool byte contiguous clone view reshape unsqueeze squeeze "
    "transpose permute t expand repeat zero_ fill_ pin_memory type_as flatten narrow index_select".split()
)


def _grad_free(rule: Rule, expr: cst.BaseExpression, depth: int) -> bool:
    """``expr`` is a tensor that does not require grad, as far as this file shows (False: unknown)."""
    if depth > 8:
        return False
    if isinstance(expr, cst.Attribute) and expr.attr.value == "data":
        return True
    if isinstance(expr, cst.Subscript):
        return _grad_free(rule, expr.value, depth + 1)
    if isinstance(expr, cst.BinaryOperation):
        sides = [s for s in (expr.left, expr.right) if not isinstance(s, (cst.Integer, cst.Float))]
        return bool(sides) and all(_grad_free(rule, s, depth + 1) for s in sides)
    if isinstance(expr, cst.Name):
        values = reaching_values(rule, expr)
        return bool(values) and all(v is not None and _grad_free(rule, v, depth + 1) for v in values or ())
    if not isinstance(expr, cst.Call):
        return False
    if any(a.keyword is not None and a.keyword.value == "requires_grad" for a in expr.args):
        return False
    if callee(rule, expr) in _FACTORIES:
        return True
    if isinstance(expr.func, cst.Attribute):
        method = expr.func.attr.value
        if method in _FRESH:
            return True
        if method in _KEEP:
            return _grad_free(rule, expr.func.value, depth + 1)
    return False
