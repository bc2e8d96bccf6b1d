"""Display-only advice for DistributedDataParallel programs (rules.md DDP-007 … DDP-009)."""
from __future__ import annotations

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.analysis.arguments import keyword
from torchopt.analysis.syntax import walk
from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp._analysis import DDP, DP, Analysis, calls
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid

_DEPS = (PositionProvider, ScopeProvider, ParentProvider)
_H = ("import torch\nimport torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
      "model = nn.Linear(4, 2)\n")


class FindUnusedParameters(Rule):
    """## What it does
    Flags `DistributedDataParallel(..., find_unused_parameters=True)`.

    ## Why is this slow
    With the flag, DDP traverses the autograd graph after every forward to find parameters that
    will get no gradient, and its buckets follow the order of the constructor (`__init__`), not
    the order of the backward pass, so all-reduces overlap less with computation (tuning guide).

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    ```

    ## Use instead
    ```python
    # every parameter gets a gradient each step:
    model = DDP(model, device_ids=[local_rank])
    # the set of used parameters is the same every step:
    model = DDP(model, device_ids=[local_rank], static_graph=True)
    ```
    `gradient_as_bucket_view=True` also saves the memory of one gradient copy.

    ## Fix safety
    Display-only: whether some parameters really go unused in some iterations (conditional
    branches, frozen heads) cannot be decided from the source; removing the flag when they do makes
    DDP raise at the next iteration.
    """

    code = "TOP407"
    name = "ddp-find-unused-parameters"
    family = FAMILY
    message = ("`find_unused_parameters=True` walks the autograd graph every iteration and buckets gradients in "
               "constructor order: drop it if every parameter gets a gradient, or use `static_graph=True` "
               "(and consider `gradient_as_bucket_view=True`)")
    safety = Safety.DISPLAY
    prefilter = ("find_unused_parameters",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, DDP)  # visit_Call: a DDP call
    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(_H + "model = DDP(model, find_unused_parameters=True)\n"),
        Valid(_H + "model = DDP(model, static_graph=True)\n"),
        Valid(_H + "model = DDP(model, find_unused_parameters=False)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if not isinstance(node.func, (cst.Name, cst.Attribute)):
            return
        kw = keyword(node, "find_unused_parameters")
        if kw is None or not (isinstance(kw.value, cst.Name) and kw.value.value == "True"):
            return
        from torchopt.analysis.names import callee

        if callee(self, node) in DDP:
            self.report(kw)


class LoadBalance(Rule):
    """## What it does
    Flags padding of variable-length sequences (`pad_sequence`, `pack_padded_sequence`) in a
    program that uses DistributedDataParallel or DataParallel.

    ## Why is this slow
    Every optimizer step waits for the slowest process. With variable-length data, a process
    that draws long sequences (or pads a batch to its longest member) holds all others at the
    gradient all-reduce (tuning guide, "Load-balance workload in a distributed setting").

    ## Example
    ```python
    batch = pad_sequence(seqs, batch_first=True)
    ```

    ## Use instead
    Batch by token count rather than by number of sequences, or bucket sequences of similar
    length (a length-grouped sampler per rank), so every process gets a similar amount of work.

    ## Fix safety
    Display-only: batching policy changes the data each step sees.
    """

    code = "TOP408"
    name = "ddp-load-balance"
    family = FAMILY
    message = ("variable-length batches under DDP: every step waits for the process with the longest sequences; "
               "batch by token count or bucket by length")
    safety = Safety.DISPLAY
    prefilter = ("pad_sequence", "pack_padded_sequence")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, DDP | DP) and may_call_torch(
            text, ("torch.nn.utils.rnn.pad_sequence", "torch.nn.utils.rnn.pack_padded_sequence"))
    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(_H + "from torch.nn.utils.rnn import pad_sequence\nmodel = DDP(model)\n"
                     "batch = pad_sequence(seqs, batch_first=True)\n"),
        Valid("import torch\nfrom torch.nn.utils.rnn import pad_sequence\nbatch = pad_sequence(seqs)\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        if not (a.ddp_calls or a.dp or a.dp_other):
            return
        for c in calls(a.module, True):
            if isinstance(c.func, (cst.Name, cst.Attribute)) and a.call_name(c) in (
                    "torch.nn.utils.rnn.pad_sequence", "torch.nn.utils.rnn.pack_padded_sequence"):
                self.report(c)


_SCHEDULERS = {"OneCycleLR": ("total_steps", "steps_per_epoch"), "CosineAnnealingLR": ("T_max",),
               "LinearLR": ("total_iters",), "PolynomialLR": ("total_iters",),
               "CosineAnnealingWarmRestarts": ("T_0",), "ConstantLR": ("total_iters",)}


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
    message = ("`{sched}` counts optimizer steps: under DDP compute `{arg}` from `len(loader)` after sharding, and "
               "scale the learning rate if the global batch changes")
    safety = Safety.DISPLAY
    prefilter = tuple(_SCHEDULERS)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, DDP | DP) and may_call_torch(
            text, [f"torch.optim.lr_scheduler.{s}" for s in _SCHEDULERS])
    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(_H + "model = DDP(model)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                     "sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=1000)\n"),
        Valid(_H + "model = DDP(model)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                   "sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=3 * len(loader))\n"),
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
                if any(isinstance(x, cst.Call) and isinstance(x.func, cst.Name) and x.func.value == "len"
                       for x in walk(kw.value)):
                    continue
                self.report(kw, fmt={"sched": cls, "arg": name})
                break


