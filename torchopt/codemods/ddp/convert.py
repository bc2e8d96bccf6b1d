"""DataParallel and single-process training scripts to DistributedDataParallel launched by torchrun
(rules.md DDP-001, DDP-002)."""
from __future__ import annotations

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp._analysis import DP, LOADERS, Analysis, Refusal
from torchopt.codemods.ddp._convert import convert, single_model
from torchopt.codemods.ddp._examples import (
    DP_AFTER,
    DP_INIT,
    DP_SRC,
    DP_SUM,
    SINGLE_AFTER,
    SINGLE_SRC,
)
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Tag, Valid

_SEMANTICS_DOC = """
    What changes (unsafe, semantics): the program is now a process group. Started with plain
    `python train.py` it is a group of one process (an in-memory store, no launcher, no port) and
    computes bitwise what it computed before (same data order: the DistributedSampler is only used
    with more than one process; DDP over one gloo/nccl process leaves gradients as they are, E-26).
    Launched with `torchrun --standalone --nproc_per_node=N train.py ...` (one machine) or
    `torchrun --nnodes=M --nproc_per_node=N --rdzv_id=JOB --rdzv_backend=c10d
    --rdzv_endpoint=HOST:29400 train.py ...` (M machines), every process trains on its shard of the
    training set. `batch_size` is per process: the rewrite divides it by the world size (asserting
    that it divides) so the global batch, and the learning rate that goes with it, stay those of
    the original; gradients are averaged across processes, which for a mean-reduced loss equals the
    full-batch gradient up to rounding (E-12). Scripts with `reduction="sum"` losses are refused.
    The sampler pads the training set to a multiple of the world size (a few samples repeat);
    `set_epoch(epoch)` gives every epoch a new shuffle. Evaluation loaders are left alone: every
    process evaluates the whole evaluation set (same numbers on every rank, rank 0 prints them).
    BatchNorm computes statistics per process (use `SyncBatchNorm` on GPUs to emulate one big
    batch); buffers are broadcast from rank 0 at each training forward. Every process seeds the
    same: dropout and augmentation draw the same streams on different data. Output side effects
    (print, logging, tqdm, TensorBoard, wandb, file writes, `torch.save`) run on rank 0 only;
    checkpoints hold `model.module.state_dict()` (no `module.` prefix) and loading accepts both
    forms. Statements that print the result of a function of the file are not guarded (it may
    run collectives) and are listed in the fix's note."""


def _report_refusal(rule: Rule, r: Refusal, what: str) -> None:
    rule.report(r.node, message=f"{what} not converted to DistributedDataParallel: {r.reason}")


class DataParallelToDDP(Rule):
    __doc__ = """## What it does
    Replaces `nn.DataParallel(model)` with `DistributedDataParallel` launched by `torchrun`: a
    set-up function joins the process group described by torchrun's environment (`RANK`,
    `LOCAL_RANK`, `WORLD_SIZE`; backend nccl on CUDA, gloo otherwise; `torch.cuda.set_device(local_rank)`
    on CUDA) and, without a launcher, forms a group of one process, so `python train.py` keeps
    working. The model is wrapped with `device_ids=[local_rank]` on CUDA. Training `DataLoader`s
    (those iterated by a loop that calls `backward()`, directly or through a function of the file)
    get a `DistributedSampler` (their `shuffle` moves into it), a per-process `batch_size`
    (`B // world_size`) and `sampler.set_epoch(epoch)` at the top of the epoch loop. Output side
    effects are guarded to rank 0 (TOP405), checkpoints saved from `model.module` and loaded with
    the `module.` prefix removed (TOP406), and `destroy_process_group()` runs at the end.

    The script is left alone, with a diagnostic saying why, when it already initialises a process
    group (no second set-up), names a fixed device index (`"cuda:1"`, `.cuda(0)`), uses a
    `reduction="sum"` loss, uses a custom sampler, wraps in another form than
    `name = nn.DataParallel(...)`, or has no training loop over a DataLoader.

    ## Why is this slow
    DataParallel runs one Python thread per GPU in one process: every iteration it scatters the
    batch, replicates the model, gathers the outputs to GPU 0 and computes the loss there, so GPU 0
    is overloaded and the GIL serialises the replicas. PyTorch recommends DistributedDataParallel
    "even if there is only a single node": one process per GPU, gradients all-reduced in buckets
    overlapped with the backward pass.

    ## Example
    ```python
    model = nn.DataParallel(Net().to(device))
    loader = DataLoader(train_ds, batch_size=256, shuffle=True)
    for epoch in range(epochs):
        for x, y in loader:
            ...
    ```

    ## Use instead
    ```python
    local_rank, rank, world_size = _torchopt_ddp_setup()
    model = Net().to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None)
    train_sampler = DistributedSampler(train_ds, shuffle=True) if world_size > 1 else None
    loader = DataLoader(train_ds, batch_size=256 // world_size, shuffle=train_sampler is None, sampler=train_sampler)
    for epoch in range(epochs):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        for x, y in loader:
            ...
    ```
    and launch with `torchrun --standalone --nproc_per_node=<GPUs> train.py`.

    ## Fix safety
    """ + _SEMANTICS_DOC.strip() + "\n"

    code = "TOP401"
    name = "data-parallel"
    family = FAMILY
    message = ("`nn.DataParallel` runs one thread per GPU in one process: use DistributedDataParallel and "
               "launch with `torchrun --standalone --nproc_per_node=N` (multi-node: `torchrun --nnodes=M "
               "--nproc_per_node=N --rdzv_backend=c10d --rdzv_endpoint=HOST:29400`)")
    fix_title = "Convert to DistributedDataParallel launched by torchrun (batch_size becomes per process)"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS,)
    prefilter = ("DataParallel",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, DP)  # visit_Module: a.dp or a.dp_other
    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)
    examples = (
        Invalid(DP_SRC, after=DP_AFTER, unsafe="semantics", runnable=True),
        Invalid(DP_SUM, after=None, note="reduction='sum': DDP's averaged gradients would be world_size times "
                                         "smaller; refused with a diagnostic"),
        Invalid(DP_INIT, after=None, note="the program already initialises a process group: no second set-up"),
        Valid(DP_AFTER, note="the rewrite's own output"),
        Valid("import torch.nn as nn\nmodel = mylib.DataParallel(nn.Linear(2, 2))\n"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        if not (a.dp or a.dp_other):
            return
        first = a.dp[0][2] if a.dp else a.dp_other[0]
        try:
            if a.dp_other:
                raise Refusal(a.dp_other[0], "only `name = nn.DataParallel(module, device_ids=..., "
                                             "output_device=...)` statements are converted")
            wraps = []
            for s, name, c in a.dp:
                pos = [x for x in c.args if x.keyword is None]
                kws = {x.keyword.value for x in c.args if x.keyword is not None}
                if any(x.star for x in c.args) or len(pos) > 3 or kws - {"module", "device_ids", "output_device"}:
                    raise Refusal(c, "`dim=` or *args/**kwargs on DataParallel")
                mods = [x.value for x in c.args if x.keyword is not None and x.keyword.value == "module"]
                if not pos and not mods:
                    raise Refusal(c, "DataParallel without a module")
                mod = pos[0].value if pos else mods[0]
                wraps.append((s, name, mod))
            new, imports, note = convert(self, a, wraps, first, "dp")
        except Refusal as r:
            _report_refusal(self, r, "`nn.DataParallel`")
            return
        self.report(first, replacement=new, target=a.module, tags=[Tag.SEMANTICS], imports=imports, note=note)


class SingleProcessToDDP(Rule):
    __doc__ = """## What it does
    Opt-in (`--select TOP402`; not part of `ALL`): converts a single-process training script to
    DistributedDataParallel launched by `torchrun`, exactly as TOP401 does for DataParallel
    scripts. The one model whose `.parameters()` build the optimizer is wrapped with
    `DistributedDataParallel` just before the optimizer is created; the training `DataLoader` gets
    a `DistributedSampler` and a per-process `batch_size`; rank-0 guards, portable checkpoints,
    `set_epoch` and `destroy_process_group()` as in TOP401. Refused (with a diagnostic) when the
    script has several models or optimizers, reads attributes of the model other than the
    `nn.Module` methods (on the wrapper they live under `.module`), or any TOP401 refusal applies.

    ## Why is this slow
    A single-process script uses one GPU. With DDP the same script trains on every GPU of one or
    many machines, one process per GPU, gradients all-reduced during the backward pass.

    ## Example
    ```python
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(train_ds, batch_size=64, shuffle=True)
    ```

    ## Use instead
    ```python
    local_rank, rank, world_size = _torchopt_ddp_setup()
    model = Net().to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train_sampler = DistributedSampler(train_ds, shuffle=True) if world_size > 1 else None
    loader = DataLoader(train_ds, batch_size=64 // world_size, shuffle=train_sampler is None, sampler=train_sampler)
    ```

    ## Fix safety
    """ + _SEMANTICS_DOC.strip() + "\n"

    code = "TOP402"
    name = "single-process-to-ddp"
    family = FAMILY
    opt_in = True
    message = ("single-process training script: DistributedDataParallel under `torchrun --standalone "
               "--nproc_per_node=N` trains on every GPU (multi-node: `torchrun --nnodes=M --nproc_per_node=N "
               "--rdzv_backend=c10d --rdzv_endpoint=HOST:29400`)")
    fix_title = "Convert to DistributedDataParallel launched by torchrun (batch_size becomes per process)"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS,)
    prefilter = ("DataLoader",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch, torch_callees

        # visit_Module: a DataLoader and a torch.optim optimizer bound to names, a training loop.
        if not (super().could_match(text) and may_call_torch(text, LOADERS)):
            return False
        callees = torch_callees(text)
        return callees is None or any(q.startswith("torch.optim.") for q in callees)
    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)
    examples = (
        Invalid(SINGLE_SRC, after=SINGLE_AFTER, unsafe="semantics", runnable=True),
        Valid(SINGLE_AFTER, note="the rewrite's own output"),
        Valid(DP_SRC, note="DataParallel scripts are TOP401's"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        if a.dp or a.dp_other or a.ddp or a.ddp_calls or not a.optimizers or not a.loaders:
            return
        loops = a.training_loops()
        if not loops:
            return
        anchor = loops[0].node
        try:
            s, m = single_model(a, anchor)
            new, imports, note = convert(self, a, [(s, m, None)], s, "single")
        except Refusal as r:
            _report_refusal(self, r, "single-process training script")
            return
        self.report(anchor, replacement=new, target=a.module, tags=[Tag.SEMANTICS], imports=imports, note=note)
