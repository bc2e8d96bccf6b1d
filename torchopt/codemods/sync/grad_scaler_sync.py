"""TOP608 `grad-scaler-sync`: Flags, inside a training step, `scaler.step(optimizer)` for an optimizer of this file that is."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import keyword
from torchopt.analysis.names import callee
from torchopt.analysis.step_loops import dotted
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.sync import FAMILY
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


_SCALERS = {
    "torch.amp.GradScaler",
    "torch.cuda.amp.GradScaler",
    "torch.amp.grad_scaler.GradScaler",
    "torch.cpu.amp.GradScaler",
}


_FUSABLE = {"Adam", "AdamW", "SGD", "Adagrad"}


class GradScalerSync(Rule):
    """## What it does
    Flags, inside a training step, `scaler.step(optimizer)` for an optimizer of this file that is
    not `fused=True`, and `scaler.get_scale()`.

    ## Why is this slow
    `GradScaler.step` reads `found_inf` with `.item()` to decide whether to skip the update (a
    synchronisation every step) unless the optimizer handles the scale itself, which the fused
    Adam/AdamW/SGD/Adagrad kernels do on the device. `get_scale()` reads the scale on the host.

    ## Example
    ```python
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in loader:
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    ```

    ## Use instead
    ```python
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ```

    ## Fix safety
    Display-only here: a fused optimizer is a different kernel whose results are not guaranteed to
    be bitwise identical (class T, [GPU-unverified]).
    """

    code = "TOP608"
    name = "grad-scaler-sync"
    family = FAMILY
    message = "`{expr}` {why} {where}; {advice}"
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("GradScaler",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_scaler_sync
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_scaler_sync).
        return super().could_match(text) and hot_check(text, may_scaler_sync)

    examples = (
        Invalid(
            "import torch\n\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.AdamW(model.parameters())\n"
            "scaler = torch.amp.GradScaler('cuda')\n\ndef train(loader):\n    for x, y in loader:\n"
            "        scaler.scale(model(x).sum()).backward()\n        scaler.step(opt)\n        scaler.update()\n",
            after=None,
        ),
        Invalid(
            "import torch\n\nmodel = torch.nn.Linear(2, 1)\nscaler = torch.amp.GradScaler('cuda')\n\n"
            "def train(loader, opt):\n    for x, y in loader:\n"
            "        scaler.scale(model(x).sum()).backward()\n        print(scaler.get_scale())\n",
            after=None,
        ),
        Valid(
            "import torch\n\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.AdamW(model.parameters(), fused=True)\n"
            "scaler = torch.amp.GradScaler('cuda')\n\ndef train(loader):\n    for x, y in loader:\n"
            "        scaler.scale(model(x).sum()).backward()\n        scaler.step(opt)\n        scaler.update()\n"
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.any_hot:
            return
        scalers: set[str] = set()
        optims: dict[str, tuple[str, cst.Call]] = {}
        for n in walk(node, True):
            if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.value, cst.Call):
                d = dotted(n.targets[0].target)
                q = callee(self, n.value)
                if d and q in _SCALERS:
                    scalers.add(d)
                elif d and q and q.startswith("torch.optim.") and q.rsplit(".", 1)[1] in _FUSABLE:
                    optims[d] = (q.rsplit(".", 1)[1], n.value)
        if not scalers:
            return
        for n in walk(node, True):
            if not isinstance(n, cst.Call) or not isinstance(n.func, cst.Attribute):
                continue
            if dotted(n.func.value) not in scalers:
                continue
            meth = n.func.attr.value
            where = hm.where(n)
            if where is None:
                continue
            if meth == "get_scale":
                self.report(
                    n,
                    fmt={
                        "expr": source(self, n),
                        "where": where.text,
                        "why": "reads the loss scale on the host",
                        "advice": "read it every N steps, outside the step",
                    },
                )
            elif meth == "step" and n.args and not n.args[0].star:
                opt = dotted(n.args[0].value)
                if opt in optims:
                    cls, ctor = optims[opt]
                    fused = keyword(ctor, "fused")
                    if fused is not None or has_star(ctor):
                        continue
                    self.report(
                        n,
                        fmt={
                            "expr": source(self, n),
                            "where": where.text,
                            "why": "reads `found_inf` with `.item()` to decide whether to step",
                            "advice": f"create the optimizer with `{cls}(..., fused=True)`, which "
                            "checks for infs on the device (a different kernel: not "
                            "guaranteed bitwise identical)",
                        },
                    )
