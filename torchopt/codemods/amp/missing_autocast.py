"""TOP202 `missing-autocast`: Rewrites a float32 training step into automatic mixed precision. A step is recognised in the."""
from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.names import dotted
from torchopt.analysis.values import string_value
from torchopt.codemods.amp import FAMILY
from torchopt.codemods.amp import prechecks
from torchopt.codemods.amp.autocast_insertion import (
    Edits, Key, OPTION_DTYPE, Refusal, StepPlan, _AMP_DONE, _AmpBase, _Analysis, _H, _HO, _Rewrite, _SCALER,
    _SETUP, _STEP_AFTER, _STEP_SRC, _WITH, _is_autograd_backward, _loop_sites, _loss_arg, _single_small,
    _site_key, _stmt, analyse_step
)
from torchopt.analysis.program import program_of
from torchopt.codemods.amp.remote_steps import plan_remote, remote_sites
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


_CLIP_SRC = _H + ("for x, y in batches:\n    optimizer.zero_grad()\n    loss = nn.functional.mse_loss(model(x), y)\n"
                  "    loss.backward()\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
                  "    optimizer.step()\n")


_CLIP_AFTER = _HO + _SETUP + _SCALER + (
    "for x, y in batches:\n    optimizer.zero_grad()\n    " + _WITH
    + "        loss = nn.functional.mse_loss(model(x), y)\n    scaler.scale(loss).backward()\n"
    "    scaler.unscale_(optimizer)\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    "    scaler.step(optimizer)\n    scaler.update()\n")


_CLOSURE = _H + ("for x, y in batches:\n    loss = nn.functional.mse_loss(model(x), y)\n    loss.backward()\n"
                 "    optimizer.step(lambda: loss)\n")


_BCE_SRC = _H + ("for x, y in batches:\n    optimizer.zero_grad()\n    out = model(x)\n"
                 "    loss = nn.functional.binary_cross_entropy(torch.sigmoid(out), y)\n    loss.backward()\n"
                 "    optimizer.step()\n")


_DP_SRC = _H.replace("model = nn.Linear(4, 2).to(device)", "model = nn.DataParallel(nn.Linear(4, 2)).to(device)") \
    + _STEP_SRC[len(_H):]


_AUTOGRAD_SRC = _STEP_SRC.replace("    loss.backward()\n", "    torch.autograd.backward(loss)\n")


_AUTOGRAD_AFTER = _STEP_AFTER.replace("    scaler.scale(loss).backward()\n",
                                      "    torch.autograd.backward(scaler.scale(loss))\n")


_CKPT_SRC = _STEP_SRC + ('    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}\n'
                         '    torch.save(ckpt, "ckpt.pt")\n')


_CKPT_AFTER = _STEP_AFTER + ('    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), '
                             '"scaler": scaler.state_dict()}\n    torch.save(ckpt, "ckpt.pt")\n')


class MissingAutocast(_AmpBase):
    """## What it does
    Rewrites a float32 training step into automatic mixed precision. A step is recognised in the
    body of a `for`/`while` loop, or in a function of the same file that a loop calls: a call of
    an `nn.Module` instance (a name bound to a `torch.nn` constructor or to a class deriving from
    `torch.nn.Module`, or whose `.parameters()` a `torch.optim` optimizer takes), a loss computed
    from its output, `loss.backward()`, and `optimizer.step()`. The forward and the loss (from the
    first statement that calls the model to the last statement the loss depends on) go under
    `torch.autocast`; with the default `dtype = "float16"` the same fix adds one
    `torch.amp.GradScaler`: `scaler.scale(loss).backward(...)` (also
    `scaler.scale(out).backward(grad)` and `torch.autograd.backward(scaler.scale(loss))`),
    `scaler.step(opt)`, one `scaler.update()` after the last step of the iteration,
    `scaler.unscale_(opt)` before the first gradient clipping or gradient read, and the scaler's
    state next to the optimizer's in `torch.save({...})` checkpoints (a dict literal passed
    directly or bound to a name first, `ckpt = {...}; torch.save(ckpt, f)`) and restored after
    `optimizer.load_state_dict(ckpt[...])`. Gradient accumulation (`if (i + 1) % k == 0:` guarding
    the step) keeps scaling every micro-batch and steps/updates under the condition. Several
    losses (each `backward()` scaled, `retain_graph=` kept), several models and optimizers (a GAN)
    share one scaler and one `update()`. A step whose optimizer is created in another function gets
    its scaler the way it gets the optimizer: created after the optimizer in the caller and passed as
    a new last parameter (`train(args, model, device, loader, optimizer, epoch, scaler)`), or set as
    `self.scaler` next to `self.optimizer` in a trainer class; the step's function then chooses the
    autocast device type and dtype from the device it moves its batches to. Names are resolved the way Python resolves them in the
    step's function (its own `model`/`optimizer` first, then the module's), so each training
    function of a file gets the finding, and its own scaler, that it gets alone.

    The step is left alone, with a diagnostic saying why, when it takes `optimizer.step(closure)`,
    calls `torch.autograd.grad`, casts the model with `.half()`, interleaves optimizer or metric
    code with the forward, computes the loss with `F.binary_cross_entropy` / an `nn.BCELoss`
    instance (they raise under CUDA autocast: use `binary_cross_entropy_with_logits` on the
    logits), or runs a model wrapped in `nn.DataParallel` (autocast state is thread-local and the
    replicas run in other threads: convert to DDP, TOP401, or decorate `forward` with
    `@torch.autocast(...)`). A step already under autocast or using a scaler is not flagged.
    Option `dtype` (`[tool.torchopt.rules.TOP202]`): `"float16"` (default) or `"bfloat16"`
    (autocast only, no scaler). TOP203 is the same check for autocast that already exists.

    ## Why is this slow
    In float32 every matmul and convolution runs at a fraction of the Tensor Core rate and moves
    twice the bytes. Under autocast those ops run in float16/bfloat16 (typically 2-3x faster on
    recent NVIDIA GPUs) while reductions, losses and the weights stay in float32.

    ## Example
    ```python
    for x, y in loader:
        optimizer.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        optimizer.step()
    ```

    ## Use instead
    ```python
    amp_device_type = torch.device(device).type
    amp_dtype = torch.float16 if amp_device_type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
            out = model(x)
            loss = loss_fn(out, y)
        out = out.float()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    ```

    ## Fix safety
    Unsafe (numerics): matmuls and convolutions in the region compute in float16 (on CUDA) or
    bfloat16 (elsewhere, e.g. on the CPU), so activations, logits and the loss lose precision
    (a 2-layer MLP forward differs from float32 by rel-L2 ~3.7e-4 in float16 and ~3.5e-3 in
    bfloat16) and training follows a slightly different trajectory (max relative loss
    difference over 50 steps 6e-6 fp16 + GradScaler, 4.8e-5 bf16). With float16 the scaler
    may skip the first steps while it calibrates its scale (their gradients overflow), so the
    number of optimizer updates can differ. Tensors assigned in the region and used after it are
    upcast with `.float()` so later float32 code keeps working. `torchopt validate` holds
    the result to its AMP tolerances: model outputs within rtol 1e-2 / atol 1e-3·max|ref| /
    rel-L2 1e-2 (float16) or 5e-2 / 1e-2·max|ref| / 5e-2 (bfloat16); losses within 1 % for the
    first 20 steps and 2 % after. On a CPU the rewritten program runs bfloat16 autocast with the
    scaler disabled; CPU autocast casts other ops than CUDA's (softmax, log_softmax and sum stay
    low precision on CPU), so a CPU validation is not representative of CUDA numerics.
    The inserted code chooses float16 (with an enabled scaler) where the model runs on CUDA and
    bfloat16 (scaler disabled) elsewhere; to go back to float32, revert the fix.
    """

    code = "TOP202"
    min_torch = (2, 3)  # `torch.amp.GradScaler(device)`
    # Each step reads only what its scope sees (the keyed view of _Analysis): its function, the functions
    # and classes it names, and module-level statements it is linked with.
    locality = "component"
    name = "missing-autocast"
    family = FAMILY
    message = "training step runs in float32: wrap forward and loss in `torch.autocast`{extra}"
    refuse_message = "training step not rewritten to mixed precision: {reason}"
    fix_title = "Insert `torch.autocast`{extra}"
    safety = Safety.UNSAFE
    tags = (Tag.NUMERICS,)
    prefilter = ("backward",)
    requires = ("optim", "step")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and prechecks.missing_autocast_possible(text)

    options = (OPTION_DTYPE,)
    examples = (
        Invalid(_STEP_SRC, after=_STEP_AFTER, unsafe="numerics"),
        Invalid(_CLIP_SRC, after=_CLIP_AFTER, unsafe="numerics",
                note="clipping reads true gradient magnitudes only after unscale_"),
        Invalid(_CLOSURE, after=None, note="optimizer.step(closure): refused with a diagnostic"),
        Invalid(_AUTOGRAD_SRC, after=_AUTOGRAD_AFTER, unsafe="numerics",
                note="torch.autograd.backward(loss) scales its tensors argument"),
        Invalid(_CKPT_SRC, after=_CKPT_AFTER, unsafe="numerics",
                note="a checkpoint dict bound to a name gains the scaler state"),
        Invalid(_BCE_SRC, after=None,
                note="binary_cross_entropy / BCELoss raise under CUDA autocast: refused, use the with_logits form"),
        Invalid(_DP_SRC, after=None,
                note="nn.DataParallel replicas run in other threads, outside a thread-local autocast: refused"),
        Valid(_AMP_DONE, note="already autocast + GradScaler"),
        Valid(_STEP_AFTER, note="the rewrite's own output is never flagged again"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = _Analysis(self)
        program = program_of(self)
        remote = remote_sites(a, program)
        handled = [site.owner for site, _ in remote]
        for site, step in remote:
            try:
                plan = analyse_step(a, site)
                if plan is None:
                    continue
                scaler = self.option("dtype") != "bfloat16"
                setup = plan_remote(self, a, program, plan, step, scaler)
                self._apply(a, plan, setup.edits, setup.names, setup.item, setup.imports, scaler, None)
            except Refusal as r:
                self.report(r.node, message=self.refuse_message.format(reason=r.reason))
        if not a.optimizers:
            return
        for site in _loop_sites(a):
            if any(_inside(a, site.owner, owner) for owner in handled):
                continue
            try:
                plan = analyse_step(a, site)
                if plan is None:
                    continue
                self._fix(a, plan)
            except Refusal as r:
                self.report(r.node, message=self.refuse_message.format(reason=r.reason))

    def _fix(self, a: _Analysis, plan: StepPlan) -> None:
        site = plan.site
        scaler = self.option("dtype") != "bfloat16"
        opts = []
        for _, o in plan.steps:
            if o not in opts:
                opts.append(o)
        file_opts = [_site_key(a, site, o) for o in opts]
        missing = [o for o in file_opts if o not in a.koptimizers]
        if missing:
            raise Refusal(plan.anchor_node, f"`{missing[0][0]}` is not created in this file")
        used = {_site_key(a, site, m) for s in site.stmts for m in a.model_of_stmt(s, site.models)}
        step_scope = site.owner if isinstance(site.owner, cst.FunctionDef) else a.scope_owner(site.owner)
        names, setup, anchor, item, imports = self._setup(
            a, step_scope, sorted(used), [a.koptimizers[o] for o in file_opts], site.trigger, scaler, plan.anchor_node)
        e = Edits()
        e.add_after(anchor, setup)
        self._apply(a, plan, e, names, item, imports, scaler, (file_opts, anchor, step_scope))

    def _apply(self, a: _Analysis, plan: StepPlan, e: Edits, names: dict[str, str], item: cst.WithItem,
               imports: tuple, scaler: bool, checkpoints: tuple | None) -> None:
        """Wrap the regions, scale the backward passes, step through the scaler, and report the fix."""
        for r in plan.regions:
            e.regions[id(r.stmts[0])] = r
            e.touched.append((r.stmts[0], True))
        if scaler:
            sc = names["scaler"]
            for c in plan.backwards:
                if _is_autograd_backward(c):  # torch.autograd.backward(loss) -> (scaler.scale(loss))
                    arg = _loss_arg(c)
                    assert arg is not None
                    scaled = cst.Call(func=cst.parse_expression(f"{sc}.scale"),
                                      args=[cst.Arg(arg.value.with_changes(lpar=[], rpar=[]))])
                    e.calls[id(c)] = c.with_changes(
                        args=[x.with_changes(value=scaled) if x is arg else x for x in c.args])
                    e.touched.append((c, False))
                    continue
                recv = c.func.value  # type: ignore[union-attr]
                recv = recv.with_changes(lpar=[], rpar=[])
                new_func = cst.Attribute(value=cst.Call(func=cst.parse_expression(f"{sc}.scale"), args=[cst.Arg(recv)]),
                                         attr=cst.Name("backward"))
                e.calls[id(c)] = c.with_changes(func=new_func)
                e.touched.append((c, False))
            for c, o in plan.steps:
                e.calls[id(c)] = cst.Call(func=cst.parse_expression(f"{sc}.step"),
                                          args=[cst.Arg(c.func.value)])  # type: ignore[union-attr]
                e.touched.append((c, False))
            last = max((a.statement(c) for c, _ in plan.steps), key=a.pos)
            e.add_after(last, [_stmt(f"{sc}.update()\n")])
            for s, os_ in plan.unscale_before:
                e.add_before(s, [_stmt(f"{sc}.unscale_({o})\n") for o in os_])
            if checkpoints is not None:
                self._checkpoints(a, e, checkpoints[0], sc, checkpoints[1], checkpoints[2])
        # The fix replaces the smallest top-level statement holding every edit (a training function),
        # so each step costs what its function costs and steps of different functions apply together.
        root = self._edit_root(a, e)
        new = root.visit(_Rewrite(e, item))
        extra = " and scale the loss with `torch.amp.GradScaler`" if scaler else " (bfloat16)"
        self.report(plan.anchor_node, fmt={"extra": extra}, replacement=new, target=root,
                    tags=[Tag.NUMERICS], imports=imports,
                    note="forward and loss run in float16 on CUDA / bfloat16 elsewhere (the AMP tolerances of `torchopt validate`)")

    @staticmethod
    def _edit_root(a: _Analysis, e: Edits) -> cst.CSTNode:
        """The top-level statement that holds every edit of ``e``, or the module."""
        root = None
        for node, in_list in e.touched:
            cur = a.parent(node) if in_list else node  # a statement added or wrapped: its block changes
            if cur is None or isinstance(cur, cst.Module):
                return a.module
            parent = a.parent(cur)
            while parent is not None and not isinstance(parent, cst.Module):
                cur, parent = parent, a.parent(parent)
            if parent is None or (root is not None and root is not cur):
                return a.module
            root = cur
        return root if root is not None else a.module

    def _named_dict(self, a: _Analysis, name: str, use: cst.CSTNode) -> cst.Dict | None:
        """The dict literal last bound to ``name`` by a plain assignment before ``use``, in its scope."""
        index = a.__dict__.get("_dict_assigns")
        if index is None:  # name -> `name = {...}` statements, one walk for the file
            index = {}
            for n in a.all_nodes:
                small = _single_small(n) if isinstance(n, cst.SimpleStatementLine) else None
                if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.value, cst.Dict) \
                        and isinstance(small.targets[0].target, cst.Name):
                    index.setdefault(small.targets[0].target.value, []).append(n)
            a._dict_assigns = index
        best = None
        scope = a.scope_owner(use)
        for n in index.get(name, ()):
            if a.pos(n) < a.pos(use) and a.scope_owner(n) is scope:
                if best is None or a.pos(n) > a.pos(best):
                    best = n
        return best.body[0].value if best is not None else None  # type: ignore[union-attr]

    def _checkpoint_calls(self, a: _Analysis) -> list[tuple[cst.Call, bool]]:
        """(call, is torch.save) for every `torch.save(x, ...)` and `x.load_state_dict(...)`, in walk order."""
        calls = a.__dict__.get("_ckpt_calls")
        if calls is None:
            calls = a._ckpt_calls = []
            for c in a.module_calls():
                if isinstance(c.func, cst.Attribute) and c.func.attr.value == "load_state_dict":
                    calls.append((c, False))
                elif isinstance(c.func, (cst.Name, cst.Attribute)) and c.args and callee(self, c) == "torch.save":
                    calls.append((c, True))
        return calls

    def _checkpoints(self, a: _Analysis, e: Edits, opts: list[Key], sc: str, anchor: cst.CSTNode,
                     step_scope: cst.CSTNode) -> None:
        anchor_scope = a.scope_owner(anchor)

        def visible(n: cst.CSTNode) -> bool:
            return a.pos(n) > a.pos(anchor) and (isinstance(anchor_scope, cst.Module)
                                                 or a.scope_owner(n) is anchor_scope)

        def is_opt(name: str | None, at: cst.CSTNode) -> bool:
            """``name`` read at ``at`` is one of the step's optimizers (also as the same-named parameter of
            a helper, `def save(model, optimizer)` called as `save(model, optimizer)`)."""
            k = a.param_alias(at).get(name) if name is not None else None
            return (k if k is not None else a.key(name, at)) in opts

        for c, is_save in self._checkpoint_calls(a):
            if is_save:
                d = c.args[0].value
                if isinstance(d, cst.Name):  # ckpt = {...}; torch.save(ckpt, f)
                    d = self._named_dict(a, d.value, c)
                if isinstance(d, cst.Dict) and visible(d) and visible(c):
                    keys = [string_value(el.key) for el in d.elements if isinstance(el, cst.DictElement)]
                    if "scaler" in keys:
                        continue
                    saves_opt = any(isinstance(el, cst.DictElement) and isinstance(el.value, cst.Call)
                                    and isinstance(el.value.func, cst.Attribute)
                                    and el.value.func.attr.value == "state_dict"
                                    and is_opt(dotted(el.value.func.value), el.value) for el in d.elements)
                    if saves_opt:
                        el = cst.DictElement(key=cst.SimpleString('"scaler"'),
                                             value=cst.parse_expression(f"{sc}.state_dict()"))
                        e.dicts[id(d)] = cst.Dict(elements=[el])
                        e.touched.append((d, False))
            elif is_opt(dotted(c.func.value), c) and len(c.args) == 1:  # type: ignore[union-attr]
                arg = c.args[0].value
                stmt = a.statement(c)
                if isinstance(arg, cst.Subscript) and isinstance(arg.value, cst.Name) and \
                        isinstance(stmt, cst.SimpleStatementLine) and visible(stmt):
                    k = arg.value.value
                    e.add_after(stmt, [_stmt(f'if "scaler" in {k}:\n    {sc}.load_state_dict({k}["scaler"])\n')])


def _inside(a: _Analysis, node: cst.CSTNode, owner: cst.CSTNode) -> bool:
    """Whether ``node`` is ``owner`` or lies inside it."""
    cur: cst.CSTNode | None = node
    while cur is not None:
        if cur is owner:
            return True
        cur = a.parent(cur)
    return False
