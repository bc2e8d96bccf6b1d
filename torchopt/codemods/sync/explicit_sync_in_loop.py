"""TOP606 `explicit-sync-in-loop`: Flags `torch.cuda.synchronize()` and `torch.cuda.empty_cache()` (and the `torch.accelerator`,."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.sync import FAMILY
from torchopt.analysis.control import QUIET_GUARDS, Guard, control_of
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


_SYNC_CALLS = {
    "torch.cuda.synchronize": "synchronises the host with the GPU",
    "torch.cuda.empty_cache": "synchronises and returns cached memory to the driver, which the next "
    "step must allocate again",
    "torch.accelerator.synchronize": "synchronises the host with the device",
    "torch.mps.synchronize": "synchronises the host with the device",
    "torch.xpu.synchronize": "synchronises the host with the device",
    "torch.mps.empty_cache": "returns cached memory, which the next step must allocate again",
    "torch.xpu.empty_cache": "returns cached memory, which the next step must allocate again",
}


# A device check does not make an explicit sync harmless: on the accelerator path, the only one where
# the call does anything, it still runs every step; only the host path is quiet.
_QUIET = (QUIET_GUARDS & ~Guard.DEVICE) | Guard.HOST_PATH | Guard.OPT_IN


class ExplicitSyncInLoop(Rule):
    """## What it does
    Flags `torch.cuda.synchronize()` and `torch.cuda.empty_cache()` (and the `torch.accelerator`,
    `mps` and `xpu` equivalents) inside a training or evaluation step.

    ## Why is this slow
    `synchronize()` blocks the host until the GPU has finished everything queued: the queue runs dry
    every step. `empty_cache()` also synchronises, and hands the allocator's cached blocks back to
    the driver, so the next step pays for `cudaMalloc` again.

    ## Example
    ```python
    for x, y in loader:
        loss = model(x).sum()
        loss.backward()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    ```

    ## Use instead
    ```python
    for x, y in loader:
        loss = model(x).sum()
        loss.backward()
    # time with torch.cuda.Event(enable_timing=True) pairs and synchronise once when reporting
    ```

    ## Fix safety
    Display-only: both calls are legitimate in timing and memory-measurement code.

    Not reported: code that runs only every few steps (`if step % log_every == 0:`), once (`if i == 0:`),
    after an error (an out-of-memory handler) or on the host path of a device check (`if device ==
    "cpu":`; see "The fact layer" in docs/design.md), nor behind an opt-in switch (`if args.sync:`). A
    sync under `if use_gpu:` or `if torch.cuda.is_available():` is reported: that is the path where
    it runs, every step. Code that runs at every step on rank 0 only (`if rank == 0:`,
    `is_main_process()`) is reported: rank 0 waits at every step and the other ranks wait for it at
    the next collective.
    """

    code = "TOP606"
    name = "explicit-sync-in-loop"
    family = FAMILY
    message = (
        "`{expr}` {why} {where}; remove it from the step (time with `torch.cuda.Event(enable_timing=True)` "
        "and synchronise once when reporting)"
    )
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("synchronize", "empty_cache")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_torch_call
        from torchopt.analysis.precheck.step_loops import hot_check

        # A call that may resolve to one of _SYNC_CALLS in a step (a superset of HotMap.where).
        return super().could_match(text) and hot_check(text, lambda h: may_torch_call(h, set(_SYNC_CALLS)))

    examples = (
        Invalid(
            "import torch\n\ndef train(model, loader):\n    for x, y in loader:\n"
            "        model(x).sum().backward()\n        torch.cuda.synchronize()\n",
            after=None,
        ),
        Invalid(
            "from torch.cuda import empty_cache\n\ndef train(model, loader):\n    for x, y in loader:\n"
            "        model(x).sum().backward()\n        empty_cache()\n",
            after=None,
        ),
        Valid(
            "import torch\n\ndef train(model, loader):\n    for x, y in loader:\n        model(x).sum().backward()\n"
            "    torch.cuda.synchronize()\n"
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.any_hot:
            return
        control = control_of(self)
        for n in walk(node, True):
            if isinstance(n, cst.Call):
                q = callee(self, n)
                if q in _SYNC_CALLS:
                    where = hm.where(n)
                    if where is not None and control.not_every_step(n, guards=_QUIET) is None:
                        self.report(n, fmt={"expr": source(self, n), "where": where.text, "why": _SYNC_CALLS[q]})
