"""Where TOP202's edits go: the set-up of a step whose parameters are updated by hand, and the
smallest top-level statement that holds every edit of a fix."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import torch_ref
from torchopt.analysis.statement_edits import Edits, Refusal, fresh_name, statement
from torchopt.codemods.amp.autocast_insertion import _Analysis, _program_device, _single_small, amp_setup_lines
from torchopt.codemods.amp.step_analysis import StepPlan, _site_key
from torchopt.rewrite.rule import Rule


def hand_update_setup(
    rule: Rule, analysis: _Analysis, plan: StepPlan
) -> tuple[Edits, dict[str, str], cst.WithItem, tuple]:
    """The bfloat16 set-up (no scaler) before the loop of a step that updates its parameters by hand:
    (edits, names, autocast item, imports); raises Refusal."""
    site = plan.site
    ref = torch_ref(rule)
    if ref is None:
        raise Refusal(plan.anchor_node, "`torch` is bound to something else in this file")
    used = sorted({_site_key(analysis, site, m) for s in site.stmts for m in analysis.model_of_stmt(s, site.models)})
    dev = analysis.device_text(used) or _program_device(rule, analysis, plan.anchor_node)
    if dev is None:
        raise Refusal(
            plan.anchor_node,
            "cannot tell which device the model runs on (no `.to(device)` / "
            "`.cuda()` on it); CPU training is not an AMP target",
        )
    dev_code, dev_var = dev
    where = setup_point(analysis, site)
    if isinstance(dev_var, cst.Name) and any(
        analysis.scope_owner(n) is analysis.scope_owner(where) and analysis.pos(n) > analysis.pos(where)
        for n in analysis.assigning(dev_var.value)
    ):
        raise Refusal(plan.anchor_node, "the device is chosen after the training loop starts")
    taken = set(analysis.names)
    names = {k: fresh_name(taken, k) for k in ("amp_device_type", "amp_dtype")}
    T = ref.name
    e = Edits()
    e.add_before(
        where, [statement(line) for line in amp_setup_lines(T, dev_code.format(T=T), names, "bfloat16", False)]
    )
    item = cst.WithItem(
        item=cst.parse_expression(f"{T}.autocast(device_type={names['amp_device_type']}, dtype={names['amp_dtype']})")
    )
    return e, names, item, tuple(ref.imports)


def edit_root(analysis: _Analysis, e: Edits) -> cst.CSTNode:
    """The top-level statement that holds every edit of ``e``, or the module."""
    root = None
    for node, in_list in e.touched:
        cur = analysis.parent(node) if in_list else node  # a statement added or wrapped: its block changes
        if cur is None or isinstance(cur, cst.Module):
            return analysis.module
        parent = analysis.parent(cur)
        while parent is not None and not isinstance(parent, cst.Module):
            cur, parent = parent, analysis.parent(parent)
        if parent is None or (root is not None and root is not cur):
            return analysis.module
        root = cur
    return root if root is not None else analysis.module


def inside(analysis: _Analysis, node: cst.CSTNode, owner: cst.CSTNode) -> bool:
    """Whether ``node`` is ``owner`` or lies inside it."""
    cur: cst.CSTNode | None = node
    while cur is not None:
        if cur is owner:
            return True
        cur = analysis.parent(cur)
    return False


def setup_point(analysis: _Analysis, site) -> cst.CSTNode:
    """The statement the autocast set-up goes before: the outermost loop of the step's scope that runs
    the step, or the first statement of a step function (after its docstring)."""
    if isinstance(site.owner, cst.FunctionDef):
        body = list(site.owner.body.body)
        first = body[0]
        small = _single_small(first)
        if (
            len(body) > 1
            and isinstance(small, cst.Expr)
            and isinstance(small.value, (cst.SimpleString, cst.ConcatenatedString))
        ):
            return body[1]
        return first
    outer = site.owner
    scope = analysis.scope_owner(outer)
    cur = analysis.parent(outer)
    while cur is not None and cur is not scope:
        if isinstance(cur, (cst.For, cst.While)):
            outer = cur
        cur = analysis.parent(cur)
    return outer
