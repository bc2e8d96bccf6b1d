"""How TOP202 applies a planned step: the autocast regions, the scaled backward passes and steps, the
scaler's set-up and checkpoint entries, and the finding's wording; the rule module keeps the decisions."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.statement_edits import ApplyEdits, Edits, Refusal
from torchopt.codemods.amp.autocast_insertion import _AmpBase, _Analysis, wrap_region
from torchopt.codemods.amp.scaler_edits import check_scaled_step, save_scaler_in_checkpoints, scale_step
from torchopt.codemods.amp.step_analysis import StepPlan, _site_key
from torchopt.codemods.amp.step_placement import edit_root, hand_update_setup
from torchopt.rewrite.rule import Later, Tag


def fix_step(rule: _AmpBase, analysis: _Analysis, plan: StepPlan) -> None:
    """Insert autocast and a GradScaler (or bfloat16 alone) around a step whose optimizers this file creates."""
    if plan.manual_update is not None:
        fix_hand_update(rule, analysis, plan)
        return
    site = plan.site
    scaler = rule.option("dtype") != "bfloat16"
    opts = []
    for _, o in plan.steps:
        if o not in opts:
            opts.append(o)
    file_opts = [_site_key(analysis, site, o) for o in opts]
    missing = [o for o in file_opts if o not in analysis.koptimizers]
    if missing:
        raise Refusal(plan.anchor_node, f"`{missing[0][0]}` is not created in this file")
    used = {_site_key(analysis, site, m) for s in site.stmts for m in analysis.model_of_stmt(s, site.models)}
    step_scope = site.owner if isinstance(site.owner, cst.FunctionDef) else analysis.scope_owner(site.owner)
    names, setup, anchor, item, imports = rule._setup(
        analysis,
        step_scope,
        sorted(used),
        [analysis.koptimizers[o] for o in file_opts],
        site.trigger,
        scaler,
        plan.anchor_node,
        globals_follow=not any(o in site.alias for o in opts),  # a parameter: the scaler would not follow it
    )
    e = Edits()
    e.add_after(anchor, setup)
    apply_fix(rule, analysis, plan, e, names, item, imports, scaler, (file_opts, anchor))


def fix_hand_update(rule: _AmpBase, analysis: _Analysis, plan: StepPlan) -> None:
    """bfloat16 autocast and no scaler: a GradScaler can only step an optimizer, and this step writes
    the weights itself; bfloat16 keeps float32's exponent range, so gradients need no scaling."""
    e, names, item, imports = hand_update_setup(rule, analysis, plan)
    apply_fix(rule, analysis, plan, e, names, item, imports, False, None)


def apply_fix(
    rule: _AmpBase,
    analysis: _Analysis,
    plan: StepPlan,
    e: Edits,
    names: dict[str, str],
    item: cst.WithItem,
    imports: tuple,
    scaler: bool,
    checkpoints: tuple | None,
) -> None:
    """Wrap the regions, scale the backward passes, step through the scaler, and report the fix."""
    if scaler:
        check_scaled_step(analysis, plan)
    for r in plan.regions:
        wrap_region(e, r, item)
    if scaler:
        scale_step(analysis, plan, e, names["scaler"])
        if checkpoints is not None:
            save_scaler_in_checkpoints(rule, analysis, e, checkpoints[0], names["scaler"], checkpoints[1])
    # The fix replaces the smallest top-level statement holding every edit (a training function),
    # so each step costs what its function costs and steps of different functions apply together.
    root = edit_root(analysis, e)
    new = Later(lambda: root.visit(ApplyEdits(e)))  # rebuilt only when the fix is applied
    extra = " and scale the loss with `torch.amp.GradScaler`" if scaler else " (bfloat16)"
    note = "forward and loss run in float16 on CUDA / bfloat16 elsewhere (the AMP tolerances of `torchopt validate`)"
    if plan.manual_update is not None:
        extra = (
            " in bfloat16, with no GradScaler: the parameters are updated by hand and a GradScaler can "
            "only step an optimizer (on CUDA, bfloat16 pays off on Ampere or newer GPUs)"
        )
        note = "forward and loss run in bfloat16 (the AMP tolerances of `torchopt validate`)"
    if plan.bce_outside:
        extra += (
            "; binary cross-entropy is unsafe to autocast, so it runs after the block on the "
            "forward's outputs upcast to float32"
        )
        note = note.replace("forward and loss run", "the forward runs").replace(
            " (the AMP", ", the binary cross-entropy loss in float32 (the AMP"
        )
    region = "the forward" if plan.bce_outside else "forward and loss"
    rule.report(
        plan.anchor_node,
        fmt={"extra": extra, "region": region},
        replacement=new,
        target=root,
        tags=[Tag.NUMERICS],
        imports=imports,
        note=note,
    )
