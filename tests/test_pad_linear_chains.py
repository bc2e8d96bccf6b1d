"""TOP302 on plain `nn.Linear` chains of one module written statement by statement in `forward`
(`x = F.relu(self.fc1(x))`, `x = self.fc2(x)`): the hidden width is padded on both sides only when
each intermediate value goes to exactly one next statement; the fixture validates by weight
transplant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import torchopt.cli
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TOP302 = Settings(select=("TOP302",))

_NET = """import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 500)
        self.fc2 = nn.Linear(500, 10)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
{forward}
"""


def _fixed(forward: str) -> str:
    return fix_source(_NET.format(forward=forward), TOP302, unsafe=True).text


def _padded(forward: str) -> bool:
    out = _fixed(forward)
    return "nn.Linear(784, 504)" in out and "nn.Linear(504, 10)" in out


@pytest.mark.parametrize(
    "forward",
    [
        "        x = x.view(-1, 784)\n        x = F.relu(self.fc1(x))\n        x = self.fc2(x)\n        return x",
        "        h = self.fc1(x)\n        h = F.relu(h)\n        h = self.drop(h)\n        return self.fc2(h)",
        "        h = self.fc1(x).relu()\n        out = self.fc2(h)\n        return out",
    ],
    ids=["rebound-x", "three-statements-dropout", "method-activation"],
)
def test_statement_chain_in_forward_is_padded(forward):
    assert _padded(forward)


_H = "        h = F.relu(self.fc1(x))\n"


@pytest.mark.parametrize(
    "forward,near_miss",
    [
        # the hidden features are returned too
        (_H + "        return self.fc2(h), h", _H + "        return self.fc2(h)"),
        # read again after the second layer
        (
            _H + "        y = self.fc2(h)\n        return y + h.sum()",
            _H + "        y = self.fc2(h)\n        return y + y.sum()",
        ),
        # the second layer runs only on one branch: the other returns the hidden features
        (
            _H + "        if self.training:\n            h = self.fc2(h)\n        return h",
            _H + "        h = self.fc2(h)\n        return h",
        ),
        # sigmoid(0) = 0.5: the pad units would learn
        ("        h = torch.sigmoid(self.fc1(x))\n        return self.fc2(h)", _H + "        return self.fc2(h)"),
    ],
    ids=["returned", "read-twice", "branch", "sigmoid"],
)
def test_hidden_value_seen_elsewhere_is_reported_not_padded(forward, near_miss):
    src = _NET.format(forward=forward)
    assert not _padded(forward)
    diags = [d for d in check_source(src, TOP302, "t.py").diagnostics if d.code == "TOP302"]
    assert diags and all(d.fix is None for d in diags)
    assert _padded(near_miss)  # the same forward without what exposes the hidden features


def test_fixture_rewrite_pads_both_hidden_widths_and_keeps_input_and_output():
    out = fix_source((FIXTURES / "pad_mlp_forward" / "before.py").read_text(), TOP302, unsafe=True).text
    assert "nn.Linear(784, 504)" in out and "nn.Linear(504, 104)" in out and "nn.Linear(104, 10)" in out


@pytest.mark.slow  # `torchopt validate` runs both programs in subprocesses: ~30 s
def test_padded_forward_chain_passes_validate_by_weight_transplant():
    r = CliRunner().invoke(
        torchopt.cli.app,
        [
            "validate",
            str(FIXTURES / "pad_mlp_forward" / "before.py"),
            "--select",
            "TOP302",
            "--unsafe-fixes",
            "--device",
            "cpu",
            "--steps",
            "3",
            "--json",
            "--timeout",
            "300",
        ],
        catch_exceptions=False,
    )
    out = json.loads(r.output)
    assert r.exit_code == 0 and out["verdict"] == "equivalent", json.dumps(out, indent=1)[:3000]
    rows = {row["name"]: row for row in out["rows"]}
    assert "padded (100, 500) -> (104, 504)" in rows["param/model.fc2.weight"]["detail"]
    assert rows["param/model.fc2.weight"]["tolerance"].startswith("rtol=1e-05")
    assert any("weight transplant" in n for n in out["notes"])
    assert not any("transplant stopped" in n for n in out["notes"]), out["notes"]
