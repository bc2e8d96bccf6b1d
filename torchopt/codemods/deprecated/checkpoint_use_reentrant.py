"""TOP827: activation checkpointing without an explicit ``use_reentrant``."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.arguments import keyword, set_kwarg
from torchopt.analysis.syntax import in_version_guard
from torchopt.codemods.deprecated import FAMILY
from torchopt.rewrite.rule import Invalid, Option, Rule, Safety, Tag, Valid

CHECKPOINT_FUNCS = {"torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential"}


class CheckpointReentrant(Rule):
    """## What it does
    Adds the explicit `use_reentrant=` that `torch.utils.checkpoint.checkpoint(...)` and
    `checkpoint_sequential(...)` now require: `use_reentrant=True` keeps today's behaviour;
    with the rule option `prefer = "non-reentrant"` the fix writes the recommended
    `use_reentrant=False` instead.

    ## Why is this slow
    PyTorch warns on every call: "the use_reentrant parameter should be passed explicitly.
    Starting in PyTorch 2.9, calling checkpoint without use_reentrant will raise an exception.
    use_reentrant=False is recommended" (2.13 still only warns). The non-reentrant variant
    also works with `torch.compile`, DDP's static graphs and inputs that do not require grad.

    ## Example
    ```python
    from torch.utils.checkpoint import checkpoint

    h = checkpoint(block, x)
    ```

    ## Use instead
    ```python
    from torch.utils.checkpoint import checkpoint

    h = checkpoint(block, x, use_reentrant=True)
    ```

    ## Fix safety
    `use_reentrant=True` is safe: it is what the call does today. `use_reentrant=False`
    (option `prefer = "non-reentrant"`) is unsafe (tag semantics): gradients are the same, but
    the recomputation runs differently (hooks, inputs without `requires_grad`, nested
    checkpoints). Calls with `**kwargs` (which may carry the keyword) are left alone.
    """

    code = "TOP827"
    name = "checkpoint-use-reentrant"
    family = FAMILY
    message = "`{func}` without `use_reentrant=` warns today and is slated to raise"
    fix_title = "Pass `use_reentrant={value}`"
    safety = Safety.SAFE
    prefilter = ("checkpoint",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import torch_calls_to

        calls = torch_calls_to(text, CHECKPOINT_FUNCS) if super().could_match(text) else []
        # visit_Call: such a call without `use_reentrant=` and without `**kwargs`.
        return calls is None or any(all(k.arg not in ("use_reentrant", None) for k in c.keywords) for c in calls)

    options = (
        Option(
            "prefer",
            str,
            "keep",
            "`keep`: write use_reentrant=True (today's behaviour, safe); "
            "`non-reentrant`: write the recommended use_reentrant=False (unsafe)",
            choices=("keep", "non-reentrant"),
        ),
    )

    examples = (
        Invalid(
            "import torch\nfrom torch.utils.checkpoint import checkpoint\n\nlin = torch.nn.Linear(4, 4)\n"
            "x = torch.randn(2, 4, requires_grad=True)\nh = checkpoint(lin, x)\nh.sum().backward()\n",
            after="import torch\nfrom torch.utils.checkpoint import checkpoint\n\nlin = torch.nn.Linear(4, 4)\n"
            "x = torch.randn(2, 4, requires_grad=True)\nh = checkpoint(lin, x, use_reentrant=True)\nh.sum().backward()\n",
            runnable=True,
        ),
        Invalid(
            "import torch.utils.checkpoint as cp\n\n\ndef forward(blocks, x):\n"
            "    return cp.checkpoint_sequential(blocks, 2, x)\n",
            after="import torch.utils.checkpoint as cp\n\n\ndef forward(blocks, x):\n"
            "    return cp.checkpoint_sequential(blocks, 2, x, use_reentrant=True)\n",
        ),
        Valid(
            "from torch.utils.checkpoint import checkpoint\n\ndef f(fn, x):\n    return checkpoint(fn, x, use_reentrant=False)\n"
        ),
        Valid(
            "from torch.utils.checkpoint import checkpoint\n\ndef f(fn, x, **kw):\n    return checkpoint(fn, x, **kw)\n",
            note="**kw may carry use_reentrant",
        ),
        Valid("from mylib import checkpoint\n\ncheckpoint('model.pt')\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        func = callee(self, node)
        if func not in CHECKPOINT_FUNCS or keyword(node, "use_reentrant") is not None:
            return
        if any(a.star == "**" for a in node.args) or in_version_guard(self, node):
            return
        recommended = self.option("prefer") == "non-reentrant"
        value = "False" if recommended else "True"
        fmt = {"func": func.rsplit(".", 1)[1] + "(...)", "value": value}
        self.report(
            node,
            fmt=fmt,
            replacement=set_kwarg(node, "use_reentrant", cst.Name(value)),
            safety=Safety.UNSAFE if recommended else Safety.SAFE,
            tags=(Tag.SEMANTICS,) if recommended else (),
            note="the non-reentrant recomputation differs for hooks, inputs without requires_grad "
            "and nested checkpoints"
            if recommended
            else "",
        )
