"""What the program does with the model (torchopt/analysis/module_modes.py) as TOP803 and TOP801 use
it: no `model.eval()` is asked for a network whose layers compute the same in both modes, the mode
reaches a closure from the function around it and a model through `accelerator.unwrap_model`, and a
project object whose `__call__` runs under no_grad is not evaluated "with autograd on". Each layout
has its counterpart that keeps the finding (a Dropout, a BatchNorm, a library model)."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest
from typer.testing import CliRunner

import torchopt.cli
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source

TOP803 = Settings(select=("TOP803",))
TOP801 = Settings(select=("TOP801",))

# A tutorial-style script: a small network, trained, then evaluated on the test loader without eval().
TUTORIAL = """\
import torch
import torch.nn as nn
import torch.nn.functional as F
{imports}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4, 2){extra})

    def forward(self, x):
        x = self.pool(F.relu(self.conv(x)))
        return self.head({forward})


net = {build}
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
train_loader = [(torch.randn(2, 3, 4, 4), torch.tensor([0, 1]))]
test_loader = [(torch.randn(2, 3, 4, 4), torch.tensor([1, 0]))]
for x, y in train_loader:
    F.cross_entropy(net(x), y).backward()
    optimizer.step()
correct = 0
for x, y in test_loader:
    correct += (net(x).argmax(1) == y).sum().item()
print(correct)
"""


def _tutorial(imports: str = "", extra: str = "", forward: str = "x", build: str = "Net()") -> str:
    return TUTORIAL.format(imports=imports, extra=extra, forward=forward, build=build)


def _codes(src: str, settings: Settings) -> list[str]:
    return [d.code for d in check_source(src, settings).diagnostics]


@pytest.mark.parametrize(
    "variant,reported",
    [
        ({}, False),  # Conv2d, MaxPool2d, ReLU, Flatten, Linear: eval() changes nothing
        ({"build": "Net().to('cpu')"}, False),
        ({"extra": ", nn.LayerNorm(2), nn.GELU()"}, False),
        ({"extra": ", nn.Dropout(0.5)"}, True),
        ({"extra": ", nn.BatchNorm1d(2)"}, True),
        ({"extra": ", nn.InstanceNorm1d(2, track_running_stats=True)"}, True),
        ({"forward": "F.dropout(x, 0.2, training=self.training)"}, True),
        ({"forward": "x if self.training else x * 2"}, True),
        ({"imports": "import torchvision", "build": "torchvision.models.resnet18()"}, True),  # unknown: kept
        ({"build": "torch.load('net.pt', weights_only=False)"}, True),  # a whole model read back: unknown
        ({"build": "torch.hub.load('owner/repo', 'net')"}, True),
        ({"build": "Net()\nnet.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(4, 2))"}, True),
        ({"build": "Net()\nnet.add_module('drop', nn.Dropout(0.5))"}, True),  # parts added after building
        ({"imports": "from layers import Block", "extra": ", Block(2)"}, True),  # a class that cannot be read
    ],
)
def test_eval_is_asked_only_where_the_mode_changes_what_the_model_computes(variant, reported):
    src = _tutorial(**variant)
    assert _codes(src, TOP803) == (["TOP803"] if reported else [])


def test_the_networks_said_mode_free_compute_the_same_in_both_modes():
    """What the fact claims, run: the tutorial network gives the same outputs in train and eval
    mode; with a Dropout or a BatchNorm added (reported above) it does not."""
    torch = pytest.importorskip("torch")

    def outputs(extra: str) -> tuple:
        scope: dict = {}
        exec(_tutorial(extra=extra).split("\n\nnet = ")[0], scope)  # the class only
        torch.manual_seed(0)
        net = scope["Net"]()
        x = torch.randn(4, 3, 4, 4)
        net.train()
        a = net(x)
        net.eval()
        return a, net(x)

    a, b = outputs("")
    assert torch.equal(a, b)
    for extra in (", nn.Dropout(0.5)", ", nn.BatchNorm1d(2)"):
        a, b = outputs(extra)
        assert not torch.equal(a, b)


PROJECT_MAIN = """\
import torch
import torch.nn.functional as F

from models.gcn import GCN


def main():
    model = GCN(8, 16, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_loader = [(torch.randn(5, 8), torch.randint(0, 4, (5,)))]
    val_loader = [(torch.randn(5, 8), torch.randint(0, 4, (5,)))]
    for epoch in range(2):
        for x, y in train_loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        for x, y in val_loader:
            acc = (model(x).argmax(-1) == y).float().mean()


if __name__ == "__main__":
    main()
"""
PROJECT_GCN = """\
from torch import nn

from models.layers import GraphConv


class GCN(nn.Module):
    def __init__(self, n_in, n_hidden, n_out):
        super().__init__()
        self.convs = nn.ModuleList([GraphConv(n_in, n_hidden), GraphConv(n_hidden, n_out)])
        self.act = nn.ReLU()

    def forward(self, x):
        for conv in self.convs[:-1]:
            x = self.act(conv(x))
        return self.convs[-1](x)
"""
PROJECT_LAYERS = """\
import math

import torch
from torch import nn


class GraphConv(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.scale = math.sqrt(n_out)

    def forward(self, x):
        return torch.tanh(self.lin(x)) / self.scale{extra}
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(dedent(text), encoding="utf-8")


@pytest.mark.parametrize(
    "extra,reported", [("", False), ("\n\n    def reset(self):\n        self.drop = nn.Dropout(0.1)", True)]
)
def test_a_model_built_from_project_classes_is_read_through_the_project(tmp_path, monkeypatch, extra, reported):
    layers = PROJECT_LAYERS.format(extra=extra)
    _write(tmp_path / "proj", {"main.py": PROJECT_MAIN, "models/gcn.py": PROJECT_GCN, "models/layers.py": layers})
    monkeypatch.chdir(tmp_path)
    args = ["check", "proj", "--no-cache", "--select", "TOP803", "-j", "1"]
    r = CliRunner().invoke(torchopt.cli.app, args, catch_exceptions=False)
    assert ("TOP803 The loop over `val_loader` runs `model` without `model.eval()`" in r.stdout) is reported, r.output
    # The file alone cannot read the classes: unknown, the finding stays.
    alone = check_source(dedent(PROJECT_MAIN), TOP803)
    assert [d.code for d in alone.diagnostics] == ["TOP803"]


CLOSURE = """\
import torch


def validate(val_loader, model, criterion):
    def run_validate(loader):
        with torch.no_grad():
            for images, target in loader:
                loss = criterion(model(images), target)

    {calls}
"""


def test_a_closure_runs_the_model_in_the_mode_its_caller_set():
    """`run_validate` reads `model` from `validate`, which calls `model.eval()` before every call of
    it: the model is in eval mode there."""
    assert _codes(dedent(CLOSURE).format(calls="model.eval()\n    run_validate(val_loader)"), TOP803) == []
    assert _codes(dedent(CLOSURE).format(calls="run_validate(val_loader)"), TOP803) == ["TOP803"]
    # Switched only after the call: the model is not in eval mode there.
    after = dedent(CLOSURE).format(calls="run_validate(val_loader)\n    model.eval()")
    assert _codes(after, TOP803) == ["TOP803"]


UNWRAP = """\
import torch


@torch.no_grad()
def log_validation(model, images, accelerator):
    {switch}
    outs = []
    for image in images:
        outs.append(accelerator.unwrap_model(model)(image))
    model.train()
    return outs
"""


def test_unwrap_model_returns_the_model_it_is_given():
    """`accelerator.unwrap_model(model)(x)` runs `model` (its mode is `model`'s); `unwrap_model`
    itself runs no model, and the message names the model, never the accelerator."""
    assert _codes(dedent(UNWRAP).format(switch="model.eval()"), TOP803) == []
    diags = check_source(dedent(UNWRAP).format(switch="pass"), TOP803).diagnostics
    assert [d.message for d in diags] == [
        "`log_validation()` runs `model` without `model.eval()`: dropout and BatchNorm stay in training mode"
    ]


PREDICTOR = """\
class Predictor:
    def __init__(self, model):
        self.model = model

    def get_decoder_features(self, src):
        return self.model(src)

    def predict(self, src):
        return self.get_decoder_features(src).argmax(-1).tolist()
"""


def test_a_method_that_runs_the_model_is_still_a_model_call():
    """Only a verb and a model word name an action on a model (`unwrap_model`, `build_model`):
    `get_decoder_features` runs one, and the evaluation that calls it is still reported."""
    assert _codes(PREDICTOR, TOP801) == ["TOP801"]
    assert _codes(PREDICTOR.replace("get_decoder_features", "build_decoder"), TOP801) == []


PIPELINE = """\
import torch
from torch import nn


class Upscaler:
    def __init__(self, net):
        self.net = net

    {decorator}
    def __call__(self, x):
        return self.net(x).clamp(0, 1)


def predict(net, images):
    generator = Upscaler(net)
    return [generator(x) for x in images]


predict(nn.Linear(4, 4), [torch.randn(2, 4)])
"""


def test_a_pipeline_whose_call_runs_under_no_grad_is_not_evaluated_with_autograd():
    assert _codes(dedent(PIPELINE).format(decorator="@torch.no_grad()"), TOP801) == []
    assert _codes(dedent(PIPELINE).format(decorator="@torch.inference_mode()"), TOP801) == []
    assert _codes(dedent(PIPELINE).format(decorator=""), TOP801) == ["TOP801"]


EPOCHS = """\
import torch
from torch import nn

model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(){extra})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = [(torch.randn(2, 4), None)]
val_loader = [(torch.randn(2, 4), None)]
for epoch in range(3):
    for x, _ in train_loader:
        model(x).sum().backward()
        opt.step()
    model.eval()
    score = sum(model(x).sum().item() for x, _ in val_loader)
"""


@pytest.mark.parametrize("extra,reported", [("", False), (", nn.Dropout(0.1)", True), (", nn.LSTM(4, 4)", False)])
def test_an_epoch_loop_left_in_eval_mode_matters_only_for_a_model_that_reads_the_mode(extra, reported):
    """From the second epoch on the model trains in eval mode: that changes nothing for a
    `nn.Sequential` of Linear and ReLU (nor with an LSTM without dropout); with a Dropout, dropout
    is off for every epoch after the first: reported."""
    codes = _codes(EPOCHS.format(extra=extra), TOP803)
    assert codes == (["TOP803"] if reported else [])


WRAPPER = """\
import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self, backbone, n_classes):
        super().__init__()
        self.backbone = backbone
        self.n_classes = n_classes
        self.fc = nn.Linear(4, n_classes)

    def forward(self, x):
        return self.fc(self.backbone(x))


model = Classifier({backbone}, 3)
test_loader = [torch.randn(2, 4)]
for x in test_loader:
    print(model(x).argmax(1))
"""


def test_a_module_handed_to_a_class_is_not_taken_for_mode_free():
    """`Classifier` builds only a Linear, but runs the backbone it is given: which layers that has is
    not read from the class, so the finding stays (here the backbone drops units in train mode)."""
    src = WRAPPER.format(backbone="nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))")
    assert _codes(src, TOP803) == ["TOP803"]
    # A number kept as an attribute and a module built in the class are not modules handed in.
    plain = WRAPPER.replace("self.backbone = backbone", "self.backbone = nn.Linear(4, 4)")
    assert _codes(plain.format(backbone="None"), TOP803) == []
