"""TOP901 (channels_last): opt-in selection, the fixture's opt-in golden, and
`torchopt validate` of the fixture's rewrite within the tolerance class."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import torchopt.cli
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
OPT_IN = Settings(select=("ALL", "TOP901", "TOP911", "TOP921"))


def _before(name: str) -> str:
    return (FIXTURES / name / "before.py").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "select,enabled",
    [
        (("ALL",), False),
        (("TOP9",), False),
        (("channels_last",), False),
        (("TOP901",), True),
        (("channels-last",), True),
        (("ALL", "TOP901"), True),
    ],
)
def test_top901_is_opt_in(select, enabled):
    assert ("TOP901" in Settings(select=select).enabled_codes()) is enabled


@pytest.mark.parametrize("name", ["cl_cnn_train", "cmp_mlp_train"])
def test_opt_in_golden(name):
    """after_opt_in.py: every default rule plus the opt-in CL/CMP/CG rewrites; a fix-point."""
    golden = (FIXTURES / name / "after_opt_in.py").read_text(encoding="utf-8")
    got = fix_source(_before(name), OPT_IN, unsafe=True).text
    assert got == golden
    compile(golden, name, "exec", dont_inherit=True)
    again = fix_source(golden, OPT_IN, unsafe=True)
    assert again.text == golden and not again.applied


def test_fixture_rewrite_converts_model_inputs_and_views():
    text = fix_source(_before("cl_cnn_train"), Settings(select=("TOP901",)), unsafe=True).text
    assert "SmallCNN().to(device).to(memory_format=torch.channels_last)" in text
    assert text.count("memory_format=torch.channels_last") == 3  # the model and its two input copies
    assert "labels[i:i + batch_size].to(device))" in text  # not a model input
    assert ".view(" not in text and "x.reshape(x.size(0), -1)" in text


def test_blockers_make_it_display_only():
    src = _before("cl_cnn_train").replace("    model.eval()\n", "    model.eval()\n    assert images.is_contiguous()\n")
    diags = [d for d in check_source(src, Settings(select=("TOP901",))).diagnostics if d.code == "TOP901"]
    assert len(diags) == 1 and diags[0].fix is None and "is_contiguous" in diags[0].message
    assert fix_source(src, Settings(select=("TOP901",)), unsafe=True).text == src


def test_fixture_validates_within_tolerance(tmp_path, monkeypatch):
    """`torchopt validate before.py after.py` (the TOP901 rewrite alone): equivalent under the
    tolerance class, not bitwise (NHWC convolutions round differently)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()
    before, after = tmp_path / "b" / "train.py", tmp_path / "a" / "train.py"
    before.write_text(_before("cl_cnn_train"), encoding="utf-8")
    after.write_text(
        fix_source(_before("cl_cnn_train"), Settings(select=("TOP901",)), unsafe=True).text, encoding="utf-8"
    )
    r = CliRunner().invoke(
        torchopt.cli.app,
        [
            "validate",
            str(before),
            str(after),
            "--select",
            "TOP901",
            "--unsafe-fixes",
            "--steps",
            "20",
            "--device",
            "cpu",
            "--json",
            "--timeout",
            "120",
        ],
        catch_exceptions=False,
    )
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and out["verdict"] == "equivalent", r.stdout[-3000:]
    assert out["tolerance"]["tags"] == ["tolerance"] and out["tolerance"]["compare_values"]
    params = [row for row in out["rows"] if row["kind"] == "param"]
    assert params and all(row["verdict"] == "ok" for row in params)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_dtype_views_and_factories_are_left_alone():
    src = _before("cl_cnn_train").replace(
        "        return self.head(x.view(x.size(0), -1))",
        "        bits = x.view(self.dtype)\n        return self.head(x.view(x.size(0), -1))",
    )
    out = fix_source(src, Settings(select=("TOP901",)), unsafe=True).text
    assert "bits = x.view(self.dtype)" in out and "x.reshape(x.size(0), -1)" in out
    # A factory that builds, evaluates and returns a CNN (timm's _prune.py shape): never run here.
    factory = (
        "import torch\nfrom torch import nn\n\n\ndef build():\n    m = nn.Sequential(nn.Conv2d(3, 8, 3))\n"
        "    m.eval()\n    return m\n"
    )
    assert not check_source(factory, Settings(select=("TOP901", "TOP911"))).diagnostics
