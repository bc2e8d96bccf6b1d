"""TOP603 `device-to-host-copy-in-loop`: Flags device→host copies inside a training or evaluation step: `t.cpu()`, `t.to("cpu")`,."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.step_loops import HOST_READS
from torchopt.analysis.step_loops import dotted
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.analysis.values import classify_device
from torchopt.codemods.sync import FAMILY
from torchopt.analysis.control import QUIET_GUARDS, control_of
from torchopt.analysis.placement import placements
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class DeviceToHostCopyInLoop(Rule):
    """## What it does
    Flags device→host copies inside a training or evaluation step: `t.cpu()`, `t.to("cpu")`,
    `t.to(torch.device("cpu"))`. (`.numpy()`, `.tolist()` and `.item()` are TOP601; a `.cpu()` that
    feeds one of them is reported there once.)

    ## Why is this slow
    A copy to ordinary host memory must wait until the kernels producing the tensor have finished,
    and the host cannot queue the next step meanwhile. Collecting predictions with
    `preds.append(out.argmax(1).cpu())` every step serialises an evaluation loop.

    ## Example
    ```python
    for x, y in loader:
        preds.append(model(x).argmax(1).cpu())
    ```

    ## Use instead
    ```python
    for x, y in loader:
        preds.append(model(x).argmax(1))
    preds = torch.cat(preds).cpu()  # one copy after the loop
    ```

    ## Fix safety
    Display-only. `non_blocking=True` is never added to a device→host copy: the host
    could read the destination before the copy arrives.

    Not reported: code that runs only every few steps (`if step % log_every == 0:`), once (`if i ==
    0:`), after an error (an out-of-memory handler) or under a device check inside the step (see "The
    fact layer" in docs/design.md), and `.cpu()` of what is already on the host. Code that runs at every
    step on rank 0 only (`if rank == 0:`, `is_main_process()`) is reported: rank 0 waits at every step
    and the other ranks wait for it at the next collective.
    """

    code = "TOP603"
    name = "device-to-host-copy-in-loop"
    family = FAMILY
    message = (
        "`{expr}` copies a tensor to the host {where} and waits for the GPU; keep the values on the "
        "device and copy once after the loop"
    )
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = (".cpu(", ".to(")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_host_copy
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_host_copy).
        return super().could_match(text) and hot_check(text, may_host_copy)

    examples = (
        Invalid(
            "import torch\n\ndef evaluate(model, loader):\n    model.eval()\n    preds = []\n"
            "    with torch.no_grad():\n        for x, y in loader:\n"
            "            preds.append(model(x).argmax(1).cpu())\n    return preds\n",
            after=None,
        ),
        Invalid(
            "import torch\n\ndef evaluate(model, loader):\n    for x, y in loader:\n        out = model(x).to('cpu')\n",
            after=None,
        ),
        Valid(
            "import torch\n\ndef evaluate(model, loader):\n    preds = []\n    for x, y in loader:\n"
            "        preds.append(model(x).argmax(1))\n    return torch.cat(preds).cpu()\n"
        ),
        Valid(
            "import torch\n\ndef evaluate(model, loader):\n    for x, y in loader:\n"
            "        v = model(x).cpu().numpy()\n",
            note="reported once, by TOP601, at `.numpy()`",
        ),
        Valid("import torch\n\nfor i in range(2):\n    t = torch.ones(2).cpu()\n", runnable=True),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.any_hot:
            return
        control = control_of(self)
        values = placements(self)
        for n in walk(node, True):
            if not isinstance(n, cst.Call) or not isinstance(n.func, cst.Attribute) or has_star(n):
                continue
            meth = n.func.attr.value
            if meth == "cpu" and not n.args:
                pass
            elif (
                meth == "to"
                and len(n.args) >= 1
                and (
                    (positional(n) and classify_device(self, positional(n)[0].value).is_cpu)
                    or ((dev_kw := keyword(n, "device")) is not None and classify_device(self, dev_kw.value).is_cpu)
                )
            ):
                pass
            else:
                continue
            if dotted(n.func.value) in hm.modules:
                continue  # model.cpu()
            parent = self.get_metadata(ParentProvider, n, None)
            grand = self.get_metadata(ParentProvider, parent, None) if parent is not None else None
            if (
                isinstance(parent, cst.Attribute)
                and isinstance(grand, cst.Call)
                and grand.func is parent
                and (parent.attr.value in HOST_READS or parent.attr.value in ("detach", "float", "double"))
            ):
                if parent.attr.value in HOST_READS:
                    continue
            where = hm.where(n)
            if where is None or control.not_every_step(n, epochs=True, guards=QUIET_GUARDS) is not None:
                continue
            if values.value(n.func.value).on_host:
                continue  # already on the host: the copy waits for nothing
            self.report(n, fmt={"expr": source(self, n), "where": where.text})
