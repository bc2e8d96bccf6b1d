"""TOP607 `grad-norm-sync`: Flags, inside a training step, `clip_grad_norm_(..., error_if_nonfinite=True)` and host reads of."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.analysis.step_loops import Tensors
from torchopt.analysis.step_loops import dotted
from torchopt.analysis.control import QUIET_GUARDS, control_of
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.sync import FAMILY
from torchopt.codemods.sync.host_read_planning import grad_norm_names
from torchopt.codemods.sync.host_read_planning import host_read
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class GradNormSync(Rule):
    """## What it does
    Flags, inside a training step, `clip_grad_norm_(..., error_if_nonfinite=True)` and host reads of
    the norm it returns (`norm.item()`, `float(norm)`, printing it) every step.

    ## Why is this slow
    `error_if_nonfinite=True` checks the total norm on the host: a synchronisation per step. Reading
    the returned norm for logging does the same.

    ## Example
    ```python
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        history.append(norm.item())
        optimizer.step()
    ```

    ## Use instead
    ```python
    for step, (x, y) in enumerate(loader):
        loss = criterion(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(norm)  # stays on the device
        optimizer.step()
    history = torch.stack(norms).tolist()  # one read after the loop
    ```

    ## Fix safety
    Display-only: dropping `error_if_nonfinite` removes the exception the program relies on.

    Not reported: code that runs only every few steps (`if step % log_every == 0:`), once (`if i == 0:`),
    after an error (an out-of-memory handler) or under a device check inside the step (see "The fact
    layer" in docs/design.md). Code that runs at every step on rank 0 only (`if rank == 0:`,
    `is_main_process()`) is reported: rank 0 waits at every step and the other ranks wait for it at
    the next collective.
    """

    code = "TOP607"
    name = "grad-norm-sync"
    family = FAMILY
    message = "`{expr}` {why} {where}; {advice}"
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("clip_grad_norm", "get_total_norm")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_grad_norm_read
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_grad_norm_read).
        return super().could_match(text) and hot_check(text, may_grad_norm_read)

    examples = (
        Invalid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        model(x).sum().backward()\n"
            "        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "        print(norm.item())\n        opt.step()\n",
            after=None,
        ),
        Invalid(
            "from torch.nn.utils import clip_grad_norm_\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        model(x).sum().backward()\n"
            "        clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)\n        opt.step()\n",
            after=None,
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        model(x).sum().backward()\n"
            "        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n        opt.step()\n"
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.any_hot:
            return
        tz = Tensors(self, hm)
        norms = grad_norm_names(hm)
        for n in walk(node, True):
            if not isinstance(n, cst.Call):
                continue
            where = hm.where(n)
            if where is None or control_of(self).not_every_step(n, guards=QUIET_GUARDS) is not None:
                continue
            d = dotted(n.func) or ""
            if d.rsplit(".", 1)[-1] in ("clip_grad_norm_", "clip_grad_norm"):
                kw = keyword(n, "error_if_nonfinite")
                if kw is not None and not (isinstance(kw.value, cst.Name) and kw.value.value == "False"):
                    self.report(
                        n,
                        fmt={
                            "expr": source(self, n),
                            "where": where.text,
                            "why": "checks the total norm on the host (error_if_nonfinite)",
                            "advice": "check `torch.isfinite(norm)` every N steps instead",
                        },
                    )
                continue
            if isinstance(n.func, cst.Attribute) and dotted(n.func.value) in norms and host_read(hm, tz, n):
                self.report(
                    n,
                    fmt={
                        "expr": source(self, n),
                        "where": where.text,
                        "why": "reads the gradient norm on the host",
                        "advice": "keep the norms on the device (`norms.append(norm)`) and read them "
                        "every N steps or after the loop",
                    },
                )
            elif (
                isinstance(n.func, cst.Name)
                and n.func.value in ("float", "print")
                and any(dotted(a.value) in norms for a in n.args)
            ):
                self.report(
                    n,
                    fmt={
                        "expr": source(self, n),
                        "where": where.text,
                        "why": "reads the gradient norm on the host",
                        "advice": "keep the norms on the device and read them every N steps",
                    },
                )
