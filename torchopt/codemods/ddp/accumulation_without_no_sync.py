"""TOP404 `accumulation-without-no-sync`: In a gradient-accumulation loop of a DistributedDataParallel model (`backward()` every."""
from __future__ import annotations

import libcst as cst

from torchopt.analysis.syntax import walk
from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp.program_analysis import Analysis
from torchopt.codemods.ddp.program_analysis import DDP
from torchopt.codemods.ddp.program_analysis import Edits
from torchopt.codemods.ddp.program_analysis import Refusal
from torchopt.codemods.ddp.program_analysis import Rewrite
from torchopt.codemods.ddp.program_analysis import body_list
from torchopt.codemods.ddp.program_analysis import calls
from torchopt.codemods.ddp.program_analysis import dotted
from torchopt.codemods.ddp.program_analysis import fresh
from torchopt.codemods.ddp.program_analysis import is_backward
from torchopt.codemods.ddp.program_analysis import stmt
from torchopt.codemods.ddp.example_programs import ACC_AFTER
from torchopt.codemods.ddp.example_programs import ACC_DONE
from torchopt.codemods.ddp.example_programs import ACC_MAYBE_AFTER
from torchopt.codemods.ddp.example_programs import ACC_MAYBE_SRC
from torchopt.codemods.ddp.example_programs import ACC_SRC
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
        Invalid(ACC_SRC, after=ACC_AFTER, unsafe="tolerance", runnable=True),
        Invalid(ACC_MAYBE_SRC, after=ACC_MAYBE_AFTER, unsafe="tolerance",
                note="DDP on some paths only: getattr(model, 'no_sync', nullcontext); the extra end-of-loader "
                     "condition is kept in the predicate"),
        Valid(ACC_DONE),
        Valid(ACC_AFTER),
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
                    self.report(r.node, fmt={"model": "model"},
                                message=f"gradient accumulation on a DDP model not put under `no_sync()`: {r.reason}")

    def _loop(self, a: Analysis, loop: cst.For) -> None:
        body = list(body_list(loop.body) or [])
        if any(isinstance(c.func, cst.Attribute) and c.func.attr.value == "no_sync" for c in calls(loop, True)):
            return
        back = [i for i, s in enumerate(body) if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1
                and isinstance(s.body[0], cst.Expr) and isinstance(s.body[0].value, cst.Call)
                and is_backward(s.body[0].value)]
        if len(back) != 1:
            return
        b = back[0]
        step_if = None
        for j in range(b + 1, len(body)):
            s = body[j]
            if isinstance(s, cst.If) and s.orelse is None and self._steps(a, s):
                step_if = j
                break
        if step_if is None:
            return
        models = [m for m in a.ddp if any(dotted(c.func) == m for s in body[:b + 1] for c in calls(s))]
        if not models:
            return
        start = next(i for i in range(b + 1) if any(dotted(c.func) in models for c in calls(body[i])))
        if len(models) > 1:
            raise Refusal(body[b], "several DDP models in one step (enter each `no_sync()` with an ExitStack)")
        cond = body[step_if].test  # type: ignore[attr-defined]
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
        ctxlib = a.plain_import("contextlib")
        if ctxlib is None:
            raise Refusal(cond, "`contextlib` is bound to something else")
        cl, imports = ctxlib
        model = models[0]
        sync = fresh(set(a.names), "sync_grads")
        ctx = (f"{model}.no_sync()" if a.ddp_sure(model)
               else f'getattr({model}, "no_sync", {cl}.nullcontext)()')
        e = Edits()
        e.add_before(body[start], [stmt(f"{sync} = {a.module.code_for_node(cond)}\n")])
        w = cst.parse_statement(f"with ({cl}.nullcontext() if {sync} else {ctx}):\n    pass\n")
        e.wraps[id(body[start])] = (w, b - start + 1)  # type: ignore[assignment]
        e.exprs[id(cond)] = lambda upd: cst.Name(sync)
        self.report(body[b], fmt={"model": model}, replacement=a.module.visit(Rewrite(e)), target=a.module,
                    tags=[Tag.TOLERANCE], imports=imports,
                    note="gradients are all-reduced once per optimizer step instead of every micro-batch "
                         "(equal up to rounding)")

    @staticmethod
    def _steps(a: Analysis, s: cst.If) -> bool:
        for c in calls(s.body):
            if isinstance(c.func, cst.Attribute) and c.func.attr.value == "step":
                recv = dotted(c.func.value)
                if recv in a.optimizers or any(dotted(x.value) in a.optimizers for x in c.args):
                    return True
        return False
