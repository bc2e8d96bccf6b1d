"""ruff's conventions as a ruff user meets them in `torchopt check` (--fix, --exit-zero, --statistics,
--show-fixes, --extend-select, --add-noqa, --output-file, unused suppressions), errors a user
understands, and one finding per problem."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source

SAFE = "import torch\nx = torch.zeros(3).cuda()\n"
SAFE_AFTER = 'import torch\nx = torch.zeros(3, device="cuda")\n'
UNSAFE = "import torch\ny = torch.rand(3).cuda()\n"
UNSAFE_AFTER = 'import torch\ny = torch.rand(3, device="cuda")\n'
CLEAN = "import torch\nz = torch.zeros(3, device='cuda')\n"

# A loader passed to the function that copies its batches: TOP104 pins it and makes the copies
# non-blocking; TOP609 (display-only advice on the copies) and TOP702 (pin_memory on the loader)
# used to report the same two problems again.
LOADER = """\
import torch
from torch.utils.data import DataLoader


def train(model, loader, device):
    for x, y in loader:
        x = x.to(device)
        y = y.to(device)
        loss = model(x).sum()
        loss.backward()


def main(ds, model, device):
    train(model, DataLoader(ds, batch_size=8), device)
"""


def cli(*args, input=None):
    return CliRunner().invoke(app, list(args), input=input, catch_exceptions=False, env={"COLUMNS": "250"})


@pytest.fixture
def proj(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "safe.py").write_text(SAFE)
    (tmp_path / "unsafe.py").write_text(UNSAFE)
    (tmp_path / "clean.py").write_text(CLEAN)
    return tmp_path


def codes(stdout: str) -> list[str]:
    return re.findall(r": (TOP\d{3}) ", stdout)


# --fix, --unsafe-fixes, --show-fixes -------------------------------------------------------------


def test_check_fix_writes_safe_fixes_and_reports_what_is_left(proj):
    r = cli("check", ".", "--fix", "--no-cache", "-j", "1")
    assert (proj / "safe.py").read_text() == SAFE_AFTER
    assert (proj / "unsafe.py").read_text() == UNSAFE
    assert codes(r.stdout) == ["TOP101"] and "unsafe.py:2:5" in r.stdout
    assert "Found 2 diagnostics (1 fixed, 1 remaining)." in r.stderr
    assert r.exit_code == 1  # ruff: 1 while a violation remains


def test_check_fix_unsafe_fixes_and_show_fixes(proj):
    r = cli("check", ".", "--fix", "--unsafe-fixes", "--show-fixes", "--no-cache", "-j", "1")
    assert r.exit_code == 0, r.output  # ruff: 0 once everything is fixed
    assert (proj / "safe.py").read_text() == SAFE_AFTER
    assert (proj / "unsafe.py").read_text() == UNSAFE_AFTER
    assert r.stdout == ""
    assert "Fixed 2 diagnostics:\nsafe.py:\n    1 × TOP101 (factory-then-move)\nunsafe.py:\n" in r.stderr


def test_check_fix_on_stdin_prints_the_fixed_source(proj):
    r = cli("check", "-", "--fix", "--stdin-filename", "x.py", input=SAFE)
    assert r.exit_code == 0
    assert r.stdout == SAFE_AFTER


def test_unsafe_fixes_help_of_check_says_it_needs_fix():
    text = cli("check", "--help").stdout
    assert "With --fix: also apply fixes" in text
    assert "Also apply fixes that change" not in text  # check writes nothing without --fix


# --exit-zero, --statistics, --output-file ---------------------------------------------------------


def test_exit_zero_keeps_reporting_and_exit_2_for_errors(proj):
    r = cli("check", "unsafe.py", "--exit-zero", "--no-cache")
    assert r.exit_code == 0 and codes(r.stdout) == ["TOP101"]
    assert cli("check", "missing.py", "--exit-zero", "--no-cache").exit_code == 2


def test_statistics_counts_per_code(proj):
    (proj / "two.py").write_text("import torch\na = torch.zeros(3).cuda()\nb = torch.ones(3).cuda()\n")
    r = cli("check", ".", "--statistics", "--no-cache", "-j", "1", "--select", "TOP101")
    assert r.exit_code == 1
    assert r.stdout == "4\tTOP101\t[*] factory-then-move\n"
    r = cli("check", ".", "--statistics", "--no-cache", "-j", "1", "--select", "TOP101", "--output-format", "json")
    assert json.loads(r.stdout) == [{"code": "TOP101", "name": "factory-then-move", "count": 4, "fixable": True}]


def test_output_file_takes_the_report(proj):
    r = cli("check", "safe.py", "--no-cache", "--output-format", "json", "-o", "out/report.json")
    assert r.exit_code == 1 and r.stdout == ""
    rows = json.loads((proj / "out" / "report.json").read_text())
    assert [row["code"] for row in rows] == ["TOP101"]


# --extend-select / extend-select ----------------------------------------------------------------


def test_extend_select_on_the_command_line_and_in_the_config(proj):
    (proj / "loader.py").write_text(LOADER)
    (proj / "pyproject.toml").write_text('[tool.torchopt]\nselect = ["TOP101"]\n')
    assert set(codes(cli("check", "loader.py", "--no-cache").stdout)) == set()
    assert set(codes(cli("check", "loader.py", "--no-cache", "--extend-select", "TOP104").stdout)) == {"TOP104"}
    (proj / "pyproject.toml").write_text('[tool.torchopt]\nselect = ["TOP101"]\nextend-select = ["TOP701"]\n')
    assert set(codes(cli("check", "loader.py", "--no-cache").stdout)) == {"TOP701"}
    # as in ruff, --select on the command line starts afresh: the file's extend-select goes too
    assert set(codes(cli("check", "loader.py", "--no-cache", "--select", "TOP104").stdout)) == {"TOP104"}
    (proj / "pyproject.toml").write_text('[tool.torchopt]\nextend-select = ["TOP9999"]\n')
    r = cli("check", "loader.py", "--no-cache")
    assert r.exit_code == 2 and "extend-select" in r.stderr


# --add-noqa -------------------------------------------------------------------------------------


def test_add_noqa_suppresses_every_finding_and_keeps_comments(proj):
    (proj / "n.py").write_text(
        "import torch\n"
        "a = torch.zeros(3).cuda()  # the buffer\n"
        "b = torch.ones(3).cuda()  # noqa: E501\n"
        'c = torch.zeros(3).to("cuda") + torch.ones(3).cuda()\n'
    )
    r = cli("check", "n.py", "--add-noqa", "--no-cache", "--select", "TOP101")
    assert r.exit_code == 0 and "Added 3 suppression comments." in r.stderr
    assert (proj / "n.py").read_text() == (
        "import torch\n"
        "a = torch.zeros(3).cuda()  # the buffer  # noqa: TOP101\n"
        "b = torch.ones(3).cuda()  # noqa: E501, TOP101\n"
        'c = torch.zeros(3).to("cuda") + torch.ones(3).cuda()  # noqa: TOP101\n'
    )
    again = cli("check", "n.py", "--no-cache")
    assert again.exit_code == 0 and "All checks passed." in again.stderr
    assert cli("check", "n.py", "--add-noqa", "--fix").exit_code == 2


# Unused and unknown suppressions (TOP001) -------------------------------------------------------

STALE = (
    "import torch\n"
    'x = torch.zeros(3, device="cuda")  # noqa: TOP101\n'
    'y = torch.zeros(3, device="cuda")  # noqa: E501, TOP999\n'
    "z = torch.zeros(3).cuda()  # torchopt: ignore[TOP101]\n"
    "w = 1  # noqa\n"
)


def test_unused_and_unknown_suppressions_are_reported_and_fixed(proj):
    (proj / "s.py").write_text(STALE)
    r = cli("check", "s.py", "--no-cache")
    assert r.exit_code == 1
    assert r.stdout == (
        "s.py:2:36: TOP001 [*] Unused suppression (unused: `TOP101`)\n"
        "s.py:3:36: TOP001 [*] Unused suppression (unknown: `TOP999`)\n"
    )
    r = cli("check", "s.py", "--fix", "--no-cache")
    assert r.exit_code == 0, r.output
    assert (proj / "s.py").read_text() == (
        "import torch\n"
        'x = torch.zeros(3, device="cuda")\n'
        'y = torch.zeros(3, device="cuda")  # noqa: E501\n'
        "z = torch.zeros(3).cuda()  # torchopt: ignore[TOP101]\n"
        "w = 1  # noqa\n"
    )


def test_suppressions_of_rules_not_selected_are_not_unused():
    found = check_source(STALE, Settings(select=("TOP001", "TOP2"))).diagnostics
    assert [(d.line, d.message) for d in found] == [(3, "Unused suppression (unknown: `TOP999`)")]


# Errors a user understands ----------------------------------------------------------------------


def test_no_all_checks_passed_after_an_error(proj):
    r = cli("check", "missing.py", "--no-cache")
    assert r.exit_code == 2
    assert "missing.py" in r.stderr and "All checks passed" not in r.stderr
    (proj / "bad.py").write_text("import torch\ndef f(:\n    pass\n")
    r = cli("check", "bad.py", "clean.py", "--no-cache", "-j", "1")
    assert r.exit_code == 2 and "All checks passed" not in r.stderr


@pytest.mark.parametrize(
    "src",
    [
        "import torch\ndef f(:\n    pass\n",
        "import torch\n\nx = (1,\n     2 +)\ny = torch.zeros(3).cuda()\n",
        "import torch\ndef f(x):\n    return x.cuda(\n\nclass A:\n    pass\n",
    ],
)
def test_syntax_errors_at_cpythons_line_and_column(proj, src):
    (proj / "bad.py").write_text(src)
    with pytest.raises(SyntaxError) as cpython:
        compile(src, "bad.py", "exec")
    r = cli("check", "bad.py", "--no-cache")
    assert r.exit_code == 2
    where = f"line {cpython.value.lineno}, column {cpython.value.offset}"
    assert f"error: bad.py: syntax error at {where}" in r.stderr


def test_folder_without_python_files_warns(proj):
    (proj / "empty").mkdir()
    for command in ("check", "rewrite"):
        r = cli(command, "empty")
        assert r.exit_code == 0
        assert "warning: No Python files found under the given path(s)" in r.stderr


def test_validate_takes_output_format_like_the_other_commands(proj):
    r = cli("validate", "safe.py", "--output-format", "xml")
    assert r.exit_code == 2 and "unknown --output-format 'xml'" in r.stderr


# One finding per problem ------------------------------------------------------------------------


def test_one_finding_per_problem(proj):
    (proj / "loader.py").write_text(LOADER)
    found = [(d.line, d.code) for d in check_source(LOADER, Settings()).diagnostics]
    assert found == [(7, "TOP104"), (8, "TOP104"), (14, "TOP104"), (14, "TOP701")]


def test_a_suppression_of_the_reported_code_silences_the_problem():
    src = LOADER.replace("batch_size=8), device)", "batch_size=8), device)  # noqa: TOP104")
    assert [(d.line, d.code) for d in check_source(src, Settings()).diagnostics] == [
        (7, "TOP104"),
        (8, "TOP104"),
        (14, "TOP701"),
    ]
    # and so does one of the code that yields to it: the problem is one
    src = LOADER.replace("batch_size=8), device)", "batch_size=8), device)  # noqa: TOP702")
    assert [(d.line, d.code) for d in check_source(src, Settings()).diagnostics] == [
        (7, "TOP104"),
        (8, "TOP104"),
        (14, "TOP701"),
    ]


def test_check_and_rewrite_count_fixable_findings_the_same_way(proj):
    (proj / "loader.py").write_text(LOADER)
    check = cli("check", "loader.py", "--no-cache")
    fixable = int(re.search(r"(\d+) fixable with `--fix`", check.stderr).group(1))
    rewrite = cli("rewrite", "loader.py", "--diff", "--no-cache")
    would = int(re.search(r"Would fix (\d+) issue", rewrite.stderr).group(1))
    assert fixable == would == 3


def _apply(text: str, edits: list[dict]) -> str:
    lines = text.splitlines(keepends=True)
    starts = [sum(len(x) for x in lines[:i]) for i in range(len(lines) + 1)]

    def offset(pos: dict) -> int:
        return starts[pos["row"] - 1] + pos["column"] - 1

    for e in sorted(edits, key=lambda e: offset(e["location"]), reverse=True):
        text = text[: offset(e["location"])] + e["content"] + text[offset(e["end_location"]) :]
    return text


def test_json_findings_carry_the_edits_of_their_fix(proj):
    src = "import torch\n\nx = torch.zeros(3).cuda()\ny = torch.rand(3).cuda()\n"
    (proj / "e.py").write_text(src)
    rows = json.loads(cli("check", "e.py", "--output-format", "json", "--no-cache").stdout)
    assert [(row["code"], row["line"]) for row in rows] == [("TOP101", 3), ("TOP101", 4)]
    for row, line, after in zip(
        rows, (3, 4), ('x = torch.zeros(3, device="cuda")\n', 'y = torch.rand(3, device="cuda")\n')
    ):
        edits = row["fix"]["edits"]
        assert edits and all(e["location"]["row"] == line for e in edits)
        assert _apply(src, edits).splitlines(keepends=True)[line - 1] == after


def test_one_fix_for_several_findings_counts_them_all(proj):
    """TOP201 rewrites a whole module for its three findings in one edit: rewrite said "Would fix 1"
    where check said "3 fixable"."""
    (proj / "amp.py").write_text(
        "import torch\nfrom torch.cuda.amp import GradScaler, autocast\n\n"
        "scaler = GradScaler(enabled=True)\nwith autocast(enabled=True):\n    y = torch.ones(2) * 2\n"
    )
    check = cli("check", "amp.py", "--no-cache")
    assert "3 fixable with `--fix`" in check.stderr
    rewrite = cli("rewrite", "amp.py", "--diff", "--no-cache")
    assert "Would fix 3 issues in 1 file (TOP201 ×3)." in rewrite.stderr
