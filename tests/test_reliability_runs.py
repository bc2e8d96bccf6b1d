"""Runs over many files: stop signals, per-file budgets (nesting, memory, time), crashed workers,
the number of workers, the stdin filter and `python -m torchopt` start-up. For every fault: the
exit code, the message naming the file, every file byte-identical to its before (or expected
after) text, and nothing outside the named folder changed."""

from __future__ import annotations

import faulthandler
import hashlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite import budget, interrupt, runner
from torchopt.rewrite.config import Overrides, Resolver

GOOD = b"import torch\nx = torch.zeros(3).cuda()\n"
GOOD_AFTER = b'import torch\nx = torch.zeros(3, device="cuda")\n'
TAIL = "y = torch.zeros(3).cuda()\n"  # makes a rule want the file, so LibCST would parse it

# Each crashed LibCST's native parser (SIGSEGV), or ran for minutes, before it was refused.
DEEP = {
    "parens.py": "import torch\nx = " + "(" * 5000 + "1" + ")" * 5000 + "\n" + TAIL,
    "lists.py": "import torch\nx = " + "[" * 5000 + "]" * 5000 + "\n" + TAIL,
    "attrs.py": "import torch\nx = a" + ".b" * 20000 + "\n" + TAIL,
    "calls.py": "import torch\nx = f" + "()" * 20000 + "\n" + TAIL,
    "terms.py": "import torch\nx = " + "+".join(["a"] * 50000) + "\n" + TAIL,
    "chain2500.py": "import torch\nx = a" + ".b" * 2500 + "\n" + TAIL,  # CPython takes it; LibCST needs ~10 s
}


def tree_hash(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def cli(*args, input=None):
    return CliRunner().invoke(app, list(args), input=input, catch_exceptions=False)


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture
def outside(tmp_path):
    """A folder next to the one processed: it must not change."""
    other = tmp_path / "outside"
    other.mkdir()
    (other / "x.py").write_bytes(GOOD)
    before = tree_hash(other)
    yield
    assert tree_hash(other) == before


def make_tree(root: Path, bad: dict[str, bytes], good: int) -> None:
    root.mkdir()
    for name, data in bad.items():
        (root / name).write_bytes(data)
    for i in range(good):
        (root / f"good{i}.py").write_bytes(GOOD)


def assert_outcome(root: Path, bad: dict[str, bytes], good: int, stderr: str, reason: str) -> None:
    lines = errors(stderr)
    assert len(lines) == len(bad), lines
    for name, data in bad.items():
        assert sum(name in line and reason in line for line in lines) == 1, (name, lines)
        assert (root / name).read_bytes() == data
    for i in range(good):
        assert (root / f"good{i}.py").read_bytes() == GOOD_AFTER
    assert sorted(p.name for p in root.iterdir()) == sorted(list(bad) + [f"good{i}.py" for i in range(good)])


# Deep nesting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_deep_nesting_is_refused_per_file(tmp_path, outside, jobs):
    """A subprocess: before, these files killed torchopt itself (SIGSEGV) with no message."""
    root = tmp_path / "src"
    bad = {name: text.encode() for name, text in DEEP.items()}
    make_tree(root, bad, good=3)
    r = subprocess.run(
        [sys.executable, "-m", "torchopt", "rewrite", str(root), "-j", jobs, "--no-cache"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 2, r.stderr
    assert_outcome(root, bad, 3, r.stderr, "too deeply nested")


def test_language_server_check_refuses_deep_text():
    assert "too deeply nested" in budget.over_budget(DEEP["parens.py"])
    assert "too deeply nested" in budget.over_budget(DEEP["chain2500.py"])
    assert budget.over_budget(GOOD.decode()) is None
    # brackets inside strings of a file CPython cannot parse are not nesting
    assert budget.over_budget('x = "' + "(" * 300 + '"\ndef f(:\n') is None


# Crashed workers, memory, time ----------------------------------------------------------------


_REAL_INIT_WORKER = interrupt.init_worker
_CRASH_DUMPS: list = []  # the file the workers of the crash test write their fault dumps to


def _init_worker_dumping_to_file(*args):
    """A worker inherits pytest's faulthandler, which writes straight to the terminal (past pytest's
    capture): this one writes its dump to a file the test reads instead."""
    faulthandler.enable(file=_CRASH_DUMPS[0])
    _REAL_INIT_WORKER(*args)


def test_crashed_worker_is_reported_and_the_rest_still_run(tmp_path, outside, monkeypatch):
    """With the nesting check off, LibCST's parser crashes its worker: only that file is reported,
    and the files that were queued behind it (lost with the broken pool before) are still fixed."""
    monkeypatch.setattr(budget, "over_budget", lambda text: None)
    monkeypatch.setattr(interrupt, "init_worker", _init_worker_dumping_to_file)
    root = tmp_path / "src"
    bad = {"crash.py": DEEP["parens.py"].encode()}
    make_tree(root, bad, good=20)
    with open(tmp_path / "dumps.txt", "w") as dumps:
        monkeypatch.setattr(sys.modules[__name__], "_CRASH_DUMPS", [dumps])
        r = cli("rewrite", str(root), "-j", "2", "--no-cache")
    assert r.exit_code == 2
    assert_outcome(root, bad, 20, r.stderr, "worker process analysing it died")
    assert "Segmentation fault" in (tmp_path / "dumps.txt").read_text()  # it did crash, quietly


@pytest.mark.slow
def test_the_crash_test_prints_no_crash_dump():
    """The README's test command: a newcomer sees no "Fatal Python error" from the worker crashed
    on purpose above."""
    here = Path(__file__)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "crashed_worker or memory_limit",
            str(here),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=here.parent.parent,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout
    assert "Fatal Python error" not in r.stdout + r.stderr


def test_file_over_the_memory_budget_is_refused(tmp_path, outside, monkeypatch):
    monkeypatch.setenv(budget.MEMORY_ENV, "1MB")
    monkeypatch.setattr(budget, "_process_budget", {"bytes": -1})
    root = tmp_path / "src"
    big = b"import torch\n" + b"".join(b"w%d = torch.zeros(3).cuda()\n" % i for i in range(100))
    bad = {"big.py": big}
    make_tree(root, bad, good=2)
    r = cli("rewrite", str(root), "-j", "1", "--no-cache")
    assert r.exit_code == 2
    assert_outcome(root, bad, 2, r.stderr, "memory budget")


@pytest.mark.slow  # over ~2.5 s on a quiet machine: CI runs it with the slow tests
def test_worker_memory_limit_stops_a_runaway_file(tmp_path, outside, monkeypatch):
    """The address-space limit of a worker, with the size estimate off: the file that needs more
    fails in its worker; every other file is fixed."""
    monkeypatch.setenv(budget.MEMORY_ENV, "64MB")
    monkeypatch.setattr(budget, "MEMORY_PER_SOURCE_BYTE", 0)
    root = tmp_path / "src"
    big = b"import torch\n" + b"".join(b"w%d = torch.zeros(3).cuda()\n" % i for i in range(15000))
    bad = {"big.py": big}
    make_tree(root, bad, good=12)
    monkeypatch.setattr(interrupt, "init_worker", _init_worker_dumping_to_file)
    with open(tmp_path / "dumps.txt", "w") as dumps:  # an allocation that fails may abort the worker
        monkeypatch.setattr(sys.modules[__name__], "_CRASH_DUMPS", [dumps])
        r = cli("rewrite", str(root), "-j", "2", "--no-cache")
    assert r.exit_code == 2
    assert_outcome(root, bad, 12, r.stderr, "")
    assert re.search(r"big\.py: .*(MemoryError|died)", r.stderr)


def test_time_budget_mechanism():
    with pytest.raises(budget.TimeBudgetExceeded), budget.time_limit(0.05):
        while True:
            pass


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_file_over_the_time_budget_is_reported(tmp_path, outside, monkeypatch, jobs):
    real = runner.process_file

    def endless_for_slow(path, *args, **kwargs):  # a file whose analysis takes far past the budget
        give_up = time.monotonic() + 30
        while os.path.basename(path) == "slow.py" and time.monotonic() < give_up:
            time.sleep(0.01)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(runner, "process_file", endless_for_slow)
    monkeypatch.setattr(budget, "FILE_SECONDS", 1.0)
    root = tmp_path / "src"
    bad = {"slow.py": GOOD}
    make_tree(root, bad, good=9)
    r = cli("rewrite", str(root), "-j", jobs, "--no-cache")
    assert r.exit_code == 2
    assert_outcome(root, bad, 9, r.stderr, "took longer than 1 s")


# Workers --------------------------------------------------------------------------------------


def test_jobs_are_capped_by_files_and_cpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files = []
    for i in range(20):
        (tmp_path / f"f{i}.py").write_bytes(GOOD)
        files.append(f"f{i}.py")
    seen = []
    resolver = Resolver(Overrides(), None)
    results = runner.run(
        files,
        resolver.for_path,
        runner.Mode.FIX,
        jobs=300,
        on_progress=lambda n: seen.append(len(multiprocessing.active_children())),
    )
    assert all(r.status == "ok" and r.changed for r in results)
    assert 0 < max(seen) <= min(20, os.cpu_count() or 1)
    assert runner.worker_count(300, 20) == min(20, len(os.sched_getaffinity(0)))
    assert runner.worker_count(None, 3) <= 3


# The stdin filter -----------------------------------------------------------------------------


STDIN_FAULTS = {
    "nul": (b"import torch\x00\nx = torch.zeros(3).cuda()\n", (), "NUL"),
    "undecodable": (b"x = '\xff\xfe'\r\ny = torch.zeros(3).cuda()\r\n", (), "decode"),
    "deep": (DEEP["parens.py"].encode(), (), "too deeply nested"),
    "bad-select": (b"\xef\xbb\xbfimport torch\r\nx = torch.zeros(3).cuda()\r\n", ("--select", "NOPE999"), "NOPE999"),
    "bad-format": (GOOD, ("--output-format", "yaml"), "output-format"),
}


@pytest.mark.parametrize("case", sorted(STDIN_FAULTS))
def test_stdin_filter_gives_its_input_back_on_any_error(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    data, args, reason = STDIN_FAULTS[case]
    r = CliRunner().invoke(app, ["rewrite", "-", *args], input=data, catch_exceptions=False)
    assert r.exit_code == 2
    assert r.stdout_bytes == data
    assert any(reason in line for line in errors(r.stderr)), r.stderr


def test_stdin_filter_with_a_broken_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[tool.torchopt]\nselect = [\n")
    before = tree_hash(tmp_path)
    r = CliRunner().invoke(app, ["rewrite", "-", "--stdin-filename", "a.py"], input=GOOD, catch_exceptions=False)
    assert r.exit_code == 2 and r.stdout_bytes == GOOD and errors(r.stderr)
    assert tree_hash(tmp_path) == before


# python -m torchopt ---------------------------------------------------------------------------


def test_python_m_does_not_import_the_users_modules(tmp_path):
    marker = tmp_path / "imported"
    for name in ("typer.py", "libcst.py", "rich.py"):
        (tmp_path / name).write_text(f"open({str(marker)!r}, 'a').write({name!r})\nraise SystemExit(99)\n")
    (tmp_path / "a.py").write_bytes(GOOD)
    before = tree_hash(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "torchopt", "rewrite", "a.py", "--diff"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    assert 'device="cuda"' in r.stdout
    assert not marker.exists()
    assert tree_hash(tmp_path) == before


# Stop signals ---------------------------------------------------------------------------------

MANY_BEFORE = "import torch\ndevice = 'cpu'\n" + "".join(f"x{i} = torch.zeros(3).to(device)\n" for i in range(20))


def _many(tmp_path: Path, n: int = 240) -> Path:
    root = tmp_path / "many_files_tree"
    root.mkdir()
    for i in range(n):
        (root / f"f{i:03d}.py").write_text(MANY_BEFORE)
    return root


def _expected_after() -> str:
    settings = Resolver(Overrides(), None).for_path("x.py")
    return runner.process_text(MANY_BEFORE, "x.py", settings, runner.Mode.FIX).new_text


def _start_and_wait_for_a_write(root: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchopt", "rewrite", str(root), "-j", "2", "--no-cache"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if any(_written(p) for p in root.iterdir()):
            return proc
        time.sleep(0.01)
    proc.kill()
    pytest.fail("torchopt finished or never wrote before the signal")


def _written(p: Path) -> bool:
    """``p`` holds the fixed text; a temporary file (renamed away while we look) does not count."""
    if p.name.startswith(".torchopt-"):
        return False
    try:
        return p.read_text() != MANY_BEFORE
    except FileNotFoundError:
        return False


def _processes_mentioning(marker: str) -> list[int]:
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


def _wait_until_gone(marker: str) -> list[int]:
    deadline = time.monotonic() + 15
    while _processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _processes_mentioning(marker)


def _assert_each_file_old_or_new(root: Path, after: str) -> int:
    written = 0
    for p in root.iterdir():
        assert p.name.endswith(".py") and not p.name.startswith(".torchopt-"), p.name  # no temp files left
        text = p.read_text()
        assert text in (MANY_BEFORE, after), p.name
        written += text == after
    return written


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signame,code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
def test_stop_signal_stops_the_run_cleanly(tmp_path, outside, signame, code):
    root = _many(tmp_path)
    after = _expected_after()
    proc = _start_and_wait_for_a_write(root)
    if signame == "SIGINT":  # Ctrl-C reaches the whole foreground process group
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, getattr(signal, signame))
    _, stderr = proc.communicate(timeout=15)
    assert proc.returncode == code, stderr
    assert _wait_until_gone(str(root)) == []
    got = re.search(r"^interrupted: (\d+) files? written$", stderr, re.M)
    assert got, stderr
    written = _assert_each_file_old_or_new(root, after)
    assert 0 < written == int(got.group(1)) < len(list(root.iterdir()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the parent-death signal")
def test_workers_die_with_a_killed_parent(tmp_path, outside):
    root = _many(tmp_path)
    after = _expected_after()
    proc = _start_and_wait_for_a_write(root)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=15)
    assert _wait_until_gone(str(root)) == []
    snapshot = tree_hash(root)
    written = _assert_each_file_old_or_new(root, after)
    assert written < len(snapshot)
    time.sleep(0.5)
    assert tree_hash(root) == snapshot  # nobody is writing any more
