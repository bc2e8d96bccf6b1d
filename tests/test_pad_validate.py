"""`torchopt validate` on the padding fixtures, end to end (subprocesses; ~30 s each).

The validator sees that a padding fix (TOP301/TOP302) was applied, runs the original first, and
starts the rewrite from its weights copied into the leading slices of the padded parameters
(torchopt/validate/transplant.py); padded tensors are compared on their leading slice.
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

import torchopt.cli

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _validate(name: str, code: str, steps: int) -> dict:
    r = CliRunner().invoke(
        torchopt.cli.app,
        [
            "validate",
            str(FIXTURES / name / "before.py"),
            "--select",
            code,
            "--unsafe-fixes",
            "--device",
            "cpu",
            "--steps",
            str(steps),
            "--json",
            "--timeout",
            "300",
        ],
        catch_exceptions=False,
    )
    out = json.loads(r.output)
    out["exit_code"] = r.exit_code
    return out


def _rows(out: dict) -> dict:
    return {r["name"]: r for r in out["rows"]}


def test_padded_gpt_passes_validate_within_fp32_rounding_and_bitwise_on_cpu():
    out = _validate("pad_gpt_vocab", "TOP301", 4)
    assert out["exit_code"] == 0 and out["verdict"] == "equivalent", json.dumps(out, indent=1)[:3000]
    rows = _rows(out)
    losses = [r for n, r in rows.items() if n.startswith("loss[")]
    assert len(losses) == 4
    # held to fp32 rounding (padded matmuls reassociate: not bitwise in general), and in fact bitwise
    # here: the losses, the sliced logits and loss on the probe batch, the (sliced) parameters
    for name in [
        "output/model[0]",
        "output/model[1]",
        "param/model.tok_emb.weight",
        "param/model.head.weight",
        *[n for n in rows if n.startswith("loss[")],
    ]:
        assert rows[name]["tolerance"].startswith("rtol=1e-05") or rows[name]["tolerance"].startswith("rtol=1.3e-06")
        assert rows[name]["max_abs"] == 0, rows[name]
    assert "padded (101, 32) -> (104, 32)" in rows["param/model.tok_emb.weight"]["detail"]
    assert any("weight transplant" in n for n in out["notes"])
    assert not any("transplant stopped" in n for n in out["notes"]), out["notes"]


def test_padded_mlp_passes_validate_within_fp32_tolerance():
    out = _validate("pad_mlp_hidden", "TOP302", 3)
    assert out["exit_code"] == 0 and out["verdict"] == "equivalent", json.dumps(out, indent=1)[:3000]
    rows = _rows(out)
    # not bitwise: the second GEMM sums over extra zero terms (see the rule page); fp32 bounds
    assert rows["output/classifier"]["tolerance"].startswith("rtol=1.3e-06")
    assert "padded (50, 100) -> (56, 104)" in rows["param/classifier.2.weight"]["detail"]
    assert not any("transplant stopped" in n for n in out["notes"]), out["notes"]
