"""TOP401 `data-parallel`: Replaces `nn.DataParallel(model)` with `DistributedDataParallel` launched by `torchrun`: a."""
from __future__ import annotations

from libcst.metadata import PositionProvider
from libcst.metadata import ScopeProvider
import libcst as cst

from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp.program_analysis import Analysis
from torchopt.codemods.ddp.program_analysis import DP
from torchopt.codemods.ddp.program_analysis import FUNCTIONAL_DP
from torchopt.codemods.ddp.program_analysis import Refusal
from torchopt.codemods.ddp.program_analysis import calls
from torchopt.codemods.ddp.program_analysis import dotted
from torchopt.codemods.ddp.data_parallel_inference import data_parallel_for_inference
from torchopt.codemods.ddp.conversion_edits import convert
from torchopt.codemods.ddp.example_programs import DP_AFTER
from torchopt.codemods.ddp.example_programs import DP_INIT
from torchopt.codemods.ddp.example_programs import DP_SRC
from torchopt.codemods.ddp.example_programs import DP_SUM
from torchopt.codemods.ddp.conversion_messages import _SEMANTICS_DOC, _report_refusal
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


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
    local_rank, rank, world_size = setup_distributed()
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

    # whether the file trains anywhere decides between this rule and TOP411
    locality = "file"
    code = "TOP401"
    name = "data-parallel"
    family = FAMILY
    message = ("`nn.DataParallel` runs one thread per GPU in one process: use DistributedDataParallel and "
               "launch with `torchrun --standalone --nproc_per_node=N` (multi-node: `torchrun --nnodes=M "
               "--nproc_per_node=N --rdzv_backend=c10d --rdzv_endpoint=HOST:29400`)")
    functional_message = ("`nn.parallel.data_parallel(module, inputs)` replicates the module on every GPU at every "
                          "call, in one process: wrap the model once in DistributedDataParallel and launch with "
                          "`torchrun` (no automatic fix for the functional form)")
    fix_title = "Convert to DistributedDataParallel launched by torchrun (batch_size becomes per process)"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS,)
    prefilter = ("DataParallel", "data_parallel")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        # visit_Module: a.dp or a.dp_other, or a functional data_parallel call
        return super().could_match(text) and may_call_torch(text, DP | FUNCTIONAL_DP)
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
        for c in calls(a.module, True):
            if isinstance(c.func, (cst.Name, cst.Attribute)) and a.call_name(c) in FUNCTIONAL_DP:
                self.report(c, message=self.functional_message)
        if not (a.dp or a.dp_other):
            return
        if all(data_parallel_for_inference(self, c) for c in [x[2] for x in a.dp] + a.dp_other):
            return  # inference only: TOP411 gives the advice that fits
        first = a.dp[0][2] if a.dp else a.dp_other[0]
        try:
            if a.dp_other:
                raise Refusal(a.dp_other[0], "only `name = nn.DataParallel(module, device_ids=..., "
                                             "output_device=...)` statements are converted")
            wraps = [self._wrap(a, s, name, c) for s, name, c in a.dp]
            new, imports, note = convert(self, a, wraps, first, "dp")
        except Refusal as r:
            _report_refusal(self, r, "`nn.DataParallel`")
            return
        self.report(first, replacement=new, target=a.module, tags=[Tag.SEMANTICS], imports=imports, note=note)

    def _wrap(self, a: Analysis, s: cst.SimpleStatementLine, name: str,
              c: cst.Call) -> tuple[cst.SimpleStatementLine, str, cst.BaseExpression]:
        """The model expression DDP wraps: the DataParallel's module, with any ``.cuda()`` /
        ``.to(...)`` that followed the DataParallel applied to it instead (DDP needs the model on
        its device before the wrap)."""
        pos = [x for x in c.args if x.keyword is None]
        kws = {x.keyword.value for x in c.args if x.keyword is not None}
        if any(x.star for x in c.args) or len(pos) > 3 or kws - {"module", "device_ids", "output_device"}:
            raise Refusal(c, "`dim=` or *args/**kwargs on DataParallel")
        mods = [x.value for x in c.args if x.keyword is not None and x.keyword.value == "module"]
        if not pos and not mods:
            raise Refusal(c, "DataParallel without a module")
        mod = pos[0].value if pos else mods[0]
        value = s.body[0].value  # type: ignore[union-attr]
        expr = mod if value is c else value.deep_replace(c, mod)
        owner = a.scope_owner(s)
        for later in calls(a.module, True):
            if (isinstance(later.func, cst.Attribute) and later.func.attr.value in ("cuda", "to")
                    and dotted(later.func.value) == name and a.scope_owner(later) is owner
                    and a.pos(later) > a.pos(s)):
                raise Refusal(later, f"`{name}.{later.func.attr.value}(...)` moves the model after it is wrapped; "
                                     "DistributedDataParallel needs it on its device first: move it before "
                                     "`nn.DataParallel`")
        return s, name, expr  # type: ignore[return-value]
