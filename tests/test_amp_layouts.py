"""TOP202 on the layouts training scripts are written in (fixtures/layout_*): the scaler is created
where the optimizer is and reaches the step the way the optimizer does; the inserted code has no
environment switch or tool-named code; the refusals say the true reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
LAYOUTS = sorted(p.name for p in FIXTURES.glob("layout_*") if (p / "before.py").is_file())
TOP2 = Settings(select=("TOP2",))


def _amp(name: str) -> str:
    return fix_source((FIXTURES / name / "before.py").read_text(), TOP2, unsafe=True).text


def _messages(src: str) -> list[str]:
    return [d.message for d in check_source(src, TOP2, "t.py").diagnostics if d.code == "TOP202"]


def test_every_layout_has_a_fixture():
    assert [n.split("_")[1] for n in LAYOUTS] == list("abcdef")


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_gets_autocast_and_a_scaler(name):
    after = _amp(name)
    assert after.count("with torch.autocast(") == 1
    assert after.count("torch.amp.GradScaler(") == 1
    assert re.search(r"scaler\.scale\(loss\)\.backward\(\)", after)
    assert "scaler.update()" in after
    for word in ("TORCHOPT", "torchopt", 'os.environ.get("TORCHOPT', "use_amp", "enabled=use"):
        assert word not in after


def test_b_scaler_created_in_main_and_passed_like_the_optimizer():
    after = _amp("layout_b_train_function")
    assert "def train(args, model, device, train_loader, optimizer, epoch, scaler):" in after
    assert "train(args, model, device, train_loader, optimizer, epoch, scaler)\n" in after
    main = after.split("def main():")[1]
    assert (
        main.index("optimizer = torch.optim.Adadelta")
        < main.index("scaler = torch.amp.GradScaler(")
        < main.index("for epoch in range")
    )
    train = after.split("def train(")[1].split("def test(")[0]
    assert "amp_device_type = torch.device(device).type" in train  # chosen from the step's own device


def test_c_scaler_is_an_attribute_set_next_to_the_optimizer():
    after = _amp("layout_c_trainer_class")
    init = after.split("def __init__")[1].split("def _run_batch")[0]
    assert init.index("self.optimizer = optimizer") < init.index("self.scaler = torch.amp.GradScaler(")
    batch = after.split("def _run_batch")[1].split("def _run_epoch")[0]
    assert "with torch.autocast(device_type=self.amp_device_type, dtype=self.amp_dtype):" in batch
    assert "self.scaler.step(self.optimizer)" in batch


def test_e_clipping_unscales_first():
    after = _amp("layout_e_devices")
    assert after.index("scaler.unscale_(optimizer)") < after.index("nn.utils.clip_grad_norm_")


@pytest.mark.slow  # runs the rewritten program in float16 on the CPU, seconds each: with the end-to-end runs
@pytest.mark.parametrize("name", ["layout_b_train_function", "layout_c_trainer_class", "layout_e_devices"])
def test_float16_scaler_path_runs_on_the_cpu(name, tmp_path):
    """With the dtype choice forced to float16 the scaler is enabled on the CPU: the scaled backward,
    unscale_, step and update run in the places the rewrite put them."""
    after = _amp(name)
    forced = re.sub(  # on one line or, past the line length, in parentheses over three
        r"(\S*amp_dtype) = \(?\s*torch\.float16 if [^\n]* else torch\.bfloat16(\s*\))?", r"\1 = torch.float16", after
    )
    forced = forced.replace('enabled=amp_device_type == "cuda"', "enabled=True")
    assert forced != after
    path = tmp_path / "prog.py"
    path.write_text(forced)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


_REMOTE = """import torch
import torch.nn as nn


def train(net, opt, batches, dev{extra}):
    for x, y in batches:
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Linear(3, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, optimizer, [(torch.randn(2, 3), torch.randn(2, 1))], device)
"""


def test_parameters_with_other_names_than_the_callers():
    after = fix_source(_REMOTE.format(extra=""), TOP2, "t.py", unsafe=True).text
    assert "def train(net, opt, batches, dev, scaler):" in after
    assert "train(model, optimizer, [(torch.randn(2, 3), torch.randn(2, 1))], device, scaler)" in after
    assert "scaler.step(opt)" in after and "amp_device_type = torch.device(dev).type" in after


def test_step_function_that_never_names_a_device_is_refused_with_the_true_reason():
    src = _REMOTE.format(extra="").replace("        x, y = x.to(dev), y.to(dev)\n", "")
    [msg] = _messages(src)
    assert msg.endswith("cannot tell which device `train` runs on")


def test_default_parameters_refused_with_the_true_reason():
    src = _REMOTE.format(extra=", log_every=10")
    assert fix_source(src, TOP2, "t.py", unsafe=True).text == src
    [msg] = _messages(src)
    assert "`train` has default or variadic parameters" in msg
    assert "the set-up must follow" not in msg


def test_conditional_step_without_accumulation_says_so():
    src = (
        "import torch\nimport torch.nn as nn\n\ndevice = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "model = nn.Linear(4, 2).to(device)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for x, y in batches:\n    loss = nn.functional.mse_loss(model(x), y)\n    loss.backward()\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    if loss_is_finite:\n"
        "        optimizer.step()\n"
    )
    [msg] = _messages(src)
    assert "runs only `if loss_is_finite:`" in msg and "micro-batches" not in msg
