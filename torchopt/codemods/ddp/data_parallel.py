"""TOP401 `data-parallel`: Replaces `nn.DataParallel(model)` with `DistributedDataParallel` launched by `torchrun`: a."""

from __future__ import annotations

from textwrap import dedent

from libcst.metadata import PositionProvider
from libcst.metadata import ScopeProvider
import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.statement_edits import Refusal
from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp.program_analysis import Analysis
from torchopt.codemods.ddp.program_analysis import DP
from torchopt.codemods.ddp.program_analysis import FUNCTIONAL_DP
from torchopt.codemods.ddp.program_analysis import calls
from torchopt.codemods.ddp.program_analysis import dotted
from torchopt.codemods.ddp.data_parallel_inference import data_parallel_for_inference
from torchopt.codemods.ddp.conversion_edits import convert
from torchopt.codemods.ddp.conversion_messages import _SEMANTICS_DOC, _report_refusal
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class DataParallelToDDP(Rule):
    __doc__ = (
        """## What it does
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
    """
        + _SEMANTICS_DOC.strip()
        + "\n"
    )

    # whether the file trains anywhere decides between this rule and TOP411
    locality = "file"
    code = "TOP401"
    name = "data-parallel"
    family = FAMILY
    message = (
        "`nn.DataParallel` runs one thread per GPU in one process: use DistributedDataParallel and "
        "launch with `torchrun --standalone --nproc_per_node=N` (multi-node: `torchrun --nnodes=M "
        "--nproc_per_node=N --rdzv_backend=c10d --rdzv_endpoint=HOST:29400`)"
    )
    functional_message = (
        "`nn.parallel.data_parallel(module, inputs)` replicates the module on every GPU at every "
        "call, in one process: wrap the model once in DistributedDataParallel and launch with "
        "`torchrun` (no automatic fix for the functional form)"
    )
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
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                from torch.utils.data import DataLoader, TensorDataset

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                train_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
                model = nn.DataParallel(nn.Linear(4, 2).to(device))
                loader = DataLoader(train_ds, batch_size=8, shuffle=True)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for epoch in range(2):
                    for x, y in loader:
                        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
                    print(epoch, loss.item())
                torch.save(model.module.state_dict(), 'ckpt.pt')
            """),
            after=dedent('''\
                import os

                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel
                from torch.utils.data import DataLoader, TensorDataset
                from torch.utils.data.distributed import DistributedSampler


                def setup_distributed():
                    """Join the process group that torchrun describes in the environment (RANK,
                    LOCAL_RANK, WORLD_SIZE); started with plain `python`, the program is a group of
                    one process."""
                    if not dist.is_initialized():
                        backend = 'nccl' if torch.cuda.is_available() else 'gloo'
                        if 'WORLD_SIZE' in os.environ:
                            dist.init_process_group(backend=backend)
                        else:
                            dist.init_process_group(
                                backend=backend, store=dist.HashStore(), rank=0, world_size=1
                            )
                    local_rank = int(os.environ.get('LOCAL_RANK', '0'))
                    if torch.cuda.is_available():
                        torch.cuda.set_device(local_rank)  # before any CUDA allocation
                    return local_rank, dist.get_rank(), dist.get_world_size()


                # launch with `torchrun --standalone --nproc_per_node=N <script>`;
                # `python <script>` runs one process
                local_rank, rank, world_size = setup_distributed()

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                train_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
                model = nn.Linear(4, 2).to(device)
                model = DistributedDataParallel(
                    model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None
                )
                # each process loads its own shard; batch_size is per process
                assert 8 % world_size == 0, (
                    'the global batch size must divide by the number of processes'
                )
                sampler = DistributedSampler(train_ds, shuffle=True) if world_size > 1 else None
                loader = DataLoader(
                    train_ds, batch_size=8 // world_size, shuffle=sampler is None, sampler=sampler
                )
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for epoch in range(2):
                    if sampler is not None:
                        sampler.set_epoch(epoch)  # a new shuffle every epoch
                    for x, y in loader:
                        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
                    if rank == 0:
                        print(epoch, loss.item())
                if rank == 0:
                    torch.save(model.module.state_dict(), 'ckpt.pt')

                dist.destroy_process_group()
            '''),
            unsafe="semantics",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                from torch.utils.data import DataLoader, TensorDataset

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                train_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
                model = nn.DataParallel(nn.Linear(4, 2).to(device))
                loader = DataLoader(train_ds, batch_size=8, shuffle=True)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for epoch in range(2):
                    for x, y in loader:
                        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device), reduction='sum')
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
                    print(epoch, loss.item())
                torch.save(model.module.state_dict(), 'ckpt.pt')
            """),
            after=None,
            note="reduction='sum': DDP's averaged gradients would be world_size times "
            "smaller; refused with a diagnostic",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                from torch.utils.data import DataLoader, TensorDataset

                torch.distributed.init_process_group('gloo')
                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                train_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
                model = nn.DataParallel(nn.Linear(4, 2).to(device))
                loader = DataLoader(train_ds, batch_size=8, shuffle=True)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for epoch in range(2):
                    for x, y in loader:
                        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
                    print(epoch, loss.item())
                torch.save(model.module.state_dict(), 'ckpt.pt')
            """),
            after=None,
            note="the program already initialises a process group: no second set-up",
        ),
        Valid(
            dedent('''\
                import torch
                import torch.nn as nn
                from torch.utils.data import DataLoader, TensorDataset
                import os
                import torch.distributed as dist
                from torch.nn.parallel import DistributedDataParallel
                from torch.utils.data.distributed import DistributedSampler


                def setup_distributed():
                    """Join the process group that torchrun describes in the environment (RANK,
                    LOCAL_RANK, WORLD_SIZE); started with plain `python`, the program is a group of one process."""
                    if not dist.is_initialized():
                        backend = "nccl" if torch.cuda.is_available() else "gloo"
                        if "WORLD_SIZE" in os.environ:
                            dist.init_process_group(backend=backend)
                        else:
                            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
                    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
                    if torch.cuda.is_available():
                        torch.cuda.set_device(local_rank)  # before any CUDA allocation
                    return local_rank, dist.get_rank(), dist.get_world_size()


                # launch with `torchrun --standalone --nproc_per_node=N <script>`; `python <script>` runs one process
                local_rank, rank, world_size = setup_distributed()

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                train_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
                model = nn.Linear(4, 2).to(device)
                model = DistributedDataParallel(model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None)
                # each process loads its own shard; batch_size is per process
                assert 8 % world_size == 0, "the global batch size must divide by the number of processes"
                sampler = DistributedSampler(train_ds, shuffle=True) if world_size > 1 else None
                loader = DataLoader(train_ds, batch_size=8 // world_size, shuffle=sampler is None, sampler=sampler)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for epoch in range(2):
                    if sampler is not None:
                        sampler.set_epoch(epoch)  # a new shuffle every epoch
                    for x, y in loader:
                        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
                    if rank == 0:
                        print(epoch, loss.item())
                if rank == 0:
                    torch.save(model.module.state_dict(), 'ckpt.pt')

                dist.destroy_process_group()
            '''),
            note="the rewrite's own output",
        ),
        Valid(
            dedent("""\
                import torch.nn as nn
                model = mylib.DataParallel(nn.Linear(2, 2))
            """)
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        for c in calls(a.module, True):
            # (a torch name: `callee` alone answers, without resolving the file's other callees)
            if isinstance(c.func, (cst.Name, cst.Attribute)) and callee(self, c) in FUNCTIONAL_DP:
                self.report(c, message=self.functional_message)
        if not (a.dp or a.dp_other):
            return
        if all(data_parallel_for_inference(self, c) for c in [x[2] for x in a.dp] + a.dp_other):
            return  # inference only: TOP411 gives the advice that fits
        first = a.dp[0][2] if a.dp else a.dp_other[0]
        current: cst.Call | None = a.dp_other[0] if a.dp_other else None  # the wrap a refusal is about
        try:
            if a.dp_other:
                raise Refusal(
                    a.dp_other[0],
                    "only `name = nn.DataParallel(module, device_ids=..., output_device=...)` statements are converted",
                )
            wraps = []
            for s, name, c in a.dp:
                current = c
                wraps.append(self._wrap(a, s, name, c))
            current = None
            new, imports, note = convert(self, a, wraps, first, "dp")
        except Refusal as r:
            _report_refusal(self, r, "`nn.DataParallel`")
            if current is None:
                return  # refused for the program (a process group it already sets up): one finding
            # Refused for one wrap's form: the file is left as it is, and every other DataParallel
            # that trains stays one too.
            for c in [x[2] for x in a.dp] + a.dp_other:
                if c is not r.node and c is not current and not data_parallel_for_inference(self, c):
                    why = f"the file's DataParallel wraps are converted together, and one is refused ({r.reason})"
                    _report_refusal(self, Refusal(c, why), "`nn.DataParallel`")
            return
        self.report(first, replacement=new, target=a.module, tags=[Tag.SEMANTICS], imports=imports, note=note)

    def _wrap(
        self, analysis: Analysis, s: cst.SimpleStatementLine, name: str, c: cst.Call
    ) -> tuple[cst.SimpleStatementLine, str, cst.BaseExpression]:
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
        value = cst.ensure_type(s.body[0], cst.Assign).value  # (a.dp holds `name = ...` statements only)
        expr = mod if value is c else value.deep_replace(c, mod)
        owner = analysis.scope_owner(s)
        for later in calls(analysis.module, True):
            if (
                isinstance(later.func, cst.Attribute)
                and later.func.attr.value in ("cuda", "to")
                and dotted(later.func.value) == name
                and analysis.scope_owner(later) is owner
                and analysis.pos(later) > analysis.pos(s)
            ):
                raise Refusal(
                    later,
                    f"`{name}.{later.func.attr.value}(...)` moves the model after it is wrapped; "
                    "DistributedDataParallel needs it on its device first: move it before "
                    "`nn.DataParallel`",
                )
        return s, name, expr
