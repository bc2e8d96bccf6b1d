"""Inputs LibCST's nesting, the memory budget, the configuration or the running Python cannot take:
each is refused on one line naming the file (exit 2), the stdin filter gives its input back byte for
byte, and no file changes. Crashing inputs run in a subprocess with their output captured."""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite import budget


def tree_hash(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


TAIL = "x = torch.zeros(3).cuda()\n"  # a rule wants the file, so LibCST would parse it


def torchopt(*args: str, data: bytes | None = None, cwd: Path | None = None, env: dict | None = None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "torchopt", *args],
        input=data,
        capture_output=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=120,
        **kw,
    )


# CPython's tree is flat for these; LibCST's nests a level per term. Each crashed torchopt (SIGSEGV,
# no message, nothing on stdout) or was called a syntax error before.
FLAT_IN_CPYTHON = {
    "or": "y = " + " or ".join(["a"] * 10000),
    "and": "y = " + " and ".join(["a"] * 30000),
    "strings": "y = " + " ".join(['"s"'] * 60000),
    "fstrings": "y = (" + "\n".join(['f"{a}"'] * 5000) + ")",
}


@pytest.mark.parametrize("shape", sorted(FLAT_IN_CPYTHON))
@pytest.mark.slow
def test_long_flat_chains_are_refused_and_the_filter_echoes(tmp_path, shape):
    data = ("import torch\n" + FLAT_IN_CPYTHON[shape] + "\n" + TAIL).encode()
    r = torchopt("rewrite", "-", data=data, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stdout == data
    lines = r.stderr.decode().splitlines()
    assert lines[0].startswith("error: -: too deeply nested for the parser"), lines
    assert "syntax error" not in r.stderr.decode()


@pytest.mark.slow
def test_long_chain_in_a_tree_is_refused_and_the_rest_fixed(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    (root / "deep.py").write_text("import torch\n" + FLAT_IN_CPYTHON["or"] + "\n" + TAIL)
    (root / "good.py").write_text("import torch\n" + TAIL)
    deep_before = (root / "deep.py").read_bytes()
    r = torchopt("rewrite", str(root), "-j", "1", "--no-cache")
    assert r.returncode == 2, r.stderr
    assert [line for line in r.stderr.decode().splitlines() if line.startswith("error:")] == [
        f"error: {root / 'deep.py'}: too deeply nested for the parser (expressions 10000 levels deep as LibCST "
        f"nests them; the limit is {budget.MAX_EXPRESSION_DEPTH})"
    ]
    assert (root / "deep.py").read_bytes() == deep_before
    assert (root / "good.py").read_text() == 'import torch\nx = torch.zeros(3, device="cuda")\n'


def test_depth_counts_what_libcst_nests():
    text = "y = " + " or ".join(["a"] * 300) + "\n"
    assert "300 levels" in budget.over_budget(text)
    assert budget.over_budget("y = " + " < ".join(["a"] * 3000) + "\n") is None  # LibCST keeps comparisons flat
    assert budget.over_budget("y = " + " or ".join(["a"] * 150) + "\n") is None
    assert "201 levels" in budget.over_budget('y = ("é"\n' + ' "s"\n' * 200 + ")\n")


# Memory ----------------------------------------------------------------------------------------

DENSE = "import torch\n" + TAIL + "".join(f'v{i} = [{i}, {i + 1}, "abc"]\n' for i in range(20000))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS")
@pytest.mark.slow
def test_address_space_limit_is_part_of_the_budget(tmp_path):
    """A 580 KB file under `ulimit -v 600000`: before, LibCST ran into the limit (a Rust allocation
    abort, exit 134, nothing on stdout) or past the time budget."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (600_000 * 1024, resource.RLIM_INFINITY))

    data = DENSE.encode()
    r = torchopt("rewrite", "-", data=data, cwd=tmp_path, preexec_fn=limit)
    assert r.returncode == 2, r.stderr
    assert r.stdout == data
    assert "too large to analyse within the memory budget" in r.stderr.decode()


def test_cgroup_memory_max_is_found_up_the_tree(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/job\n")
    job = tmp_path / "fs" / "user.slice" / "job"
    job.mkdir(parents=True)
    (job / "memory.max").write_text("max\n")
    (job.parent / "memory.max").write_text(f"{600 << 20}\n")
    (job.parent / "memory.current").write_text(f"{100 << 20}\n")
    assert budget._cgroup_memory_left(str(proc), str(tmp_path / "fs")) == 500 << 20
    (job.parent / "memory.max").write_text("max\n")
    assert budget._cgroup_memory_left(str(proc), str(tmp_path / "fs")) is None


def test_budget_message_gives_real_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv(budget.MEMORY_ENV, "1KB")
    monkeypatch.setattr(budget, "_process_budget", {"bytes": -1})
    why = budget.over_budget("x = 1\n" * 100)
    assert "600 bytes" in why or "KB" in why, why
    assert "1.0 KB allowed" in why and "0 MB" not in why, why


# Signals ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP")
@pytest.mark.slow
def test_sighup_to_the_stdin_filter_gives_the_input_back(tmp_path):
    data = DENSE.encode() * 3  # takes long enough to be caught mid-analysis
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchopt", "rewrite", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env={**os.environ, budget.MEMORY_ENV: "64GB"},
    )
    assert proc.stdin is not None
    proc.stdin.write(data)
    proc.stdin.close()
    time.sleep(3)
    proc.send_signal(signal.SIGHUP)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.wait(timeout=30)
    assert proc.returncode == 129, err
    assert out == data
    assert err.decode().splitlines()[-1] == "interrupted"


# Configuration ---------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
@pytest.mark.slow
def test_config_naming_a_fifo_is_refused_without_blocking(tmp_path):
    (tmp_path / "a.py").write_text("import torch\n" + TAIL)
    os.mkfifo(tmp_path / "cfg")
    before = tree_hash(tmp_path)
    r = torchopt("rewrite", "a.py", "--config", "cfg", cwd=tmp_path)  # hung before (the timeout fired)
    assert r.returncode == 2
    assert r.stderr.decode().splitlines() == ["error: cfg: not a regular file"]
    assert tree_hash(tmp_path) == before


# Syntax of a newer Python ----------------------------------------------------------------------

NEWER = [
    ((3, 12), "type X = int\n", "needs Python 3.12: a `type` statement (line 2)"),
    ((3, 12), "def f[T](x: T) -> T:\n    return x\n", "needs Python 3.12: type parameters (line 2)"),
    ((3, 12), 'y = f"{"a"}"\n', "needs Python 3.12: an f-string"),
    ((3, 13), "def f[T = int](x: T) -> T:\n    return x\n", "needs Python 3.13: a type parameter default"),
    ((3, 14), 'y = t"{a}"\n', "needs Python 3.14: a template string"),
]


@pytest.mark.parametrize("version,code,message", NEWER)
@pytest.mark.parametrize("tail", [TAIL, ""], ids=["parsed-by-libcst", "syntax-checked"])
def test_newer_syntax_says_which_python_it_needs(tmp_path, monkeypatch, version, code, message, tail):
    """Reported as "fix by TOP101 produced invalid code" (or a syntax error) before."""
    if sys.version_info[:2] >= version:
        pytest.skip(f"Python {sys.version_info[0]}.{sys.version_info[1]} compiles it")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "new.py").write_text("import torch\n" + code + tail)
    before = tree_hash(tmp_path)
    r = CliRunner().invoke(app, ["rewrite", "new.py", "--no-cache"], catch_exceptions=False)
    assert r.exit_code == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: new.py: {message}"), errors
    assert "invalid code" not in r.stderr
    assert tree_hash(tmp_path) == before
