"""TOP202 on a call of a step in another module of the project asks the project index what that
function runs: one that only sets each param group's learning rate is no step, and a step that
already runs under the program's own autocast and GradScaler (set up by a project helper) is no
float32 step."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

import torchopt.cli

MAIN = """\
import torch
import torch.nn as nn

from engine import train_one_epoch
from utils import set_lr


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Linear(16, 4).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler()
    for epoch in range(10):
        set_lr(optimizer, epoch, 0.1)
        train_one_epoch(model, loader, optimizer, scaler, device)


if __name__ == "__main__":
    main()
"""

UTILS = """\
def set_lr(optimizer, epoch, base):
    lr = base * 0.9**epoch
    for group in optimizer.param_groups:
        group["lr"] = lr
"""

ENGINE_AMP = """\
import torch.nn.functional as F

from precision import get_autocast


def backward(loss, scaler):
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()


def train_one_epoch(model, loader, optimizer, scaler, device):
    autocast = get_autocast("amp", device.type)
    for x, y in loader:
        with autocast():
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        backward(loss, scaler)
        scaler.step(optimizer)
        scaler.update()
"""

PRECISION = """\
from contextlib import suppress
from functools import partial

import torch


def get_autocast(precision, device_type):
    if precision != "amp":
        return suppress
    return partial(torch.amp.autocast, device_type=device_type, dtype=torch.float16)
"""

ENGINE_FP32 = """\
import torch.nn.functional as F


def train_one_epoch(model, loader, optimizer, scaler, device):
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


def _check(root: Path, engine: str) -> list[str]:
    root.mkdir()
    for name, text in (("main", MAIN), ("utils", UTILS), ("engine", engine), ("precision", PRECISION)):
        (root / f"{name}.py").write_text(text, encoding="utf-8")
    r = CliRunner().invoke(torchopt.cli.app, ["check", str(root), "--no-cache", "--select", "TOP202"])
    return [line for line in r.stdout.splitlines() if "TOP202" in line]


def test_a_learning_rate_setter_is_no_step_and_a_step_under_its_own_amp_is_no_float32_step(tmp_path):
    assert _check(tmp_path / "amp", ENGINE_AMP) == []


def test_a_float32_step_in_another_module_is_still_reported_and_the_setter_is_not(tmp_path):
    [line] = _check(tmp_path / "fp32", ENGINE_FP32)
    assert "main.py:15:9: TOP202" in line and "the step (`train_one_epoch`) is defined in `engine.py`" in line


def test_a_function_whose_calls_cannot_be_followed_is_still_reported(tmp_path):
    # `set_lr` hands the optimizer to a method of a value it was given: what that runs is unknown,
    # so it is not ruled out as a step
    root = tmp_path / "p"
    root.mkdir()
    (root / "precision.py").write_text(PRECISION, encoding="utf-8")
    (root / "engine.py").write_text(ENGINE_AMP, encoding="utf-8")
    (root / "utils.py").write_text(
        "def set_lr(optimizer, epoch, stepper):\n    stepper.run(optimizer)\n", encoding="utf-8"
    )
    (root / "main.py").write_text(MAIN, encoding="utf-8")
    r = CliRunner().invoke(torchopt.cli.app, ["check", str(root), "--no-cache", "--select", "TOP202"])
    [line] = [x for x in r.stdout.splitlines() if "TOP202" in x]
    assert "main.py:14:9: TOP202" in line and "the step (`set_lr`) is defined in `utils.py`" in line
