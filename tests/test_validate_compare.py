"""The validator's comparison and report, on hand-made probe dicts (no subprocess, no harness)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from torchopt.validate.compare import compare, kind_of, ranks_agree
from torchopt.validate.report import headline, render_text, to_json
from torchopt.validate.tolerance import Tolerance, tolerance_for

BITWISE = tolerance_for([])
SAFE_FIX = {"code": "TOP101", "line": 3, "column": 5, "tags": [], "message": "create on device", "safety": "safe"}
RNG_FIX = {"code": "TOP102", "line": 7, "column": 1, "tags": ["rng"], "message": "randn on device", "safety": "unsafe"}
AMP_FIX = {"code": "AMP002", "line": 12, "column": 9, "tags": ["numerics"], "message": "autocast", "safety": "unsafe"}


def probe(n_losses: int = 6, **over) -> dict:
    g = torch.Generator().manual_seed(0)
    d = {
        "status": "ok",
        "traceback": None,
        "device": "cpu",
        "steps_done": n_losses,
        "losses": [torch.tensor(2.0 / (i + 1)) for i in range(n_losses)],
        "loss_steps": list(range(n_losses)),
        "tensors": {
            "param/fc.weight": torch.randn(4, 3, generator=g),
            "param/fc.bias": torch.randn(4, generator=g),
            "optim/state.0.exp_avg": torch.randn(4, 3, generator=g),
            "output/logits": torch.randn(2, 4, generator=g),
            "global/step": torch.tensor(n_losses),
            "rng/cpu": torch.arange(16, dtype=torch.uint8),
        },
        "notes": [],
    }
    d.update(over)
    return d


def with_tensor(p: dict, name: str, value) -> dict:
    q = dict(p)
    q["tensors"] = dict(p["tensors"])
    if value is None:
        del q["tensors"][name]
    else:
        q["tensors"][name] = value
    return q


def with_loss(p: dict, i: int, value) -> dict:
    q = dict(p)
    q["losses"] = list(p["losses"])
    q["losses"][i] = torch.as_tensor(value, dtype=torch.float32)
    return q


def row(cmp, name):
    return next(r for r in cmp.rows if r.name == name)


def verdict(before, after, tol, name="output/y") -> str:
    """The row verdict for one extra tensor added to otherwise identical probes."""
    b = probe()
    return row(compare(with_tensor(b, name, before), with_tensor(b, name, after), tol), name).verdict


def nextafter(t: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(t, torch.full_like(t, math.inf))


# --------------------------------------------------------------------------- tolerance table


def test_no_tags_is_bitwise():
    assert BITWISE.bitwise and BITWISE.compare_values and BITWISE.tags == ()


def test_tolerance_tag_fp32_defaults_and_training_rel():
    t = tolerance_for(["tolerance"])
    assert not t.bitwise and (t.rtol, t.atol) == (1.3e-6, 1e-5)
    assert t.bound("output").rtol == 1.3e-6
    assert t.bound("param").rtol == 1e-5 and t.bound("loss").rtol == 1e-5
    assert "tolerance" in t.reason


@pytest.mark.parametrize(
    "dtype, rtol, atol, rel_l2, early, late",
    [
        ("float16", 1e-2, 1e-3, 1e-2, 1e-2, 2e-2),
        ("fp16", 1e-2, 1e-3, 1e-2, 1e-2, 2e-2),
        ("bfloat16", 5e-2, 1e-2, 5e-2, 5e-2, 1.5e-1),
        (None, 5e-2, 1e-2, 5e-2, 5e-2, 1.5e-1),
    ],
)
def test_numerics_amp_rows(dtype, rtol, atol, rel_l2, early, late):
    t = tolerance_for(["numerics"], dtype)
    b = t.bound("output")
    assert (b.rtol, b.atol, b.rel_l2, b.atol_relative) == (rtol, atol, rel_l2, True)
    assert t.allow_dtype_change
    assert t.bound("loss", 3).rtol == early and t.bound("loss", 25).rtol == late


def test_rng_not_compared_unless_replayed():
    t = tolerance_for(["rng"])
    assert not t.compare_values and "rng" in t.reason
    assert tolerance_for(["rng"], replayed=True).bitwise


def test_semantics_bitwise_but_ignores_requires_grad():
    t = tolerance_for(["semantics"])
    assert t.bitwise and not t.check_requires_grad


def test_several_tags_take_the_loosest():
    t = tolerance_for(["tolerance", "numerics", "semantics"], "float16")
    assert t.bound("output").rtol == 1e-2 and t.bound("output").atol_relative
    assert not t.check_requires_grad and set(t.tags) == {"tolerance", "numerics", "semantics"}
    assert not tolerance_for(["numerics", "rng"]).compare_values
    assert tolerance_for(["semantics", "tolerance"]).bound("output").rtol == 1.3e-6


def test_unknown_tag_or_dtype_raises():
    with pytest.raises(ValueError):
        tolerance_for(["fast"])
    with pytest.raises(ValueError):
        tolerance_for(["numerics"], "float8")


# --------------------------------------------------------------------------- compare


def test_identical_is_equivalent():
    cmp = compare(probe(), probe(), BITWISE)
    assert cmp.verdict == "equivalent" and cmp.first_divergence is None and cmp.explanations == []
    assert all(r.verdict == "ok" for r in cmp.rows)
    assert [r.name for r in cmp.rows][:6] == [f"loss[{i}]" for i in range(6)]
    assert row(cmp, "rng/cpu").tolerance == "exact"


def test_one_ulp_off_under_bitwise_names_the_tensor():
    b = probe()
    w = b["tensors"]["param/fc.weight"].clone()
    w[1, 2] = nextafter(w[1, 2])
    cmp = compare(b, with_tensor(b, "param/fc.weight", w), BITWISE)
    assert cmp.verdict == "diverged"
    assert cmp.first_divergence.name == "param/fc.weight"
    assert cmp.first_divergence.step == b["steps_done"]
    r = row(cmp, "param/fc.weight")
    assert r.verdict == "diverged" and 0 < r.max_abs < 1e-6 and r.kind == "param"
    # The same ulp passes under the tolerance tag.
    assert compare(b, with_tensor(b, "param/fc.weight", w), tolerance_for(["tolerance"])).verdict == "equivalent"


def test_loss_divergence_reports_step_from_loss_steps():
    b = probe(8, loss_steps=[0, 0, 1, 1, 2, 2, 3, 3])  # two losses per optimizer step
    a = with_loss(b, 3, 0.123)
    a = with_loss(a, 5, 0.456)
    cmp = compare(b, a, BITWISE)
    assert cmp.first_divergence.name == "loss[3]" and cmp.first_divergence.step == 1
    assert row(cmp, "loss[3]").step == 1 and row(cmp, "loss[5]").verdict == "diverged"
    assert row(cmp, "loss[2]").verdict == "ok"


def test_loss_divergence_wins_over_tensor_divergence():
    b = probe()
    a = with_loss(with_tensor(b, "output/logits", b["tensors"]["output/logits"] + 1), 4, 9.0)
    assert compare(b, a, BITWISE).first_divergence.name == "loss[4]"


def test_fewer_losses_diverge_at_first_missing_index():
    b = probe(6)
    a = dict(b, losses=b["losses"][:4], loss_steps=b["loss_steps"][:4])
    cmp = compare(b, a, BITWISE)
    assert cmp.first_divergence.name == "loss[4]" and cmp.first_divergence.step == 4
    assert row(cmp, "loss[4]").verdict == "missing" and row(cmp, "loss[5]").verdict == "missing"
    extra = compare(a, b, BITWISE)  # more losses after: also a divergence
    assert extra.first_divergence.name == "loss[4]"


def test_missing_tensor_either_side():
    b = probe()
    a = with_tensor(b, "optim/state.0.exp_avg", None)
    cmp = compare(b, a, BITWISE)
    assert cmp.verdict == "diverged" and row(cmp, "optim/state.0.exp_avg").verdict == "missing"
    cmp = compare(b, with_tensor(b, "param/new_buffer", torch.zeros(2)), BITWISE)
    assert row(cmp, "param/new_buffer").verdict == "missing"
    assert cmp.first_divergence.name == "param/new_buffer"


def test_globals_in_one_version_only_are_notes_not_divergences():
    """A scaler the rewrite introduced, or a temporary (`out = model(x)`) it inlined: what it held
    reaches the losses and parameters, which are compared; the global itself is a note."""
    b = probe()
    cmp = compare(b, with_tensor(b, "global/use_amp", torch.tensor(1)), BITWISE)
    assert row(cmp, "global/use_amp").verdict == "skipped"
    assert cmp.verdict == "equivalent"
    b2 = with_tensor(b, "global/out", torch.ones(1))
    cmp = compare(b2, b, BITWISE)
    assert cmp.verdict == "equivalent" and row(cmp, "global/out").detail == "only in the original"
    assert any("exist in one version only" in n and "global/out" in n for n in cmp.notes)
    # ... but not when something computed differs as well.
    a2 = with_tensor(b, "param/fc.weight", b["tensors"]["param/fc.weight"] + 1)
    assert compare(b2, a2, BITWISE).verdict == "diverged"


def test_clock_and_process_globals_are_not_compared():
    """Globals the harness found to hold clock/process values (provenance.py) differ between two
    runs of the same program: skipped on either side's word, every other global still compared."""
    b = with_tensor(
        with_tensor(probe(), "global/dt", torch.tensor(0.25, dtype=torch.float64)),
        "global/stats['time'][0]",
        torch.tensor(1.0, dtype=torch.float64),
    )
    a = with_tensor(
        with_tensor(b, "global/dt", torch.tensor(0.5, dtype=torch.float64)),
        "global/stats['time'][0]",
        torch.tensor(2.0, dtype=torch.float64),
    )
    assert compare(b, a, BITWISE).verdict == "diverged", "without provenance both would count"
    a["uncomputed"] = ["dt", "stats['time']"]
    cmp = compare(b, a, BITWISE)
    assert cmp.verdict == "equivalent", cmp.first_divergence
    assert row(cmp, "global/dt").verdict == "skipped"
    assert any("clock, process or random" in n and "global/dt" in n for n in cmp.notes)
    a2 = with_tensor(a, "global/dtype_count", torch.tensor(3))
    b2 = with_tensor(b, "global/dtype_count", torch.tensor(4))
    assert compare(b2, a2, BITWISE).first_divergence.name == "global/dtype_count", "a prefix is not a name"


def test_amp_losses_are_measured_against_the_largest_loss_so_far():
    """A loss that training drove towards zero keeps the trajectory's absolute error: 0.12 for 0.10
    is 20 % of itself but 1 % of the loss training started from (2.0), which is what AMP drift is
    measured against. A first step 10 % off is still a divergence, and so is a late loss 20 % of
    the scale off."""
    tol = tolerance_for(["numerics"], "bfloat16")
    steps = {"loss_steps": [0, 1, 2, 3], "steps_done": 4}
    b = dict(probe(), losses=[torch.tensor(v) for v in (2.0, 1.0, 0.1, 0.05)], **steps)
    drifted = dict(b, losses=[torch.tensor(v) for v in (2.0, 1.01, 0.12, 0.06)])
    cmp = compare(b, drifted, tol)
    assert cmp.verdict == "equivalent", cmp.first_divergence
    assert row(cmp, "loss[2]").max_rel == pytest.approx(0.2) and row(cmp, "loss[2]").verdict == "ok"
    assert row(cmp, "loss[2]").tolerance == "0.05·max|loss so far|"

    wrong = dict(b, losses=[torch.tensor(v) for v in (2.0, 1.2, 0.1, 0.05)])
    cmp = compare(b, wrong, tol)
    assert cmp.verdict == "diverged" and cmp.first_divergence.name == "loss[1]"

    late = dict(b, loss_steps=[0, 1, 20, 21], losses=[torch.tensor(v) for v in (2.0, 1.0, 0.1, 0.05)])
    assert (
        compare(late, dict(late, losses=[torch.tensor(v) for v in (2.0, 1.0, 0.35, 0.05)]), tol).verdict == "equivalent"
    )  # 0.25 = 12.5 % of 2.0, inside the late 15 %
    cmp = compare(late, dict(late, losses=[torch.tensor(v) for v in (2.0, 1.0, 0.5, 0.05)]), tol)
    assert cmp.verdict == "diverged" and cmp.first_divergence.name == "loss[2]"


def test_amp_training_state_is_reported_not_bounded():
    """AMP training is bounded by its losses; parameters and optimizer state are shown, not failed."""
    b = probe()
    p = b["tensors"]["optim/state.0.exp_avg"]
    tol = tolerance_for(["numerics"], "bfloat16")
    r = row(compare(b, with_tensor(b, "optim/state.0.exp_avg", p * 1.5), tol), "optim/state.0.exp_avg")
    assert r.verdict == "ok" and r.max_abs and r.max_abs > 0 and "reported" in r.tolerance
    lossy = dict(b, losses=[loss * 1.5 for loss in b["losses"]])
    assert compare(b, lossy, tol).verdict == "diverged", "losses still bound AMP training"


def test_amp_outputs_after_training_follow_the_parameters_rule():
    """The probe batch's outputs after AMP training come from the drifted parameters: reported
    like them, bounded by the losses; an inference run (no steps) keeps the output bound."""
    b = probe()
    drifted = with_tensor(b, "output/logits", b["tensors"]["output/logits"] * 1.3)
    tol = tolerance_for(["numerics"], "bfloat16")
    cmp = compare(b, drifted, tol)
    r = row(cmp, "output/logits")
    assert cmp.verdict == "equivalent" and r.verdict == "ok" and "reported" in r.tolerance and r.max_abs > 0
    infer = dict(b, steps_done=0, losses=[], loss_steps=[])
    cmp = compare(infer, dict(drifted, steps_done=0, losses=[], loss_steps=[]), tol)
    assert cmp.verdict == "diverged" and cmp.first_divergence.name == "output/logits"
    assert compare(b, drifted, BITWISE).verdict == "diverged", "only AMP's rule reports them"


def test_shape_mismatch():
    b = probe()
    cmp = compare(b, with_tensor(b, "output/logits", b["tensors"]["output/logits"].reshape(1, 8)), BITWISE)
    r = row(cmp, "output/logits")
    assert r.verdict == "shape" and "(2, 4)" in r.detail and r.max_abs is None


def test_dtype_mismatch_fails_except_under_numerics():
    b = probe()
    half = b["tensors"]["output/logits"].to(torch.bfloat16)
    a = with_tensor(b, "output/logits", half)
    assert row(compare(b, a, BITWISE), "output/logits").verdict == "dtype"
    assert row(compare(b, a, tolerance_for(["tolerance"])), "output/logits").verdict == "dtype"
    cmp = compare(b, a, tolerance_for(["numerics"], "bfloat16"))
    assert row(cmp, "output/logits").verdict == "ok" and cmp.verdict == "equivalent"
    assert any("dtype" in n for n in cmp.notes)


def test_integer_tensors_exact_even_under_loose_tolerance():
    b = probe()
    a = with_tensor(b, "global/step", torch.tensor(b["steps_done"] + 1))
    cmp = compare(b, a, tolerance_for(["numerics"]))
    assert row(cmp, "global/step").verdict == "diverged" and row(cmp, "global/step").tolerance == "exact"
    flags = torch.tensor([True, False])
    cmp = compare(
        with_tensor(b, "global/mask", flags), with_tensor(b, "global/mask", ~flags), tolerance_for(["tolerance"])
    )
    assert row(cmp, "global/mask").verdict == "diverged"


def test_nan_same_positions_equal_different_positions_diverge():
    b = probe()
    x = torch.tensor([1.0, float("nan"), 3.0])
    same = compare(with_tensor(b, "output/x", x), with_tensor(b, "output/x", x.clone()), BITWISE)
    assert same.verdict == "equivalent"
    # A NaN with another payload is still "NaN at the same position".
    other_nan = x.clone()
    other_nan.view(torch.int32)[1] = 0x7FC00001
    assert other_nan[1].isnan()
    assert verdict(x, other_nan, BITWISE, "output/x") == "ok"
    moved = torch.tensor([float("nan"), 2.0, 3.0])
    for tol in (BITWISE, tolerance_for(["numerics"])):
        cmp = compare(with_tensor(b, "output/x", x), with_tensor(b, "output/x", moved), tol)
        assert row(cmp, "output/x").verdict == "diverged" and "NaN" in row(cmp, "output/x").detail


def test_inf_sign_matters():
    b = probe()
    x = torch.tensor([1.0, math.inf])
    assert verdict(x, x.clone(), BITWISE, "output/x") == "ok"
    y = torch.tensor([1.0, -math.inf])
    cmp = compare(with_tensor(b, "output/x", x), with_tensor(b, "output/x", y), tolerance_for(["numerics"]))
    assert cmp.verdict == "diverged"


def test_negative_zero_is_not_bitwise_equal():
    b = probe()
    pz, nz = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    cmp = compare(with_tensor(b, "output/z", pz), with_tensor(b, "output/z", nz), BITWISE)
    r = row(cmp, "output/z")
    assert r.verdict == "diverged" and r.max_abs == 0.0 and "bits" in r.detail
    assert (
        compare(with_tensor(b, "output/z", pz), with_tensor(b, "output/z", nz), tolerance_for(["tolerance"])).verdict
        == "equivalent"
    )


def test_fp32_default_tolerance_boundaries():
    b = probe()
    ref = torch.ones(100)
    close = ref * (1 + 1e-6)
    far = ref * (1 + 1e-4)
    tol = tolerance_for(["tolerance"])
    assert verdict(ref, close, tol) == "ok"
    assert verdict(ref, far, tol) == "diverged"
    # params after N steps get rel 1e-5 (compile row); outputs do not.
    p5 = ref * (1 + 5e-6)
    assert row(compare(with_tensor(b, "param/p", ref), with_tensor(b, "param/p", p5), tol), "param/p").verdict == "ok"
    assert (
        row(compare(with_tensor(b, "output/y", ref * 10), with_tensor(b, "output/y", p5 * 10), tol), "output/y").verdict
        == "diverged"
    )


def test_numerics_fp16_vs_bf16_and_rel_l2():
    b = probe(0)  # no training: the outputs are held to the AMP output bound
    ref = torch.linspace(1, 2, 1000)
    off = ref * (1 + 2e-2)  # 2 % everywhere: beyond fp16 (1 %), within bf16 (5 %)
    before, after = with_tensor(b, "output/y", ref), with_tensor(b, "output/y", off)
    assert row(compare(before, after, tolerance_for(["numerics"], "float16")), "output/y").verdict == "diverged"
    assert row(compare(before, after, tolerance_for(["numerics"], "bfloat16")), "output/y").verdict == "ok"
    # atol scales with max|ref|: a small element may move by 1e-3 * max|ref| under fp16.
    ref2 = torch.tensor([100.0, 0.0])
    ok2 = torch.tensor([100.0, 0.05])
    assert (
        row(
            compare(
                with_tensor(b, "output/y", ref2),
                with_tensor(b, "output/y", ok2),
                tolerance_for(["numerics"], "float16"),
            ),
            "output/y",
        ).verdict
        == "ok"
    )


def test_numerics_losses_within_one_percent():
    b = probe()
    tol = tolerance_for(["numerics"], "float16")
    ok = with_loss(b, 2, float(b["losses"][2]) * 1.005)
    bad = with_loss(b, 2, float(b["losses"][2]) * 1.05)  # 0.033 off: 1.7 % of the largest loss (2.0)
    assert compare(b, ok, tol).verdict == "equivalent"
    cmp = compare(b, bad, tol)
    assert cmp.first_divergence.name == "loss[2]"
    assert any("AMP002" in e for e in compare(b, bad, tol, [AMP_FIX]).explanations)


def test_rng_values_not_compared_but_structure_is():
    b = probe()
    a = with_tensor(b, "param/fc.weight", torch.randn(4, 3))
    a = with_tensor(a, "rng/cpu", torch.arange(16, dtype=torch.uint8).flip(0))
    a = with_loss(a, 0, 5.0)
    cmp = compare(b, a, tolerance_for(["rng"]), [RNG_FIX])
    assert cmp.verdict == "equivalent"
    assert row(cmp, "param/fc.weight").verdict == "skipped" and row(cmp, "loss[0]").verdict == "skipped"
    assert any("not compared" in n for n in cmp.notes)
    assert "values not compared" in headline(cmp)
    shaped = compare(b, with_tensor(b, "param/fc.weight", torch.randn(3, 4)), tolerance_for(["rng"]), [RNG_FIX])
    assert shaped.verdict == "diverged" and row(shaped, "param/fc.weight").verdict == "shape"


def test_requires_grad_change_only_allowed_under_semantics():
    b = probe()
    leaf = torch.ones(3, requires_grad=True)
    plain = torch.ones(3)
    before, after = with_tensor(b, "global/w", plain), with_tensor(b, "global/w", leaf)
    assert compare(before, after, BITWISE).verdict == "diverged"
    assert compare(before, after, tolerance_for(["semantics"])).verdict == "equivalent"


def test_steps_done_mismatch():
    b = probe()
    assert compare(b, dict(b, steps_done=5), BITWISE).first_divergence.name == "steps_done"
    cmp = compare(b, dict(b, steps_done=5), tolerance_for(["numerics"], "float16"))
    assert cmp.verdict == "equivalent" and any("optimizer steps" in n for n in cmp.notes)


def test_crash_in_one_version_is_a_divergence():
    b = probe()
    a = probe(2, status="error", traceback="Traceback ...\nRuntimeError: boom", tensors={})
    cmp = compare(b, a, BITWISE, [SAFE_FIX])
    assert cmp.verdict == "diverged"
    assert cmp.first_divergence.name == "crash" and cmp.first_divergence.step == 2
    assert "after" in cmp.first_divergence.detail
    assert any("boom" in n for n in cmp.notes) and "boom" in cmp.tracebacks["after"]
    assert any("bug" in e for e in cmp.explanations)
    assert {r.name for r in cmp.rows} == {"loss[0]", "loss[1]"}  # only what both recorded
    t = compare(b, dict(probe(1), status="timeout"), BITWISE)
    assert t.first_divergence.name == "timeout" and t.verdict == "diverged"
    # The original failing while the rewrite runs is also a divergence.
    assert compare(a, b, BITWISE).first_divergence.name == "crash"


def test_crash_in_both_versions_could_not_run():
    a = probe(status="error", traceback="Traceback A\nValueError: first")
    b = probe(status="error", traceback="Traceback B\nKeyError: second")
    cmp = compare(a, b, BITWISE)
    assert cmp.verdict == "could-not-run" and cmp.first_divergence is None
    text = "\n".join(cmp.notes)
    assert "ValueError: first" in text and "KeyError: second" in text
    assert headline(cmp) == "COULD NOT RUN"


def test_explanations():
    b = probe()
    a = with_tensor(b, "output/logits", b["tensors"]["output/logits"] + 1)
    safe = compare(b, a, BITWISE, [SAFE_FIX])
    assert any("Unexpected" in e and "bug" in e for e in safe.explanations)
    assert any("TOP101" in e for e in safe.explanations)
    unsafe = compare(b, a, tolerance_for(["rng"], replayed=True), [SAFE_FIX, RNG_FIX])
    assert any("TOP102" in e for e in unsafe.explanations)
    assert not any("Unexpected" in e for e in unsafe.explanations)
    assert any("nondeterministic" in e or "not deterministic" in e for e in compare(b, a, BITWISE).explanations)
    assert compare(b, b, BITWISE, [SAFE_FIX]).explanations == []


def test_ranks_agree():
    r0 = probe()
    r1 = probe()
    assert ranks_agree([r0, r1]) == []
    w = r1["tensors"]["param/fc.bias"].clone()
    w[0] = nextafter(w[0])
    r2 = with_tensor(r1, "param/fc.bias", w)
    r2 = with_tensor(r2, "output/logits", torch.zeros(2, 4))  # not a param: ignored
    assert ranks_agree([r0, r1, r2]) == ["param/fc.bias"]
    assert ranks_agree([r0, with_tensor(r1, "param/fc.weight", None)]) == ["param/fc.weight"]
    assert ranks_agree([]) == []


def test_kind_of():
    assert kind_of("param/a.b") == "param" and kind_of("rng/cpu") == "rng" and kind_of("weird") == "other"


# --------------------------------------------------------------------------- report


def render(cmp, applied=(), device="cpu", width=100):
    return render_text(
        cmp,
        before_label="train.py",
        after_label="train.py (fixed)",
        device=device,
        applied=list(applied),
        console_width=width,
    )


def test_text_report_equivalent_has_headline_and_rows():
    cmp = compare(probe(), probe(), BITWISE)
    text = render(cmp)
    assert text.splitlines()[0] == "EQUIVALENT (bitwise)"
    for r in cmp.rows:
        assert r.name in text
    assert "max abs err" in text and "\x1b[" not in text


def test_text_report_divergence_and_explanations():
    b = probe()
    a = with_loss(b, 3, 7.0)
    cmp = compare(b, a, BITWISE, [SAFE_FIX])
    text = render(cmp, [SAFE_FIX])
    assert text.splitlines()[0] == "DIVERGED at step 3, loss[3]"
    assert "Unexpected divergence" in text and "TOP101" in text


def test_text_report_summarises_long_lists():
    n = 60
    b = probe(n)
    b["tensors"] = {f"param/layer{i}.weight": torch.ones(2) * i for i in range(40)}
    b["tensors"]["rng/cpu"] = torch.zeros(3, dtype=torch.uint8)
    a = with_loss(b, 45, 1.0)
    a = with_tensor(a, "param/layer7.weight", torch.ones(2) * 99)
    cmp = compare(b, a, BITWISE)
    text = render(cmp, width=140)
    assert "loss[19]" in text and "loss[45]" in text and f"loss[{n - 1}]" in text
    assert "loss[21]" not in text.replace("loss[20]..loss[44]", "")  # folded into a summary row
    assert "summarised" in text and "param/layer7.weight" in text and "param/layer8.weight" not in text
    assert len(text.splitlines()) < 60


def test_text_report_crash_shows_tracebacks_and_escapes_markup():
    a = probe(status="error", traceback="Traceback A\nValueError: [bold]first[/bold]")
    b = probe(status="error", traceback="Traceback B\nKeyError: second")
    text = render(compare(a, b, BITWISE))
    assert text.startswith("COULD NOT RUN")
    assert "ValueError: [bold]first[/bold]" in text and "KeyError: second" in text
    one = render(compare(probe(), b, BITWISE, [SAFE_FIX]), [SAFE_FIX])
    assert "DIVERGED" in one and "crash" in one and "KeyError: second" in one


def test_text_report_cpu_numerics_note():
    cmp = compare(probe(), probe(), tolerance_for(["numerics"]), [AMP_FIX])
    assert "not CUDA numerics" in render(cmp, [AMP_FIX], device="cpu")
    assert "not CUDA numerics" not in render(cmp, [AMP_FIX], device="cuda")
    assert "not CUDA numerics" not in render(compare(probe(), probe(), BITWISE), [SAFE_FIX], device="cpu")
    assert headline(cmp).startswith("EQUIVALENT (within tolerance")


def test_json_round_trips():
    b = probe()
    a = with_tensor(b, "output/logits", b["tensors"]["output/logits"] * 0)  # relative error 1 / inf
    a = with_tensor(a, "output/z", torch.tensor([1.0]))
    b = with_tensor(b, "output/z", torch.tensor([0.0]))
    cmp = compare(b, a, BITWISE, [SAFE_FIX, RNG_FIX])
    data = to_json(cmp, before_label="x.py", after_label="y.py", device="cpu", applied=[SAFE_FIX, RNG_FIX])
    back = json.loads(json.dumps(data, allow_nan=False))
    assert back["verdict"] == "diverged" and back["first_divergence"]["name"] == "output/logits"
    assert len(back["rows"]) == len(cmp.rows) and back["applied"][1]["code"] == "TOP102"
    assert row(cmp, "output/z").max_rel == math.inf
    assert next(r for r in back["rows"] if r["name"] == "output/z")["max_rel"] == "inf"
    crash = to_json(compare(probe(), probe(status="timeout"), BITWISE))
    assert json.loads(json.dumps(crash))["first_divergence"]["name"] == "timeout"
    assert isinstance(Tolerance, type)
