"""TOP206 `gradient-penalty-amp`: Points at `torch.autograd.grad(..., create_graph=True)` (a gradient penalty, double backward)."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.syntax import source
from torchopt.codemods.amp import FAMILY
from torchopt.codemods.amp import prechecks
from torchopt.codemods.amp.amp_api import AUTOCAST_NAMES, SCALER_NAMES, _AmpUses
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class GradientPenaltyAmp(_AmpUses):
    """## What it does
    Points at `torch.autograd.grad(..., create_graph=True)` (a gradient penalty, double backward)
    in a file that uses `GradScaler` or `autocast`, when the gradients are not taken of a scaled
    loss, and gives the `torch.amp` recipe for it.

    ## Why is this slow
    With loss scaling, gradients taken of the unscaled loss lose the scaler's protection: in fp16
    they underflow, and the penalty computed from them is wrong or zero. If they are taken of the
    scaled loss but not unscaled, the penalty is computed from gradients that are too large by
    the scale factor, which changes every step. Either way the step is silently wrong, and the
    safe alternative is to give up fp16 AMP for that step. The recipe (from the PyTorch AMP
    examples) keeps the step in AMP:

    ```python
    scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]
    with torch.autocast("cuda", dtype=torch.float16):
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        loss = loss + penalty
    scaler.scale(loss).backward()
    ```

    ## Example
    ```python
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
    penalty = sum(g.pow(2).sum() for g in grads)
    scaler.scale(loss + penalty).backward()
    ```

    ## Use instead
    ```python
    scaler = torch.amp.GradScaler("cuda")
    params = list(model.parameters())
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]
    with torch.autocast("cuda", dtype=torch.float16):
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        loss = loss + penalty
    scaler.scale(loss).backward()
    ```

    ## Fix safety
    Display-only: the recipe restructures the step (which loss is scaled, where gradients are
    unscaled, what runs under autocast), which needs the user's intent. Calls whose first
    argument is already `scaler.scale(...)` are taken to follow it.
    """

    code = "TOP206"
    name = "gradient-penalty-amp"
    family = FAMILY
    message = (
        "`{call}` under AMP: take the gradients of `scaler.scale(loss)`, multiply them by "
        "`1.0 / scaler.get_scale()`, and compute the penalty under autocast (see the rule's docs)"
    )
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("create_graph", "autograd")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return (
            super().could_match(text)
            and ("autocast" in text or "GradScaler" in text)
            and prechecks.gradient_penalty_possible(text)
        )

    examples = (
        Invalid(
            'import torch\n\nscaler = torch.amp.GradScaler("cuda")\n\n\ndef step(model, x):\n'
            '    with torch.autocast("cuda"):\n        loss = model(x).sum()\n'
            "    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)\n"
            "    penalty = sum(g.pow(2).sum() for g in grads)\n    scaler.scale(loss + penalty).backward()\n",
            after=None,
        ),
        Invalid(
            "import torch\nfrom torch.autograd import grad\nfrom torch.cuda.amp import GradScaler\n\n"
            "scaler = GradScaler()\n\n\ndef gp(out, inp):\n    return grad(out, inp, create_graph=True)[0]\n",
            after=None,
        ),
        Valid(
            "import torch\n\n\ndef gp(out, inp):\n    return torch.autograd.grad(out, inp, create_graph=True)[0]\n",
            note="no AMP in the file",
        ),
        Valid(
            'import torch\n\nscaler = torch.amp.GradScaler("cuda")\n\n\ndef step(loss, params):\n'
            "    scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)\n"
            "    inv = 1.0 / scaler.get_scale()\n    return [g * inv for g in scaled]\n",
            note="already follows the recipe",
        ),
        Valid(
            'import torch\n\nscaler = torch.amp.GradScaler("cuda")\n\n\ndef step(loss, params):\n'
            "    return torch.autograd.grad(loss, params, create_graph=False)\n"
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._grads: list[cst.Call] = []

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) != "torch.autograd.grad":
            return
        kw = keyword(node, "create_graph")
        pos = positional(node)
        value = kw.value if kw is not None else (pos[4].value if len(pos) > 4 else None)
        if value is None or (isinstance(value, cst.Name) and value.value in ("False", "None")):
            return
        out = keyword(node, "outputs")
        first = out.value if out is not None else (pos[0].value if pos else None)
        if isinstance(first, cst.Call) and isinstance(first.func, cst.Attribute) and first.func.attr.value == "scale":
            return
        self._grads.append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        if self._grads and self.uses(AUTOCAST_NAMES | SCALER_NAMES):
            for call in self._grads:
                self.report(call, fmt={"call": source(self, call)})
