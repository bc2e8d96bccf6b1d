"""The pieces of declared and inferred changes and of the noise floor, on hand-made inputs (quick):
`--expect` parsing, the class read from an edit, and the comparison against the reference run."""

from __future__ import annotations

import pytest
import torch

from torchopt.validate.compare import compare
from torchopt.validate.declared import infer, parse
from torchopt.validate.tolerance import Precision, tolerance_for


def test_expect_values_are_normalised_and_checked() -> None:
    assert parse(["numerics=bfloat16", "rng,tolerance", "numerics=bf16"]) == ["numerics=bf16", "rng", "tolerance"]
    assert parse(["numerics=TF32"]) == ["numerics=tf32"]
    for bad in ("speed", "rng=bf16", "numerics=int8"):
        with pytest.raises(ValueError, match="--expect"):
            parse([bad])


BEFORE = """\
import torch
opt = torch.optim.AdamW(params, lr=1e-3)
for x in data:
    loss = model(x).sum()
    loss.backward()
"""


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        (
            BEFORE.replace(
                "    loss = model", '    with torch.autocast("cuda", dtype=torch.bfloat16):\n        loss = model'
            ),
            ["numerics=bf16"],
        ),
        (
            BEFORE.replace("    loss = model", "    with torch.cuda.amp.autocast():\n        loss = model"),
            ["numerics=fp16"],
        ),
        (BEFORE.replace("    loss = model", "    with autocast(device):\n        loss = model"), ["numerics"]),
        ("torch.backends.cuda.matmul.allow_tf32 = True\n" + BEFORE, ["numerics=tf32"]),
        ('torch.set_float32_matmul_precision("high")\n' + BEFORE, ["numerics=tf32"]),
        (BEFORE.replace("lr=1e-3)", "lr=1e-3, fused=True)"), ["tolerance"]),
        (BEFORE.replace("model(x)", "model(x.to(memory_format=torch.channels_last))"), ["tolerance"]),
        (BEFORE.replace("lr=1e-3", "lr=2e-3"), []),
        ('torch.set_float32_matmul_precision("highest")\n' + BEFORE, []),
    ],
)
def test_the_class_of_a_recognisable_edit_is_inferred(after: str, expected: list[str]) -> None:
    assert [i.declared for i in infer(BEFORE, after)] == expected


def test_a_region_the_original_already_had_is_not_a_change() -> None:
    amp = BEFORE.replace(
        "    loss = model", '    with torch.autocast("cpu", dtype=torch.bfloat16):\n        loss = model'
    )
    assert infer(amp, amp.replace("lr=1e-3", "lr=2e-3")) == []


def _run(losses: list[float], weight: list[float], dtype: torch.dtype = torch.float32) -> dict:
    return {
        "losses": [torch.tensor(v) for v in losses],
        "loss_steps": list(range(len(losses))),
        "loss_dtypes": ["torch.float32"] * len(losses),
        "steps_done": len(losses),
        "tensors": {"param/model.w": torch.tensor(weight, dtype=dtype)},
    }


NUMERICS = tolerance_for(["numerics"], "bfloat16", reference=Precision(autocast="bfloat16"))


def test_the_rewrite_may_be_k_times_as_far_as_the_reference_run() -> None:
    before = _run([2.0, 1.5, 1.2], [1.0, -1.0])
    reference = _run([2.001, 1.49, 1.21], [1.01, -1.0])
    near = _run([2.002, 1.47, 1.22], [1.03, -1.0])  # 2-3x the reference's distance
    far = _run([2.002, 1.45, 1.2], [1.03, -1.0])  # loss[1] 5x the largest reference distance so far
    assert compare(before, near, NUMERICS, reference=reference).verdict == "equivalent"
    cmp = compare(before, far, NUMERICS, reference=reference)
    assert (cmp.verdict, cmp.first_divergence and cmp.first_divergence.name) == ("diverged", "loss[1]")
    # The flat band (5 % of the loss scale) would have accepted it; it is only reported now.
    assert any(n.startswith("flat band (reported") for n in cmp.notes)


def test_parameters_are_held_to_the_floor_and_a_dtype_the_reference_keeps() -> None:
    before = _run([2.0], [1.0, -1.0])
    reference = _run([2.0], [1.01, -1.0])
    assert compare(before, _run([2.0], [1.05, -1.0]), NUMERICS, reference=reference).verdict == "diverged"
    cmp = compare(before, _run([2.0], [1.0, -1.0], torch.bfloat16), NUMERICS, reference=reference)
    assert cmp.rows[-1].verdict == "dtype" and "computes it in torch.float32" in cmp.rows[-1].detail


def test_a_precision_change_that_changes_nothing_is_caught() -> None:
    before = _run([2.0, 1.5], [1.0, -1.0])
    reference = _run([2.001, 1.49], [1.01, -1.0])
    cmp = compare(before, _run([2.0, 1.5], [1.0, -1.0]), NUMERICS, reference=reference)
    assert cmp.first_divergence is not None and cmp.first_divergence.name == "precision"
    # ... unless the reference changes nothing either (TF32 on a CPU)
    assert compare(before, _run([2.0, 1.5], [1.0, -1.0]), NUMERICS, reference=before).verdict == "equivalent"


def test_without_a_reference_run_the_flat_band_decides() -> None:
    before = _run([2.0, 1.5], [1.0, -1.0])
    failed = {"status": "error", "traceback": "RuntimeError: boom"}
    cmp = compare(before, _run([2.0, 1.45], [1.2, -1.0]), NUMERICS, reference=failed)
    assert cmp.verdict == "equivalent" and any("flat bands instead" in n for n in cmp.notes)


def test_a_loss_dtype_only_the_rewrite_has_diverges() -> None:
    before = _run([2.0, 1.5], [1.0, -1.0])
    reference = _run([2.001, 1.49], [1.01, -1.0])
    cast = {**_run([2.0, 1.5], [1.01, -1.0]), "loss_dtypes": ["torch.bfloat16"] * 2}
    cmp = compare(before, cast, NUMERICS, reference=reference)
    assert cmp.rows[0].verdict == "dtype" and "computed in torch.bfloat16" in cmp.rows[0].detail
    # A loss the reference computes in bfloat16 but the rewrite keeps in float32 is no divergence.
    low = {**reference, "loss_dtypes": ["torch.bfloat16"] * 2}
    assert compare(before, _run([2.0, 1.5], [1.01, -1.0]), NUMERICS, reference=low).verdict == "equivalent"


def test_the_reference_run_follows_the_declared_kinds() -> None:
    from torchopt.validate.declared import split
    from torchopt.validate.tolerance import precision_for

    def precision(*declared: str, codes: tuple[str, ...] = ()) -> Precision:
        return precision_for(codes, "bfloat16", split(parse(declared))[1])

    assert precision("numerics=fp16") == Precision(autocast="float16")
    assert precision("numerics=tf32") == Precision(tf32=True)
    assert precision("numerics", "numerics=tf32") == Precision(autocast="bfloat16", tf32=True)
    assert precision(codes=("TOP202", "TOP502")) == Precision(autocast="bfloat16", tf32=True)
    assert precision(codes=("TOP502",)) == Precision(tf32=True)


def test_no_reference_run_when_values_are_not_compared() -> None:
    assert tolerance_for(["numerics", "rng"]).reference is None
    assert tolerance_for(["numerics", "rng"], replayed=True).reference == Precision(autocast="bfloat16")
