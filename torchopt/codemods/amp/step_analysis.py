"""The analysis of one training step for TOP202: where a step is (a loop body, or a function of the
file a loop calls), which statements are its forward and loss (the regions autocast wraps), its
backward passes and optimizer steps, where gradients are read before a step (``unscale_``), and
every reason a step cannot be rewritten (a ``Refusal`` naming the fact that is missing).

The file model it reads (models, optimizers, devices, their keys) is ``autocast_insertion._Analysis``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Sequence

import libcst as cst
from libcst.metadata import Scope

from torchopt.analysis.names import callee, dotted, qualified_names
from torchopt.analysis.statement_edits import Refusal, body_list
from torchopt.analysis.syntax import walk
from torchopt.analysis.values import FLOAT_DTYPES, dtype_of
from torchopt.codemods.amp.autocast_insertion import (
    _BCE_CLASSES,
    _BCE_FUNCS,
    _EXCLUDED_FUNCS,
    _EXCLUDED_METHODS,
    _GRAD_READERS,
    Key,
    Region,
    _Analysis,
    _assigned_names,
    _calls,
    _no_model_reason,
    _read_names,
    _single_small,
    _targets,
    method_receiver,
)
from torchopt.codemods.amp.upcasts import check_unpacked, is_store
from torchopt.codemods.amp.program_gate import half_cast_reason


@dataclass
class StepSite:
    stmts: Sequence[cst.BaseStatement]
    owner: cst.CSTNode  # the loop or function whose body this is
    models: "set[str] | _Visible"  # names (as written in the step) that are models
    optimizers: "set[str] | _Visible"
    alias: dict[str, Key]  # local (parameter) name -> the key of the caller's argument
    trigger: cst.CSTNode  # the loop that runs the step (for ordering)
    scope: Scope | None = None  # LibCST scope of the step's statements (TOP202's keyed view)


class _Visible:
    """The names that, read in ``scope``, are one of ``keys`` (a parameter listed in ``alias`` stands for
    its caller's argument). Supports ``name in visible`` only."""

    def __init__(self, analysis: _Analysis, scope: Scope | None, keys: Container[Key], alias: dict[str, Key]) -> None:
        self.a, self.scope, self.keys, self.alias = analysis, scope, keys, alias

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        k = self.alias.get(name)
        return (k if k is not None else self.a.key_in(self.scope, name)) in self.keys

    def steps_with(self, name: str, method: str) -> bool:
        """``name.method()`` steps the optimizer ``name``: ``step``, or a stepping method of its wrapper."""
        k = self.alias.get(name)
        w = self.a.kwrappers.get(k if k is not None else self.a.key_in(self.scope, name))  # type: ignore[arg-type]  # None only for a None name
        return method in w.methods if w is not None else method == "step"


def _site_key(analysis: _Analysis, site: StepSite, name: str) -> Key:
    """The key of ``name`` as the step reads it."""
    k = site.alias.get(name)
    return k if k is not None else analysis.key_in(site.scope, name)  # type: ignore[return-value]  # None only for a None name


def _loop_sites(analysis: _Analysis) -> list[StepSite]:
    sites = []
    for n in analysis.all_nodes:
        if isinstance(n, (cst.For, cst.While)):
            body = body_list(n.body)
            if body:
                scope = analysis.scope_of(n)
                alias = analysis.param_alias(n)
                sites.append(
                    StepSite(
                        body,
                        n,
                        _Visible(analysis, scope, analysis.kmodels, alias),
                        _Visible(analysis, scope, analysis.koptimizers, alias),
                        alias,
                        n,
                        scope,
                    )
                )
    for fname, fn in analysis.functions.items():
        body = body_list(fn.body)
        if not body:
            continue
        calls = analysis.in_loop_call(fname)
        if not calls:
            continue
        params = [p.name.value for p in fn.params.params]
        alias = {}
        for c in calls:
            for i, arg in enumerate(c.args):
                if arg.star:
                    continue
                pname = arg.keyword.value if arg.keyword is not None else (params[i] if i < len(params) else None)
                k = analysis.key(dotted(arg.value), arg.value)
                if pname and k and (k in analysis.kmodels or k in analysis.koptimizers or k in analysis.kbce):
                    alias[pname] = k
        scope = analysis.scope_of(fn.body)
        models = _Visible(analysis, scope, analysis.kmodels, alias)
        opts = _Visible(analysis, scope, analysis.koptimizers, alias)
        loop = None
        cur: cst.CSTNode | None = calls[0]
        while cur is not None and not isinstance(cur, (cst.For, cst.While)):
            cur = analysis.parent(cur)
        loop = cur or calls[0]
        sites.append(StepSite(body, fn, models, opts, alias, loop, scope))
    return sites


def _is_autograd_backward(c: cst.Call) -> bool:
    """``torch.autograd.backward(...)`` (any alias of torch), not a ``tensor.backward(...)``."""
    d = dotted(c.func)
    return d is not None and (d == "autograd.backward" or d.endswith(".autograd.backward"))


def _loss_arg(c: cst.Call) -> cst.Arg | None:
    """The argument holding the tensors of ``torch.autograd.backward(tensors, ...)``."""
    for arg in c.args:
        if arg.star:
            return None
        if arg.keyword is None or arg.keyword.value == "tensors":
            return arg
    return None


def _loss_expr(c: cst.Call) -> cst.BaseExpression:
    """What a backward call differentiates: ``loss`` in ``loss.backward()`` and in
    ``torch.autograd.backward(loss)``."""
    if _is_autograd_backward(c):
        arg = _loss_arg(c)
        assert arg is not None
        return arg.value
    return method_receiver(c)


def _backward_call(stmt: cst.CSTNode) -> cst.Call | None:
    small = _single_small(stmt)
    if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
        c = small.value
        if isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward":
            if _is_autograd_backward(c) and _loss_arg(c) is None:
                return None
            return c
    return None


def _is_scale_call(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "scale"


def _bce_call(analysis: "_Analysis", site: "StepSite", node: cst.CSTNode, depth: int = 0) -> cst.Call | None:
    """A call of ``F.binary_cross_entropy`` / an ``nn.BCELoss`` instance in ``node`` (one level into the
    file's own functions called there)."""
    for c in _calls(node):
        if isinstance(c.func, cst.Call):
            if isinstance(c.func.func, (cst.Name, cst.Attribute)) and callee(analysis.rule, c.func) in _BCE_CLASSES:
                return c
            continue
        d = dotted(c.func)
        if d is None:
            continue
        k = _site_key(analysis, site, d) if depth == 0 else analysis.key(d, c)  # one level in: that function's scope
        if k in analysis.kbce or callee(analysis.rule, c) in _BCE_FUNCS:
            return c
        fn = analysis.functions.get(d)
        if fn is not None and depth == 0 and fn is not site.owner:
            inner = _bce_call(analysis, site, fn.body, 1)
            if inner is not None:
                return c
    return None


def before_bce_loss(
    analysis: "_Analysis", site: "StepSite", region: list[cst.BaseStatement]
) -> tuple[list[cst.BaseStatement], bool]:
    """The region up to the statement computing binary cross-entropy, and whether it was cut there.

    CUDA autocast raises on ``binary_cross_entropy`` (it is unsafe in float16), so that loss and what
    follows it stay after the block, reading the forward's outputs upcast to float32."""
    for k, s in enumerate(region):
        bce = _bce_call(analysis, site, s)
        if bce is None:
            continue
        if analysis.calls_model(s, site.models):
            raise Refusal(
                bce,
                "the binary cross-entropy loss (unsafe to autocast) takes the model's output in the "
                "same statement that runs the forward, so the forward cannot go under autocast "
                "without the loss: assign the model's output to a name first",
            )
        later = next((t for t in region[k + 1 :] if analysis.calls_model(t, site.models)), None)
        if later is not None:
            raise Refusal(
                bce,
                "the forward continues after the binary cross-entropy loss (unsafe to autocast), "
                "so no single autocast block covers the forward without that loss",
            )
        return list(region[:k]), True
    return list(region), False


def recurrent_state(analysis: "_Analysis", site: "StepSite", region: Sequence[cst.BaseStatement]) -> set[str]:
    """Names the region binds from a model call that also takes them (``out, hidden = model(x, hidden)``).

    Such state may be a tuple (an LSTM's ``(h, c)``) and goes back into the model, which autocast
    casts anyway, so it is not upcast with ``.float()``."""
    state: set[str] = set()
    for s in region:
        for n in walk(s):
            if (
                not isinstance(n, cst.Assign)
                or not isinstance(n.value, cst.Call)
                or dotted(n.value.func) not in site.models
            ):
                continue
            passed = {dotted(arg.value) for arg in n.value.args}
            state |= {d for d in (dotted(t) for t in _targets(n)) if d is not None and d in passed}
    return state


_INTEGER_CASTS = {"long", "int", "short", "bool", "byte", "char"}


def not_floating(analysis: "_Analysis", region: Sequence[cst.BaseStatement]) -> set[str]:
    """Names every assignment of which in the region ends in a cast to an integer or bool dtype
    (``y = batch.y.squeeze().to(torch.long)``, ``mask = m.bool()``): autocast leaves them exact, and
    ``.float()`` after the block would turn labels into floats."""
    exact: dict[str, bool] = {}
    for s in region:
        for n in walk(s):
            if isinstance(n, cst.Assign):
                casts = _integer_cast(analysis, n.value)
                for t in n.targets:
                    if isinstance(t.target, cst.Name):
                        exact[t.target.value] = exact.get(t.target.value, True) and casts
                    else:  # unpacked or an attribute: each item's dtype is not known
                        exact.update({x.value: False for x in walk(t.target) if isinstance(x, cst.Name)})
            elif isinstance(n, (cst.AugAssign, cst.AnnAssign, cst.For, cst.NamedExpr, cst.WithItem)):
                for d in _assigned_names(n):
                    exact[d] = False
    return {name for name, ok in exact.items() if ok}


def _integer_cast(analysis: "_Analysis", value: cst.BaseExpression) -> bool:
    """``x.long()`` / ``x.to(torch.long)`` / ``x.to(dtype=torch.int64)``: an integer or bool tensor."""
    if not isinstance(value, cst.Call) or not isinstance(value.func, cst.Attribute):
        return False
    method = value.func.attr.value
    if method in _INTEGER_CASTS:
        return not value.args
    if (
        method == "to"
        and len(value.args) == 1
        and (value.args[0].keyword is None or value.args[0].keyword.value == "dtype")
    ):
        dtype = dtype_of(analysis.rule, value.args[0].value)
        return dtype is not None and dtype not in FLOAT_DTYPES and not dtype.startswith("complex")
    return False


def _accelerate_backward(analysis: "_Analysis", c: cst.Call) -> bool:
    """``accelerator.backward(loss)`` with ``accelerator`` bound to a call from the ``accelerate`` package."""
    if _is_autograd_backward(c) or not c.args:
        return False
    receiver = dotted(method_receiver(c))
    for stmt in analysis.assigning(receiver) if receiver else ():
        value = getattr(_single_small(stmt), "value", None)
        if isinstance(value, cst.Call) and any(
            q.split(".")[0] == "accelerate" for q in qualified_names(analysis.rule, value.func)
        ):
            return True
    return False


def hand_update(
    analysis: "_Analysis", stmts: Sequence[cst.BaseStatement], models: "set[str] | _Visible"
) -> cst.For | None:
    """A ``for p in model.parameters():`` loop in the step (also under ``if``/``else`` or ``with``)
    that writes each parameter in place from its gradient, as plain SGD by hand does."""
    for s in stmts:
        for n in walk(s):
            if not isinstance(n, cst.For) or not isinstance(n.target, cst.Name):
                continue
            it = n.iter
            if not (
                isinstance(it, cst.Call)
                and isinstance(it.func, cst.Attribute)
                and it.func.attr.value == "parameters"
                and dotted(it.func.value) in models
            ):
                continue
            p = n.target.value
            if _reads_grads(n.body) and any(_writes_in_place(m, p) for m in walk(n.body)):
                return n
    return None


def _writes_in_place(node: cst.CSTNode, param: str) -> bool:
    """``p.add_(...)``, ``p.data.add_(...)``, ``p -= ...`` or ``p.data -= ...`` for the loop variable ``param``."""
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value.endswith("_"):
        target = node.func.value
    elif isinstance(node, cst.AugAssign):
        target = node.target
    else:
        return False
    return dotted(target) in (param, f"{param}.data")


def _step_call(stmt: cst.CSTNode, optimizers: "set[str] | _Visible") -> cst.Call | None:
    small = _single_small(stmt)
    value = None
    if isinstance(small, cst.Expr):
        value = small.value
    elif isinstance(small, cst.Assign):
        value = small.value
    if (
        isinstance(value, cst.Call)
        and isinstance(value.func, cst.Attribute)
        and (d := dotted(value.func.value)) is not None
        and d in optimizers
        and (
            optimizers.steps_with(d, value.func.attr.value)
            if isinstance(optimizers, _Visible)
            else value.func.attr.value == "step"
        )
    ):
        return value
    return None


def _reads_grads(stmt: cst.CSTNode) -> bool:
    for n in walk(stmt):
        if isinstance(n, cst.Attribute) and n.attr.value == "grad":
            return True
        if isinstance(n, cst.Call):
            d = dotted(n.func) or ""
            if d.rsplit(".", 1)[-1] in _GRAD_READERS:
                return True
    return False


def _excluded(stmt: cst.CSTNode) -> bool:
    small = _single_small(stmt)
    if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
        f = small.value.func
        if isinstance(f, cst.Attribute) and f.attr.value == "zero_grad":
            return False  # `opt.zero_grad()` on its own line only clears gradients: no op autocast casts
    for c in _calls(stmt):
        if isinstance(c.func, cst.Attribute) and c.func.attr.value in _EXCLUDED_METHODS:
            return True
        if isinstance(c.func, cst.Name) and c.func.value in _EXCLUDED_FUNCS and not _literal_args(c):
            return True
    return isinstance(stmt, (cst.Return,)) or any(
        isinstance(n, (cst.Return, cst.Yield, cst.Break, cst.Continue)) for n in walk(stmt)
    )


def _literal_args(call: cst.Call) -> bool:
    """Every argument is a literal (``print("switching to global attention")`` in a branch of the
    forward): the call reads no value the forward computes, so autocast cannot change what it does."""
    return all(
        not a.star and isinstance(a.value, (cst.SimpleString, cst.ConcatenatedString, cst.Integer, cst.Float))
        for a in call.args
    )


@dataclass
class StepPlan:
    site: StepSite
    regions: list[Region]
    backwards: list[cst.Call]
    steps: list[tuple[cst.Call, str]]  # (call, optimizer name as written)
    step_list: Sequence[cst.BaseStatement]
    unscale_before: list[tuple[cst.BaseStatement, list[str]]]
    anchor_node: cst.CSTNode  # first region statement (where the diagnostic points)
    # The binary cross-entropy loss is computed after the autocast block, on float32 inputs.
    bce_outside: bool = False
    # A `for p in model.parameters():` loop that updates the weights by hand (no GradScaler possible).
    manual_update: cst.For | None = None


def _escapes(analysis: _Analysis, site: StepSite, region: list[cst.BaseStatement], exclude: set[str]) -> list[str]:
    """Names assigned in the region and read anywhere else in their scope."""
    names: list[str] = []
    for s in region:
        for t in _targets(s):
            if isinstance(t, cst.Name) and t.value not in exclude and t.value not in names:
                names.append(t.value)
    if not names:
        return []
    lo, hi = analysis.pos(region[0]), analysis.end(region[-1])
    pending = set(names)
    found: set[str] = set()
    scope_node = analysis.scope_owner(region[0])
    for n in (
        walk(scope_node, True) if not isinstance(scope_node, cst.Module) else analysis.all_nodes
    ):  # one walk for all
        if isinstance(n, cst.Name) and n.value in pending:
            p = analysis.pos(n)
            if lo <= p <= hi:
                continue
            parent = analysis.parent(n)
            if is_store(analysis, n) or (isinstance(parent, cst.Attribute) and parent.attr is n):
                continue
            if (
                isinstance(parent, (cst.Param, cst.FunctionDef, cst.ClassDef, cst.Arg))
                and getattr(parent, "keyword", None) is n
            ):
                continue
            if isinstance(parent, (cst.Param, cst.FunctionDef, cst.ClassDef)):
                continue
            found.add(n.value)
            pending.discard(n.value)
            if not pending:
                break
    return [name for name in names if name in found]


# A step call found in the step: (the statement list holding it, its index there, the call, the
# optimizer as written).
_Found = tuple[Sequence[cst.BaseStatement], int, cst.Call, str]


def analyse_step(analysis: _Analysis, site: StepSite) -> StepPlan | None:
    """The plan of the training step in ``site``: None when it is no float32 step (no backward, no
    step, already mixed precision); raises Refusal with the reason when it cannot be rewritten."""
    stmts = list(site.stmts)
    backs = [(i, c) for i, s in enumerate(stmts) if (c := _backward_call(s)) is not None]
    micro, first = stmts, backs[0][0] if backs else -1  # where the backward passes are
    if not backs:
        found = _micro_batch_loop(stmts, site)
        if found is None:
            return None
        first, micro, backs = found
    steps = _find_steps(stmts, site)
    manual = hand_update(analysis, stmts, site.models)
    if _already_mixed(analysis, micro, backs) or (micro is not stmts and _already_mixed(analysis, stmts, [])):
        return None
    if not steps and manual is None:
        _refuse_unknown_optimizer(analysis, site, stmts, first, micro, backs)
        return None
    _refuse_unsupported(analysis, site, stmts, backs[0][1], steps, manual)
    regions, bce_outside = _regions(analysis, site, micro, backs)
    anchor = regions[0].stmts[0] if regions else micro[backs[0][0]]
    if manual is not None:  # bfloat16 without a scaler: no step goes through it, nothing to unscale
        return StepPlan(site, regions, [c for _, c in backs], [], stmts, [], anchor, bce_outside, manual)
    if any(j < first for lst, j, _, _ in steps if lst is stmts):
        return None  # a step before the micro-batch loop: not one accumulation step
    step_list, unscale = _unscale_points(analysis, stmts, first, steps)
    return StepPlan(
        site, regions, [c for _, c in backs], [(c, o) for _, _, c, o in steps], step_list, unscale, anchor, bce_outside
    )


def _refuse_unknown_optimizer(
    analysis: _Analysis,
    site: StepSite,
    stmts: list[cst.BaseStatement],
    first: int,
    micro: list[cst.BaseStatement],
    backs: list[tuple[int, cst.Call]],
) -> None:
    """Raise Refusal for a step whose loss comes from a model and whose optimizer is built by a class of
    a library other than torch (``opt = MuonAdamAtan2(...)``; ``opt.zero_grad()`` and ``opt.step()``):
    ``GradScaler.step`` unscales the ``param_groups`` of a torch.optim.Optimizer, and whether that class
    is one is not known. A class of the project is left to ``foreign_wrappers``."""
    for s in stmts[first + 1 :]:
        small = _single_small(s)
        c = small.value if isinstance(small, cst.Expr) else None
        if not (
            isinstance(c, cst.Call)
            and isinstance(c.func, cst.Attribute)
            and c.func.attr.value == "step"
            and not c.args
            and isinstance(c.func.value, cst.Name)
        ):
            continue
        name = c.func.value.value
        written = _library_class(analysis, name)
        zeroes = any(
            isinstance(z.func, cst.Attribute) and z.func.attr.value == "zero_grad" and dotted(z.func.value) == name
            for z in analysis.module_calls()
        )
        if written is None or not zeroes:
            continue
        try:
            regions, _ = _regions(analysis, site, micro, backs)
        except Refusal:
            return  # no model feeds the loss, or the forward cannot be wrapped: not this step's question
        if regions:
            raise Refusal(
                c,
                f"`{name}` is built by `{written}(...)`, which is not a torch.optim class: "
                f"`GradScaler.step({name})` needs a torch.optim.Optimizer (it unscales the gradients of its "
                f"`param_groups` before stepping it), and whether `{written}` is one is not known",
            )
        return


def _library_class(analysis: _Analysis, name: str) -> str | None:
    """The class, as written, that every binding of ``name`` in the file calls, when it comes from a
    library other than torch (not the project's, not torch's); else None."""
    from torchopt.analysis.project import index_of

    found: set[str] = set()
    for stmt in analysis.assigning(name):
        small = _single_small(stmt)
        value = small.value if isinstance(small, cst.Assign) and len(small.targets) == 1 else None
        if not isinstance(value, cst.Call) or not isinstance(value.func, (cst.Name, cst.Attribute)):
            return None
        written = dotted(value.func)
        if written is None or callee(analysis.rule, value) is not None or not written.split(".")[-1][:1].isupper():
            return None
        if index_of(analysis.rule).resolve(written) is not None or written.split(".")[0] not in _imported(analysis):
            return None
        found.add(written)
    return found.pop() if len(found) == 1 else None


def _imported(analysis: _Analysis) -> set[str]:
    """Names the module binds by an import statement."""
    out = set()
    for n in analysis.all_nodes:
        if isinstance(n, (cst.Import, cst.ImportFrom)) and not isinstance(n.names, cst.ImportStar):
            for a in n.names:
                bound = a.asname.name if a.asname is not None else a.name
                if isinstance(bound, cst.Name):
                    out.add(bound.value)
                elif isinstance(bound, cst.Attribute):
                    out.add((dotted(bound) or "").split(".")[0])
    return out


def _micro_batch_loop(
    stmts: list[cst.BaseStatement], site: StepSite
) -> tuple[int, list[cst.BaseStatement], list[tuple[int, cst.Call]]] | None:
    """Gradient accumulation over an inner loop (``for _ in range(k): loss = model(next(it));
    (loss / k).backward()``, the optimizer stepped after it): the loop's index in ``stmts``, its body
    and the backward calls there. Only a loop without ``else`` or ``break`` whose body steps no optimizer."""
    for i, s in enumerate(stmts):
        if not isinstance(s, (cst.For, cst.While)) or s.orelse is not None:
            continue
        body = body_list(s.body)
        if not body or any(isinstance(n, cst.Break) for n in walk(s.body)):
            continue
        backs = [(j, c) for j, b in enumerate(body) if (c := _backward_call(b)) is not None]
        if backs and not _find_steps(list(body), site):
            return i, list(body), backs
    return None


def _find_steps(stmts: list[cst.BaseStatement], site: StepSite) -> list[_Found]:
    """Step statements: at the top level of the body, or directly in an `if` there (accumulation)."""
    lists: list[Sequence[cst.BaseStatement]] = [stmts]
    for s in stmts:
        if isinstance(s, cst.If):
            body = body_list(s.body)
            if body:
                lists.append(body)
    steps: list[_Found] = []
    for lst in lists:
        for j, s in enumerate(lst):
            c = _step_call(s, site.optimizers)
            if c is not None:
                steps.append((lst, j, c, dotted(method_receiver(c)) or ""))
    return steps


def _already_mixed(analysis: _Analysis, stmts: list[cst.BaseStatement], backs: list[tuple[int, cst.Call]]) -> bool:
    """The step already owns its precision (idempotence): `Accelerator(mixed_precision=...)`'s
    backward, autocast anywhere in the step, a scaled backward or an `unscale_`."""
    if any(_accelerate_backward(analysis, c) for _, c in backs):
        return True
    body_node = cst.IndentedBlock(body=stmts)  # only for walking
    if analysis.autocast_with(body_node):
        return True
    if any(_is_scale_call(_loss_expr(c)) for _, c in backs):
        return True
    return any(isinstance(c.func, cst.Attribute) and c.func.attr.value == "unscale_" for c in _calls(body_node))


def _refuse_unsupported(
    analysis: _Analysis,
    site: StepSite,
    stmts: list[cst.BaseStatement],
    first_back: cst.Call,
    steps: list[_Found],
    manual: cst.For | None,
) -> None:
    """Raise Refusal for a step AMP cannot take as it is: a closure step, a gradient penalty, steps
    in different blocks, a DataParallel model with bfloat16, a model cast to half precision."""
    for _, _, c, opt in steps if manual is None else ():
        if c.args and _site_key(analysis, site, opt) not in analysis.kwrappers:
            raise Refusal(
                c,
                f"`{opt}.step(...)` takes a closure, which GradScaler does not support "
                '(`GradScaler.step` raises "Closure use is not currently supported")',
            )
    for c in _calls(cst.IndentedBlock(body=stmts)):
        if isinstance(c.func, (cst.Name, cst.Attribute)) and callee(analysis.rule, c) == "torch.autograd.grad":
            raise Refusal(
                c,
                "the step calls `torch.autograd.grad` (a gradient penalty needs the AMP "
                "template: scale the inputs of autograd.grad and unscale its outputs)",
            )
    if len({id(lst) for lst, _, _, _ in steps}) != 1 and manual is None:
        raise Refusal(
            first_back,
            "optimizer steps sit in different blocks, so no single `scaler.update()` "
            "placement runs once per iteration after all of them",
        )
    used_models = {m for s in stmts for m in analysis.model_of_stmt(s, site.models)}
    fmodels = {_site_key(analysis, site, m) for m in used_models}
    dp = fmodels & analysis.kdata_parallel
    if dp and (manual is not None or analysis.rule.option("dtype") == "bfloat16"):
        # DataParallel's replica threads enter autocast with the caller's on/off state but the
        # device's default dtype (float16 on CUDA): a float16 step reaches them, a bfloat16 one not.
        raise Refusal(
            first_back,
            f"`{sorted(dp)[0][0]}` is wrapped in `torch.nn.DataParallel`, whose replica threads "
            "autocast to float16 (the CUDA default) whatever dtype the step chooses, and this step "
            "would choose bfloat16: convert to DistributedDataParallel (TOP401) or "
            "decorate the model's `forward` with `@torch.autocast(...)`",
        )
    half = fmodels & analysis.khalf
    if half:
        raise Refusal(first_back, half_cast_reason(analysis.rule, sorted(half)[0][0]))


def _regions(
    analysis: _Analysis, site: StepSite, stmts: list[cst.BaseStatement], backs: list[tuple[int, cst.Call]]
) -> tuple[list[Region], bool]:
    """The autocast regions, one per group of consecutive backward calls (from the first statement
    that calls a model to the last one the loss depends on), with the names to upcast after each;
    and whether the binary cross-entropy loss was left after the block."""
    regions: list[Region] = []
    prev = -1
    groups: list[list[int]] = []
    for i, _ in backs:
        if groups and groups[-1][-1] == i - 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    loss_names: set[str] = set()
    bce_outside = False
    for g in groups:
        needed: set[str] = set()
        for i in g:
            recv = _loss_expr(dict(backs)[i])  # the backward call of stmts[i]
            needed |= _read_names(recv) if not isinstance(recv, (cst.Name, cst.Attribute)) else {dotted(recv) or ""}
            loss_names |= {n for n in needed if "." not in n}
        in_slice: list[int] = []
        for j in range(g[0] - 1, prev, -1):
            assigned = _assigned_names(stmts[j])
            if assigned & needed:
                in_slice.append(j)
                needed |= _read_names(stmts[j])
        model_stmts = [j for j in in_slice if analysis.calls_model(stmts[j], site.models)]
        if not model_stmts:
            if not regions:
                raise Refusal(
                    stmts[g[0]], _no_model_reason(analysis, site.models, [stmts[j] for j in sorted(in_slice)])
                )
            prev = g[-1]
            continue
        start, end = min(model_stmts), max(in_slice)
        region, cut = before_bce_loss(analysis, site, stmts[start : end + 1])
        bce_outside = bce_outside or cut
        for s in region:
            if _excluded(s) or analysis.autocast_with(s):
                raise Refusal(
                    s,
                    "a statement between the forward and the loss ("
                    + " ".join(analysis.module.code_for_node(s).split())[:50]
                    + ") cannot run under autocast (optimizer, metric or host conversion)",
                )
        regions.append(Region(list(region)))
        prev = g[-1]
    for r in regions:
        state = recurrent_state(analysis, site, r.stmts)
        exact = not_floating(analysis, r.stmts)
        r.upcasts = [n for n in _escapes(analysis, site, r.stmts, loss_names) if n not in state and n not in exact]
        check_unpacked(analysis, r.stmts, r.upcasts)
    return regions, bce_outside


def _unscale_points(
    analysis: _Analysis, stmts: list[cst.BaseStatement], first_back: int, steps: list[_Found]
) -> tuple[Sequence[cst.BaseStatement], list[tuple[cst.BaseStatement, list[str]]]]:
    """The statement list holding the steps, and the gradient readers between the first backward
    and the steps, each with the optimizers to `unscale_` before it (once per optimizer)."""
    step_list = steps[0][0]
    step_idx = sorted(j for _, j, _, _ in steps)
    unscale: list[tuple[cst.BaseStatement, list[str]]] = []
    done: set[str] = set()
    opt_at = {j: o for _, j, _, o in steps}
    if step_list is stmts:
        candidates = [(j, stmts[j]) for j in range(first_back + 1, step_idx[-1])]
    else:
        host = next(s for s in stmts if isinstance(s, cst.If) and body_list(s.body) is step_list)
        _refuse_grads_read_off_step(analysis, stmts[first_back + 1 : stmts.index(host)], host)
        candidates = [(j, step_list[j]) for j in range(0, step_idx[-1])]
    for j, s in candidates:
        if j in opt_at or not _reads_grads(s):
            continue
        nxt = [k for k in step_idx if k > j]
        run: list[int] = []
        for k in nxt:
            if run and k != run[-1] + 1:
                break
            run.append(k)
        opts = [opt_at[k] for k in run if opt_at[k] not in done]
        if opts:
            done.update(opts)
            unscale.append((s, opts))
    return step_list, unscale


def _refuse_grads_read_off_step(analysis: _Analysis, between: list[cst.BaseStatement], host: cst.If) -> None:
    """Gradients read between the backward and an `if` that holds the steps would be unscaled on
    iterations that do not step."""
    for s in between:
        if _reads_grads(s):
            test = " ".join(analysis.module.code_for_node(host.test).split())
            if "%" in test:
                raise Refusal(
                    s,
                    "gradients are read on micro-batches that do not step "
                    "(unscale_ there would be repeated before update())",
                )
            raise Refusal(
                s,
                f"gradients are read before the step, which runs only `if {test}:`, so "
                "`unscale_` would run on iterations that do not step (move the gradient "
                "read under the same condition)",
            )
