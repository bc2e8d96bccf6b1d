"""`torchopt validate` as a gate: no false alarms on right programs, the fix that broke a wrong
one named, run options shared by `rewrite --validate`, and `--bench` figures.

End to end on the CPU with tiny programs (each validation is two harness processes; a bisect or a
benchmark a few more). Every test checks that the user's tree is byte-identical afterwards (or
holds exactly the expected rewrite) and that nothing next to it changed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchopt.cli import app, split_script_args


def cli(*args: object):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def validate_json(*args: object) -> tuple[int, dict, str]:
    res = cli("validate", *args, "--json")
    assert res.stdout.lstrip().startswith("{"), res.output
    return res.exit_code, json.loads(res.stdout), res.stdout


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def row(out: dict, name: str) -> dict:
    return next(r for r in out["rows"] if r["name"] == name)


# --------------------------------------------------------------------------- no false alarms

# nanoGPT-style logging: wall-clock, an MFU estimate from it, process facts, a Python random draw
# from an unseeded generator. Deterministic tensors: the program compared with itself is the same.
CLOCKED = """\
import datetime
import os
import random
import time
from time import perf_counter

import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(16, 4)
Y = torch.randn(16, 1)
random.seed()  # from the OS: differs between runs
jitter = random.random()
pid = os.getpid()
started = datetime.datetime.now().timestamp()
history = {"time": [], "loss": []}
running_mfu = -1.0


def estimate_mfu(flops, dt):
    return flops / dt / 1e12


t0 = time.time()
for iter_num in range(3):
    t1 = perf_counter()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), Y)
    loss.backward()
    opt.step()
    lossf = loss.item()
    t2 = time.time()
    dt = t2 - t0
    t0 = t2
    iter_time = perf_counter() - t1
    mfu = estimate_mfu(1e6, dt)
    running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
    history["time"].append(dt)
    history["loss"].append(lossf)
"""


def test_same_program_with_clock_and_process_globals_is_equivalent(tmp_path: Path) -> None:
    script = write(tmp_path / "prog" / "train.py", CLOCKED)
    before = tree(tmp_path)
    code, out, _ = validate_json(script, script, "--steps", "3", "--device", "cpu")
    assert code == 0, out
    assert out["verdict"] == "equivalent"
    for name in (
        "global/dt",
        "global/t0",
        "global/iter_time",
        "global/mfu",
        "global/running_mfu",
        "global/pid",
        "global/jitter",
        "global/started",
        "global/history['time'][0]",
    ):
        assert row(out, name)["verdict"] == "skipped", name
    # What the program computed from its data is still compared, bit for bit.
    for name in ("global/lossf", "global/history['loss'][1]", "global/iter_num", "loss[2]", "param/model.weight"):
        assert row(out, name)["verdict"] == "ok" and row(out, name)["tolerance"] in ("bitwise", "exact"), name
    assert any("hold clock, process or random values and are not compared" in n for n in out["notes"])
    assert tree(tmp_path) == before


ONE_TEMPORARY = """\
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(16, 4)
Y = torch.randn(16, 1)
for step in range(3):
    opt.zero_grad()
    out = model(X)
    loss = torch.nn.functional.mse_loss(out, Y)
    loss.backward()
    opt.step()
"""


def test_a_global_named_in_one_version_only_is_a_note(tmp_path: Path) -> None:
    a = write(tmp_path / "prog" / "a.py", ONE_TEMPORARY)
    b = write(
        tmp_path / "prog" / "b.py",
        ONE_TEMPORARY.replace(
            "    out = model(X)\n    loss = torch.nn.functional.mse_loss(out, Y)\n",
            "    loss = torch.nn.functional.mse_loss(model(X), Y)\n",
        ),
    )
    before = tree(tmp_path)
    code, out, _ = validate_json(a, b, "--steps", "3", "--device", "cpu")
    assert code == 0, out
    assert row(out, "global/out") == {**row(out, "global/out"), "verdict": "skipped", "detail": "only in the original"}
    assert any("exist in one version only" in n and "global/out" in n for n in out["notes"])
    assert tree(tmp_path) == before


# A plain CNN trained with SGD and momentum; TOP202 turns its step into autocast + GradScaler.
CNN = """\
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.fc = nn.Linear(16 * 5 * 5, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        x = F.adaptive_avg_pool2d(x, 5).flatten(1)
        return F.log_softmax(self.fc(x), dim=1)


model = Net().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(1)
data = torch.randn(64, 1, 16, 16, generator=g)
target = torch.randint(0, 10, (64,), generator=g)
for epoch in range(100):
    for i in range(0, 64, 16):
        x, y = data[i:i + 16].to(device), target[i:i + 16].to(device)
        optimizer.zero_grad()
        output = model(x)
        loss = F.nll_loss(output, y)
        loss.backward()
        optimizer.step()
"""


@pytest.mark.parametrize("steps", [3, 20])
def test_amp_cnn_passes_within_its_noise_floor(tmp_path: Path, steps: int) -> None:
    """After AMP training the parameters and the probe batch's outputs drift (by more than the
    flat output bound at 20 steps), as they do in the original run inside autocast: every probe
    is held to that run's distance (docs/validation.md, "The noise floor")."""
    script = write(tmp_path / "prog" / "cnn.py", CNN)
    before = tree(tmp_path)
    code, out, _ = validate_json(script, "--unsafe-fixes", "--select", "TOP202", "--steps", steps, "--device", "cpu")
    assert code == 0, (out["headline"], out["first_divergence"])
    assert [f["code"] for f in out["applied"]] == ["TOP202"]
    assert row(out, "output/model")["tolerance"].startswith("4×ref (")
    assert row(out, f"loss[{steps - 1}]")["verdict"] == "ok"
    assert tree(tmp_path) == before


# --------------------------------------------------------------------------- which fix broke

# Two safe TOP101 fixes and TOP831 (`zero_grad(set_to_none=False)` -> `zero_grad()`), which is
# wrong here: `head` gets a gradient in step 0 only; with zeros, weight decay and momentum keep
# moving it, with None the optimizer skips it. Needs `--dataset fake`.
TWO_FIXES = """\
import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--dataset", choices=["fake", "mnist"], required=True)
args = parser.parse_args()
torch.manual_seed(0)
device = "cpu"
model = torch.nn.Linear(4, 2)
head = torch.nn.Linear(2, 2)
opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1, momentum=0.9, weight_decay=0.1)
X = torch.ones(8, 4).to(device)
Y = torch.zeros(8, 2).to(device)
for step in range(3):
    opt.zero_grad(set_to_none=False)
    out = model(X)
    if step == 0:
        out = head(out)
    loss = torch.nn.functional.mse_loss(out, Y)
    loss.backward()
    opt.step()
"""


def test_divergence_is_bisected_to_the_wrong_fix(tmp_path: Path) -> None:
    script = write(tmp_path / "prog" / "train.py", TWO_FIXES)
    before = tree(tmp_path)
    code, out, _ = validate_json(
        script,
        "--unsafe-fixes",
        "--steps",
        "3",
        "--device",
        "cpu",
        "--jobs",
        "2",
        "--script-arg=--dataset",
        "--script-arg=fake",
    )
    assert code == 1, out
    # The report names every applied fix: code, file:line, title, safety and tags.
    assert [(f["code"], f["line"], f["safety"], f["tags"]) for f in out["applied"]] == [
        ("TOP101", 13, "safe", []),
        ("TOP101", 14, "safe", []),
        ("TOP831", 16, "unsafe", ["semantics"]),
    ]
    assert all(f["path"] == str(script) and f["title"] for f in out["applied"])
    culprits = out["bisect"]["culprits"]
    assert [(f["code"], f["line"]) for f in culprits] == [("TOP831", 16)]
    first = out["bisect"]["first_divergence"]
    assert first["name"] == "param/head.weight" and first["max_abs"] > 0
    res = cli(
        "validate",
        script,
        "--unsafe-fixes",
        "--steps",
        "3",
        "--device",
        "cpu",
        "--jobs",
        "2",
        "--script-arg=--dataset",
        "--script-arg=fake",
    )
    assert "Fixes applied (3):" in res.stdout
    assert f"TOP831 {script}:16:5 Set gradients to None" in res.stdout
    assert "the smallest set of fixes that diverges (1 of 3)" in res.stdout
    assert "first difference with only this fix: param/head.weight at step 3" in res.stdout
    assert tree(tmp_path) == before


def test_rewrite_validate_takes_script_args_and_writes_the_largest_passing_set(tmp_path: Path) -> None:
    script = write(tmp_path / "prog" / "train.py", TWO_FIXES)
    bystander = write(tmp_path / "notes.txt", "not part of the run\n")
    argv = split_script_args(
        [
            "torchopt",
            "rewrite",
            str(tmp_path / "prog"),
            "--unsafe-fixes",
            "--validate",
            str(script),
            "--steps",
            "3",
            "--device",
            "cpu",
            "--timeout",
            "120",
            "--no-cache",
            "--",
            "--dataset",
            "fake",
        ]
    )
    res = cli(*argv[1:])
    assert res.exit_code == 0, res.output
    assert "train.py: diverges: not written: param/head.weight at step 3" in res.stderr
    assert "max abs err" in res.stderr
    assert "TOP101 in " in res.stderr and "train.py: passes" in res.stderr
    expected = TWO_FIXES.replace("torch.ones(8, 4).to(device)", "torch.ones(8, 4, device=device)").replace(
        "torch.zeros(8, 2).to(device)", "torch.zeros(8, 2, device=device)"
    )
    assert script.read_text() == expected
    assert sorted(tree(tmp_path)) == ["notes.txt", "prog/train.py"]
    assert bystander.read_text() == "not part of the run\n"


def test_rewrite_validate_without_its_arguments_cannot_validate(tmp_path: Path) -> None:
    """Without `--dataset fake` the script exits in argparse in both versions: nothing written."""
    script = write(tmp_path / "prog" / "train.py", TWO_FIXES)
    before = tree(tmp_path)
    res = cli("rewrite", tmp_path / "prog", "--validate", script, "--steps", "3", "--device", "cpu", "--no-cache")
    assert res.exit_code == 1, res.output
    assert "could not run; fix it first" in res.stderr
    assert tree(tmp_path) == before


def test_script_args_after_double_dash_go_to_the_script_only_with_validate() -> None:
    assert split_script_args(["torchopt", "rewrite", "src", "--validate", "t.py", "--", "--lr", "1"]) == [
        "torchopt",
        "rewrite",
        "src",
        "--validate",
        "t.py",
        "--script-arg=--lr",
        "--script-arg=1",
    ]
    assert split_script_args(["torchopt", "rewrite", "--", "-odd.py"]) == ["torchopt", "rewrite", "--", "-odd.py"]


# --------------------------------------------------------------------------- what it buys

BENCHED = ONE_TEMPORARY.replace("range(3)", "range(8)")


def test_bench_reports_step_times_memory_and_speedup_on_cpu(tmp_path: Path) -> None:
    script = write(
        tmp_path / "prog" / "train.py",
        BENCHED.replace("Y = torch.randn(16, 1)\n", "Y = torch.randn(16, 1)\nZ = torch.zeros(4).to('cpu')\n"),
    )
    before = tree(tmp_path)
    code, out, _ = validate_json(
        script, "--steps", "8", "--device", "cpu", "--bench", "--bench-repeats", "2", "--bench-warmup", "2"
    )
    assert code == 0, out
    bench = out["bench"]
    for side in ("before", "after"):
        assert bench[side]["median_step_s"] > 0 and bench[side]["steps_per_s"] > 0
        assert bench[side]["peak_memory_bytes"] > 0 and len(bench[side]["run_medians_s"]) == 2
    assert bench["speedup"] > 0 and len(bench["speedup_ci95"]) == 2
    assert bench["speedup_ci95"][0] <= bench["speedup"] <= bench["speedup_ci95"][1]
    assert any("CPU speed says nothing of GPU speed" in n for n in bench["notes"])
    res = cli("validate", script, "--steps", "8", "--device", "cpu", "--bench", "--bench-repeats", "1")
    assert "before: median step" in res.stdout and "after:  median step" in res.stdout
    assert "speed-up:" in res.stdout and "(one round: no interval)" in res.stdout
    assert "CPU speed says nothing of GPU speed" in res.stdout
    assert tree(tmp_path) == before
