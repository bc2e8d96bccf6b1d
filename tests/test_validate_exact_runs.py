"""`torchopt validate` end to end on programs that used to fool it: a pass that compared nothing,
fixes it could not check, a program that traces its model, two versions fighting over a port, and
writes aimed at the user's files. Each test starts harness subprocesses."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchopt.cli import app

pytestmark = pytest.mark.slow  # whole programs under the validator, ~5-40 s each

ROOT = Path(__file__).resolve().parents[1]
CNN = ROOT / "tests" / "data" / "validate" / "cnn_train.py"


def cli(*args: object):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def validate_json(*args: object) -> tuple[int, dict]:
    res = cli("validate", *args, "--json", "--device", "cpu", "--steps", "2")
    assert res.stdout.lstrip().startswith("{"), res.output
    return res.exit_code, json.loads(res.stdout)


def tree_hash(folder: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cnn_unsafe_rewrite_is_validated_whole(tmp_path: Path) -> None:
    """Every fix `rewrite --unsafe-fixes` writes is in the validated program (6 of 12 before)."""
    script = tmp_path / "train.py"
    script.write_text(CNN.read_text(encoding="utf-8"), encoding="utf-8")
    code, out = validate_json(script, "--unsafe-fixes")
    written = tmp_path / "w.py"
    written.write_text(CNN.read_text(encoding="utf-8"), encoding="utf-8")
    res = cli("rewrite", written, "--unsafe-fixes", "--no-cache", "--output-format", "json")
    fixed = sorted(r["code"] for r in json.loads(res.stdout) if r.get("fixed"))
    assert sorted(f["code"] for f in out["applied"]) == fixed
    assert out["verdict"] == "equivalent", out["headline"]
    # the bias-free convolution runs from the original's values, and the DataLoader with workers is
    # checked batch for batch against the original's: every fix is exercised
    assert not out["unvalidated"]
    assert any("DataLoader yielded the original's batches" in n for n in out["notes"])
    assert code == 0


def test_a_pass_that_compared_no_value_is_inconclusive(tmp_path: Path) -> None:
    """Two versions that compute nothing comparable (a clock reading) no longer pass: exit 3."""
    a = tmp_path / "a.py"
    a.write_text("import time\n\nt0 = time.time()\n", encoding="utf-8")
    b = tmp_path / "b.py"
    b.write_text("import time\n\nt0 = time.time()  # started\n", encoding="utf-8")
    code, out = validate_json(a, b)
    assert out["verdict"] == "inconclusive" and out["headline"].startswith("INCONCLUSIVE"), out
    assert code == 3


def test_second_file_that_is_torchopts_rewrite_is_compared_by_value(tmp_path: Path) -> None:
    """`validate a.py rewritten.py` with a random-stream fix used to check structure only and exit 0;
    the rewrite is recognised and replayed, so values are compared."""
    src = "import torch\n\nx = torch.rand(40).double()\ny = x * 2\n"
    a = tmp_path / "a.py"
    a.write_text(src, encoding="utf-8")
    b = tmp_path / "b.py"
    b.write_text(src, encoding="utf-8")
    assert cli("rewrite", b, "--unsafe-fixes", "--no-cache").exit_code == 0
    assert b.read_text(encoding="utf-8") != src
    code, out = validate_json(a, b, "--unsafe-fixes")
    assert out["tolerance"]["compare_values"] is True
    rows = {r["name"]: r for r in out["rows"]}
    assert rows["global/y"]["verdict"] == "ok" and rows["global/y"]["max_abs"] == 0
    assert code == 0, out["headline"]


CLASS_BODY = """\
import torch


class Config:
    n = 40
    noise = torch.rand(n).double()


y = torch.ones(3) * 2
z = torch.ones(2).to("cpu")
"""


def test_a_fix_that_cannot_be_validated_is_listed_and_exits_4(tmp_path: Path) -> None:
    a = tmp_path / "a.py"
    a.write_text(CLASS_BODY, encoding="utf-8")
    code, out = validate_json(a, "--unsafe-fixes")
    assert [f["code"] for f in out["unvalidated"]] == ["TOP102"]
    assert "class body" in out["unvalidated"][0]["why"]
    assert code == 4
    res = cli("validate", a, "--unsafe-fixes", "--device", "cpu", "--allow-unvalidated", "TOP102")
    assert "Not validated (1" in res.stdout and "because it" in res.stdout
    assert res.exit_code == 0, res.stdout


def test_rewrite_validate_never_writes_an_unvalidated_fix(tmp_path: Path) -> None:
    a = tmp_path / "a.py"
    a.write_text(CLASS_BODY, encoding="utf-8")
    res = cli("rewrite", a, "--unsafe-fixes", "--no-cache", "--validate", a, "--device", "cpu", "--steps", "2")
    assert "not validated, so not written" in res.stderr and "class body" in res.stderr
    written = a.read_text(encoding="utf-8")
    assert "noise = torch.rand(n).double()" in written  # the fix it could not check: not written
    assert 'z = torch.ones(2, device="cpu")' in written  # the safe fix beside it, validated: written


TRACE = """\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(16, 4)
Y = torch.randn(16, 1)
traced = torch.jit.trace(model, X[:2])
for step in range(3):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), Y)
    loss.backward()
    opt.step()
"""


def test_tracing_sees_the_program_not_the_harness(tmp_path: Path) -> None:
    """torch.jit.trace checks its trace by tracing again; the probe recorder's input copies showed
    up in the first trace only, so the program failed under the harness (not under python)."""
    a = tmp_path / "a.py"
    a.write_text(TRACE, encoding="utf-8")
    b = tmp_path / "b.py"
    b.write_text(TRACE.replace("lr=0.1", "lr=0.1 "), encoding="utf-8")
    code, out = validate_json(a, b)
    assert out["verdict"] == "equivalent", out["notes"][:3]
    assert code == 0


def test_a_failure_of_the_harness_is_not_blamed_on_the_program(tmp_path: Path) -> None:
    """When both versions fail under the harness but the original runs on its own, the report says
    the harness is at fault; it never asks the user to fix a program that works."""
    src = "import builtins\n\nif hasattr(builtins, '__torchopt_site__'):\n    raise RuntimeError('only under the harness')\n"
    a = tmp_path / "a.py"
    a.write_text(src, encoding="utf-8")
    b = tmp_path / "b.py"
    b.write_text(src + "# b\n", encoding="utf-8")
    code, out = validate_json(a, b)
    assert out["verdict"] == "could-not-run" and code == 2
    assert "bug in torchopt" in out["notes"][0]
    assert not any("fix the original" in n for n in out["notes"])


PORT = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(8, 4)
for step in range(3):
    opt.zero_grad()
    model(X).pow(2).mean().backward()
    opt.step()
dist.destroy_process_group()
"""


def test_versions_that_bind_the_same_port_do_not_collide(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a = tmp_path / "a.py"
    a.write_text(PORT.format(port=port), encoding="utf-8")
    b = tmp_path / "b.py"
    b.write_text(PORT.format(port=port) + "# b\n", encoding="utf-8")
    code, out = validate_json(a, b)
    assert out["verdict"] == "equivalent", (out["headline"], out["notes"][:3])
    assert code == 0


WRITES = """\
import os, shutil, sqlite3
import numpy as np
import torch

target = {target!r}
model = torch.jit.script(torch.nn.Linear(2, 2))
for attempt in (
    lambda: torch.jit.save(model, os.path.join(target, "model.pt")),
    lambda: open(os.path.join(target, "log.txt"), "w").write("x"),
    lambda: sqlite3.connect(os.path.join(target, "runs.db")).execute("create table t (x)"),
    lambda: np.save(os.path.join(target, "arr.npy"), np.zeros(2)),
    lambda: os.replace(os.path.join(target, "keep.txt"), os.path.join(target, "moved.txt")),
    lambda: os.remove(os.path.join(target, "keep.txt")),
    lambda: shutil.copy(__file__, os.path.join(target, "copy.py")),
    lambda: shutil.rmtree(os.path.join(target, "sub")),
):
    try:
        attempt()
    except PermissionError:
        pass
y = torch.ones(2) * 3
"""


def test_writes_outside_the_scratch_copy_are_refused(tmp_path: Path) -> None:
    """Absolute paths into the user's folder, by every kind of write: the tree is unchanged."""
    folder = tmp_path / "project"
    (folder / "sub").mkdir(parents=True)
    (folder / "keep.txt").write_text("keep", encoding="utf-8")
    (folder / "sub" / "data.txt").write_text("data", encoding="utf-8")
    a = folder / "a.py"
    a.write_text(WRITES.format(target=str(folder)), encoding="utf-8")
    b = folder / "b.py"
    b.write_text(WRITES.format(target=str(folder)) + "# b\n", encoding="utf-8")
    before = tree_hash(folder)
    code, out = validate_json(a, b)
    assert tree_hash(folder) == before
    assert not any(n.startswith("WARNING") for n in out["notes"]), out["notes"]
    assert code == 0, out["headline"]
