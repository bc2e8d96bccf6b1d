"""TOP202 on the single-GPU training steps real scripts are written in and that it used to refuse:
a binary cross-entropy loss (unsafe to autocast on CUDA), a GAN with two optimizers and that loss,
parameters updated by hand, an RNN's tuple hidden state, and accelerate's own mixed precision."""

from __future__ import annotations

import ast
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path
from cpu_support import skip_unless_bfloat16_lstm

import pytest
from typer.testing import CliRunner

import torchopt.cli
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TOP2 = Settings(select=("TOP2",))
NEW_FIXTURES = ["amp_bce_loop", "amp_bce_function", "amp_bce_gan", "amp_manual_update"]


def _before(name: str) -> str:
    return (FIXTURES / name / "before.py").read_text()


def _amp(src: str) -> str:
    return fix_source(src, TOP2, unsafe=True).text


def _top202(src: str) -> list[str]:
    return [d.message for d in check_source(src, TOP2, "t.py").diagnostics if d.code == "TOP202"]


def _calls_under_autocast(src: str) -> list[str]:
    """The source of every call made inside a `with torch.autocast(...)` block."""
    inside = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.With) and any("autocast" in ast.unparse(i.context_expr) for i in node.items):
            inside += [ast.unparse(c) for s in node.body for c in ast.walk(s) if isinstance(c, ast.Call)]
    return inside


def _force_float16(src: str) -> str:
    """The rewrite with float16 chosen on every device, so the scaler runs on the CPU too."""
    forced = re.sub(  # on one line or, past the line length, in parentheses over three
        r"(\S*amp_dtype) = \(?\s*torch\.float16 if [^\n]* else torch\.bfloat16(\s*\))?", r"\1 = torch.float16", src
    )
    assert forced != src
    return forced


def _run(src: str, tmp_path: Path) -> None:
    path = tmp_path / "prog.py"
    path.write_text(src)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# ----------------------------------------------------------------------------- binary cross-entropy


def test_bce_loss_in_a_module_loop_runs_after_the_autocast_block():
    after = _amp(_before("amp_bce_loop"))
    assert (
        "with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):\n        probs = model(inputs[step])\n"
        "    probs = probs.float()\n    loss = criterion(probs, targets[step])\n" in after
    )
    assert not any("criterion" in c for c in _calls_under_autocast(after))
    assert "scaler.scale(loss).backward()" in after and after.count("scaler.update()") == 1
    [message] = _top202(_before("amp_bce_loop"))
    assert "binary cross-entropy is unsafe to autocast" in message and "float32" in message


def test_bce_inside_the_files_loss_function_keeps_that_call_outside():
    after = _amp(_before("amp_bce_function"))
    assert not any("loss_function" in c for c in _calls_under_autocast(after))
    assert any(c == "model(x)" for c in _calls_under_autocast(after))
    for name in ("recon", "mu", "logvar"):  # the loss reads float32 tensors
        assert f"        {name} = {name}.float()\n" in after
    assert after.index("logvar = logvar.float()") < after.index("loss = loss_function(recon, x, mu, logvar)")


def test_gan_with_bce_shares_one_scaler_and_updates_once_after_both_steps():
    after = _amp(_before("amp_bce_gan"))
    assert after.count("torch.amp.GradScaler(") == 1
    assert after.count("with torch.autocast(") == 3
    assert not any("criterion" in c for c in _calls_under_autocast(after))
    for loss in ("errD_real", "errD_fake", "errG"):
        assert f"scaler.scale({loss}).backward()" in after
    assert after.count("scaler.update()") == 1
    assert (
        after.index("scaler.step(optimizerD)")
        < after.index("scaler.step(optimizerG)")
        < after.index("scaler.update()")
        < after.index("history.append(")
    )


@pytest.mark.slow  # runs the rewritten program in float16 on the CPU, seconds each: with the end-to-end runs
def test_gan_float16_scaler_path_runs_on_the_cpu(tmp_path):
    _run(_force_float16(_amp(_before("amp_bce_gan"))), tmp_path)


def test_model_and_bce_in_one_statement_is_refused_with_the_true_reason():
    src = _before("amp_bce_loop").replace(
        "    probs = model(inputs[step])\n    loss = criterion(probs, targets[step])\n",
        "    loss = criterion(model(inputs[step]), targets[step])\n",
    )
    assert _amp(src) == src
    [message] = _top202(src)
    assert "not rewritten" in message and "same statement" in message


# ----------------------------------------------------------------------------- updates by hand, RNN state


def test_hand_written_update_gets_bfloat16_autocast_without_a_scaler():
    after = _amp(_before("amp_manual_update"))
    assert "    amp_dtype = torch.bfloat16\n    for i in range(" in after
    assert "GradScaler" not in after and "scaler" not in after
    assert "p.data.add_(p.grad, alpha=-lr)" in after and "loss.backward()" in after
    [message] = _top202(_before("amp_manual_update"))
    assert "bfloat16" in message and "updated by hand" in message and "not rewritten" not in message


def test_tuple_hidden_state_fed_back_to_the_model_is_not_upcast():
    after = _amp(_before("amp_manual_update"))
    assert "hidden.float()" not in after
    # With an optimizer (the float16 path) the same state stays as it is too.
    src = (
        _before("amp_manual_update")
        .replace(
            "criterion = nn.NLLLoss()\n",
            "criterion = nn.NLLLoss()\noptimizer = torch.optim.SGD(model.parameters(), lr=lr)\n",
        )
        .replace(
            "        for p in model.parameters():\n            p.data.add_(p.grad, alpha=-lr)\n",
            "        optimizer.step()\n",
        )
    )
    after = _amp(src)
    assert "scaler.step(optimizer)" in after and "hidden.float()" not in after


def test_optional_optimizer_with_a_hand_update_branch_and_clipping():
    """The word-language-model layout: `optimizer.step()` under `if args.use_optimizer:`, the update by
    hand in its `else`, gradients clipped before both (it was refused: unscale_ on iterations that do not
    step); no scaler can serve the hand-written branch, so bfloat16."""
    src = (
        _before("amp_manual_update")
        .replace(
            "criterion = nn.NLLLoss()\n",
            "criterion = nn.NLLLoss()\nuse_optimizer = False\noptimizer = torch.optim.SGD(model.parameters(), lr=lr)\n",
        )
        .replace(
            "        for p in model.parameters():\n            p.data.add_(p.grad, alpha=-lr)\n",
            "        if use_optimizer:\n            optimizer.step()\n        else:\n"
            "            for p in model.parameters():\n                p.data.add_(p.grad, alpha=-lr)\n",
        )
    )
    after = _amp(src)
    assert "amp_dtype = torch.bfloat16" in after and "scaler" not in after
    assert "            optimizer.step()\n" in after


def test_hand_update_in_a_function_given_its_model_and_device(tmp_path):
    """The step's function receives model, optimizer and device as parameters: the bfloat16 set-up
    goes at its top, from the device it moves its batches to, and the program runs."""
    src = (
        "import torch\nimport torch.nn as nn\n\n\n"
        "def train(net, opt, batches, dev, use_opt):\n    for x, y in batches:\n"
        "        x, y = x.to(dev), y.to(dev)\n        net.zero_grad()\n"
        "        loss = nn.functional.mse_loss(net(x), y)\n        loss.backward()\n"
        "        if use_opt:\n            opt.step()\n        else:\n"
        "            for p in net.parameters():\n                p.data.add_(p.grad, alpha=-0.1)\n\n\n"
        "def main():\n    device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "    model = nn.Linear(3, 1).to(device)\n    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    train(model, optimizer, [(torch.randn(2, 3), torch.randn(2, 1))], device, False)\n\n\nmain()\n"
    )
    after = _amp(src)
    assert after.startswith(
        src.split("    for x, y")[0] + "    amp_device_type = torch.device(dev).type\n"
        "    amp_dtype = torch.bfloat16\n    for x, y in batches:\n"
    )
    assert "            loss = nn.functional.mse_loss(net(x), y)\n        loss.backward()\n" in after
    assert "scaler" not in after
    _run(after, tmp_path)


# ----------------------------------------------------------------------------- accelerate


def test_accelerator_backward_is_not_flagged():
    src = (
        "import torch\nimport torch.nn as nn\nfrom accelerate import Accelerator\n\n"
        "accelerator = Accelerator(mixed_precision='fp16')\nmodel = nn.Linear(4, 2)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model, optimizer = accelerator.prepare(model, optimizer)\n"
        "def train(loader):\n    for x, y in loader:\n        optimizer.zero_grad()\n"
        "        loss = nn.functional.mse_loss(model(x), y)\n        accelerator.backward(loss)\n"
        "        optimizer.step()\n"
    )
    assert _top202(src) == []
    assert _amp(src) == src


# ----------------------------------------------------------------------------- command line on a tree


def _tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_cli_writes_the_amp_rewrite_only_into_the_named_folder(tmp_path):
    project = tmp_path / "project"
    (project / "gan").mkdir(parents=True)
    (project / "other").mkdir()
    (tmp_path / "outside.py").write_text(_before("amp_bce_gan"))
    (project / "gan" / "train.py").write_text(_before("amp_bce_gan"))
    (project / "gan" / "notes.txt").write_text("not python\n")
    (project / "other" / "train.py").write_text(_before("amp_bce_loop"))
    before = _tree_hashes(tmp_path)
    r = CliRunner().invoke(
        torchopt.cli.app,
        ["rewrite", str(project / "gan"), "--unsafe-fixes", "--no-cache", "--select", "TOP202", "-j", "1"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    assert "TOP202" in r.stderr and "binary cross-entropy" in r.stderr
    after = _tree_hashes(tmp_path)
    assert {k for k in before if before[k] != after.get(k)} == {"project/gan/train.py"}
    assert set(after) == set(before)  # nothing created, nothing deleted
    assert (project / "gan" / "train.py").read_text() == fix_source(
        _before("amp_bce_gan"), Settings(select=("TOP202",)), unsafe=True
    ).text
    # Without --unsafe-fixes nothing is written.
    r = CliRunner().invoke(
        torchopt.cli.app,
        ["rewrite", str(project / "other"), "--no-cache", "--select", "TOP202", "-j", "1"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    assert _tree_hashes(tmp_path) == after


# ----------------------------------------------------------------------------- validation on the CPU


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW_FIXTURES)
def test_unsafe_rewrite_validates_on_the_cpu(name, tmp_path):
    src = tmp_path / "before.py"
    src.write_bytes((FIXTURES / name / "before.py").read_bytes())
    skip_unless_bfloat16_lstm(src.read_text(encoding="utf-8"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchopt",
            "validate",
            "--unsafe-fixes",
            "--device",
            "cpu",
            "--select",
            "TOP202",
            str(src),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "TOP202" in r.stdout + r.stderr
    assert src.read_bytes() == (FIXTURES / name / "before.py").read_bytes()
