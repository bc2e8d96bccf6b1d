"""INF rules (TOP801-TOP803) beyond their generated example tests: what the `semantics` tag of
TOP801/TOP802 means (values bitwise, `requires_grad` differs) and `torchopt validate` on the
inf_eval_script fixture."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from semantic import compare_programs
from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "inf_eval_script"


def test_no_grad_changes_only_requires_grad():
    src = (
        "import torch\nfrom torch import nn\n\ntorch.manual_seed(0)\nmodel = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))\n"
        "test_batches = [torch.randn(3, 4) for _ in range(2)]\nouts = []\nhits = 0\n"
        "for x in test_batches:\n    out = model(x)\n    outs.append(out)\n    hits += (out > 0).sum().item()\n"
    )
    res = fix_source(src, Settings(select=("TOP801",)), unsafe=True)
    assert [d.fix.tags for d in res.applied] == [("semantics",)]  # `outs` collects model outputs
    diffs = compare_programs(src, res.text)
    assert diffs and all("requires_grad" in d for d in diffs), diffs
    # When nothing that leaves the loop can require grad (a module-level `out` would): a safe fix.
    src2 = src.replace("    out = model(x)\n    outs.append(out)\n    hits += (out > 0)", "    hits += (model(x) > 0)")
    assert src2 != src
    res2 = fix_source(src2, Settings(select=("TOP801",)), unsafe=False)
    assert [d.fix.safety for d in res2.applied] == ["safe"]
    assert compare_programs(src2, res2.text) == []


def test_inference_mode_not_offered_where_it_would_raise():
    """Not offered where inference mode would raise: an inference tensor saved for backward, or
    updated in place outside inference mode."""
    base = "import torch\n\nnet = torch.nn.Linear(2, 2)\nx = torch.ones(1, 2)\n"
    cases = [
        base + "with torch.no_grad():\n    h = net(x)\nh.mul_(2)\n",
        base + "with torch.no_grad():\n    h = net(x)\ny = net(h)\n",
        base + "opt = torch.optim.SGD(net.parameters(), lr=0.1)\nwith torch.no_grad():\n    h = net(x)\n",
    ]
    for src in cases:
        assert not [d for d in check_source(src, Settings(select=("TOP802",))).diagnostics], src


def test_fixture_exercises_every_inference_rule():
    text = (FIXTURE / "before.py").read_text()
    diags = check_source(text, Settings(select=("TOP80",))).diagnostics
    assert {d.code for d in diags} == {"TOP801", "TOP802", "TOP803"}
    eval_mode = [d for d in diags if d.code == "TOP803"]
    assert len(eval_mode) == 1 and "ema_model" in eval_mode[0].message


def test_unsafe_rewrite_validates_as_equivalent():
    """TOP801 (safe and semantics) and TOP802 (semantics): `requires_grad` of the collected logits
    may differ; TOP101's `linspace(...)` built on the device (tolerance: a device's float kernel may
    round otherwise) makes the comparison one within a tolerance, not bitwise."""
    res = CliRunner().invoke(
        app,
        [
            "validate",
            str(FIXTURE / "before.py"),
            str(FIXTURE / "after_unsafe.py"),
            "--steps",
            "4",
            "--device",
            "cpu",
            "--json",
        ],
        catch_exceptions=False,
    )
    out = json.loads(res.stdout)
    assert res.exit_code == 0, out
    tol = out["tolerance"]
    assert {"semantics", "tolerance"} <= set(tol["tags"]) and tol["compare_values"] is True, tol
    assert tol["bitwise"] is False, tol
    assert out["verdict"] == "equivalent"


NESTED_TTA = """\
import torch


def infer(model, images, level=0):
    def infer_basic(inputs, net):
        return net(inputs).clone()

    def infer_mirror(inputs, net):
        return 0.5 * net(inputs) + 0.5 * net(inputs.flip(-1))

    def infer_mirror_translate(inputs, net):
        return infer_mirror(inputs, net) + infer_mirror(inputs.roll(1, -1), net)

    {switch}
    infer_fn = [infer_basic, infer_mirror, infer_mirror_translate][level]
    with torch.no_grad():
        return torch.cat([infer_fn(inputs, model) for inputs in images.split(2000)])
"""


def test_nested_helpers_of_an_evaluation_under_no_grad_and_eval_are_not_reported():
    """A nested helper called (through a pick of helpers) only inside its caller's `no_grad`, after
    the caller's `model.eval()`, runs with autograd off and in eval mode: neither TOP801 nor TOP803."""
    settings = Settings(select=("TOP801", "TOP803"))
    codes = [d.code for d in check_source(NESTED_TTA.format(switch="model.eval()"), settings).diagnostics]
    assert codes == []
    # Without the caller's eval(), TOP803 still reports both helpers; TOP801 still does not.
    codes = [d.code for d in check_source(NESTED_TTA.format(switch="pass"), settings).diagnostics]
    assert codes == ["TOP803", "TOP803"]
