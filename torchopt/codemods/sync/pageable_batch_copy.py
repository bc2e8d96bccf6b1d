"""TOP609 `pageable-batch-copy`: Flags, inside a training or evaluation step, a synchronous host→device copy (`x.cuda()`,."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.step_loops import calls_in
from torchopt.analysis.step_loops import dotted
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.analysis.values import classify_device
from torchopt.codemods.sync import FAMILY
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class PageableBatchCopy(Rule):
    """## What it does
    Flags, inside a training or evaluation step, a synchronous host→device copy (`x.cuda()`,
    `x.to(device)` without `non_blocking=True`) of a batch the loop iterates over, or draws with
    `next(batches)` at every step, when the batches do not come from a `DataLoader` the loop
    iterates and that is built in the same file (then TOP104 fixes both the loader and the copy).

    ## Why is this slow
    A copy from pageable host memory is staged through a pinned buffer and blocks the host until it
    completes, so the next kernels are queued late.

    ## Example
    ```python
    def train(model, loader, device):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
    ```

    ## Use instead
    ```python
    # loader = DataLoader(..., pin_memory=True)
    def train(model, loader, device):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    ```

    ## Fix safety
    Display-only: without seeing the loader, torchopt cannot pin its batches.
    """

    code = "TOP609"
    name = "pageable-batch-copy"
    family = FAMILY
    message = (
        "`{expr}` copies a batch to the device synchronously {where}; pin the loader's batches "
        "(`DataLoader(..., pin_memory=True)`) and copy with `non_blocking=True`"
    )
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = (".cuda(", ".to(")
    yields_to = {
        "TOP104": "TOP104 follows the batches to the DataLoader that makes them: it pins the loader and "
        "makes this copy non-blocking, where this rule can only advise"
    }

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_pageable_copy
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_pageable_copy).
        return super().could_match(text) and hot_check(text, may_pageable_copy)

    examples = (
        Invalid(
            "import torch\n\ndef train(model, loader, opt, device):\n    for x, y in loader:\n"
            "        x, y = x.to(device), y.to(device)\n        model(x).sum().backward()\n",
            after=None,
        ),
        Invalid(
            "import torch\n\ndef train(model, batches, opt, device, steps):\n    for step in range(steps):\n"
            "        x, y = next(batches)\n        x = x.to(device)\n        model(x).sum().backward()\n",
            after=None,
            note="a batch drawn from an iterator at every step (a `sample_data(loader)` generator)",
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt, device):\n    for x, y in loader:\n"
            "        x = x.to(device, non_blocking=True)\n        model(x).sum().backward()\n"
        ),
        Valid(
            "import torch\nfrom torch.utils.data import DataLoader\n\nloader = DataLoader(ds)\n"
            "def train(model, opt, device):\n    for x, y in loader:\n"
            "        x = x.to(device)\n        model(x).sum().backward()\n",
            note="the loader is built in this file: TOP104's finding",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.step_loops:
            return
        loaders = self._file_loaders(node)
        for loop in hm.step_loops.values():
            names = _drawn(loop.node.body)
            if isinstance(loop.node, cst.For):
                names |= _batch_target(loop.node, loaders)
            for c in calls_in(loop.node.body):
                if not isinstance(c.func, cst.Attribute) or has_star(c):
                    continue
                if not isinstance(c.func.value, cst.Name) or c.func.value.value not in names:
                    continue
                if keyword(c, "non_blocking") is not None:
                    continue
                meth = c.func.attr.value
                if meth == "cuda" and not c.args:
                    pass
                elif meth == "to" and positional(c) and len(c.args) == 1:
                    dev = classify_device(self, positional(c)[0].value)
                    if not dev.is_device or dev.is_cpu or dev.text == "meta":
                        continue
                else:
                    continue
                self.report(c, fmt={"expr": source(self, c), "where": f"in {loop.text}"})

    def _file_loaders(self, node: cst.Module) -> set[str]:
        out = set()
        for n in walk(node, True):
            if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.value, cst.Call):
                q = callee(self, n.value) or ""
                if q.endswith("DataLoader"):
                    d = dotted(n.targets[0].target)
                    if d:
                        out.add(d)
        return out


def _batch_target(loop: cst.For, loaders: set[str]) -> set[str]:
    """The names the loop's target binds to a batch; none when the loader is built in this file
    (TOP104's finding)."""
    it: cst.BaseExpression = loop.iter
    target: cst.BaseExpression = loop.target
    for _ in range(3):
        if (
            isinstance(it, cst.Call)
            and isinstance(it.func, cst.Name)
            and it.args
            and it.func.value in ("enumerate", "tqdm", "iter")
        ):
            if it.func.value == "enumerate" and isinstance(target, cst.Tuple) and len(target.elements) == 2:
                target = target.elements[1].value
            it = it.args[0].value
    if dotted(it) in loaders:
        return set()
    return {n.value for n in walk(target) if isinstance(n, cst.Name)}


def _drawn(body: cst.CSTNode) -> set[str]:
    """Names a step's body binds to ``next(it)``: a batch drawn from an iterator at every step
    (``real = next(loader)`` over a ``sample_data(loader)`` generator, ``x, y = next(batches)``)."""
    out: set[str] = set()
    for n in walk(body):
        if (
            isinstance(n, cst.Assign)
            and isinstance(n.value, cst.Call)
            and isinstance(n.value.func, cst.Name)
            and n.value.func.value == "next"
            and len(n.value.args) == 1
        ):
            for t in n.targets:
                out |= {m.value for m in walk(t.target) if isinstance(m, cst.Name)}
    return out
