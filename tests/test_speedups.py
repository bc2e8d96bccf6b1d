"""LibCST stays LibCST unless an entry point asks for torchopt's speed-ups: importing any part of
torchopt changes nothing in LibCST, the command line and the language server install them (and their
spawned workers get them too), and on a LibCST version they were not tested with nothing is installed."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import PositionProvider

from torchopt.rewrite import speedups

ROOT = Path(__file__).resolve().parents[1]

# Fingerprint of LibCST as the process sees it: every module's globals, every class's own attributes
# and metaclass, by identity. Printed as JSON-able lists so a subprocess can hand it back.
SNAPSHOT = """
import sys

def snapshot():
    import libcst, libcst.metadata, libcst.matchers, libcst.codemod, libcst.codemod.visitors, libcst.helpers
    out = {}
    for name, mod in sorted(sys.modules.items()):
        if not (name == "libcst" or name.startswith("libcst.")) or mod is None:
            continue
        for attr, value in sorted(vars(mod).items()):
            out[f"{name}.{attr}"] = id(value)
            if isinstance(value, type) and value.__module__.startswith("libcst"):
                out[f"{name}.{attr} metaclass"] = id(type(value))
                for key, member in value.__dict__.items():
                    out[f"{name}.{attr}.{key}"] = id(member)
    return out


def changed(before, after):
    return sorted(k for k in before if after.get(k) != before[k]) + sorted(
        k for k in after if k not in before and k.rsplit(".", 1)[0] in before)
"""


def _run(code: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow  # over ~2.5 s on a quiet machine: CI runs it with the slow tests
def test_importing_every_torchopt_module_leaves_libcst_untouched():
    code = SNAPSHOT + textwrap.dedent("""
        import importlib, pkgutil
        before = snapshot()
        import torchopt, torchopt.rewrite.engine, torchopt.rewrite.registry
        torchopt.rewrite.registry.all_rules()  # every rule module
        imported = []
        for info in pkgutil.walk_packages(torchopt.__path__, prefix="torchopt."):
            if info.name.endswith("__main__"):
                continue  # runs the program
            importlib.import_module(info.name)
            imported.append(info.name)
        assert "torchopt.lsp.server" in imported and "torchopt.rewrite.speedups" in imported, imported
        assert any(n.startswith("torchopt.codemods.") for n in imported)
        print("\\n".join(changed(before, snapshot())) or "UNCHANGED")
        """)
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "UNCHANGED"


def test_uninstall_puts_every_libcst_object_back():
    code = SNAPSHOT + textwrap.dedent("""
        from torchopt.rewrite import speedups
        before = snapshot()
        assert speedups.install() == speedups.DEFAULT
        during = changed(before, snapshot())
        speedups.uninstall()
        print(len(during), "\\n".join(changed(before, snapshot())) or "RESTORED")
        """)
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    count, restored = proc.stdout.split(maxsplit=1)
    assert int(count) >= len(speedups.DEFAULT)  # the snapshot does see the fast paths
    assert restored.strip() == "RESTORED"


def _libcst_state() -> tuple:
    return (
        cst.CSTNode.__dict__["visit"],
        cst.CSTNode.__dict__["children"],
        cst.Module.__dict__["code"],
        PositionProvider.__dict__.get("_gen"),
        cst.BatchableCSTVisitor.__dict__["get_visitors"],
        type(cst.Call),
    )


@pytest.fixture
def clean():
    speedups.uninstall()
    yield
    speedups.uninstall()


@pytest.mark.parametrize("version", [(1, 0), (0, 4), (1, 10), (2, 0), None])
def test_an_untested_libcst_version_keeps_libcsts_own_code(clean, monkeypatch, caplog, version):
    monkeypatch.setattr(speedups, "libcst_version", lambda: version)
    before = _libcst_state()
    with caplog.at_level(logging.DEBUG, logger="torchopt.rewrite.speedups"):
        assert speedups.install() == ()
    assert _libcst_state() == before
    assert speedups.worker_initializer() is None
    shown = ".".join(map(str, version)) if version else "unknown"
    assert f"LibCST {shown} is outside the tested range >=1.1,<1.10" in caplog.text


def test_the_tested_range_is_the_one_pyproject_allows():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    low, high = (".".join(map(str, v)) for v in speedups.TESTED_LIBCST)
    assert f'"libcst>={low},<{high}"' in text
    assert speedups.supported(speedups.libcst_version())  # the installed one is tested


def test_the_off_switch_keeps_libcsts_own_code(clean, monkeypatch, caplog):
    monkeypatch.setenv("TORCHOPT_NO_SPEEDUPS", "1")
    before = _libcst_state()
    with caplog.at_level(logging.DEBUG, logger="torchopt.rewrite.speedups"):
        assert speedups.install() == ()
    assert _libcst_state() == before
    assert "TORCHOPT_NO_SPEEDUPS=1" in caplog.text


def test_install_is_idempotent_and_rejects_unknown_names(clean):
    before = _libcst_state()
    with pytest.raises(ValueError, match="unknown fast path"):
        speedups.install(["visit", "no-such-path"])
    assert _libcst_state() == before and speedups.installed() == ()
    speedups.install()
    once = _libcst_state()
    assert once != before
    assert speedups.install() == speedups.DEFAULT and _libcst_state() == once
    speedups.uninstall()
    assert _libcst_state() == before


ENTRY = """
import sys
from torchopt.rewrite import speedups
assert speedups.installed() == ()
if sys.argv[1] == "cli":
    from torchopt import cli
    sys.argv = ["torchopt", "rules"]
    try:
        cli.main()
    except SystemExit:
        pass
else:
    from torchopt.lsp import server

    class Quiet:
        def start_io(self):
            pass

    server.create_server = Quiet  # the real one would wait for a client on stdin
    try:
        server.main()
    except SystemExit:
        pass
print("INSTALLED", ",".join(speedups.installed()), file=sys.stderr)
"""


@pytest.mark.parametrize("entry", ["cli", "lsp"])
def test_entry_points_install_the_speedups(entry):
    proc = _run(ENTRY, entry)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "INSTALLED " + ",".join(speedups.DEFAULT)


def test_entry_points_honour_the_off_switch():
    import os

    env = dict(os.environ, TORCHOPT_NO_SPEEDUPS="1")
    proc = subprocess.run(
        [sys.executable, "-c", ENTRY, "cli"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "INSTALLED"


# A stand-in for the runner's chunk function: what a worker process reports about its LibCST.
PROBE = """
from torchopt.rewrite import speedups
from torchopt.rewrite.runner import FileResult


def chunk(files, mode, unsafe, cache=None, scope=None):
    return [FileResult(path=path, reason=",".join(speedups.installed())) for path, *_ in files]
"""

WORKERS = """
import multiprocessing, sys
multiprocessing.set_start_method(sys.argv[1])
sys.path.insert(0, sys.argv[2])
import probe
from torchopt.rewrite import runner, speedups
from torchopt.rewrite.config import Settings
if sys.argv[3] == "install":
    speedups.install()
runner._chunk = probe.chunk  # pickled by reference: the workers import probe themselves
files = [f"f{i}.py" for i in range(8)]
results = runner.run(files, lambda f: Settings(), runner.Mode.CHECK, jobs=2)
print(sorted({r.reason for r in results}))
"""


@pytest.mark.slow  # starts fresh interpreters that import the engine: seconds each; CI runs it
@pytest.mark.parametrize(
    "method,install,expected",
    [
        ("spawn", "install", [",".join(speedups.DEFAULT)]),
        ("forkserver", "install", [",".join(speedups.DEFAULT)]),
        ("spawn", "no", [""]),  # a library caller that installed nothing gets nothing in its workers
    ],
)
def test_workers_get_the_speedups_of_the_process_that_started_them(tmp_path, method, install, expected):
    (tmp_path / "probe.py").write_text(PROBE, encoding="utf-8")
    proc = _run(WORKERS, method, str(tmp_path), install)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr(expected)
