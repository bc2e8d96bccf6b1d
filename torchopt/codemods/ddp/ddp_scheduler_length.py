"""TOP409 `ddp-scheduler-length`: In a program that uses DistributedDataParallel or DataParallel, flags learning-rate schedulers."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.analysis.syntax import walk
from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp.program_analysis import Analysis
from torchopt.codemods.ddp.program_analysis import DDP
from torchopt.codemods.ddp.program_analysis import DP
from torchopt.codemods.ddp.program_analysis import calls
from torchopt.codemods.ddp.step_checks import _DEPS
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


_SCHEDULERS = {
    "OneCycleLR": ("total_steps", "steps_per_epoch"),
    "CosineAnnealingLR": ("T_max",),
    "LinearLR": ("total_iters",),
    "PolynomialLR": ("total_iters",),
    "CosineAnnealingWarmRestarts": ("T_0",),
    "ConstantLR": ("total_iters",),
}


class SchedulerAfterDDP(Rule):
    """## What it does
    In a program that uses DistributedDataParallel or DataParallel, flags learning-rate schedulers
    whose length is counted in optimizer steps (`OneCycleLR`, `CosineAnnealingLR`, `LinearLR`,
    `PolynomialLR`, `ConstantLR`, `CosineAnnealingWarmRestarts`) when that length is not computed
    from `len(<a DataLoader>)`.

    ## Why is this slow
    Not a speed problem: after sharding, a process takes `len(dataset) / (batch_size x world_size)`
    steps per epoch. TOP401/TOP402 keep the global batch (per-process `batch_size = B //
    world_size`), so the number of steps per epoch is unchanged; but a script that keeps `B` per
    process (global batch `B x world_size`) takes world_size times fewer steps, so a hard-coded
    step count stretches the schedule, and the learning rate usually needs scaling with the batch.
    Accelerate steps its schedulers `num_processes` times per step for this reason.

    ## Example
    ```python
    scheduler = OneCycleLR(optimizer, max_lr=0.1, total_steps=10_000)
    ```

    ## Use instead
    ```python
    scheduler = OneCycleLR(optimizer, max_lr=0.1, total_steps=epochs * len(train_loader))
    ```
    (`len(train_loader)` measured after the DistributedSampler is attached.)

    ## Fix safety
    Display-only: the right schedule depends on the batch-size policy chosen for the run.
    """

    code = "TOP409"
    name = "ddp-scheduler-length"
    family = FAMILY
    message = (
        "`{sched}` counts optimizer steps: under DDP compute `{arg}` from `len(loader)` after sharding, and "
        "scale the learning rate if the global batch changes"
    )
    safety = Safety.DISPLAY
    prefilter = tuple(_SCHEDULERS)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return (
            super().could_match(text)
            and may_call_torch(text, DDP | DP)
            and may_call_torch(text, [f"torch.optim.lr_scheduler.{s}" for s in _SCHEDULERS])
        )

    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP
                model = nn.Linear(4, 2)
                model = DDP(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=1000)
            """)
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP
                model = nn.Linear(4, 2)
                model = DDP(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=3 * len(loader))
            """)
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        if not (a.ddp_calls or a.dp or a.dp_other):
            return
        for c in calls(a.module, True):
            if not isinstance(c.func, (cst.Name, cst.Attribute)):
                continue
            q = a.call_name(c) or ""
            if not q.startswith("torch.optim.lr_scheduler."):
                continue
            cls = q.rsplit(".", 1)[1]
            args = _SCHEDULERS.get(cls)
            if not args:
                continue
            for name in args:
                kw = keyword(c, name)
                if kw is None:
                    continue
                if any(
                    isinstance(x, cst.Call) and isinstance(x.func, cst.Name) and x.func.value == "len"
                    for x in walk(kw.value)
                ):
                    continue
                self.report(kw, fmt={"sched": cls, "arg": name})
                break
