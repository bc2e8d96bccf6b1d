"""TOP829 `autograd-variable`: Removes the `torch.autograd.Variable(t)` wrapper: since PyTorch 0.4 it returns the tensor."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.syntax import has_comments
from torchopt.analysis.syntax import in_version_guard
from torchopt.rewrite.metadata import ParentProvider
from torchopt.codemods.deprecated import FAMILY
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class AutogradVariable(Rule):
    """## What it does
    Removes the `torch.autograd.Variable(t)` wrapper: since PyTorch 0.4 it returns the tensor
    unchanged.

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
    Safe for `Variable(t)` with a single argument: the result is `t` itself. `Variable(t,
    requires_grad=True)` (it makes a new leaf) and `volatile=` (ignored since 0.4) are reported
    without a fix. The now-unused import is left for your import cleaner.
    """

    code = "TOP829"
    name = "autograd-variable"
    family = FAMILY
    message = "`Variable(...)` is a no-op since PyTorch 0.4"
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
                self.report(node, replacement=cst.RemovalSentinel.REMOVE, target=line)
            else:
                self.report(node)
            return
        if not isinstance(value, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) and not value.lpar:
            value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        self.report(
            node,
            replacement=value.with_changes(lpar=[*node.lpar, *value.lpar], rpar=[*value.rpar, *node.rpar])
            if node.lpar
            else value,
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
