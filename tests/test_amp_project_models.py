"""TOP202 knows a model whose class another file of the project defines: the project index says
the class derives from torch.nn.Module, so a step whose loss comes from calling it (a latent
projection through a generator of `model.py`, an optimizer over latents rather than the model's
parameters) is rewritten, and the rewrite runs before and after on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import torchopt.cli

BLOCKS = """\
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(n, n)
"""

MODEL = """\
import torch
from torch import nn

from blocks import Block


class Generator(Block):
    def __init__(self, n):
        super().__init__(n)
        self.out = nn.Linear(n, 3)

    def forward(self, z):
        h = torch.relu(self.fc(z))
        return self.out(h), h
"""

NOT_A_MODULE = """\
class Generator:
    def __init__(self, n):
        self.n = n

    def __call__(self, z):
        return z * 2, z
"""

PROJECT = """\
import torch
from torch import optim

from model import Generator


def regularize(z):
    return z.pow(2).mean()


if __name__ == "__main__":
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = Generator(8)
    g.eval()
    g = g.to(device)
    target = torch.randn(4, 3, device=device)
    latent = torch.zeros(4, 8, device=device, requires_grad=True)
    optimizer = optim.Adam([latent], lr=0.05)
    for i in range(20):
        img, _ = g(latent)
        loss = (img - target).pow(2).mean() + 0.1 * regularize(latent)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"{loss.item():.3f}")
"""


def _project(root: Path, model: str) -> Path:
    root.mkdir()
    (root / "blocks.py").write_text(BLOCKS, encoding="utf-8")
    (root / "model.py").write_text(model, encoding="utf-8")
    (root / "project.py").write_text(PROJECT, encoding="utf-8")
    return root


def _cli(*args: str) -> str:
    r = CliRunner().invoke(torchopt.cli.app, [*args, "--no-cache", "--select", "TOP202"], catch_exceptions=False)
    return r.stdout + r.stderr


def _run(root: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "project.py"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_a_model_class_of_another_file_is_a_model_and_the_step_is_rewritten(tmp_path):
    root = _project(tmp_path / "p", MODEL)
    before = _run(root)
    out = _cli("rewrite", str(root), "--unsafe-fixes")
    assert "known to be a torch.nn.Module" not in out
    text = (root / "project.py").read_text()
    compile(text, "project.py", "exec")
    assert "with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):\n            img, _ = g(latent)" in text
    assert "scaler.scale(loss).backward()" in text and "scaler.step(optimizer)" in text
    assert "amp_device_type = torch.device(device).type" in text
    # the other files are not edited, and a second run changes nothing
    assert (root / "model.py").read_text() == MODEL
    _cli("rewrite", str(root), "--unsafe-fixes")
    assert (root / "project.py").read_text() == text
    after = _run(root)  # CPU: bfloat16 autocast, scaler disabled
    assert abs(float(after) - float(before)) < 0.05 * max(1.0, abs(float(before)))


def test_a_class_of_another_file_that_is_no_module_is_no_model(tmp_path):
    root = _project(tmp_path / "p", NOT_A_MODULE)
    out = _cli("check", str(root))
    assert "known to be a torch.nn.Module" in out and "`g(...)`" in out
