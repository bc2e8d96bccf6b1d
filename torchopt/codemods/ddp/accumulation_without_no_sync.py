"""TOP404 `accumulation-without-no-sync`: In a gradient-accumulation loop of a DistributedDataParallel model (`backward()` every."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.syntax import walk
from torchopt.analysis.statement_edits import ApplyEdits, Edits, Refusal, body_list, fresh_name, statement
from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp.program_analysis import Analysis
from torchopt.codemods.ddp.program_analysis import DDP
from torchopt.codemods.ddp.program_analysis import calls
from torchopt.codemods.ddp.program_analysis import dotted
from torchopt.codemods.ddp.program_analysis import is_backward
from torchopt.codemods.ddp.step_checks import _DEPS
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class NoSyncAccumulation(Rule):
    """## What it does
    In a gradient-accumulation loop of a DistributedDataParallel model (`backward()` every
    iteration, `optimizer.step()` under `if cond:`), runs the forward and backward of the
    micro-batches that do not step under `model.no_sync()`. The step condition is computed once
    into a variable, before the forward, and used both for the context and for the `if`, so the
    two cannot drift apart; the forward is inside the context (otherwise DDP still all-reduces).
    A model that is DDP only on some paths gets `getattr(model, "no_sync", contextlib.nullcontext)()`.

    ## Why is this slow
    DDP all-reduces the gradients during every backward. While accumulating, only the last
    micro-batch's all-reduce matters: gradients accumulated locally under `no_sync()` are reduced
    by the next synchronising backward. Skipping k-1 of k all-reduces removes most of the
    communication (tuning guide, "Skip unnecessary all-reduce").

    ## Example
    ```python
    for i, (x, y) in enumerate(loader):
        loss = criterion(model(x), y) / accum
        loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
    ```

    ## Use instead
    ```python
    for i, (x, y) in enumerate(loader):
        sync_grads = (i + 1) % accum == 0
        with (contextlib.nullcontext() if sync_grads else model.no_sync()):
            loss = criterion(model(x), y) / accum
            loss.backward()
        if sync_grads:
            optimizer.step()
            optimizer.zero_grad()
    ```

    ## Fix safety
    Unsafe (tolerance): the gradients are summed locally, then averaged once, instead of averaged
    every micro-batch; the result equals the original up to rounding (`allclose(atol=1e-6)`)
    and is bitwise the same with one process. Not offered when the condition reads names the
    forward or backward assign, or calls anything but `len`.
    """

    code = "TOP404"
    name = "accumulation-without-no-sync"
    family = FAMILY
    message = "gradient accumulation on a DDP model all-reduces every micro-batch: use `{model}.no_sync()`"
    fix_title = "Run the forward and backward of non-stepping micro-batches under `no_sync()`"
    safety = Safety.UNSAFE
    tags = (Tag.TOLERANCE,)
    prefilter = ("DistributedDataParallel",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, DDP)  # visit_Module: a.ddp

    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                if not dist.is_initialized():
                    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                torch.manual_seed(0)
                model = DDP(nn.Linear(4, 2))
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                data = torch.randn(4, 3, 4)
                for i in range(4):
                    loss = model(data[i]).pow(2).mean() / 2
                    loss.backward()
                    if (i + 1) % 2 == 0:
                        optimizer.step()
                        optimizer.zero_grad()
            """),
            after=dedent("""\
                import contextlib

                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                if not dist.is_initialized():
                    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                torch.manual_seed(0)
                model = DDP(nn.Linear(4, 2))
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                data = torch.randn(4, 3, 4)
                for i in range(4):
                    sync_grads = (i + 1) % 2 == 0
                    with contextlib.nullcontext() if sync_grads else model.no_sync():
                        loss = model(data[i]).pow(2).mean() / 2
                        loss.backward()
                    if sync_grads:
                        optimizer.step()
                        optimizer.zero_grad()
            """),
            unsafe="tolerance",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = nn.Linear(4, 2)
                model = DDP(model) if dist.is_initialized() else model
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for i, (x, y) in enumerate(batches):
                    loss = (model(x) - y).pow(2).mean()
                    loss.backward()
                    if (i + 1) % 4 == 0 or i == len(batches) - 1:
                        optimizer.step()
                        optimizer.zero_grad()
            """),
            after=dedent("""\
                import contextlib

                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = nn.Linear(4, 2)
                model = DDP(model) if dist.is_initialized() else model
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for i, (x, y) in enumerate(batches):
                    sync_grads = (i + 1) % 4 == 0 or i == len(batches) - 1
                    with (
                        contextlib.nullcontext()
                        if sync_grads
                        else getattr(model, "no_sync", contextlib.nullcontext)()
                    ):
                        loss = (model(x) - y).pow(2).mean()
                        loss.backward()
                    if sync_grads:
                        optimizer.step()
                        optimizer.zero_grad()
            """),
            unsafe="tolerance",
            note="DDP on some paths only: getattr(model, 'no_sync', nullcontext); the extra end-of-loader "
            "condition is kept in the predicate",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                if not dist.is_initialized():
                    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                torch.manual_seed(0)
                model = DDP(nn.Linear(4, 2))
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                data = torch.randn(4, 3, 4)
                for i in range(4):
                    with model.no_sync():
                        loss = model(data[i]).pow(2).mean() / 2
                        loss.backward()
                    if (i + 1) % 2 == 0:
                        optimizer.step()
                        optimizer.zero_grad()
            """)
        ),
        Valid(
            dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP
                import contextlib

                if not dist.is_initialized():
                    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                torch.manual_seed(0)
                model = DDP(nn.Linear(4, 2))
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                data = torch.randn(4, 3, 4)
                for i in range(4):
                    sync_grads = (i + 1) % 2 == 0
                    with (contextlib.nullcontext() if sync_grads else model.no_sync()):
                        loss = model(data[i]).pow(2).mean() / 2
                        loss.backward()
                    if sync_grads:
                        optimizer.step()
                        optimizer.zero_grad()
            """)
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        if not a.ddp:
            return
        for n in walk(a.module, True):
            if isinstance(n, cst.For) and body_list(n.body):
                try:
                    self._loop(a, n)
                except Refusal as r:
                    self.report(
                        r.node or a.module,
                        fmt={"model": "model"},
                        message=f"gradient accumulation on a DDP model not put under `no_sync()`: {r.reason}",
                    )

    def _loop(self, analysis: Analysis, loop: cst.For) -> None:
        body = list(body_list(loop.body) or [])
        if any(isinstance(c.func, cst.Attribute) and c.func.attr.value == "no_sync" for c in calls(loop, True)):
            return
        back = [
            i
            for i, s in enumerate(body)
            if isinstance(s, cst.SimpleStatementLine)
            and len(s.body) == 1
            and isinstance(s.body[0], cst.Expr)
            and isinstance(s.body[0].value, cst.Call)
            and is_backward(s.body[0].value)
        ]
        if len(back) != 1:
            return
        b = back[0]
        step_if = None
        for j in range(b + 1, len(body)):
            s = body[j]
            if isinstance(s, cst.If) and s.orelse is None and self._steps(analysis, s):
                step_if = j
                break
        if step_if is None:
            return
        models = [m for m in analysis.ddp if any(dotted(c.func) == m for s in body[: b + 1] for c in calls(s))]
        if not models:
            return
        start = next(i for i in range(b + 1) if any(dotted(c.func) in models for c in calls(body[i])))
        if len(models) > 1:
            raise Refusal(body[b], "several DDP models in one step (enter each `no_sync()` with an ExitStack)")
        cond = cst.ensure_type(body[step_if], cst.If).test
        for c in calls(cond):
            if not (isinstance(c.func, cst.Name) and c.func.value == "len"):
                raise Refusal(cond, "the step condition calls a function")
        read = {n.value for n in walk(cond) if isinstance(n, cst.Name)}
        assigned: set[str] = set()
        for s in body[start:step_if]:
            for t in walk(s):
                if isinstance(t, cst.AssignTarget) or isinstance(t, (cst.AugAssign, cst.AnnAssign)):
                    tgt = t.target
                    assigned |= {x.value for x in walk(tgt) if isinstance(x, cst.Name)}
        if read & assigned:
            raise Refusal(cond, f"the step condition reads `{sorted(read & assigned)[0]}`, assigned by the step")
        ctxlib = analysis.plain_import("contextlib")
        if ctxlib is None:
            raise Refusal(cond, "`contextlib` is bound to something else")
        cl, imports = ctxlib
        model = models[0]
        sync = fresh_name(set(analysis.names), "sync_grads")
        ctx = f"{model}.no_sync()" if analysis.ddp_sure(model) else f'getattr({model}, "no_sync", {cl}.nullcontext)()'
        e = Edits()
        e.add_before(body[start], [statement(f"{sync} = {analysis.module.code_for_node(cond)}\n")])
        w = cst.ensure_type(
            cst.parse_statement(f"with ({cl}.nullcontext() if {sync} else {ctx}):\n    pass\n"), cst.With
        )
        e.wrap(body[start : b + 1], w)
        e.replace_node(cond, cst.Name(sync))
        self.report(
            body[b],
            fmt={"model": model},
            replacement=analysis.module.visit(ApplyEdits(e)),
            target=analysis.module,
            tags=[Tag.TOLERANCE],
            imports=imports,
            note="gradients are all-reduced once per optimizer step instead of every micro-batch "
            "(equal up to rounding)",
        )

    @staticmethod
    def _steps(analysis: Analysis, s: cst.If) -> bool:
        for c in calls(s.body):
            if isinstance(c.func, cst.Attribute) and c.func.attr.value == "step":
                recv = dotted(c.func.value)
                if recv in analysis.optimizers or any(dotted(x.value) in analysis.optimizers for x in c.args):
                    return True
        return False
