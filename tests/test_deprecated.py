"""The DEP family (TOP820–TOP829) beyond its generated example tests: `target-torch` keeps rules
whose fix needs a newer PyTorch from running, version guards are left alone, and the legacy
training fixture's full rewrite validates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite.config import ConfigError, Resolver, Settings, from_table
from torchopt.rewrite.engine import check_source, fix_source

ROOT = Path(__file__).resolve().parents[1]

SDP = "import torch\n\nwith torch.backends.cuda.sdp_kernel(enable_math=False):\n    pass\n"


def codes(text: str, settings: Settings) -> set[str]:
    return {d.code for d in check_source(text, settings).diagnostics}


def test_target_torch_skips_rules_needing_a_newer_api() -> None:
    assert "TOP824" in codes(SDP, from_table({}, "t", "."))
    assert "TOP824" in codes(SDP, from_table({"target-torch": "2.4"}, "t", "."))
    older = from_table({"target-torch": "2.3.1"}, "t", ".")
    assert "TOP824" not in codes(SDP, older)
    assert fix_source(SDP, older).text == SDP
    # Rules that need nothing new still run under an old target.
    assert "TOP829" in codes("import torch\n\nx = torch.autograd.Variable(torch.ones(1))\n", older)


def test_target_torch_from_pyproject(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.torchopt]\ntarget-torch = "2.2"\n')
    script = tmp_path / "attn.py"
    script.write_text(SDP)
    res = CliRunner().invoke(app, ["check", str(script), "--output-format", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == [] or all(d["code"] != "TOP824" for d in json.loads(res.stdout))
    assert Resolver().for_path(str(script)).target_torch == (2, 2)


@pytest.mark.parametrize("bad", ["two", "2", 2, "2.x"])
def test_bad_target_torch_names_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match="target-torch"):
        from_table({"target-torch": bad}, "pyproject.toml", ".")


GUARDED = [
    "import torch\n\ntry:\n    ctx = torch.nn.attention.sdpa_kernel([])\nexcept AttributeError:\n"
    "    ctx = torch.backends.cuda.sdp_kernel(enable_math=False)\n",
    "import torch\n\nif torch.__version__ < '2.0':\n    torch.set_default_tensor_type(torch.cuda.FloatTensor)\n",
    "import torch\n\nr = torch.range(0, 3) if not hasattr(torch, 'arange') else torch.arange(4)\n",
    "import torch\n\ntry:\n    from torch.testing import assert_close as check\nexcept ImportError:\n"
    "    check = None\nif check is None:\n    pass\nelse:\n    pass\n"
    "try:\n    import foo\nexcept ImportError:\n    torch.testing.assert_allclose(torch.ones(1), torch.ones(1))\n",
]


@pytest.mark.parametrize("text", GUARDED)
def test_version_guards_are_left_alone(text: str) -> None:
    settings = Settings(select=("TOP82",))
    assert not check_source(text, settings).diagnostics
    assert fix_source(text, settings, unsafe=True).text == text


def test_legacy_fixture_unsafe_rewrite_validates() -> None:
    """Everything the DEP family writes in the fixture, the unsafe `torch.range` → `torch.arange`
    included, computes the same losses and parameters on the CPU."""
    before = ROOT / "fixtures" / "dep_legacy_train" / "before.py"
    res = CliRunner().invoke(
        app,
        ["validate", str(before), "--steps", "3", "--device", "cpu", "--unsafe-fixes", "--select", "TOP82", "--json"],
        catch_exceptions=False,
    )
    out = json.loads(res.stdout)
    assert res.exit_code == 0, res.output
    assert out["verdict"] == "equivalent"
    applied = {f["code"] for f in out["applied"]}
    assert {"TOP821", "TOP823", "TOP825", "TOP826", "TOP827", "TOP829"} <= applied
    assert out["rows"] and all(r["verdict"] == "ok" for r in out["rows"])
