"""TOP961 (fused optimizers) beyond its examples: opt-in selection, target-torch, what `rewrite`
writes on disk (only the file it fixes), the refusals, the opt-in golden of fixtures/optim_fused_train
and `torchopt validate` of that rewrite on the CPU."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from textwrap import dedent

import pytest
from typer.testing import CliRunner

import torchopt.cli
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
OPT_IN = Settings(select=("ALL", "TOP961"))
ONLY = Settings(select=("TOP961",))

TRAIN = dedent("""\
    import torch
    from torch import nn

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = nn.Linear(4, 2).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
""")


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _cli(*args: str):
    return CliRunner().invoke(torchopt.cli.app, list(args), catch_exceptions=False)


def _codes(src: str, settings: Settings) -> list[str]:
    return [d.code for d in check_source(src, settings).diagnostics if d.code == "TOP961"]


def test_opt_in_only_when_named():
    assert _codes(TRAIN, Settings()) == []
    assert _codes(TRAIN, Settings(select=("TOP9",))) == []
    assert _codes(TRAIN, OPT_IN) == ["TOP961"]
    assert _codes(TRAIN, Settings(select=("fused-optimizer",))) == ["TOP961"]


@pytest.mark.parametrize("target, fused", [("2.3", False), ("2.4", True)])
def test_target_torch_older_than_cpu_kernels_writes_nothing(tmp_path, target, fused):
    """PyTorch < 2.4 has no fused CPU kernels: `fused=True` would break the CPU fallback."""
    (tmp_path / "pyproject.toml").write_text(f'[tool.torchopt]\ntarget-torch = "{target}"\n', encoding="utf-8")
    script = tmp_path / "train.py"
    script.write_text(TRAIN, encoding="utf-8")
    before = _tree(tmp_path)
    r = _cli("rewrite", str(script), "--select", "TOP961", "--unsafe-fixes", "--no-cache", "-j", "1")
    assert r.exit_code == 0, r.output
    if fused:
        assert script.read_text(encoding="utf-8") == TRAIN.replace("lr=1e-3)", "lr=1e-3, fused=True)")
        before.pop("train.py")
        assert {k: v for k, v in _tree(tmp_path).items() if k != "train.py"} == before
    else:
        assert _tree(tmp_path) == before


def test_rewrite_writes_fused_only_into_the_file_it_fixes(tmp_path):
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    outside = tmp_path / "outside.py"
    outside.write_text(TRAIN, encoding="utf-8")
    train = root / "pkg" / "train.py"
    train.write_bytes(TRAIN.replace("\n", "\r\n").encode("utf-8"))
    other = root / "pkg" / "cpu_only.py"
    other.write_text(TRAIN.replace(".to(device)", ""), encoding="utf-8")
    before_root, before_outside = _tree(root), outside.read_bytes()

    r = _cli("rewrite", str(root), "--select", "TOP961", "--no-cache", "-j", "1")
    assert r.exit_code == 0 and _tree(root) == before_root, "an unsafe fix was written without --unsafe-fixes"
    assert "--unsafe-fixes" in r.stderr

    r = _cli("rewrite", str(root), "--select", "TOP961", "--unsafe-fixes", "--no-cache", "-j", "1")
    assert r.exit_code == 0, r.output
    assert "TOP961" in r.stderr and "tolerance" in r.stderr
    want = TRAIN.replace("lr=1e-3)", "lr=1e-3, fused=True)").replace("\n", "\r\n").encode("utf-8")
    assert train.read_bytes() == want  # CRLF kept
    after = _tree(root)
    assert after.pop("pkg/train.py") != before_root.pop("pkg/train.py")
    assert after == before_root
    assert outside.read_bytes() == before_outside


@pytest.mark.parametrize(
    "src, why",
    [
        (TRAIN.replace("lr=1e-3)", "lr=1e-3, fused=False)"), "fused chosen"),
        (TRAIN.replace("lr=1e-3)", "lr=1e-3, differentiable=True)"), "differentiable has no fused kernel"),
        (TRAIN.replace("lr=1e-3)", "**extra)"), "keyword arguments we cannot see"),
        (TRAIN.replace("model.parameters()", "[{'params': model.parameters(), **group}]"), "unpacked group"),
        (TRAIN.replace("torch.optim.Adam", "torch.optim.Adagrad"), "no fused CUDA kernel"),
        (TRAIN.replace('"cuda" if torch.cuda.is_available() else "cpu"', '"cpu"'), "CPU only"),
        (TRAIN.replace('"cuda" if torch.cuda.is_available() else "cpu"', '"cuda" if ok else "mps"'), "maybe MPS"),
        (
            "import torch_xla.core.xla_model as xm\n"
            + TRAIN.replace('torch.device("cuda" if torch.cuda.is_available() else "cpu")', "xm.xla_device()"),
            "XLA",
        ),
        (
            TRAIN.replace(
                "model = nn.Linear(4, 2).to(device)", "model = nn.Linear(4, 2)\nother = nn.Linear(2, 2).to(device)"
            ),
            "another module was moved",
        ),
        (
            TRAIN.replace("model.parameters()", "params").replace("optimizer", "params = get()\noptimizer"),
            "parameters of unknown origin",
        ),
    ],
)
def test_refusals(src, why):
    assert _codes(src, ONLY) == [], why
    assert fix_source(src, ONLY, unsafe=True).text == src


def test_opt_in_golden_of_the_fixture():
    before = (FIXTURES / "optim_fused_train" / "before.py").read_text(encoding="utf-8")
    golden = (FIXTURES / "optim_fused_train" / "after_opt_in.py").read_text(encoding="utf-8")
    got = fix_source(before, OPT_IN, unsafe=True)
    assert got.text == golden
    assert sorted(d.code for d in got.applied if d.code == "TOP961") == ["TOP961", "TOP961"]
    again = fix_source(golden, OPT_IN, unsafe=True)
    assert again.text == golden


def test_fixture_rewrite_validates_on_cpu(tmp_path, monkeypatch):
    """The fused CPU kernels change rounding only: `torchopt validate` finds the rewrite equivalent
    within the tolerance of its tag, and the optimizer states were compared."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    before = tmp_path / "train.py"
    before.write_text((FIXTURES / "optim_fused_train" / "before.py").read_text(encoding="utf-8"), encoding="utf-8")
    r = _cli(
        "validate",
        str(before),
        "--select",
        "TOP961",
        "--unsafe-fixes",
        "--steps",
        "12",
        "--device",
        "cpu",
        "--json",
        "--timeout",
        "120",
    )
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and out["verdict"] == "equivalent", r.stdout[-3000:]
    assert [a["code"] for a in out["applied"]] == ["TOP961", "TOP961"]
    assert out["tolerance"]["tags"] == ["tolerance"]
    kinds = {row["kind"] for row in out["rows"] if row["max_abs"] is not None}
    assert {"param", "loss"} <= kinds
