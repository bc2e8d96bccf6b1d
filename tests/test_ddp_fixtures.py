"""The DDP fixtures end to end (issue 5): each DDP rewrite (TOP4xx, TOP402 opted in)
  * run with plain `python` (a process group of one) computes bitwise what the original computed,
    checked by `torchopt validate BEFORE AFTER` (every probe bitwise);
  * runs under `torchrun --standalone --nproc_per_node=2` on the CPU (gloo) to completion, the two
    ranks ending with bitwise-equal parameters, and only rank 0 printing, logging or writing files.
The goldens themselves (before/after_safe/after_unsafe) are checked by tests/test_fixtures.py; the
opt-in rewrite of the single-GPU script has its own golden, after_opt_in.py, checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import torchopt.cli
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import fix_source

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
NAMES = ["ddp_imagenet_dp", "ddp_single_gpu", "ddp_accumulation", "ddp_checkpoint_logging"]
DDP_ONLY = Settings(select=("TOP4", "TOP402"))  # TOP402 is opt-in: named explicitly
CONVERTER = {"ddp_single_gpu": "TOP402"}


def _before(name: str) -> str:
    return (FIXTURES / name / "before.py").read_text(encoding="utf-8")


def _ddp(name: str, settings: Settings = DDP_ONLY) -> str:
    res = fix_source(_before(name), settings, unsafe=True)
    assert CONVERTER.get(name, "TOP401") in {d.code for d in res.applied}, name
    return res.text


@pytest.mark.parametrize("name", NAMES)
def test_ddp_rewrite_is_complete_and_a_fix_point(name):
    text = _ddp(name)
    for needle in (
        "DistributedDataParallel(",
        "setup_distributed()",
        "DistributedSampler(",
        ".set_epoch(epoch)",
        "destroy_process_group()",
        "== 0:",
    ):
        assert needle in text, f"{name}: the rewrite lacks {needle!r}"
    assert "DataParallel(model)" not in text.replace("DistributedDataParallel", "")
    compile(text, name, "exec", dont_inherit=True)
    again = fix_source(text, DDP_ONLY, unsafe=True)
    assert again.text == text and not again.applied


def test_single_gpu_conversion_is_opt_in():
    before = _before("ddp_single_gpu")
    assert "DistributedDataParallel" not in fix_source(before, Settings(), unsafe=True).text
    assert "DistributedDataParallel" not in fix_source(before, Settings(select=("TOP4",)), unsafe=True).text
    golden = (FIXTURES / "ddp_single_gpu" / "after_opt_in.py").read_text(encoding="utf-8")
    got = fix_source(before, Settings(select=("ALL", "TOP402")), unsafe=True).text
    assert got == golden
    assert fix_source(golden, Settings(select=("ALL", "TOP402")), unsafe=True).text == golden


def test_launch_command_is_in_the_summary(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(_before("ddp_imagenet_dp"), encoding="utf-8")
    r = CliRunner().invoke(
        torchopt.cli.app,
        ["rewrite", str(path), "--select", "TOP401", "--unsafe-fixes", "--diff", "-j", "1"],
        catch_exceptions=False,
    )
    assert r.exit_code == 1, r.output
    assert "torchrun --standalone --nproc_per_node=N train.py" in r.stderr
    assert "torchrun --nnodes=M --nproc_per_node=N" in r.stderr and "per process" in r.stderr


@pytest.mark.parametrize("name", NAMES)
def test_world_size_one_is_bitwise_the_original(name, tmp_path):
    """`torchopt validate before.py after.py`: plain `python`, every probe bitwise."""
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()  # separate folders: the two runs go side by side and write files
    before, after = tmp_path / "b" / "train.py", tmp_path / "a" / "train.py"
    before.write_text(_before(name), encoding="utf-8")
    after.write_text(_ddp(name), encoding="utf-8")
    r = CliRunner().invoke(
        torchopt.cli.app,
        ["validate", str(before), str(after), "--steps", "1000", "--device", "cpu", "--json", "--timeout", "300"],
        catch_exceptions=False,
    )
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and out["verdict"] == "equivalent", r.stdout[-4000:]
    assert any(row["name"].startswith("param/") for row in out["rows"]), "no parameters were compared"


def _torchrun(script: Path, workdir: Path, out: Path) -> list[dict]:
    out.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "ddp_support.py"),
            str(script),
            str(out),
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _check_ranks(name: str, ranks: list[dict]) -> None:
    r0, r1 = ranks
    assert r0["params"] and len(r0["params"]) == len(r1["params"])
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b), f"{name}: the ranks disagree on a parameter"
    assert r1["writes"] == [], f"{name}: rank 1 wrote {r1['writes']}"
    assert r1["stdout"] == "", f"{name}: rank 1 printed {r1['stdout']!r}"
    ours = [ln for ln in r0["stderr"].splitlines() if ln and "Warning" not in ln and not ln.startswith(("[W", " "))]
    for ln in ours:
        assert ln not in r1["stderr"], f"{name}: rank 1 logged {ln!r}"
    assert r0["stdout"] or ours, f"{name}: rank 0 printed nothing"


@pytest.mark.parametrize("name", NAMES)
def test_two_gloo_ranks_agree_and_only_rank_zero_writes(name, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_ddp(name), encoding="utf-8")
    ranks = _torchrun(script, tmp_path, tmp_path / "out")
    _check_ranks(name, ranks)
    if name != "ddp_accumulation":  # the accumulation script writes no file
        assert ranks[0]["writes"], f"{name}: rank 0 wrote nothing"
    if name == "ddp_checkpoint_logging":
        # Second run resumes from rank 0's checkpoint (saved from model.module, loaded on every rank).
        again = _torchrun(script, tmp_path, tmp_path / "out2")
        _check_ranks(name, again)
        assert "resumed after epoch 1" in again[0]["stderr"]
        assert (tmp_path / "metrics.csv").read_text().count("\n") == 4


def test_amp_composes_with_ddp_under_two_ranks(tmp_path):
    """TOP401 unblocks TOP202 (which refuses DataParallel); TOP404 then puts the autocast forward and
    the scaled backward under no_sync(). The result runs on two ranks that stay in agreement."""
    text = _ddp("ddp_accumulation", Settings(select=("TOP4", "TOP2")))
    assert "torch.autocast(" in text and "no_sync()" in text and "scaler.scale(loss).backward()" in text
    w = text.index("no_sync()")
    assert w < text.index("torch.autocast(", w) < text.index("scaler.scale(loss).backward()")
    script = tmp_path / "train.py"
    script.write_text(text, encoding="utf-8")
    _check_ranks("ddp_accumulation+amp", _torchrun(script, tmp_path, tmp_path / "out"))
