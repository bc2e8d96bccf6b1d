"""TOP402 `single-process-to-ddp`: Opt-in (`--select TOP402`; not part of `ALL`): converts a single-process training script to."""

from __future__ import annotations

from textwrap import dedent

from libcst.metadata import PositionProvider
from libcst.metadata import ScopeProvider
import libcst as cst

from torchopt.analysis.statement_edits import Refusal
from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp.program_analysis import Analysis
from torchopt.codemods.ddp.program_analysis import LOADERS
from torchopt.codemods.ddp.conversion_edits import convert
from torchopt.codemods.ddp.conversion_edits import single_model
from torchopt.codemods.ddp.conversion_messages import _SEMANTICS_DOC, _report_refusal
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class SingleProcessToDDP(Rule):
    __doc__ = (
        """## What it does
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
    local_rank, rank, world_size = setup_distributed()
    model = Net().to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train_sampler = DistributedSampler(train_ds, shuffle=True) if world_size > 1 else None
    loader = DataLoader(train_ds, batch_size=64 // world_size, shuffle=train_sampler is None, sampler=train_sampler)
    ```

    ## Fix safety
    """
        + _SEMANTICS_DOC.strip()
        + "\n"
    )

    code = "TOP402"
    name = "single-process-to-ddp"
    family = FAMILY
    opt_in = True
    message = (
        "single-process training script: DistributedDataParallel under `torchrun --standalone "
        "--nproc_per_node=N` trains on every GPU (multi-node: `torchrun --nnodes=M --nproc_per_node=N "
        "--rdzv_backend=c10d --rdzv_endpoint=HOST:29400`)"
    )
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
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                from torch.utils.data import DataLoader, TensorDataset

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                train_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
                model = nn.Linear(4, 2).to(device)
                loader = DataLoader(train_ds, batch_size=8, shuffle=True)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for epoch in range(2):
                    for x, y in loader:
                        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
                    print(epoch, loss.item())
                torch.save(model.state_dict(), 'ckpt.pt')
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
                # each process loads its own shard; batch_size is per process
                assert 8 % world_size == 0, (
                    'the global batch size must divide by the number of processes'
                )
                sampler = DistributedSampler(train_ds, shuffle=True) if world_size > 1 else None
                loader = DataLoader(
                    train_ds, batch_size=8 // world_size, shuffle=sampler is None, sampler=sampler
                )
                model = DistributedDataParallel(
                    model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None
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
                # each process loads its own shard; batch_size is per process
                assert 8 % world_size == 0, "the global batch size must divide by the number of processes"
                sampler = DistributedSampler(train_ds, shuffle=True) if world_size > 1 else None
                loader = DataLoader(train_ds, batch_size=8 // world_size, shuffle=sampler is None, sampler=sampler)
                model = DistributedDataParallel(model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None)
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
            note="DataParallel scripts are TOP401's",
        ),
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
