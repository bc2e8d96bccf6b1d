"""TOP832 `manual-grad-zeroing`: Flags a loop that zeroes every gradient by hand and rewrites it to `zero_grad()`:."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.syntax import has_comments
from torchopt.analysis.syntax import source
from torchopt.codemods.zero_grad import FAMILY
from torchopt.codemods.zero_grad.optimizer_objects import MODULE
from torchopt.codemods.zero_grad.optimizer_objects import OPTIM
from torchopt.codemods.zero_grad.optimizer_objects import UNKNOWN
from torchopt.codemods.zero_grad.optimizer_objects import grad_reads
from torchopt.codemods.zero_grad.optimizer_objects import module_classes
from torchopt.codemods.zero_grad.optimizer_objects import receiver_kind
from torchopt.codemods.zero_grad.zeroing_loops import (
    _SAFETY_DOC,
    _ZERO_METHODS,
    _loop_var,
    _zeroing_body,
    _zeroing_loop_possible,
)
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class ManualGradZeroing(Rule):
    __doc__ = """## What it does
    Flags a loop that zeroes every gradient by hand and rewrites it to `zero_grad()`:

    * `for p in model.parameters(): p.grad.zero_()` (also `p.grad.data.zero_()`, and the
      `if p.grad is not None: p.grad.detach_(); p.grad.zero_()` form) becomes `model.zero_grad()`;
    * `for group in opt.param_groups: for p in group["params"]: ...` becomes `opt.zero_grad()`.

    The guide's loop `for p in model.parameters(): p.grad = None` is already what
    `model.zero_grad()` does and is not flagged.

    ## Why is this slow
    The loop launches one memset per gradient tensor from Python on every step, and the next
    backward accumulates into the zeroed tensors instead of writing them. `zero_grad()` (which
    sets gradients to None by default since PyTorch 2.0) does neither and frees the gradient
    memory between steps.

    ## Example
    ```python
    for p in model.parameters():
        if p.grad is not None:
            p.grad.detach_()
            p.grad.zero_()
    ```

    ## Use instead
    ```python
    model.zero_grad()
    ```

    ## Fix safety
{safety}
    """.replace("{safety}", _SAFETY_DOC)

    code = "TOP832"
    name = "manual-grad-zeroing"
    family = FAMILY
    message = "This loop zeroes every gradient of `{owner}` by hand, one kernel per tensor"
    blocked_message = "This loop zeroes every gradient of `{owner}` by hand; not fixed: {why}"
    fix_title = "Use `{new}` (gradients set to None)"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS,)
    prefilter = (".grad",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # visit_For: a loop over `X.parameters()` or `X.param_groups` whose body calls one of
        # _ZERO_METHODS on `<var>.grad`.
        if not (
            super().could_match(text)
            and ("parameters" in text or "param_groups" in text)
            and any(m in text for m in _ZERO_METHODS)
        ):
            return False
        return _zeroing_loop_possible(text)

    examples = (
        Invalid(
            "import torch\n\nmodel = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for _ in range(3):\n    for p in model.parameters():\n        if p.grad is not None:\n"
            "            p.grad.detach_()\n            p.grad.zero_()\n"
            "    model(torch.ones(3, 4)).sum().backward()\n    opt.step()\n",
            after="import torch\n\nmodel = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for _ in range(3):\n    model.zero_grad()\n"
            "    model(torch.ones(3, 4)).sum().backward()\n    opt.step()\n",
            unsafe="semantics",
            runnable=True,
        ),
        Invalid(
            "import torch\n\nw = torch.ones(3, requires_grad=True)\nopt = torch.optim.Adam([w], lr=0.1)\n"
            "for _ in range(2):\n    (w * 2).sum().backward()\n    opt.step()\n"
            "    for group in opt.param_groups:\n        for q in group['params']:\n            q.grad.data.zero_()\n",
            after="import torch\n\nw = torch.ones(3, requires_grad=True)\nopt = torch.optim.Adam([w], lr=0.1)\n"
            "for _ in range(2):\n    (w * 2).sum().backward()\n    opt.step()\n    opt.zero_grad()\n",
            unsafe="semantics",
            runnable=True,
        ),
        Invalid(
            "import torch.nn as nn\n\n\nclass Net(nn.Module):\n    def reset(self):\n"
            "        for p in self.parameters():\n            p.grad.zero_()\n",
            after="import torch.nn as nn\n\n\nclass Net(nn.Module):\n    def reset(self):\n        self.zero_grad()\n",
            unsafe="semantics",
        ),
        Invalid(
            "def step(model, loss):\n    for p in model.parameters():\n        p.grad.zero_()\n"
            "    loss.backward()\n    return [p.grad.norm() for p in model.parameters()]\n",
            after=None,
            note="`.grad` read unguarded after the zeroing",
        ),
        Valid(
            "def reset(model):\n    for p in model.parameters():\n        p.grad = None\n",
            note="already what zero_grad() does",
        ),
        Valid(
            "def reset(model):\n    for p in model.parameters():\n        p.grad.zero_()\n        p.data.mul_(0.5)\n",
            note="the loop does more than zeroing",
        ),
        Valid(
            "def reset(model):\n    for p in model.encoder.parameters():\n        p.grad.zero_()\n",
            note="a sub-module's parameters: `model.encoder.zero_grad()` would do, but only plain names are rewritten",
        ),
        Valid("def reset(params):\n    for p in params:\n        p.grad.zero_()\n", note="not a module's parameters"),
    )

    def visit_For(self, node: cst.For) -> None:
        var = _loop_var(node)
        if var is None:
            return
        owner: cst.BaseExpression | None = None
        method_owner = False
        it = node.iter
        if (
            isinstance(it, cst.Call)
            and not it.args
            and isinstance(it.func, cst.Attribute)
            and it.func.attr.value == "parameters"
            and _zeroing_body(node.body, var)
        ):
            owner = it.func.value
        elif (
            isinstance(it, cst.Attribute)
            and it.attr.value == "param_groups"
            and isinstance(node.body, cst.IndentedBlock)
            and len(node.body.body) == 1
            and isinstance(node.body.body[0], cst.For)
        ):
            inner = node.body.body[0]
            ivar = _loop_var(inner)
            if (
                ivar is not None
                and isinstance(inner.iter, cst.Subscript)
                and isinstance(inner.iter.value, cst.Name)
                and inner.iter.value.value == var
                and len(inner.iter.slice) == 1
                and isinstance(inner.iter.slice[0].slice, cst.Index)
                and isinstance(inner.iter.slice[0].slice.value, cst.SimpleString)
                and inner.iter.slice[0].slice.value.evaluated_value == "params"
                and _zeroing_body(inner.body, ivar)
            ):
                owner = it.value
                method_owner = True
        if owner is None:
            return
        if not (
            isinstance(owner, cst.Name)
            or (isinstance(owner, cst.Attribute) and isinstance(owner.value, cst.Name) and owner.value.value == "self")
        ):
            return
        modules = module_classes(self)
        kind = receiver_kind(self, owner, modules)
        want = OPTIM if method_owner else MODULE
        owner_src = source(self, owner)
        why = None
        if kind not in (want, UNKNOWN):
            why = (
                f"`{owner_src}` is not a torch.optim optimizer"
                if method_owner
                else f"`{owner_src}` is not a torch.nn module"
            )
        else:
            reads = grad_reads(self, exclude=node)
            if reads:
                why = f"`{source(self, reads[0])}` is read where it would be None"
            elif has_comments(node.body):
                why = "a comment would be lost"
        if why:
            self.report(node, message=self.blocked_message, fmt={"owner": owner_src, "why": why})
            return
        call = cst.Call(func=cst.Attribute(value=owner, attr=cst.Name("zero_grad")))
        new = cst.SimpleStatementLine(body=[cst.Expr(call)], leading_lines=node.leading_lines)
        note = (
            "gradients become None instead of zeros: a parameter without a gradient in a step is skipped "
            "by the optimizer (momentum, weight decay)"
        )
        if kind == UNKNOWN:
            note += f"; assuming `{owner_src}` is a torch {'optimizer' if method_owner else 'module'}"
        self.report(
            node,
            fmt={"owner": owner_src, "new": f"{owner_src}.zero_grad()"},
            replacement=new,
            tags=[Tag.SEMANTICS],
            note=note,
        )
