"""Training steps whose optimizer is created somewhere else than the step's own function: a function
that receives the model and optimizer as parameters (``train(args, model, device, loader, optimizer,
epoch)`` called from ``main()``), or a trainer method reading ``self.model`` / ``self.optimizer``.

The scaler is created where the optimizer is and reaches the step the way the optimizer does: as an
extra parameter passed at every call site, or as an attribute set next to ``self.optimizer``. The
autocast device type and dtype are chosen in the step's own function from the device that function
moves its batches to (or, for a trainer, set as attributes next to the scaler)."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from torchopt.analysis.names import callee, dotted, torch_ref
from torchopt.analysis.program import Function, Program, Step
from torchopt.analysis.syntax import walk
from torchopt.analysis.statement_edits import Edits, Refusal, body_list, fresh_name, statement
from torchopt.codemods.amp.autocast_insertion import _Analysis, amp_setup_lines
from torchopt.codemods.amp.step_analysis import StepPlan, StepSite
from torchopt.codemods.amp.module_kinds import parameter_free
from torchopt.codemods.amp.program_gate import half_cast_reason
from torchopt.rewrite.metadata import children_of
from torchopt.rewrite.rule import Rule


@dataclass
class RemoteSetup:
    edits: Edits
    names: dict[str, str]
    item: cst.WithItem
    imports: tuple


def _step_stmts(step: Step) -> tuple[list[cst.BaseStatement], cst.CSTNode] | None:
    """The statements that hold the backward pass and the node that owns them."""
    if step.body_function is not None:
        body = body_list(step.body_function.node.body)
        return (list(body), step.body_function.node) if body else None
    body = body_list(step.loop.body)
    return (list(body), step.loop) if body else None


def remote_sites(analysis: _Analysis, program: Program) -> list[tuple[StepSite, Step]]:
    """Step sites of training steps inside functions whose optimizer is created in another function."""
    out = []
    for step in program.steps:
        fn = step.body_function or step.function
        if step.kind != "training" or fn is None:
            continue
        found = _step_stmts(step)
        if found is None:
            continue
        stmts, owner = found
        models, optimizers = _roles_in(program, stmts)
        remote = [o for o in optimizers.values() if o.binding is None or program.function_of(o.binding) is not fn]
        if (
            not optimizers
            or not remote
            or any(o.binding is not None and program.function_of(o.binding) is None for o in optimizers.values())
        ):
            continue  # created in the step's function or at module level: the plain path handles it
        scope = analysis.scope_of(stmts[0])
        out.append((StepSite(stmts, owner, set(models), set(optimizers), {}, step.loop, scope), step))
    return out


def check_remote_models(analysis: _Analysis, program: Program, plan: StepPlan, bfloat16: bool) -> None:
    """Refuse a step whose models, where they are created (``model`` in ``main``), are cast with
    ``.half()``, or wrapped in DataParallel when the step would choose bfloat16: what the file does to
    them there holds for the step's function that receives them."""
    for stmt in plan.site.stmts:
        for n in _walk_calls(stmt):
            role = program.role_of(n.func, n) if isinstance(n.func, (cst.Name, cst.Attribute)) else None
            k = _created_as(analysis, role) if role is not None and role.kind == "model" else None
            if k is None:
                continue
            if k in analysis.khalf:
                raise Refusal(plan.anchor_node, half_cast_reason(analysis.rule, k[0], " where it is created"))
            if k in analysis.kdata_parallel and (bfloat16 or plan.manual_update is not None):
                raise Refusal(
                    plan.anchor_node,
                    f"`{k[0]}` is wrapped in `torch.nn.DataParallel`, whose replica threads autocast to "
                    "float16 (the CUDA default), and this step would choose bfloat16",
                )


def _created_as(analysis: _Analysis, role):
    """The key of the name a model is bound to where it is created (``model`` in ``main``), so that
    what the file does to it there (``.half()``, ``DataParallel``) counts for the step that receives it."""
    stmt = role.binding
    small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        target = small.targets[0].target
        return analysis.key(dotted(target), target) if dotted(target) else None
    return None


def _roles_in(program: Program, stmts: list[cst.BaseStatement]):
    models, optimizers = {}, {}
    for stmt in stmts:
        for n in _walk_calls(stmt):
            d = dotted(n.func)
            if d is not None:
                role = program.role_of(n.func, n)
                if role is not None and role.kind == "model" and not _parameter_free(program, role):
                    models[d] = role
            if isinstance(n.func, cst.Attribute) and n.func.attr.value == "step":
                recv = dotted(n.func.value)
                role = program.role_of(n.func.value, n) if recv else None
                if role is not None and role.kind == "optimizer":
                    optimizers[recv] = role
    return models, optimizers


def _parameter_free(program: Program, role) -> bool:
    """The role is a torch.nn module without parameters (``nn.CosineSimilarity()`` used as a criterion)."""
    origin = role.origin
    while (
        isinstance(origin, cst.Call)
        and isinstance(origin.func, cst.Attribute)
        and isinstance(origin.func.value, cst.Call)
    ):
        origin = origin.func.value  # `nn.CosineSimilarity(dim=1).cuda(gpu)`
    return isinstance(origin, cst.Call) and parameter_free(callee(program.rule, origin))


def _walk_calls(node: cst.CSTNode):
    """The calls in ``node``, leaving out the functions, classes and lambdas nested in it."""
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, cst.Call):
            yield cur
        if not isinstance(cur, (cst.FunctionDef, cst.ClassDef, cst.Lambda)) or cur is node:
            stack.extend(children_of(cur))


def plan_remote(
    rule: Rule, analysis: _Analysis, program: Program, plan: StepPlan, step: Step, scaler: bool
) -> RemoteSetup:
    """Where the setup goes and how the scaler reaches the step; raises Refusal with the reason."""
    ref = torch_ref(rule)
    if ref is None:
        raise Refusal(plan.anchor_node, "`torch` is bound to something else in this file")
    opts = sorted({o for _, o in plan.steps})
    fn = step.body_function or step.function
    assert fn is not None
    if all(o.startswith("self.") for o in opts) and fn.cls is not None:
        return _through_attributes(rule, analysis, program, plan, fn, opts, scaler, ref.name, tuple(ref.imports))
    if all("." not in o and o in fn.params for o in opts) and fn.cls is None:
        return _through_parameters(rule, analysis, program, plan, fn, opts, scaler, ref.name, tuple(ref.imports))
    raise Refusal(
        plan.anchor_node,
        f"`{opts[0]}` reaches the step neither as a parameter of `{fn.name}` "
        "nor as an attribute set in its class, so the scaler has no way to follow it",
    )


def _device_code(analysis: _Analysis, T: str, device: cst.BaseExpression) -> str:
    if cuda_index(analysis, device):
        return '"cuda"'  # `x.cuda(args.gpu)`: a CUDA device index, possibly None (`torch.device(None)` raises)
    return f"{T}.device({analysis.module.code_for_node(device)}).type"


def cuda_index(analysis: _Analysis, device: cst.BaseExpression) -> bool:
    """``device`` is the argument of a ``.cuda(...)`` call: a device index on CUDA, not a device."""
    arg = analysis.parent(device)
    call = analysis.parent(arg) if isinstance(arg, cst.Arg) else None
    return isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value == "cuda"


def _through_attributes(rule, analysis, program, plan, fn: Function, opts, scaler, T, imports) -> RemoteSetup:
    binds = program.attribute_bindings(fn.cls, opts[-1][len("self.") :])
    if not binds:
        raise Refusal(plan.anchor_node, f"`{opts[-1]}` is never set in `{fn.cls}`")
    anchor = binds[0]
    device = program.device_at(anchor)
    if device is None:
        raise Refusal(plan.anchor_node, f"cannot tell which device `{fn.cls}` moves its model to")
    taken = {n.value for n in walk_names(program.classes[fn.cls])}
    names = {k: "self." + fresh_name(taken, k) for k in ("amp_device_type", "amp_dtype", "scaler")}
    if isinstance(device, cst.Attribute):
        later = [
            s
            for s in program.attribute_bindings(fn.cls, device.attr.value)
            if program.function_of(s) is program.function_of(anchor) and analysis.pos(s) > analysis.pos(anchor)
        ]
        anchor = later[-1] if later else anchor
    e = Edits()
    lines = amp_setup_lines(T, _device_code(analysis, T, device), names, rule.option("dtype"), scaler)
    e.add_after(anchor, [statement(s) for s in lines])
    item = cst.WithItem(
        item=cst.parse_expression(f"{T}.autocast(device_type={names['amp_device_type']}, dtype={names['amp_dtype']})")
    )
    return RemoteSetup(e, names, item, imports)


def walk_names(node: cst.CSTNode) -> list[cst.Name]:
    """Every name and attribute name under ``node`` (what a new ``self.`` attribute must not reuse)."""
    out = []
    for n in walk(node, cross_scopes=True):
        if isinstance(n, cst.Name):
            out.append(n)
        elif isinstance(n, cst.Attribute):
            out.append(n.attr)
    return out


def _through_parameters(rule, analysis, program, plan, fn: Function, opts, scaler, T, imports) -> RemoteSetup:
    params = fn.node.params
    if (
        params.star_arg is not cst.MaybeSentinel.DEFAULT
        or params.kwonly_params
        or params.star_kwarg
        or params.posonly_params
        or any(p.default is not None for p in params.params)
    ):
        raise Refusal(
            plan.anchor_node,
            f"`{fn.name}` has default or variadic parameters, so a scaler "
            "parameter cannot be added where every caller passes it",
        )
    if not fn.callers or any(edge.how != "call" for edge in fn.callers):
        raise Refusal(
            plan.anchor_node,
            f"`{fn.name}` is not called from this file, so the scaler cannot be created where the optimizer is",
        )
    step_device = program.device_at(plan.anchor_node)
    if step_device is None:
        raise Refusal(plan.anchor_node, f"cannot tell which device `{fn.name}` runs on")
    taken = set(analysis.names)
    local = {k: fresh_name(taken, k) for k in ("amp_device_type", "amp_dtype")}
    outer = {"amp_device_type": local["amp_device_type"], "amp_dtype": local["amp_dtype"]}
    sc = fresh_name(taken, "scaler") if scaler else ""
    e = Edits()
    callers = {id(program.function_of(edge.call)) for edge in fn.callers}
    if scaler:
        creation = _optimizer_creation(analysis, program, plan, fn, opts)
        if len(callers) != 1 or creation is None:
            raise Refusal(
                plan.anchor_node,
                f"the optimizers `{fn.name}` steps are not all created in the one "
                "function that calls it, before the call",
            )
        anchor, caller_device = creation
        dev = outer["amp_device_type"]
        e.add_after(
            anchor,
            [
                statement(f"{dev} = {_device_code(analysis, T, caller_device)}\n"),
                statement(f'{sc} = {T}.amp.GradScaler({dev}, enabled={dev} == "cuda")\n'),
            ],
        )
        for edge in fn.callers:
            call = edge.call
            kw = any(arg.keyword is not None for arg in call.args)
            new_arg = cst.Arg(
                cst.Name(sc),
                keyword=cst.Name(sc) if kw else None,
                equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
                )
                if kw
                else cst.MaybeSentinel.DEFAULT,
            )
            args = list(call.args)
            if args:
                args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            e.replace_node(call, call.with_changes(args=args + [new_arg]))
        plist = list(params.params)
        plist[-1] = plist[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        e.replace_node(params, params.with_changes(params=plist + [cst.Param(cst.Name(sc))]))
    lines = amp_setup_lines(T, _device_code(analysis, T, step_device), local, rule.option("dtype"), False)
    top = _top_statement(analysis, fn, plan.anchor_node)
    e.add_before(top, [statement(s) for s in lines])
    names = dict(local, scaler=sc)
    item = cst.WithItem(
        item=cst.parse_expression(f"{T}.autocast(device_type={local['amp_device_type']}, dtype={local['amp_dtype']})")
    )
    return RemoteSetup(e, names, item, imports)


def _optimizer_creation(analysis, program: Program, plan: StepPlan, fn: Function, opts):
    """(the last statement creating one of the step's optimizers, the device the caller moves its model to),
    when they are all created in the one caller of ``fn`` before its call."""
    edge = fn.callers[0]
    caller = program.function_of(edge.call)
    anchors = []
    for o in opts:
        idx = fn.params.index(o)
        pos = [arg for arg in edge.call.args if arg.keyword is None]
        arg = next(
            (x.value for x in edge.call.args if x.keyword is not None and x.keyword.value == o),
            pos[idx].value if idx < len(pos) else None,
        )
        role = program.role_of(arg, edge.call) if arg is not None else None
        if (
            role is None
            or role.kind != "optimizer"
            or role.binding is None
            or program.function_of(role.binding) is not caller
            or analysis.pos(role.binding) >= analysis.pos(edge.call)
        ):
            return None
        anchors.append(role.binding)
    anchor = max(anchors, key=analysis.pos)
    device = program.device_at(anchor)
    return (anchor, device) if device is not None else None


def _top_statement(analysis: _Analysis, fn: Function, node: cst.CSTNode) -> cst.CSTNode:
    """The statement of ``fn``'s body that holds ``node``."""
    cur = node
    while analysis.parent(cur) is not None and analysis.parent(analysis.parent(cur)) is not fn.node:
        cur = analysis.parent(cur) or cur  # (not None: tested just above)
    return cur
