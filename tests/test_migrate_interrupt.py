"""Ctrl-C during `torchopt migrate`: workers leave it to the parent, which stops them (they do not
finish the repository or file under way), exits 130 with one line, and leaves every repository
byte-identical, no scratch folder in the temp folder, no process behind, and in --out only its state
file (for --resume), never a half-written one. Also: the workers get the parent's LibCST speed-ups."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchopt.migrate import task
from torchopt.rewrite import speedups

BEFORE = 'import torch\ndevice = "cpu"\nx = torch.zeros(3).to(device)\n'
IDENTITY = {
    "GIT_AUTHOR_NAME": "T",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "T",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}

# The migration under test, with the work of each repository (or each chunk of files) replaced by a
# wait far longer than the test: it marks that it started, and that it finished if it ever does.
# The pools fork, so the replacement reaches the workers.
STUCK_RUN = """
import sys, time
from pathlib import Path
import torchopt.migrate.task as task

marks = Path(sys.argv[1])


def stuck(items, *args, **kw):
    name = f"{Path(items[0][0]).parent.name}-{Path(items[0][0]).name}-{len(items)}"
    (marks / f"started-{name}").touch()
    time.sleep(60)
    (marks / f"finished-{name}").touch()
    return []


setattr(task, sys.argv[2], stuck)
from torchopt.cli import main
sys.argv = ["torchopt", "migrate", *sys.argv[3:]]
main()
"""


# The same, with the creation of the first repository's branch slowed down: Ctrl-C arrives while its
# commit is being made.
SLOW_COMMIT_RUN = """
import sys, time
from pathlib import Path
import torchopt.migrate.git as git

marks = Path(sys.argv[1])
real = git.create_branch


def slow(*args, **kw):
    (marks / "started").touch()
    time.sleep(1)
    return real(*args, **kw)


git.create_branch = slow
from torchopt.cli import main
sys.argv = ["torchopt", "migrate", *sys.argv[2:]]
main()
"""


def git(cwd: Path, *args: str) -> bytes:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", *args], cwd=cwd, env={**env, **IDENTITY}, check=True, capture_output=True).stdout


def make_repo(root: Path, name: str, files: int) -> Path:
    repo = root / name
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for i in range(files):
        (repo / f"train{i}.py").write_text(BEFORE)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "init")
    return repo


def tree_state(root: Path) -> dict[str, bytes]:
    state = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() or path.is_symlink():
            state[str(path.relative_to(root))] = (
                oct(path.lstat().st_mode).encode()
                + b":"
                + (os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
            )
    return state


def processes_mentioning(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in argv and state != "Z":
                found.append(int(entry))
    return found


# (what is replaced, repositories and their files, arguments, how many pieces of work run at once)
CASES = {
    "pool over repositories": ("_fix_all", {"first": 1, "second": 1, "third": 1}, ["-j", "2", "--commit"], 2),
    "pool over one repository's files": ("_fix_chunk", {"big": 16}, ["-j", "2"], 2),
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("case", sorted(CASES))
def test_ctrl_c_stops_migrate_cleanly(tmp_path, case):
    replaced, repos, args, busy = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    for name, files in repos.items():
        make_repo(work, name, files)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    marks = tmp_path / "marks"
    marks.mkdir()
    out = tmp_path / "out"
    before = tree_state(work)
    script = [
        STUCK_RUN,
        str(marks),
        replaced,
        *(str(work / n) for n in repos),
        "--out",
        str(out),
        "--select",
        "TOP101",
        *args,
    ]
    code, stderr = start_and_interrupt(tmp_path, script, busy)
    assert code == 130, stderr
    assert stderr.splitlines() == ["interrupted"]  # no worker's traceback
    assert not [m for m in os.listdir(marks) if m.startswith("finished-")]
    assert processes_mentioning(str(marks)) == []
    assert tree_state(work) == before  # no branch, no object, no file changed
    assert os.listdir(scratch) == []
    assert os.listdir(out) == ["migrate-state.json"]


def start_and_interrupt(tmp_path: Path, script: list[str], busy: int) -> tuple[int, str]:
    """Run ``script`` (its arguments after it) until ``busy`` marks exist, then press Ctrl-C."""
    marks = tmp_path / "marks"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(IDENTITY, TMPDIR=str(tmp_path / "tmp"))
    proc = subprocess.Popen(
        [sys.executable, "-c", *script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for _ in range(1200):  # until every worker is inside its work (at most a minute)
            if len(os.listdir(marks)) >= busy or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert len(os.listdir(marks)) == busy, proc.communicate(timeout=60)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground process group
        _, stderr = proc.communicate(timeout=30)  # stuck work would take 60 s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, stderr


def test_ctrl_c_during_a_commit_lets_it_finish_and_records_it(tmp_path):
    """The commit under way is completed, never half made, and --resume knows it is done; the next
    repository is not started."""
    work = tmp_path / "work"
    work.mkdir()
    first, second = make_repo(work, "first", 1), make_repo(work, "second", 1)
    for name in ("tmp", "marks"):
        (tmp_path / name).mkdir()
    out = tmp_path / "out"
    second_before = tree_state(second)
    args = [str(first), str(second), "--out", str(out), "--select", "TOP101", "--commit", "-j", "1"]
    code, stderr = start_and_interrupt(tmp_path, [SLOW_COMMIT_RUN, str(tmp_path / "marks"), *args], 1)
    assert code == 130, stderr
    assert stderr.splitlines() == ["interrupted"]
    assert (
        git(first, "cat-file", "blob", "torchopt/migrate:train0.py")
        == b'import torch\ndevice = "cpu"\nx = torch.zeros(3, device=device)\n'
    )
    assert git(first, "status", "--porcelain") == b""
    assert tree_state(second) == second_before
    assert os.listdir(tmp_path / "tmp") == []
    assert sorted(os.listdir(out)) == ["first.patch", "migrate-state.json"]
    state = json.loads((out / "migrate-state.json").read_text())
    assert state["repos"][str(first)]["status"] == "changed"
    assert state["pending"] == [str(second)]


def speedups_of_this_process(items: list) -> list:
    """Stands in for the fix of a chunk of files: what a worker reports is its LibCST speed-ups."""
    return [speedups.installed()] * len(items)


def test_file_workers_get_the_speedups_even_when_spawned(monkeypatch):
    """A spawned (or forkserver) worker does not inherit the parent's patched LibCST: the pool's
    initializer must install the same fast paths there."""
    had = speedups.installed()
    wanted = speedups.install()
    try:
        if not wanted:
            pytest.skip("no LibCST speed-ups here (TORCHOPT_NO_SPEEDUPS, or an untested LibCST)")
        spawn = multiprocessing.get_context("spawn")
        monkeypatch.setattr(multiprocessing, "get_context", lambda method=None: spawn)
        monkeypatch.setattr(task, "_fix_chunk", speedups_of_this_process)
        items = [(f"f{i}.py", f"f{i}.py", None, None, None) for i in range(8)]
        assert task._fix_all(items, jobs=2) == [wanted] * 8
    finally:
        if not had:
            speedups.uninstall()
