"""`torchopt validate` end to end: real subprocess runs of tiny programs, on the CPU.

Each validation starts two harness processes (before and after) that import torch, so a test
costs a few seconds; programs are kept to a handful of SGD steps on a tiny model.  The
comparison logic itself is unit-tested on hand-made probes in test_validate_compare.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from torchopt.cli import app

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = sorted(p.parent.name for p in (ROOT / "fixtures").glob("*/before.py"))

# 4 SGD steps on a tiny MLP with deterministic data: the BEFORE of every wrong "rewrite".
TRAIN = """\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
X = torch.randn(16, 4, generator=g)
Y = torch.randn(16, 1, generator=g)
for step in range(4):
    opt.zero_grad()
    out = model(X)
    loss = torch.nn.functional.mse_loss(out, Y)
    loss.backward()
    opt.step()
"""


def cli(*args: object):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def validate_json(*args: object) -> tuple[int, dict]:
    res = cli("validate", *args, "--json")
    assert res.stdout.lstrip().startswith("{"), res.output
    return res.exit_code, json.loads(res.stdout)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (pycache included) with a hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------- fixtures


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_safe_rewrite_is_bitwise_equivalent(name: str) -> None:
    before = ROOT / "fixtures" / name / "before.py"
    text = before.read_bytes()
    code, out = validate_json(before, "--steps", "2", "--device", "cpu")
    assert code == 0, out
    assert out["verdict"] == "equivalent"
    expected = ROOT / "fixtures" / name / "after_safe.py"
    if out.get("notes") == ["the rewrite changes nothing"]:  # nothing to run: no safe fix applies
        assert not expected.exists() or expected.read_bytes() == text
        return
    assert out["headline"] == "EQUIVALENT (bitwise)"
    assert out["tolerance"]["bitwise"] is True
    assert out["applied"] and all(f["safety"] == "safe" for f in out["applied"])
    assert out["rows"] and all(r["verdict"] == "ok" for r in out["rows"])
    assert before.read_bytes() == text  # one-file mode rewrites in memory only


def test_fixture_unsafe_rewrite_validates_by_record_replay() -> None:
    """aliases_chains' unsafe rewrite draws other numbers even on the CPU (`T.rand(4).double()` ->
    `T.rand(4, dtype=T.float64)`); replay lets everything else, and the CPU stream after it, be
    compared value for value."""
    before = ROOT / "fixtures" / "aliases_chains" / "before.py"
    code, out = validate_json(before, "--steps", "2", "--device", "cpu", "--unsafe-fixes")
    assert code == 0, out
    assert out["verdict"] == "equivalent"
    assert any(f["code"] == "TOP102" and "rng" in f["tags"] for f in out["applied"])
    assert any("record/replay" in n for n in out["notes"])
    assert out["tolerance"]["compare_values"] is True  # values compared, not just structure
    rows = {r["name"]: r for r in out["rows"]}
    assert rows["global/double_rand"]["verdict"] == "ok" and rows["global/double_rand"]["max_abs"] == 0
    assert rows["rng/cpu"]["verdict"] == "ok"  # the dummy draw kept the CPU stream aligned
    assert all(r["verdict"] == "ok" for r in out["rows"])


# --------------------------------------------------------------------------- wrong rewrites


WRONG = {
    # lr only acts in the update after loss[0]: loss[1] is the first to differ.
    "changed-lr": (lambda s: edit(s, "lr=0.1", "lr=0.2"), 1),
    # step 0's gradients are fresh either way; step 1's update accumulates, so loss[2] differs.
    "dropped-zero_grad": (lambda s: edit(s, "    opt.zero_grad()\n", ""), 2),
    # step() before backward(): the first update uses no gradient, so loss[1] differs.
    "swapped-statements": (
        lambda s: edit(s, "    loss.backward()\n    opt.step()\n", "    opt.step()\n    loss.backward()\n"),
        1,
    ),
    # dropout changes the very first forward pass.
    "extra-dropout": (
        lambda s: edit(s, "    out = model(X)\n", "    out = torch.nn.functional.dropout(model(X), 0.1)\n"),
        0,
    ),
    # other initial weights: the very first loss differs.
    "changed-init-seed": (lambda s: edit(s, "torch.manual_seed(0)", "torch.manual_seed(1)"), 0),
}


@pytest.mark.parametrize("kind", list(WRONG))
def test_wrong_rewrite_is_caught_at_its_first_step(tmp_path: Path, kind: str) -> None:
    change, step = WRONG[kind]
    before = write(tmp_path / "before.py", TRAIN)
    after = write(tmp_path / "after.py", change(TRAIN))
    code, out = validate_json(before, after, "--steps", "4")
    assert code == 1, out
    assert out["verdict"] == "diverged"
    assert out["first_divergence"]["step"] == step
    assert out["first_divergence"]["name"] == f"loss[{step}]"
    assert out["headline"] == f"DIVERGED at step {step}, loss[{step}]"
    losses = [r for r in out["rows"] if r["name"].startswith("loss[")]
    assert [r["verdict"] for r in losses[:step]] == ["ok"] * step  # identical up to that step


# --------------------------------------------------------------------------- crash, hang


def test_crash_in_after_only_is_a_divergence(tmp_path: Path) -> None:
    before = write(tmp_path / "before.py", TRAIN)
    after = write(
        tmp_path / "after.py",
        edit(
            TRAIN,
            "    opt.step()\n",
            "    opt.step()\n    if step == 1:\n        raise RuntimeError('after-only boom')\n",
        ),
    )
    code, out = validate_json(before, after, "--steps", "4")
    assert code == 1, out
    assert out["verdict"] == "diverged"
    assert out["headline"] == "DIVERGED at step 2, crash"
    assert out["first_divergence"]["name"] == "crash"
    assert out["first_divergence"]["step"] == 2
    assert set(out["tracebacks"]) == {"after"}  # the before version completed
    tb = out["tracebacks"]["after"]
    assert f'File "{after}", line' in tb  # the program's own frame, not just the harness's
    assert tb.rstrip().endswith("RuntimeError: after-only boom")
    assert [r["verdict"] for r in out["rows"]] == ["ok", "ok"]  # losses of steps 0 and 1 agreed


def test_both_crashing_could_not_run_with_programs_traceback(tmp_path: Path) -> None:
    prog = write(
        tmp_path / "broken.py",
        "import torch\n\n\ndef load():\n    raise ValueError('cannot load the data-xyz')\n\n\nload()\n",
    )
    res = cli("validate", prog, write(tmp_path / "broken2.py", prog.read_text()), "--steps", "2")
    assert res.exit_code == 2, res.output
    assert res.stdout.startswith("COULD NOT RUN")
    for side, path in (("before", prog), ("after", tmp_path / "broken2.py")):
        assert f"Traceback ({side} version)" in res.stdout
        assert f'File "{path}", line 5, in load' in res.stdout
    assert res.stdout.count("ValueError: cannot load the data-xyz") == 2


def test_hanging_versions_time_out(tmp_path: Path) -> None:
    """Both versions hang (one hanging version alone is a divergence: see test_validate_compare.py;
    end to end it would need the other version to finish inside 5 s, which a loaded 2-core box
    does not promise). The hung processes are killed, not left behind."""
    # The pid files go to an absolute path outside the program's folder: a relative one would land
    # in the run's scratch copy, deleted with it, and the "process is gone" check could not fail.
    pids = tmp_path / "pids"
    pids.mkdir()
    hang = TRAIN.replace(
        "    opt.step()\n",
        "    opt.step()\n    if step == 1:\n        import os, time\n"
        f"        open(os.path.join({str(pids)!r}, os.path.basename(__file__) + '.pid'), 'w')"
        ".write(str(os.getpid()))\n"
        "        while True:\n            time.sleep(0.05)\n",
    )
    a, b = write(tmp_path / "prog" / "a.py", hang), write(tmp_path / "prog" / "b.py", hang)
    code, out = validate_json(a, b, "--steps", "4", "--timeout", "15")
    assert code == 2, out
    assert out["verdict"] == "could-not-run"
    assert out["tracebacks"] == {"before": "timed out after 15 s", "after": "timed out after 15 s"}
    assert "before version: timeout\ntimed out after 15 s" in out["notes"]
    assert sorted(p.name for p in pids.iterdir()) == ["a.py.pid", "b.py.pid"], "both reached their hang"
    for pid_file in pids.iterdir():
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


# --------------------------------------------------------------------------- script arguments


ARGS_SCRIPT = """\
import argparse
import torch

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.5)
args = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
X = torch.ones(8, 4)
for step in range(3):
    opt.zero_grad()
    model(X).pow(2).mean().backward()
    opt.step()
"""


def test_script_arguments_reach_both_versions(tmp_path: Path) -> None:
    """The versions differ only in the default lr: they diverge without `--lr` and agree with it."""
    before = write(tmp_path / "before.py", ARGS_SCRIPT)
    after = write(tmp_path / "after.py", edit(ARGS_SCRIPT, "default=0.5", "default=0.7"))
    code, out = validate_json(before, after, "--steps", "2")
    assert code == 1 and out["first_divergence"]["step"] == 1, out

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchopt",
            "validate",
            str(before),
            str(after),
            "--steps",
            "2",
            "--json",
            "--",
            "--lr",
            "0.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "equivalent"


def test_script_that_needs_its_arguments(tmp_path: Path) -> None:
    text = """\
import sys
import torch

lr = float(sys.argv[1])
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=lr)
for step in range(3):
    opt.zero_grad()
    model(torch.ones(8, 4)).pow(2).mean().backward()
    opt.step()
"""
    a, b = write(tmp_path / "a.py", text), write(tmp_path / "b.py", text)
    res = cli("validate", a, b, "--steps", "2")
    assert res.exit_code == 2, res.output
    assert res.stdout.count("IndexError: list index out of range") == 2

    code, out = validate_json(a, b, "--steps", "2", "--script-arg", "0.1")
    assert code == 0, out
    assert out["verdict"] == "equivalent"
    assert [r["name"] for r in out["rows"] if r["name"].startswith("loss[")] == ["loss[0]", "loss[1]"]


# --------------------------------------------------------------------------- entry mode


def test_entry_mode_serves_rewrite_from_memory(tmp_path: Path) -> None:
    write(tmp_path / "helper.py", "import torch\n\n\ndef weights():\n    return torch.randn(4, 4)\n")
    mod = write(
        tmp_path / "mymod.py",
        """\
import torch

from helper import weights

device = "cpu"


def func():
    torch.manual_seed(0)
    w = weights()
    b = torch.zeros(4).to(device)
    x = torch.ones(2, 4).to(device)
    return {"y": x @ w + b, "w": w}
""",
    )
    on_disk = snapshot(tmp_path)
    code, out = validate_json(mod, "--entry", "mymod:func", "--steps", "2")
    assert code == 0, out
    assert out["verdict"] == "equivalent" and out["headline"] == "EQUIVALENT (bitwise)"
    assert [f["code"] for f in out["applied"]] == ["TOP101", "TOP101"]
    assert {r["name"] for r in out["rows"]} >= {"return['y']", "return['w']"}
    assert snapshot(tmp_path) == on_disk  # nothing written, not even bytecode

    # Two-file entry mode: AFTER's text is served under the module's name, so a change shows.
    after = write(tmp_path / "other" / "mymod.py", edit(mod.read_text(), "x @ w + b", "x @ w - b + 1"))
    code, out = validate_json(mod, after, "--entry", "mymod:func", "--steps", "2")
    assert code == 1, out
    assert out["first_divergence"]["name"] == "return['y']"


# --------------------------------------------------------------------------- DDP under torchrun


DDP_SCRIPT = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
device = "cpu"
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
X = torch.randn(8, 4, generator=g)
target = torch.zeros(8, 2).to(device)
for step in range(2):
    opt.zero_grad()
    loss = (model(X) - target).pow(2).mean()
    loss.backward()
    opt.step()
dist.destroy_process_group()
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_torchrun_two_processes(tmp_path: Path) -> None:
    prog = write(tmp_path / "train.py", DDP_SCRIPT)
    code, out = validate_json(prog, "--nproc", "2", "--steps", "2", "--device", "cpu")
    assert code == 0, out
    assert out["verdict"] == "equivalent"
    assert [f["code"] for f in out["applied"]] == ["TOP101"]
    for label in ("before", "after"):
        assert f"{label}: all 2 ranks agree on every parameter" in out["notes"]
    names = [r["name"] for r in out["rows"]]
    assert names[:2] == ["loss[0]", "loss[1]"]
    assert "param/model.weight" in names  # DDP's `module.` prefix is stripped


# --------------------------------------------------------------------------- rewrite --validate


def test_rewrite_validate_writes_fixes_that_pass(tmp_path: Path) -> None:
    write(tmp_path / "pkg" / "helper.py", "import torch\n\n\ndef bias(device):\n    return torch.zeros(4).to(device)\n")
    entry = write(
        tmp_path / "pkg" / "entry.py",
        TRAIN.replace(
            "for step in range(4):\n",
            "from helper import bias\n\nY = Y + torch.ones(16, 1).to('cpu') + bias('cpu').sum()\nfor step in range(4):\n",
        ),
    )
    res = cli("rewrite", tmp_path / "pkg", "--validate", entry, "--steps", "2")
    assert res.exit_code == 0, res.output
    assert "computes the same thing with every fix (TOP101)" in res.stderr
    assert "torch.ones(16, 1, device='cpu')" in entry.read_text()
    assert "torch.zeros(4, device=device)" in (tmp_path / "pkg" / "helper.py").read_text()


ENTRY_SEMANTICS = """\
import torch

device = "cpu"
scale = torch.ones(3, requires_grad=True).double()
scale.mul_(2)  # fine on a non-leaf; a leaf that requires grad refuses in-place ops
w = torch.zeros(3).to(device)
"""


def test_rewrite_validate_writes_only_what_passed(tmp_path: Path) -> None:
    """TOP102's unsafe fix makes `scale` a leaf, so the rewritten program crashes: not written;
    TOP101 alone passes and is written."""
    entry = write(tmp_path / "entry.py", ENTRY_SEMANTICS)
    res = cli("rewrite", tmp_path, "--unsafe-fixes", "--validate", entry, "--steps", "2")
    assert res.exit_code == 0, res.output
    assert "a leaf Variable that requires grad is being used in an in-place operation" in res.stderr
    assert "TOP101 in " in res.stderr and "entry.py: passes" in res.stderr
    assert "TOP102 in " in res.stderr and "entry.py: diverges: not written: crash" in res.stderr
    assert entry.read_text() == edit(ENTRY_SEMANTICS, "torch.zeros(3).to(device)", "torch.zeros(3, device=device)")


def test_rewrite_validate_writes_nothing_when_rewrite_crashes(tmp_path: Path) -> None:
    entry = write(tmp_path / "entry.py", ENTRY_SEMANTICS)
    on_disk = snapshot(tmp_path)
    res = cli("rewrite", tmp_path, "--unsafe-fixes", "--select", "TOP102", "--validate", entry, "--steps", "2")
    assert res.exit_code == 1, res.output
    assert "DIVERGED at step 0, crash" in res.stderr
    assert "nothing written" in res.stderr
    assert snapshot(tmp_path) == on_disk
