"""TOP203 `missing-grad-scaler`: Flags float16 autocast in a training step (a step with `backward()` and `optimizer.step()`)."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.values import dtype_of
from torchopt.analysis.values import string_value
from torchopt.codemods.amp import FAMILY
from torchopt.codemods.amp import prechecks
from torchopt.codemods.amp.autocast_insertion import _AUTOCASTS, _AmpBase, _Analysis
from torchopt.codemods.amp.step_analysis import _backward_call
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class MissingGradScaler(_AmpBase):
    """## What it does
    Flags float16 autocast in a training step (a step with `backward()` and `optimizer.step()`)
    when the file creates no `GradScaler`: `torch.autocast("cuda")` without a dtype,
    `dtype=torch.float16`/`torch.half`, or the deprecated `torch.cuda.amp.autocast()`. Display-only:
    the scaler rewrite is inserted by TOP202 together with autocast, so a float32 step
    never ends up half converted; this rule covers steps someone already put under autocast.

    ## Why is this slow
    Without loss scaling, small float16 gradients flush to zero and large ones overflow, so
    float16 training silently stalls or diverges; the usual workaround, training in float32,
    gives up the Tensor Core speed-up.

    ## Example
    ```python
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    ```

    ## Use instead
    ```python
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    ```

    ## Fix safety
    No automatic fix (display-only). Adding a scaler changes numerics: gradients are computed on a
    scaled loss and unscaled in float32 before the step, and steps whose gradients overflow are
    skipped, so the number of optimizer updates can differ from the unscaled program. The
    validator tolerance for such a change is the float16 AMP tolerance of `torchopt validate`.
    """

    code = "TOP203"
    name = "missing-grad-scaler"
    family = FAMILY
    message = "float16 autocast in a training step without a `GradScaler`: gradients can underflow"
    safety = Safety.DISPLAY
    tags = (Tag.NUMERICS,)
    prefilter = ("autocast",)
    requires = ("optim", "backward")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and prechecks.missing_grad_scaler_possible(text)

    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in batches:
                    with torch.autocast('cuda', dtype=torch.float16):
                        loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    optimizer.step()
            """),
            after=None,
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                scaler = torch.amp.GradScaler('cuda')
                for x, y in batches:
                    with torch.autocast('cuda', dtype=torch.float16):
                        loss = nn.functional.mse_loss(model(x), y)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
            """)
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in batches:
                    with torch.autocast('cuda', dtype=torch.bfloat16):
                        loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    optimizer.step()
            """),
            note="bfloat16 needs no scaler",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == "cuda" else torch.bfloat16
                scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
                for x, y in batches:
                    optimizer.zero_grad()
                    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                        out = model(x)
                        loss = nn.functional.mse_loss(out, y)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
            """)
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = _Analysis(self)
        if a.has_scaler() or not a.optimizers:
            return
        has_backward = any(_backward_call(s) is not None for s in a.all_nodes if isinstance(s, cst.SimpleStatementLine))
        if not has_backward:
            return
        for n in a.all_nodes:
            if isinstance(n, cst.WithItem) and isinstance(n.item, cst.Call) and self._fp16(n.item):
                self.report(n.item)

    def _fp16(self, call: cst.Call) -> bool:
        q = callee(self, call)
        if q not in _AUTOCASTS or q == "torch.cpu.amp.autocast":
            return False
        kw = {x.keyword.value: x.value for x in call.args if x.keyword is not None}
        pos = [x.value for x in call.args if x.keyword is None and not x.star]
        if "enabled" in kw and isinstance(kw["enabled"], cst.Name) and kw["enabled"].value == "False":
            return False
        if "dtype" in kw:
            return dtype_of(self, kw["dtype"]) == "float16"
        if q == "torch.cuda.amp.autocast":
            return not pos or not (isinstance(pos[0], cst.Name) and pos[0].value == "False")
        dev = kw.get("device_type", pos[0] if pos else None)
        if len(pos) > 1:
            return dtype_of(self, pos[1]) == "float16"
        return string_value(dev) == "cuda"
