"""TOP831 `zero-grad-set-to-none-false`: Flags `optimizer.zero_grad(set_to_none=False)` and `model.zero_grad(set_to_none=False)` and."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.syntax import has_comments
from torchopt.analysis.syntax import source
from torchopt.codemods.zero_grad import FAMILY
from torchopt.codemods.zero_grad.optimizer_objects import OTHER
from torchopt.codemods.zero_grad.optimizer_objects import UNKNOWN
from torchopt.codemods.zero_grad.optimizer_objects import grad_reads
from torchopt.codemods.zero_grad.optimizer_objects import module_classes
from torchopt.codemods.zero_grad.optimizer_objects import receiver_kind
from torchopt.codemods.zero_grad.zeroing_loops import _SAFETY_DOC
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class ZeroGradSetToNoneFalse(Rule):
    __doc__ = """## What it does
    Flags `optimizer.zero_grad(set_to_none=False)` and `model.zero_grad(set_to_none=False)` and
    rewrites them to the plain `zero_grad()`, which sets gradients to None.

    ## Why is this slow
    `set_to_none=False` launches a memset for every gradient tensor on every step, and the next
    backward then *accumulates* into the zeroed tensors (a read-modify-write) instead of simply
    writing them. With gradients set to None both disappear and the memory of the gradients is
    freed between steps (PyTorch tuning guide, "Use parameter.grad = None instead of
    model.zero_grad() or optimizer.zero_grad()"; since 2.0 `zero_grad()` does exactly that).

    ## Example
    ```python
    optimizer.zero_grad(set_to_none=False)
    ```

    ## Use instead
    ```python
    optimizer.zero_grad()
    ```

    ## Fix safety
{safety}
    """.replace("{safety}", _SAFETY_DOC)

    code = "TOP831"
    name = "zero-grad-set-to-none-false"
    family = FAMILY
    message = "`{call}` fills every gradient with zeros on every step"
    blocked_message = "`{call}` fills every gradient with zeros on every step; not fixed: {why}"
    fix_title = "Set gradients to None: `{new}`"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS,)
    prefilter = ("zero_grad",)

    examples = (
        Invalid(
            "import torch\n\nmodel = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
            "for _ in range(3):\n    opt.zero_grad(set_to_none=False)\n    model(torch.ones(3, 4)).sum().backward()\n    opt.step()\n",
            after="import torch\n\nmodel = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
            "for _ in range(3):\n    opt.zero_grad()\n    model(torch.ones(3, 4)).sum().backward()\n    opt.step()\n",
            unsafe="semantics",
            runnable=True,
            note="every parameter gets a gradient on every step: bitwise the same",
        ),
        Invalid(
            "def train_step(model, batch):\n    model.zero_grad(False)\n    model(batch).sum().backward()\n",
            after="def train_step(model, batch):\n    model.zero_grad()\n    model(batch).sum().backward()\n",
            unsafe="semantics",
            note="positional form; an unresolved receiver is assumed to be a torch module or optimizer",
        ),
        Invalid(
            "import torch\n\nmodel = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "opt.zero_grad(set_to_none=False)\nmodel(torch.ones(3, 4)).sum().backward()\n"
            "print(model.weight.grad.norm())\n",
            after=None,
            note="`.grad` is read unguarded elsewhere: it would be None before the first backward",
        ),
        Invalid(
            "from apex.optimizers import FusedAdam\n\nopt = FusedAdam(params)\nopt.zero_grad(set_to_none=False)\n",
            after=None,
            note="not a torch.optim built-in",
        ),
        Valid(
            "import torch\n\nopt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)\nopt.zero_grad()\n",
            runnable=True,
        ),
        Valid(
            "import torch\n\nopt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)\n"
            "opt.zero_grad(set_to_none=True)\n",
            runnable=True,
        ),
        Valid("def reset(opt, keep):\n    opt.zero_grad(set_to_none=keep)\n", note="not a literal False"),
        Valid("def reset(opt, kw):\n    opt.zero_grad(**kw)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if not isinstance(func, cst.Attribute) or func.attr.value != "zero_grad" or has_star(node):
            return
        if len(node.args) != 1:
            return
        arg = node.args[0]
        if arg.keyword is not None and arg.keyword.value != "set_to_none":
            return
        if not (isinstance(arg.value, cst.Name) and arg.value.value == "False"):
            return
        call = source(self, node)
        modules = module_classes(self)
        kind = receiver_kind(self, func.value, modules)
        why = None
        if kind == OTHER:
            why = f"`{source(self, func.value)}` is not a torch.optim optimizer or torch.nn module"
        else:
            reads = grad_reads(self)
            if reads:
                why = (
                    f"`{source(self, reads[0])}` is read where it would be None "
                    "(gradients set to None have no `.norm()`, `.add_()`, ...)"
                )
            elif has_comments(node):
                why = "a comment would be lost"
        if why:
            self.report(node, message=self.blocked_message, fmt={"call": call, "why": why})
            return
        new = node.with_changes(args=[])
        note = (
            "gradients become None between steps: a parameter that gets no gradient in a step is skipped "
            "by the optimizer instead of being updated with a zero gradient (momentum, weight decay)"
        )
        if kind == UNKNOWN:
            note += f"; assuming `{source(self, func.value)}` is a torch optimizer or module"
        self.report(
            node, fmt={"call": call, "new": source(self, new)}, replacement=new, tags=[Tag.SEMANTICS], note=note
        )
