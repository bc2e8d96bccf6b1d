"""The command line as a user meets it: exit codes, diff/check/write modes, stdin, formats, summaries,
and bad input that is reported in one line and left byte-for-byte as it was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from torchopt.cli import app

SAFE = "import torch\nx = torch.zeros(3).cuda()\n"
SAFE_AFTER = 'import torch\nx = torch.zeros(3, device="cuda")\n'
UNSAFE = "import torch\ny = torch.rand(3).cuda()\n"
UNSAFE_AFTER = 'import torch\ny = torch.rand(3, device="cuda")\n'
CLEAN = 'import torch\nz = torch.zeros(3, device="cuda")\n'


def cli(*args, input=None):
    return CliRunner().invoke(app, list(args), input=input, catch_exceptions=False)


@pytest.fixture
def proj(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "safe.py").write_text(SAFE)
    (tmp_path / "unsafe.py").write_text(UNSAFE)
    (tmp_path / "clean.py").write_text(CLEAN)
    return tmp_path


def test_rewrite_writes_safe_fixes_and_reports_hidden_unsafe(proj):
    r = cli("rewrite", ".", "-j", "1")
    assert r.exit_code == 0, r.output
    assert (proj / "safe.py").read_text() == SAFE_AFTER
    assert (proj / "unsafe.py").read_text() == UNSAFE, "unsafe fix applied without --unsafe-fixes"
    assert "Fixed 1 issue in 1 file (TOP101 ×1)" in r.stderr
    assert "1 unsafe fix not applied" in r.stderr and "--unsafe-fixes" in r.stderr and "rng" in r.stderr


def test_rewrite_unsafe_says_what_changes(proj):
    r = cli("rewrite", "unsafe.py", "--unsafe-fixes")
    assert r.exit_code == 0
    assert (proj / "unsafe.py").read_text() == UNSAFE_AFTER
    assert "unsafe fix" in r.stderr and "rng" in r.stderr and "random numbers" in r.stderr


def test_diff_writes_nothing_and_exits_1(proj):
    r = cli("rewrite", ".", "--diff")
    assert r.exit_code == 1
    assert "-x = torch.zeros(3).cuda()" in r.stdout and '+x = torch.zeros(3, device="cuda")' in r.stdout
    assert "--- a/safe.py" in r.stdout
    assert (proj / "safe.py").read_text() == SAFE
    assert "Would fix 1 issue" in r.stderr


def test_check_flag_lists_files(proj):
    r = cli("rewrite", ".", "--check")
    assert r.exit_code == 1
    assert r.stdout.strip().splitlines() == ["Would rewrite: safe.py"]
    assert (proj / "safe.py").read_text() == SAFE


def test_nothing_to_do_exits_0(proj):
    r = cli("rewrite", "clean.py", "--diff")
    assert r.exit_code == 0 and r.stdout == ""


def test_second_run_changes_nothing(proj):
    cli("rewrite", ".", "--unsafe-fixes")
    snapshot = {p.name: p.read_bytes() for p in proj.iterdir()}
    r = cli("rewrite", ".", "--unsafe-fixes", "--diff")
    assert r.exit_code == 0 and r.stdout == ""
    assert snapshot == {p.name: p.read_bytes() for p in proj.iterdir()}


def test_check_command_text_is_ruff_like_and_sorted(proj):
    r = cli("check", ".")
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert lines == sorted(lines, key=lambda line: (line.split(":")[0], int(line.split(":")[1])))
    assert "safe.py:2:5: TOP101 [*] " in r.stdout
    assert "unsafe.py:2:5: TOP101 [unsafe fix] " in r.stdout
    again = cli("check", ".")
    assert again.stdout == r.stdout, "output must be stable across runs"


def test_select_and_ignore(proj):
    assert cli("check", ".", "--select", "TOP102").exit_code == 0
    assert cli("check", ".", "--ignore", "TOP1").exit_code == 0
    assert cli("check", ".", "--select", "device").exit_code == 1
    bad = cli("check", ".", "--select", "TOP999")
    assert bad.exit_code == 2 and "TOP999" in bad.stderr


def test_json_output(proj):
    r = cli("check", "safe.py", "--output-format", "json")
    rows = json.loads(r.stdout)
    assert rows[0]["code"] == "TOP101"
    assert {"code", "message", "path", "line", "column", "end_line", "end_column", "fix"} <= set(rows[0])
    assert rows[0]["fix"]["safety"] == "safe" and rows[0]["fix"]["title"]
    assert (rows[0]["line"], rows[0]["column"]) == (2, 5)


def test_sarif_and_github(proj):
    sarif = json.loads(cli("check", "safe.py", "--output-format", "sarif").stdout)
    assert sarif["version"] == "2.1.0"
    res = sarif["runs"][0]["results"][0]
    assert res["ruleId"] == "TOP101"
    assert res["locations"][0]["physicalLocation"]["region"]["startLine"] == 2
    gh = cli("check", "safe.py", "--output-format", "github").stdout
    assert gh.startswith("::warning ") and "file=safe.py,line=2,col=5" in gh


def test_stdin_rewrite_and_diff(proj):
    r = cli("rewrite", "-", input=SAFE)
    assert r.exit_code == 0 and r.stdout == SAFE_AFTER
    d = cli("rewrite", "-", "--diff", "--stdin-filename", "model.py", input=SAFE)
    assert d.exit_code == 1 and "+++ b/model.py" in d.stdout
    c = cli("check", "-", "--stdin-filename", "model.py", input=SAFE)
    assert c.exit_code == 1 and c.stdout.startswith("model.py:2:5: TOP101")


def test_stdin_syntax_error_echoes_input(proj):
    r = cli("rewrite", "-", input="def (:\n")
    assert r.exit_code == 2 and r.stdout == "def (:\n" and "syntax error" in r.stderr


def test_config_error_exit_2(proj):
    (proj / "pyproject.toml").write_text("[tool.torchopt]\nselect = ['NOPE']\n")
    r = cli("check", ".")
    assert r.exit_code == 2 and "pyproject.toml" in r.stderr


def test_rules_and_rule_pages():
    r = cli("rules")
    assert r.exit_code == 0 and "TOP101" in r.stdout
    page = cli("rule", "TOP101")
    assert page.exit_code == 0
    for section in ("## What it does", "## Why is this slow", "## Fix safety", "## Tested examples"):
        assert section in page.stdout
    assert cli("rule", "TOP999").exit_code == 2


def test_version_and_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "torchopt", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("torchopt ")


def test_engine_does_not_import_torch(tmp_path):
    """`torchopt rewrite` starts without importing torch (fast start-up, light environments)."""
    (tmp_path / "a.py").write_text(SAFE)
    code = (
        "import sys; from torchopt.cli import main; sys.argv=['torchopt','rewrite','--diff',%r]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None, 'torch was imported'\n"
        "print('ok')" % str(tmp_path / "a.py")
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip().endswith("ok"), out.stderr


def test_parallel_run_matches_serial(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for i in range(24):
        (tmp_path / f"m{i:02d}.py").write_text(SAFE if i % 2 else UNSAFE)
    serial = cli("rewrite", ".", "--diff", "-j", "1", "--unsafe-fixes")
    parallel = cli("rewrite", ".", "--diff", "-j", "2", "--unsafe-fixes")
    assert serial.exit_code == parallel.exit_code == 1
    assert serial.stdout == parallel.stdout
