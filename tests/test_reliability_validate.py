"""The validator leaves the user's files alone and leaves no process behind.

Each version runs in a scratch copy of its folder; writes aimed at the user's folder are refused;
every process a run started (including `setsid` daemons) is killed when the run ends or times
out; entry files are read the way the rewrite engine reads them (coding line, BOM). Programs are
tiny (a 2-parameter model, 2 steps, CPU); each test costs two harness processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.validate import scratch

LINUX = sys.platform.startswith("linux") and os.path.isdir("/proc")

# Reads what it finds in the folder, appends to log.txt (its line count feeds the model input, so
# one version seeing the other's line would diverge) and checkpoints to model.pt every step.
CHECKPOINTING = """\
import torch

torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with open("data/scale.txt") as fh:
    scale = float(fh.read())
with open("log.txt", "a") as fh:
    fh.write("run\\n")
with open("log.txt") as fh:
    lines = len(fh.readlines())
X = torch.ones(4, 2).to("cpu") * scale * lines
for step in range(2):
    opt.zero_grad()
    loss = (model(X) ** 2).mean()
    loss.backward()
    opt.step()
    torch.save(model.state_dict(), "model.pt")
"""


def cli(*args: object):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def tree(folder: Path) -> dict[str, bytes]:
    """Every file and link under ``folder`` with the hash of its bytes (or its link target)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = b"link:" + os.readlink(p).encode()
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).digest()
        else:
            out[rel] = b"dir"
    return out


def project(tmp_path: Path, program: str) -> Path:
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "scale.txt").write_text("0.5\n")
    (proj / "log.txt").write_text("old line\n")
    (proj / "model.pt").write_bytes(b"the user's checkpoint")
    (tmp_path / "sibling.txt").write_text("outside the project\n")
    entry = proj / "train.py"
    entry.write_text(program, encoding="utf-8")
    return entry


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped does not count)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


# --------------------------------------------------------------------------- scratch copies


def test_each_version_runs_in_its_own_copy_and_the_tree_is_untouched(tmp_path: Path) -> None:
    entry = project(tmp_path, CHECKPOINTING)
    before = tree(tmp_path)
    res = cli("validate", entry, "--steps", "2", "--device", "cpu", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    # Each version saw only its own log line: the same input, hence bitwise the same.
    assert out["verdict"] == "equivalent" and out["headline"] == "EQUIVALENT (bitwise)"
    rows = {r["name"]: r for r in out["rows"]}
    assert rows["global/lines"]["verdict"] == "ok"
    for label in ("before", "after"):
        assert (
            f"{label} version wrote, in its scratch copy of its folder (discarded): "
            "log.txt (changed), model.pt (changed)"
        ) in out["notes"]
    assert not any(n.startswith("WARNING") for n in out["notes"])
    assert tree(tmp_path) == before  # model.pt, log.txt and everything around them byte-identical


WRITES_INTO_TREE = {
    "torch.save to an absolute path": "torch.save(model.state_dict(), {target!r})\n",
    "open for append by absolute path": "open({target!r}, 'a').write('x')\n",
    "write through a link to a large file": "open('data/big.bin', 'r+b').write(b'overwritten')\n",
}


@pytest.mark.parametrize("kind", list(WRITES_INTO_TREE))
def test_writes_into_the_users_folder_are_refused(tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scratch, "COPY_FILE_LIMIT", 1000)  # big.bin is linked, not copied
    target = tmp_path / "proj" / "model.pt"
    program = CHECKPOINTING + WRITES_INTO_TREE[kind].format(target=str(target))
    entry = project(tmp_path, program)
    (tmp_path / "proj" / "data" / "big.bin").write_bytes(b"\0" * 4000)
    before = tree(tmp_path)
    res = cli("validate", entry, "--steps", "5", "--device", "cpu")
    assert res.exit_code == 2, res.output  # both versions stopped by the same refusal
    assert res.stdout.startswith("COULD NOT RUN")
    refused = target if "absolute" in kind else tmp_path / "proj" / "data" / "big.bin"
    assert res.stdout.count("PermissionError: [Errno 13] torchopt validate: refusing to write into your folder") == 2
    assert str(refused.resolve()) in res.stdout.replace("\n", "")
    assert tree(tmp_path) == before


# --------------------------------------------------------------------------- process trees


DAEMON = """\
import os, subprocess, sys, time
out = {out!r}
code = ("import os, sys, time; os.setsid(); "
        "open(os.path.join(sys.argv[1], str(os.getpid()) + '.pid'), 'w').write('x'); "
        "time.sleep(60); open(os.path.join(sys.argv[1], 'marker'), 'w').write('late')")
subprocess.Popen([sys.executable, "-c", code, out])
for _ in range(400):  # wait until the daemon is up, so that killing it is what the test sees
    if any(n.endswith(".pid") for n in os.listdir(out)):
        break
    time.sleep(0.05)
"""


@pytest.mark.skipif(not LINUX, reason="process trees are tracked through /proc")
@pytest.mark.parametrize("ending", ["normal end", "timeout"])
def test_every_process_a_run_started_is_killed(tmp_path: Path, ending: str) -> None:
    """A `setsid` daemon leaves the run's process group; it must still be gone when validate
    returns (so it never writes the marker it would write a minute later)."""
    out = tmp_path / "daemon"
    out.mkdir()
    program = CHECKPOINTING.replace("import torch\n", "import torch\n" + DAEMON.format(out=str(out)), 1)
    if ending == "timeout":
        program = program.replace(
            "for step in range(2):", "import time\nwhile True:\n    time.sleep(0.05)\nfor step in range(2):"
        )
    entry = project(tmp_path, program)
    proj_before = tree(tmp_path / "proj")
    args = ["validate", entry, "--steps", "2", "--device", "cpu"]
    res = cli(*args, "--timeout", "20") if ending == "timeout" else cli(*args)
    assert res.exit_code == (2 if ending == "timeout" else 0), res.output
    pids = [int(p.name[:-4]) for p in out.glob("*.pid")]
    if ending == "normal end":
        assert len(pids) == 2  # one daemon per version
    assert pids or ending == "timeout"  # (a loaded machine may time out before the daemon starts)
    assert not [pid for pid in pids if alive(pid)]  # killed, so its late marker can never appear
    assert not (out / "marker").exists()
    assert tree(tmp_path / "proj") == proj_before


# --------------------------------------------------------------------------- encodings


ENCODED = {"latin-1 coding line": ("latin-1", "# -*- coding: latin-1 -*-\n"), "UTF-8 BOM": ("utf-8-sig", "")}


@pytest.mark.parametrize("kind", list(ENCODED))
def test_rewrite_validate_reads_entry_and_modules_as_the_engine_does(tmp_path: Path, kind: str) -> None:
    encoding, header = ENCODED[kind]
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    helper_text = (
        header + 'NAME = "café"\n\n\ndef bias(device):\n    import torch\n\n    return torch.zeros(2).to(device)\n'
    )
    entry_text = (
        header
        + "# données\nimport torch\n\nimport helper\n\ntorch.manual_seed(0)\n"
        + "width = torch.full((1,), float(len(helper.NAME)))\n"
        + "model = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        + 'X = torch.ones(4, 2).to("cpu") + helper.bias("cpu")\nfor step in range(3):\n'
        + "    opt.zero_grad()\n    (model(X) ** 2).mean().backward()\n    opt.step()\n"
    )
    (pkg / "helper.py").write_bytes(helper_text.encode(encoding))
    entry = pkg / "entry.py"
    entry.write_bytes(entry_text.encode(encoding))
    (tmp_path / "outside.txt").write_text("untouched\n")
    res = cli("rewrite", pkg, "--validate", entry, "--steps", "2")
    assert res.exit_code == 0, res.output
    assert "computes the same thing with every fix (TOP101)" in res.stderr
    expected_entry = entry_text.replace('torch.ones(4, 2).to("cpu")', 'torch.ones(4, 2, device="cpu")')
    expected_helper = helper_text.replace("torch.zeros(2).to(device)", "torch.zeros(2, device=device)")
    assert entry.read_bytes() == expected_entry.encode(encoding)
    assert (pkg / "helper.py").read_bytes() == expected_helper.encode(encoding)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["entry.py", "helper.py", "outside.txt", "pkg"]
    assert (tmp_path / "outside.txt").read_text() == "untouched\n"
