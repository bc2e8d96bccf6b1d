"""The GradScaler part of the TOP202 rewrite: each backward pass scaled, each optimizer step taken
through the scaler with one ``update()`` after the last, ``unscale_`` before the gradients are read,
and the scaler's state saved and restored next to the optimizer's in checkpoints."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.names import dotted
from torchopt.analysis.statement_edits import Edits, statement
from torchopt.analysis.values import string_value
from torchopt.codemods.amp.autocast_insertion import Key, _Analysis, _single_small, dict_with_entry, method_receiver
from torchopt.codemods.amp.step_analysis import StepPlan, _site_key, _is_autograd_backward, _loss_arg
from torchopt.codemods.amp.optimizer_wrappers import Wrapper, check_wrapper_steps, scale_wrapper_steps
from torchopt.rewrite.rule import Rule


def wrapper_steps(analysis: _Analysis, plan: StepPlan) -> list[tuple[cst.Call, Wrapper]]:
    """The step calls of ``plan`` that go through a wrapper's own method, with the wrapper."""
    out = []
    for c, o in plan.steps:
        w = analysis.kwrappers.get(_site_key(analysis, plan.site, o))
        if w is not None:
            out.append((c, w))
    return out


def check_scaled_step(analysis: _Analysis, plan: StepPlan) -> None:
    """Raise Refusal when the scaler cannot reach a step of ``plan`` (see check_wrapper_steps)."""
    wrapped = wrapper_steps(analysis, plan)
    if wrapped:
        check_wrapper_steps(analysis, wrapped, {o for _, os_ in plan.unscale_before for o in os_})


def scale_step(analysis: _Analysis, plan: StepPlan, e: Edits, sc: str) -> None:
    """Route the step through the scaler named ``sc``: the scaled loss is what is differentiated, the
    scaler skips a step whose gradients overflowed, and clipping must see unscaled gradients."""
    for c in plan.backwards:
        if _is_autograd_backward(c):  # torch.autograd.backward(loss) -> (scaler.scale(loss))
            arg = _loss_arg(c)
            assert arg is not None
            scaled = cst.Call(
                func=cst.parse_expression(f"{sc}.scale"), args=[cst.Arg(arg.value.with_changes(lpar=[], rpar=[]))]
            )
            e.replace_node(c, c.with_changes(args=[x.with_changes(value=scaled) if x is arg else x for x in c.args]))
            continue
        recv = method_receiver(c)
        recv = recv.with_changes(lpar=[], rpar=[])
        new_func = cst.Attribute(
            value=cst.Call(func=cst.parse_expression(f"{sc}.scale"), args=[cst.Arg(recv)]), attr=cst.Name("backward")
        )
        e.replace_node(c, c.with_changes(func=new_func))
    wrapped = wrapper_steps(analysis, plan)
    scale_wrapper_steps(e, wrapped, sc)
    for c, o in plan.steps:
        if all(c is not w for w, _ in wrapped):
            e.replace_node(c, cst.Call(func=cst.parse_expression(f"{sc}.step"), args=[cst.Arg(method_receiver(c))]))
    last = max((s for c, _ in plan.steps if (s := analysis.statement(c)) is not None), key=analysis.pos)
    e.add_after(last, [statement(f"{sc}.update()\n")])
    for s, os_ in plan.unscale_before:
        e.add_before(s, [statement(f"{sc}.unscale_({o})\n") for o in os_])


def save_scaler_in_checkpoints(
    rule: Rule, analysis: _Analysis, e: Edits, opts: list[Key], sc: str, anchor: cst.CSTNode
) -> None:
    """Add the scaler's state to each checkpoint dict that saves one of ``opts``, and restore it after
    each ``optimizer.load_state_dict(ckpt[...])``: a resumed run keeps its calibrated scale. Only
    checkpoints the scaler created at ``anchor`` is visible to are touched."""
    anchor_scope = analysis.scope_owner(anchor)

    def visible(n: cst.CSTNode) -> bool:
        return analysis.pos(n) > analysis.pos(anchor) and (
            isinstance(anchor_scope, cst.Module) or analysis.scope_owner(n) is anchor_scope
        )

    def is_opt(name: str | None, at: cst.CSTNode) -> bool:
        """``name`` read at ``at`` is one of the step's optimizers (also as the same-named parameter of
        a helper, `def save(model, optimizer)` called as `save(model, optimizer)`)."""
        k = analysis.param_alias(at).get(name) if name is not None else None
        return (k if k is not None else analysis.key(name, at)) in opts

    for c, is_save in _checkpoint_calls(rule, analysis):
        if is_save:
            d: cst.BaseExpression | None = c.args[0].value
            if isinstance(d, cst.Name):  # ckpt = {...}; torch.save(ckpt, f)
                d = _named_dict(analysis, d.value, c)
            if isinstance(d, cst.Dict) and visible(d) and visible(c):
                keys = [string_value(el.key) for el in d.elements if isinstance(el, cst.DictElement)]
                if "scaler" in keys:
                    continue
                saves_opt = any(
                    isinstance(el, cst.DictElement)
                    and isinstance(el.value, cst.Call)
                    and isinstance(el.value.func, cst.Attribute)
                    and el.value.func.attr.value == "state_dict"
                    and is_opt(dotted(el.value.func.value), el.value)
                    for el in d.elements
                )
                if saves_opt:
                    el = cst.DictElement(
                        key=cst.SimpleString('"scaler"'), value=cst.parse_expression(f"{sc}.state_dict()")
                    )
                    e.replace_node(d, lambda updated, el=el: dict_with_entry(updated, el))  # type: ignore[misc]  # mypy infers no lambda with a default, which binds this entry
        elif is_opt(dotted(method_receiver(c)), c) and len(c.args) == 1:
            arg = c.args[0].value
            stmt = analysis.statement(c)
            if (
                isinstance(arg, cst.Subscript)
                and isinstance(arg.value, cst.Name)
                and isinstance(stmt, cst.SimpleStatementLine)
                and visible(stmt)
            ):
                k = arg.value.value
                e.add_after(stmt, [statement(f'if "scaler" in {k}:\n    {sc}.load_state_dict({k}["scaler"])\n')])


def _named_dict(analysis: _Analysis, name: str, use: cst.CSTNode) -> cst.Dict | None:
    """The dict literal last bound to ``name`` by a plain assignment before ``use``, in its scope."""
    index = analysis.__dict__.get("_dict_assigns")
    if index is None:  # name -> `name = {...}` statements, one walk for the file
        index = {}
        for n in analysis.all_nodes:
            small = _single_small(n) if isinstance(n, cst.SimpleStatementLine) else None
            if (
                isinstance(small, cst.Assign)
                and len(small.targets) == 1
                and isinstance(small.value, cst.Dict)
                and isinstance(small.targets[0].target, cst.Name)
            ):
                index.setdefault(small.targets[0].target.value, []).append(n)
        analysis.__dict__["_dict_assigns"] = index
    best = None
    scope = analysis.scope_owner(use)
    for n in index.get(name, ()):
        if analysis.pos(n) < analysis.pos(use) and analysis.scope_owner(n) is scope:
            if best is None or analysis.pos(n) > analysis.pos(best):
                best = n
    return best.body[0].value if best is not None else None


def _checkpoint_calls(rule: Rule, analysis: _Analysis) -> list[tuple[cst.Call, bool]]:
    """(call, is torch.save) for every `torch.save(x, ...)` and `x.load_state_dict(...)`, in walk order."""
    calls = analysis.__dict__.get("_ckpt_calls")
    if calls is None:
        calls = analysis.__dict__["_ckpt_calls"] = []
        for c in analysis.module_calls():
            if isinstance(c.func, cst.Attribute) and c.func.attr.value == "load_state_dict":
                calls.append((c, False))
            elif isinstance(c.func, (cst.Name, cst.Attribute)) and c.args and callee(rule, c) == "torch.save":
                calls.append((c, True))
    return calls
