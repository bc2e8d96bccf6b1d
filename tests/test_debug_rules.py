"""DBG rules (TOP811-TOP814) beyond their generated example tests: the gated forms switch the
debugging aid back on when TORCHOPT_DEBUG is set, and `torchopt validate` on dbg_left_on."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "dbg_left_on"


def _run_gated(src: str, flag: str | None) -> dict:
    old = os.environ.pop("TORCHOPT_DEBUG", None)
    if flag is not None:
        os.environ["TORCHOPT_DEBUG"] = flag
    ns: dict = {}
    try:
        exec(compile(src, "<gated>", "exec"), ns)
        return ns
    finally:
        os.environ.pop("TORCHOPT_DEBUG", None)
        if old is not None:
            os.environ["TORCHOPT_DEBUG"] = old
        torch.autograd.set_detect_anomaly(False)


def test_gated_anomaly_detection_comes_back_with_the_variable():
    src = ("import torch\n\ntorch.autograd.set_detect_anomaly(True)\non_a = torch.is_anomaly_enabled()\n"
           "with torch.autograd.detect_anomaly():\n    on_b = torch.is_anomaly_enabled()\n")
    after = fix_source(src, Settings(select=("TOP811",))).text
    assert after != src
    assert _run_gated(after, None)["on_a"] is False and _run_gated(after, None)["on_b"] is False
    ns = _run_gated(after, "1")
    assert ns["on_a"] is True and ns["on_b"] is True


def test_gated_profilers_run_both_ways():
    src = ("import torch\n\nw = torch.ones(2, requires_grad=True)\nopt = torch.optim.SGD([w], lr=0.1)\n"
           "with torch.profiler.profile():\n    for _ in range(2):\n        (w * 2).sum().backward()\n        opt.step()\n"
           "with torch.autograd.profiler.profile():\n    for _ in range(2):\n        (w * 2).sum().backward()\n"
           "        opt.step()\nresult = w.detach().clone()\n")
    after = fix_source(src, Settings(select=("TOP812",))).text
    assert "contextlib.nullcontext()" in after and "enabled=bool(" in after
    a, b = _run_gated(after, None), _run_gated(after, "1")
    assert torch.equal(a["result"], b["result"])


def test_fixture_exercises_every_debug_rule():
    text = (FIXTURE / "before.py").read_text()
    codes = {d.code for d in check_source(text, Settings(select=("TOP81", "TOP803"))).diagnostics}
    assert codes == {"TOP811", "TOP812", "TOP813", "TOP814", "TOP803"}


def test_safe_rewrite_validates_bitwise():
    res = CliRunner().invoke(app, ["validate", str(FIXTURE / "before.py"), str(FIXTURE / "after_safe.py"),
                                   "--steps", "8", "--device", "cpu", "--json"], catch_exceptions=False)
    out = json.loads(res.stdout)
    assert res.exit_code == 0, out
    assert out["headline"] == "EQUIVALENT (bitwise)"
