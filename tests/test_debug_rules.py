"""DBG rules (TOP811-TOP814) beyond their generated example tests: the debugging aids are removed
in plain PyTorch (no switch, no environment variable, no added import), what is computed stays the
same, a later use of the profile is refused, and `torchopt validate` on dbg_left_on."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "dbg_left_on"

TRAIN = "w = torch.ones(3, requires_grad=True)\nopt = torch.optim.SGD([w], lr=0.1)\n"


def _run(src: str) -> dict:
    ns: dict = {}
    try:
        exec(compile(src, "<rewritten>", "exec"), ns)
        return ns
    finally:
        torch.autograd.set_detect_anomaly(False)


def _fix_once_and_again(src: str, code: str) -> str:
    after = fix_source(src, Settings(select=(code,))).text
    assert fix_source(after, Settings(select=(code,))).text == after, "a second run changed the output"
    return after


def _tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_anomaly_switch_is_removed_and_values_stay():
    src = (
        "import torch\n\n" + TRAIN + "torch.autograd.set_detect_anomaly(True)  # NaN hunt\n"
        "for _ in range(2):\n    opt.zero_grad()\n    (w * w).sum().backward()\n    opt.step()\n"
        "on = torch.is_anomaly_enabled()\n"
    )
    after = _fix_once_and_again(src, "TOP811")
    assert after == src.replace("torch.autograd.set_detect_anomaly(True)  # NaN hunt\n", "")
    before_ns, after_ns = _run(src), _run(after)
    assert before_ns["on"] is True and after_ns["on"] is False
    assert torch.equal(before_ns["w"], after_ns["w"])


def test_detect_anomaly_with_is_unwrapped_keeping_comments():
    src = (
        "import torch\n\n" + TRAIN + "\n\ndef step():\n    # one step\n"
        "    with torch.autograd.detect_anomaly():  # NaN hunt\n        # forward and backward\n"
        "        (w * w).sum().backward()\n        opt.step()\n    return torch.is_anomaly_enabled()\n\n\n"
        "on = step()\n"
    )
    after = _fix_once_and_again(src, "TOP811")
    assert after == (
        "import torch\n\n" + TRAIN + "\n\ndef step():\n    # one step\n    # NaN hunt\n"
        "    # forward and backward\n    (w * w).sum().backward()\n    opt.step()\n"
        "    return torch.is_anomaly_enabled()\n\n\non = step()\n"
    )
    assert "import os" not in after and "environ" not in after
    before_ns, after_ns = _run(src), _run(after)
    assert torch.equal(before_ns["w"], after_ns["w"]) and after_ns["on"] is False


def test_anomaly_switch_whose_value_is_used_is_refused():
    src = "import torch\n\nprevious = torch.autograd.set_detect_anomaly(True)\n"
    result = check_source(src, Settings(select=("TOP811",)))
    [diag] = result.diagnostics
    assert diag.fix is None and "its value is used" in diag.message
    assert fix_source(src, Settings(select=("TOP811",))).text == src


def test_unread_profiler_is_unwrapped_and_user_import_os_kept():
    src = (
        "import os\nimport torch\n\n" + TRAIN + "with torch.profiler.profile() as prof:\n"
        "    for _ in range(2):\n        (w * w).sum().backward()\n        opt.step()\n"
    )
    after = _fix_once_and_again(src, "TOP812")
    assert after == (
        "import os\nimport torch\n\n" + TRAIN + "for _ in range(2):\n    (w * w).sum().backward()\n    opt.step()\n"
    )
    assert torch.equal(_run(src)["w"], _run(after)["w"])


def test_profiler_read_later_is_refused_and_the_tree_is_untouched(tmp_path):
    """`enabled=False` is no way out here: a disabled profiler binds `prof` to None."""
    src = (
        "import torch\n\n" + TRAIN + "with torch.autograd.profiler.profile() as prof:\n"
        "    for _ in range(2):\n        (w * w).sum().backward()\n        opt.step()\n"
        "table = prof.key_averages().table()\n"
    )
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(src, encoding="utf-8")
    (tmp_path / "outside.py").write_text(src, encoding="utf-8")
    before = _tree_hashes(tmp_path)
    res = CliRunner().invoke(app, ["rewrite", str(project)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert _tree_hashes(tmp_path) == before
    checked = CliRunner().invoke(app, ["check", str(project)], catch_exceptions=False)
    assert checked.exit_code == 1
    assert "train.py:5:6: TOP812" in checked.output and "its `as` name is read" in checked.output
    assert _tree_hashes(tmp_path) == before
    assert "table" in _run(src)


def test_fixture_exercises_every_debug_rule():
    text = (FIXTURE / "before.py").read_text()
    codes = {d.code for d in check_source(text, Settings(select=("TOP81", "TOP803"))).diagnostics}
    assert codes == {"TOP811", "TOP812", "TOP813", "TOP814", "TOP803"}


def test_safe_rewrite_validates_bitwise():
    res = CliRunner().invoke(
        app,
        [
            "validate",
            str(FIXTURE / "before.py"),
            str(FIXTURE / "after_safe.py"),
            "--steps",
            "8",
            "--device",
            "cpu",
            "--json",
        ],
        catch_exceptions=False,
    )
    out = json.loads(res.stdout)
    assert res.exit_code == 0, out
    assert out["headline"] == "EQUIVALENT (bitwise)"
