"""ZG rules (TOP831 `zero_grad(set_to_none=False)`, TOP832 hand-written zeroing loops): receivers,
what blocks the fix, the semantics the `semantics` tag warns about, and the fixture's validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from semantic import compare_programs
from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

ROOT = Path(__file__).resolve().parents[1]
ZG = Settings(select=("TOP83",))


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def diags(src: str):
    return check_source(src, ZG).diagnostics


def fix(src: str) -> str:
    return fix_source(src, ZG, unsafe=True).text


TRAINER = """\
import torch
{imp}

class Trainer:
    def __init__(self, model):
        self.model = model
        self.optimizer = {opt}

    def step(self, x):
        self.optimizer.zero_grad(set_to_none=False)
        self.model(x).sum().backward()
        self.optimizer.step()
"""


def test_attribute_receiver_resolved_in_its_class():
    src = TRAINER.format(imp="", opt="torch.optim.SGD(model.parameters(), lr=0.1)")
    assert "        self.optimizer.zero_grad()\n" in fix(src)
    [d] = diags(src)
    assert d.fix is not None and d.fix.safety == "unsafe" and d.fix.tags == ("semantics",)
    assert "assuming" not in d.fix.note


def test_non_torch_optimizer_is_reported_without_fix():
    src = TRAINER.format(imp="from apex.optimizers import FusedAdam", opt="FusedAdam(model.parameters())")
    [d] = diags(src)
    assert d.fix is None and "not a torch.optim optimizer" in d.message
    assert fix(src) == src


def test_guarded_grad_reads_and_autograd_grad_do_not_block():
    src = (
        "import torch\n\nmodel = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "opt.zero_grad(set_to_none=False)\nx = torch.ones(1, 2, requires_grad=True)\n"
        "g, = torch.autograd.grad(model(x).sum(), x)\nmodel(x).sum().backward()\n"
        "norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]\n"
        "for p in model.parameters():\n    if p.grad is not None:\n        print(p.grad.abs().max())\n"
    )
    [d] = diags(src)
    assert d.fix is not None


def test_unguarded_grad_read_blocks():
    src = (
        "import torch\n\nmodel = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "opt.zero_grad(set_to_none=False)\naccum = [p.grad.clone() for p in model.parameters()]\n"
    )
    [d] = diags(src)
    assert d.fix is None and "p.grad" in d.message


def test_loop_over_a_non_module_is_reported_without_fix():
    src = "import numpy as np\n\nthing = np.zeros(3)\nfor p in thing.parameters():\n    p.grad.zero_()\n"
    [d] = diags(src)
    assert d.code == "TOP832" and d.fix is None


def test_loop_with_a_comment_keeps_it():
    src = "def reset(model):\n    for p in model.parameters():\n        # in place\n        p.grad.zero_()\n"
    [d] = diags(src)
    assert d.fix is None and "comment" in d.message


def test_semantics_tag_is_needed_when_a_parameter_skips_a_step():
    """A parameter that gets no gradient in a step is skipped by the optimizer when its grad
    is None, but still moved by momentum with a zero grad: the rewrite changes the values."""
    before = (
        "import torch\n\ntorch.manual_seed(0)\na = torch.nn.Linear(2, 2)\nb = torch.nn.Linear(2, 2)\n"
        "opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1, momentum=0.9)\n"
        "for step in range(3):\n    opt.zero_grad(set_to_none=False)\n    x = torch.ones(1, 2)\n"
        "    y = a(b(x)) if step == 0 else a(x)\n"
        "    y.sum().backward()\n    opt.step()\n"
    )
    after = fix(before)
    assert "opt.zero_grad()\n" in after
    assert compare_programs(before, after), "b skips step 1: values must differ"
    # every parameter used in every step: bitwise the same
    always = before.replace("y = a(b(x)) if step == 0 else a(x)", "y = a(b(x))")
    assert compare_programs(always, fix(always)) == []


def test_fixture_second_run_changes_nothing():
    before = (ROOT / "fixtures" / "zg_accumulation" / "before.py").read_text(encoding="utf-8")
    first = fix_source(before, ZG, unsafe=True)
    assert sorted(d.code for d in first.applied) == ["TOP831", "TOP831", "TOP832"]
    assert "set_to_none=False" not in first.text and ".zero_()" not in first.text
    again = fix_source(first.text, ZG, unsafe=True)
    assert again.text == first.text and not again.applied


def test_fixture_validates_bitwise(tmp_path):
    """Every parameter gets a gradient on every step, nothing reads `.grad` unguarded: the ZG
    rewrite (class S) is bitwise the same, which is what the semantics tag is held to."""
    before = ROOT / "fixtures" / "zg_accumulation" / "before.py"
    after = tmp_path / "after.py"
    after.write_text(fix(before.read_text(encoding="utf-8")), encoding="utf-8")
    res = CliRunner().invoke(
        app,
        [
            "validate",
            str(before),
            str(after),
            "--select",
            "TOP83",
            "--unsafe-fixes",
            "--device",
            "cpu",
            "--steps",
            "4",
            "--json",
        ],
        catch_exceptions=False,
    )
    out = json.loads(res.stdout)
    assert res.exit_code == 0, out
    assert out["tolerance"]["tags"] == ["semantics"] and out["tolerance"]["bitwise"]
    assert sorted(f["code"] for f in out["applied"]) == ["TOP831", "TOP831", "TOP832"]
    assert sum(r["kind"] == "loss" for r in out["rows"]) == 8  # every micro-batch's backward
