"""A training script that logs its model's graph (`SummaryWriter.add_graph`, which traces the model
with `torch.jit.trace`) validates under the harness exactly as it runs under plain `python`: the
trace sees the program's operations only. tensorboard is not a dependency of torchopt (it pulls
grpcio and protobuf), so the SummaryWriter test is skipped without it; the other test performs the
same trace as `add_graph` does (torch/utils/tensorboard/_pytorch_graph.py: the model switched to
eval mode for the trace, `strict=True`, the graph inlined and walked node by node)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchopt.cli import app

pytestmark = pytest.mark.slow  # two harness runs and a plain run, ~15-40 s

HEAD = """\
import sys

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        x = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.fc(x.flatten(1))


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(16, 1, 8, 8)
Y = torch.randint(0, 3, (16,))
"""

# What `SummaryWriter.add_graph(model, X[:2])` does, spelled out.
DIRECT = """\
was_training = model.training
model.eval()
try:
    traced = torch.jit.trace(model, (X[:2],), strict=True)
finally:
    model.train(was_training)
graph = traced.graph
torch._C._jit_pass_inline(graph)
kinds = ",".join(f"{n.kind()}/{n.scopeName()}/{len(list(n.inputs()))}" for n in graph.nodes())
"""

WRITER = """\
from torch.utils.tensorboard import SummaryWriter

writer = SummaryWriter("runs")
writer.add_graph(model, X[:2])
writer.close()
traced = torch.jit.trace(model.eval(), (X[:2],), strict=True)
model.train()
kinds = ",".join(n.kind() for n in traced.graph.nodes())
"""

TAIL = """\
if sys.argv[1:] == ["--print"]:
    print(kinds)
elif sys.argv[1:] and sys.argv[1] != kinds:
    raise SystemExit(f"the traced graph differs from plain python's: {kinds}")
for step in range(3):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(X), Y)
    loss.backward()
    opt.step()
"""


def _validates_as_plain_python(tmp_path: Path, middle: str) -> None:
    src = HEAD + middle + TAIL
    a = tmp_path / "a.py"
    a.write_text(src, encoding="utf-8")
    b = tmp_path / "b.py"
    b.write_text(src.replace("lr=0.1)", "lr=0.1)  # same"), encoding="utf-8")
    plain = subprocess.run(
        [sys.executable, str(a), "--print"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert plain.returncode == 0, plain.stderr
    kinds = plain.stdout.strip()
    assert "aten::" in kinds
    res = CliRunner().invoke(
        app,
        ["validate", str(a), str(b), "--json", "--device", "cpu", "--steps", "3", "--script-arg", kinds],
        catch_exceptions=False,
    )
    out = json.loads(res.stdout)
    # both versions ran (the graph each traced is plain python's, else the script exits) and
    # their values were compared
    assert out["verdict"] == "equivalent", (out["headline"], out.get("tracebacks"), out["notes"][:3])
    rows = {r["name"]: r for r in out["rows"]}
    assert rows["loss[2]"]["verdict"] == "ok"
    assert res.exit_code == 0


def test_tracing_as_add_graph_does_sees_what_plain_python_sees(tmp_path: Path) -> None:
    _validates_as_plain_python(tmp_path, DIRECT)


def test_summary_writer_add_graph_validates_as_under_plain_python(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    _validates_as_plain_python(tmp_path, WRITER)
