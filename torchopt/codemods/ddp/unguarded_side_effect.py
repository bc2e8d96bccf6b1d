"""TOP405 `unguarded-side-effect`: In a program that calls `init_process_group`, guards output side effects with."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.process_group import Setup, process_group_at
from torchopt.analysis.syntax import walk
from torchopt.analysis.statement_edits import ApplyEdits, Edits
from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp.program_analysis import Analysis
from torchopt.codemods.ddp.program_analysis import INITS
from torchopt.codemods.ddp.conversion_edits import Context
from torchopt.codemods.ddp.conversion_edits import guard_edits
from torchopt.codemods.ddp.step_checks import _DEPS
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class RankZeroGuards(Rule):
    """## What it does
    In a program that calls `init_process_group`, guards output side effects with
    `if dist.get_rank() == 0:` (after an unconditional `init_process_group`, in the same function)
    or `if not dist.is_initialized() or dist.get_rank() == 0:` (elsewhere: code that may also run
    without a process group keeps its output):
    `print`, `logging` calls and loggers' methods, `torch.save`, TensorBoard writers (created as
    `SummaryWriter(...) if <rank 0> else None`, their `add_*`/`flush`/`close` guarded),
    `wandb`/`mlflow` logging, `plt.savefig` and `with open(path, "w")` blocks; `tqdm(...)` gets
    `disable=<not rank 0>`. Consecutive guarded statements share one `if`, and a save is guarded
    with its group: the folder created for it just before (`os.makedirs`, `os.mkdir` behind an
    `exists` test, `Path.mkdir`; unguarded, every process creates it at once and all but one fail
    with `FileExistsError`), the path computed in between (moved above the `if` when code outside
    the group reads it), and the copy and the log line of the file after it. Statements
    already under a test that mentions the rank (`if RANK in {-1, 0}:` included) are left alone,
    prints are left alone in a program that replaces `builtins.print` itself (the
    `setup_for_distributed` idiom: it already decides which ranks print), and so is anything that
    could take part in a collective (a DDP forward, `backward()`, `dist.*`, a function of the file).
    Only code after the process group is created, or inside functions, is edited; a statement that
    runs before the group is set up on the paths the file shows (a function called only before
    `init_process_group`, `deepspeed.init_distributed()` or `Accelerator()`, or a spawned worker's
    code before its own) is left alone with a note naming the set-up call: there no rank test that
    reads the process group can tell the processes apart.

    ## Why is this slow
    Every process runs the whole script: unguarded, each line is printed world-size times, each
    checkpoint written by every process at once (racing on the same file) and every TensorBoard
    event logged N times, which costs I/O and makes logs unreadable.

    ## Example
    ```python
    print(f"epoch {epoch}: {loss.item():.4f}")
    torch.save(model.module.state_dict(), "ckpt.pt")
    ```

    ## Use instead
    ```python
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: {loss.item():.4f}")
        torch.save(model.module.state_dict(), "ckpt.pt")
    ```

    ## Fix safety
    Unsafe (semantics): processes other than rank 0 no longer print, log or write files; training
    maths is untouched. Values printed by rank 0 are rank 0's own (e.g. its local loss); to log a
    global mean, `dist.all_reduce` a copy on every rank before the guard. If other ranks read a
    checkpoint rank 0 writes, add `dist.barrier()` after the save.
    """

    code = "TOP405"
    name = "unguarded-side-effect"
    family = FAMILY
    message = "output side effects run on every DDP process: guard them with rank 0"
    fix_title = "Run prints, logs and file writes on rank 0 only"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS,)
    prefilter = ("init_process_group",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, INITS)  # visit_Module: a.inits

    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                dist.init_process_group("gloo")
                model = DDP(nn.Linear(4, 2))
                for epoch in range(2):
                    loss = model(torch.randn(3, 4)).mean()
                    loss.backward()
                    print(f"epoch {epoch}: {loss.item():.4f}")
                    torch.save(model.module.state_dict(), "ckpt.pt")
            """),
            after=dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                dist.init_process_group("gloo")
                model = DDP(nn.Linear(4, 2))
                for epoch in range(2):
                    loss = model(torch.randn(3, 4)).mean()
                    loss.backward()
                    if dist.get_rank() == 0:
                        print(f"epoch {epoch}: {loss.item():.4f}")
                        torch.save(model.module.state_dict(), "ckpt.pt")
            """),
            unsafe="semantics",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                dist.init_process_group("gloo")
                model = DDP(nn.Linear(4, 2))
                for epoch in range(2):
                    loss = model(torch.randn(3, 4)).mean()
                    loss.backward()
                    if dist.get_rank() == 0:
                        print(f"epoch {epoch}: {loss.item():.4f}")
                        torch.save(model.module.state_dict(), "ckpt.pt")
            """)
        ),
        Valid(
            dedent("""\
                import sys

                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                dist.init_process_group("gloo")
                model = DDP(nn.Linear(4, 2))
                for step in range(4):
                    x = torch.load(f"shard{step}.pt")
                    if x.shape[-1] != 4:
                        print(f"shard {step} has {x.shape[-1]} features, expected 4")
                        sys.exit(1)
                    model(x).mean().backward()
            """),
            note="an error report right before the process exits: each rank says why it stops",
        ),
        Valid(
            dedent("""\
                import os

                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                dist.init_process_group("nccl")
                local_rank = int(os.environ["LOCAL_RANK"])
                device = f"cuda:{local_rank}"
                print(f"using device: {device}")
                model = DDP(nn.Linear(4, 2).to(device), device_ids=[local_rank])
                for step in range(4):
                    model(torch.randn(3, 4, device=device)).mean().backward()
            """),
            note="each process prints its own device, computed from its rank: on purpose",
        ),
        Valid(
            dedent("""\
                import os
                import random

                import torch
                import torch.distributed as dist

                dist.init_process_group("nccl")
                paths = sorted(os.listdir("images"))
                random.shuffle(paths)
                for path in paths:
                    out = os.path.join("features", path + ".pt")
                    if os.path.exists(out):
                        continue
                    feature = torch.load(os.path.join("images", path)).cuda().mean(0)
                    torch.save(feature, out)
            """),
            note="one file per item: whether the ranks split the items between them is not known",
        ),
        Valid(
            dedent("""\
                import logging
                import torch.distributed as dist
                from utils import create_logger

                logger = logging.getLogger(__name__)

                def setup(path, rank):
                    dist.init_process_group("nccl")
                    logger = create_logger(path, rank=rank)
                    logger.info("started")
                    return logger
            """),
            note="this `logger` is the project's (a local of the same name as the module's `getLogger`)",
        ),
        Valid(
            dedent("""\
                import torch
                print(torch.zeros(2))
                torch.save({}, 'x.pt')
            """),
            note="not a distributed program",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        if not a.inits:
            return
        alias = a.dist_alias()
        if alias is None:
            return
        dist, imports = alias
        anchor = min(a.inits, key=a.pos)
        anchor_scope = a.scope_owner(anchor)
        apos = a.pos(anchor)
        init_stmt = a.statement(anchor)
        parent = a.parent(init_stmt) if init_stmt is not None else None
        unconditional = isinstance(parent, cst.Module) or (
            isinstance(parent, cst.IndentedBlock) and a.parent(parent) is anchor_scope
        )
        safe = f"(not {dist}.is_initialized() or {dist}.get_rank() == 0)"

        class _Ctx(Context):
            def may_edit(self, node: cst.CSTNode) -> bool:
                owner = a.scope_owner(node)
                if owner is anchor_scope:
                    return a.pos(node) > apos
                return not isinstance(owner, cst.Module)

            def before_setup(self, node: cst.CSTNode) -> str | None:
                state = process_group_at(a.rule, node)
                if state.setup is not Setup.NOT_YET:
                    return None
                setup = f"`{state.setup_call}`" if state.setup_call else "the process group set-up"
                return f"runs before {setup} sets up the process group, where no rank test can tell the processes apart"

            def _sure(self, node: cst.CSTNode) -> bool:
                return unconditional and a.scope_owner(node) is anchor_scope

            def rank0(self, node: cst.CSTNode) -> str:
                return f"{dist}.get_rank() == 0" if self._sure(node) else safe[1:-1]

            def not_rank0(self, node: cst.CSTNode) -> str:
                return f"{dist}.get_rank() != 0" if self._sure(node) else f"not {safe}"

        e = Edits()
        skipped: list[str] = []
        n = guard_edits(a, e, _Ctx(a, dist), skipped)
        if n == 0:
            return
        first = min((x for x in walk(a.module, True) if id(x) in e.guards or id(x) in e.nodes), key=a.pos)
        self.report(
            first,
            replacement=a.module.visit(ApplyEdits(e)),
            target=a.module,
            tags=[Tag.SEMANTICS],
            imports=imports,
            note="processes other than rank 0 no longer print, log or write files"
            + ("; " + "; ".join(skipped) if skipped else ""),
        )
