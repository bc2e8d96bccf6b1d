"""TOP202 facts the third real-world sample found wrong: a model moved by rebinding its name
(``model = model.to(device)``, in a notebook often a cell of its own) runs on that device; and a
refusal names the calls that really feed the loss (a loss built in the file, a builtin or a function
of the file is no model; a method of the model is said to be one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from torchopt.cli import app

ROOT = Path(__file__).resolve().parents[1]


def _cell(src: str) -> dict:
    return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": src.splitlines(True)}


SETUP = """\
import torch
import torch.nn as nn

torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc(x)
"""
BUILD = "model = Scorer()\nprint(sum(p.numel() for p in model.parameters()))\n"
MOVE = "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\ncriterion = nn.BCEWithLogitsLoss()\n\nmodel = {move}\n"
TRAIN = """\
def train(model, batches, optimizer, criterion):
    model.train()
    total = 0.0
    for x, y in batches:
        optimizer.zero_grad()
        predictions = model(x).squeeze(1)
        loss = criterion(predictions, y)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total / len(batches)
"""
RUN = """\
batches = [(torch.randn(16, 8).to(device), torch.randint(0, 2, (16,)).float().to(device)) for _ in range(4)]
for epoch in range(3):
    mean_loss = train(model, batches, optimizer, criterion)
print(f"LOSS {mean_loss:.6f}")
"""


def _notebook(path: Path, move: str) -> Path:
    cells = [_cell(SETUP), _cell(BUILD), _cell(MOVE.format(move=move)), _cell(TRAIN), _cell(RUN)]
    nb = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb, indent=1) + "\n", encoding="utf-8")
    return path


def _run_cells(path: Path, tmp: Path) -> float:
    """Run the notebook's code cells in order, as one program, on the CPU; the last mean loss."""
    code = "".join("".join(c["source"]) + "\n" for c in json.loads(path.read_text())["cells"])
    script = tmp / f"{path.stem}_run.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(proc.stdout.split("LOSS ")[-1])


def test_a_move_in_another_cell_is_the_model_device(tmp_path):
    nb = _notebook(tmp_path / "cells.ipynb", "model.to(device)")
    before = _run_cells(nb, tmp_path)
    res = CliRunner().invoke(app, ["rewrite", str(nb), "--no-cache", "--unsafe-fixes", "--select", "TOP202"])
    assert res.exit_code == 0, res.output
    cells = ["".join(c["source"]) for c in json.loads(nb.read_text())["cells"]]
    assert "torch.autocast(device_type=" in cells[3] and "scaler.scale(loss).backward()" in cells[3]
    assert "torch.device(device).type" in cells[2]  # the device the model was moved to
    after = _run_cells(nb, tmp_path)  # bfloat16 autocast on the CPU; the scaler is disabled there
    assert abs(after - before) < 0.05 * max(1.0, abs(before)), (before, after)


def test_a_model_moved_to_the_cpu_in_another_cell_is_not_fixed(tmp_path):
    nb = _notebook(tmp_path / "cpu.ipynb", 'model.to("cpu")')
    text = nb.read_text()
    res = CliRunner().invoke(app, ["rewrite", str(nb), "--no-cache", "--unsafe-fixes", "--select", "TOP202"])
    assert nb.read_text() == text, res.output
    res = CliRunner().invoke(app, ["check", str(nb), "--no-cache", "--select", "TOP202"])
    assert "CPU training is not an AMP target" in res.output


def test_a_model_made_half_by_rebinding_is_not_given_autocast(tmp_path):
    """A half model needs no autocast (and a GradScaler cannot unscale half gradients): the rebinding
    is read as a half cast, not as a model of unknown device."""
    nb = _notebook(tmp_path / "half.ipynb", "model.to(device).half()")
    text = nb.read_text()
    res = CliRunner().invoke(app, ["rewrite", str(nb), "--no-cache", "--unsafe-fixes", "--select", "TOP202"])
    assert nb.read_text() == text, res.output
    res = CliRunner().invoke(app, ["check", str(nb), "--no-cache", "--select", "TOP202"])
    assert "cannot tell which device" not in res.output, res.output


AGENT = """\
import torch
import torch.nn as nn


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def act_and_value(self, x):
        h = torch.relu(self.body(x))
        return torch.sigmoid(self.head(h)), h


def pick(t, idx):
    return t[idx]


agent = Agent().to("cuda")
optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3)
bce = nn.BCELoss()
for step in range(3):
    x = torch.randn(8, 4, device="cuda")
    y = torch.rand(8, 1, device="cuda")
    prob, h = agent.act_and_value(x)
    loss = bce(pick(prob, slice(None)), y) + h.pow(2).mean() / len(h)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""

REMOTE = """\
import torch
import torch.nn as nn
from elsewhere import run

params = [torch.zeros(4, device="cuda", requires_grad=True)]
optimizer = torch.optim.SGD(params, lr=0.1)
bce = nn.BCELoss()
for step in range(3):
    x = torch.randn(8, 4, device="cuda")
    loss = bce(run(x, params), torch.rand(8, device="cuda"))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def _message(tmp_path: Path, src: str) -> str:
    path = tmp_path / "step.py"
    path.write_text(src, encoding="utf-8")
    res = CliRunner().invoke(app, ["check", str(path), "--no-cache", "--select", "TOP202"])
    [line] = [ln for ln in res.output.splitlines() if ln.startswith(str(path))]
    return line


def test_a_method_of_the_model_is_named_and_the_file_s_loss_is_not(tmp_path):
    line = _message(tmp_path, AGENT)
    assert "`agent.act_and_value(...)`, a method of the model `agent`" in line
    for not_a_model in ("`bce(...)`", "`len(...)`", "`pick(...)`", "not visible in this file"):
        assert not_a_model not in line, line


def test_an_imported_callable_is_still_named_but_the_loss_built_here_is_not(tmp_path):
    line = _message(tmp_path, REMOTE)
    assert "`run(...)`" in line and "not visible in this file" in line
    assert "`bce(...)`" not in line, line
