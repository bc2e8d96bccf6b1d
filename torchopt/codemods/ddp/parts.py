"""What a DistributedDataParallel program needs per rank (rules.md DDP-003 … DDP-006): `set_epoch`,
`no_sync()` while accumulating gradients, rank-0 guards for output, portable checkpoints."""
from __future__ import annotations

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.analysis.arguments import keyword
from torchopt.analysis.syntax import walk
from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp._analysis import (
    DDP,
    DSAMPLERS,
    INITS,
    LOADERS,
    Analysis,
    Edits,
    Refusal,
    Rewrite,
    body_list,
    calls,
    dotted,
    fresh,
    is_backward,
    stmt,
)
from torchopt.codemods.ddp._convert import Context, checkpoint_edits, guard_edits, set_epoch_edits
from torchopt.codemods.ddp._examples import (
    ACC_AFTER,
    ACC_DONE,
    ACC_MAYBE_AFTER,
    ACC_MAYBE_SRC,
    ACC_SRC,
    EPOCH_AFTER,
    EPOCH_SRC,
    GUARD_AFTER,
    GUARD_SRC,
    LOAD_AFTER,
    LOAD_SRC,
    SAVE_AFTER,
    SAVE_SRC,
)
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Tag, Valid

_DEPS = (PositionProvider, ScopeProvider, ParentProvider)


class MissingSetEpoch(Rule):
    """## What it does
    Inserts `sampler.set_epoch(epoch)` as the first statement of the epoch loop around a training
    loop whose `DataLoader` takes a `DistributedSampler` (a name bound to one, or an inline
    `sampler=DistributedSampler(ds)`, then `loader.sampler.set_epoch(epoch)`), when the file never
    calls `set_epoch` on it. The epoch is the target of the `for epoch in ...` loop.

    ## Why is this slow
    Not a speed problem but a training bug that DDP conversions often introduce: the sampler
    seeds its shuffle with `seed + epoch`, so without `set_epoch` every epoch visits the data in
    the same order (verified: same order twice without it, a new one after `set_epoch(1)`, E-12).

    ## Example
    ```python
    for epoch in range(epochs):
        for x, y in loader:
            ...
    ```

    ## Use instead
    ```python
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            ...
    ```

    ## Fix safety
    Unsafe (semantics): the data order of every epoch after the first changes (that is the point:
    the original repeated the first epoch's order). With a `while` epoch loop nothing is inserted
    and the diagnostic asks for a counter; when resuming, pass the resumed epoch.
    """

    code = "TOP403"
    name = "missing-set-epoch"
    family = FAMILY
    message = "`DistributedSampler` without `set_epoch(epoch)`: every epoch shuffles the data the same way"
    fix_title = "Call `set_epoch(epoch)` at the start of each epoch"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS,)
    prefilter = ("DistributedSampler",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        # visit_Module: a DataLoader (sampler=<a DistributedSampler>) bound to a name, looped over.
        return super().could_match(text) and may_call_torch(text, DSAMPLERS) and may_call_torch(text, LOADERS)
    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(EPOCH_SRC, after=EPOCH_AFTER, unsafe="semantics"),
        Valid(EPOCH_AFTER),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        samplers: dict[str, str] = {}
        for L, binds in a.loaders.items():
            if len(binds) != 1:
                continue
            _, lc = binds[0]
            kw = keyword(lc, "sampler")
            if kw is None:
                continue
            v = kw.value
            if isinstance(v, cst.Name) and v.value in a.samplers:
                if not a.set_epoch_called(v.value, L):
                    samplers[L] = v.value
            elif isinstance(v, cst.Call) and a.call_name(v) in DSAMPLERS:
                if not a.set_epoch_called(None, L):
                    samplers[L] = f"{L}.sampler"
        if not samplers:
            return
        loops = [lp for lp in a.training_loops() if lp.loader in samplers and lp.epoch is not None]
        if not loops:
            return
        e = Edits()
        notes: list[str] = []
        n = set_epoch_edits(a, e, samplers, notes)
        if n == 0:
            self.report(loops[0].node, message=self.message + " (no `for epoch in ...` loop: add a counter)")
            return
        self.report(loops[0].node, replacement=a.module.visit(Rewrite(e)), target=a.module,
                    tags=[Tag.SEMANTICS], note="the data order of each epoch after the first changes")


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
    every micro-batch; the result equals the original up to rounding (`allclose(atol=1e-6)`, E-12)
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
                         "(equal up to rounding, E-12)")

    @staticmethod
    def _steps(a: Analysis, s: cst.If) -> bool:
        for c in calls(s.body):
            if isinstance(c.func, cst.Attribute) and c.func.attr.value == "step":
                recv = dotted(c.func.value)
                if recv in a.optimizers or any(dotted(x.value) in a.optimizers for x in c.args):
                    return True
        return False


class RankZeroGuards(Rule):
    """## What it does
    In a program that calls `init_process_group`, guards output side effects with
    `if dist.get_rank() == 0:` (after an unconditional `init_process_group`, in the same function)
    or `if not dist.is_initialized() or dist.get_rank() == 0:` (elsewhere: code that may also run
    without a process group keeps its output):
    `print`, `logging` calls and loggers' methods, `torch.save`, TensorBoard writers (created as
    `SummaryWriter(...) if <rank 0> else None`, their `add_*`/`flush`/`close` guarded),
    `wandb`/`mlflow` logging, `plt.savefig` and `with open(path, "w")` blocks; `tqdm(...)` gets
    `disable=<not rank 0>`. Consecutive guarded statements share one `if`. Statements
    already under a test that mentions the rank are left alone, and so is anything that could take
    part in a collective (a DDP forward, `backward()`, `dist.*`, a function of the file).
    Only code after the process group is created, or inside functions, is edited.

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
        Invalid(GUARD_SRC, after=GUARD_AFTER, unsafe="semantics"),
        Valid(GUARD_AFTER),
        Valid("import torch\nprint(torch.zeros(2))\ntorch.save({}, 'x.pt')\n", note="not a distributed program"),
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
            isinstance(parent, cst.IndentedBlock) and a.parent(parent) is anchor_scope)
        safe = f"(not {dist}.is_initialized() or {dist}.get_rank() == 0)"

        class _Ctx(Context):
            def may_edit(self, node: cst.CSTNode) -> bool:  # type: ignore[override]
                owner = a.scope_owner(node)
                if owner is anchor_scope:
                    return a.pos(node) > apos
                return not isinstance(owner, cst.Module)

            def _sure(self, node: cst.CSTNode) -> bool:
                return unconditional and a.scope_owner(node) is anchor_scope

            def rank0(self, node: cst.CSTNode) -> str:  # type: ignore[override]
                return f"{dist}.get_rank() == 0" if self._sure(node) else safe[1:-1]

            def not_rank0(self, node: cst.CSTNode) -> str:  # type: ignore[override]
                return f"{dist}.get_rank() != 0" if self._sure(node) else f"not {safe}"

        e = Edits()
        skipped: list[str] = []
        n = guard_edits(a, e, _Ctx(a, dist), skipped)
        if n == 0:
            return
        first = min((x for x in walk(a.module, True) if id(x) in e.guards or id(x) in e.exprs), key=a.pos)
        self.report(first, replacement=a.module.visit(Rewrite(e)), target=a.module, tags=[Tag.SEMANTICS],
                    imports=imports, note="processes other than rank 0 no longer print, log or write files"
                    + ("; " + "; ".join(skipped) if skipped else ""))


class CheckpointPortability(Rule):
    """## What it does
    For a model bound to `DistributedDataParallel(...)`: saves its inner module,
    `model.module.state_dict()` instead of `model.state_dict()`, so checkpoints have no `module.`
    prefix and load into the plain model; and before `model.load_state_dict(sd)` removes a
    `module.` prefix if the checkpoint has one (`consume_prefix_in_state_dict_if_present`) and
    loads into `model.module`, so both old (wrapper) and new checkpoints load.

    ## Why is this slow
    Not a speed problem: DDP (like DataParallel) prefixes every key with `module.`, so checkpoints
    saved from the wrapper do not load into an unwrapped model for evaluation or inference
    (E-12, E-22), and ones saved from the inner module do not load into the wrapper.

    ## Example
    ```python
    torch.save(model.state_dict(), "ckpt.pt")
    model.load_state_dict(torch.load("ckpt.pt"))
    ```

    ## Use instead
    ```python
    torch.save(model.module.state_dict(), "ckpt.pt")
    state_dict = torch.load("ckpt.pt")
    consume_prefix_in_state_dict_if_present(state_dict, "module.")
    model.module.load_state_dict(state_dict)
    ```

    ## Fix safety
    Loading: safe (the same tensors reach the same parameters; a checkpoint without the prefix now
    loads instead of raising). Saving: unsafe (semantics): the file's keys lose the `module.`
    prefix, which matters to other programs that load it into a wrapped model.
    """

    code = "TOP406"
    name = "ddp-checkpoint-prefix"
    family = FAMILY
    message = "checkpoint of a DDP model: `{what}` carries the wrapper's `module.` prefix"
    fix_title = "Use `{model}.module`"
    safety = Safety.SAFE
    prefilter = ("DistributedDataParallel",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, DDP)  # visit_Module: a.ddp
    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(SAVE_SRC, after=SAVE_AFTER, unsafe="semantics"),
        Invalid(LOAD_SRC, after=LOAD_AFTER),
        Valid(SAVE_AFTER.replace("model.load_state_dict", "model.module.load_state_dict")),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        models = {m for m in a.ddp if a.ddp_sure(m)}
        if not models:
            return
        for c in calls(a.module, True):
            if isinstance(c.func, cst.Attribute) and c.func.attr.value == "state_dict" \
                    and dotted(c.func.value) in models and not c.args:
                m = dotted(c.func.value)
                new = c.with_changes(func=c.func.with_changes(value=cst.Attribute(value=c.func.value,
                                                                                  attr=cst.Name("module"))))
                self.report(c, fmt={"what": f"{m}.state_dict()", "model": m}, replacement=new,
                            tags=[Tag.SEMANTICS], note="saved checkpoints lose the `module.` key prefix")
        loads = [c for c in calls(a.module, True) if isinstance(c.func, cst.Attribute)
                 and c.func.attr.value == "load_state_dict" and dotted(c.func.value) in models]
        if not loads:
            return
        found = a.import_name("torch.nn.modules.utils", "consume_prefix_in_state_dict_if_present")
        if found is None:
            return
        consume, imports = found
        e = Edits()
        _, n = checkpoint_edits(a, e, models, consume, saves=False)
        if n:
            m = dotted(loads[0].func.value)  # type: ignore[union-attr]
            self.report(loads[0], fmt={"what": f"{m}.load_state_dict(...)", "model": m},
                        replacement=a.module.visit(Rewrite(e)), target=a.module, imports=imports)
