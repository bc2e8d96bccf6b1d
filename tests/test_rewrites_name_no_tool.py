"""Rewritten code reads as if a PyTorch expert wrote it: nothing a fix adds names the tool (no
`torchopt`, no rule code, no `_torchopt` helper), and an inserted backend switch is recognised on a
second run by the statement itself, however the file spells it, not by a marker comment."""

from __future__ import annotations

import difflib
import hashlib
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import torchopt.cli
from torchopt.rewrite.registry import all_rules
from torchopt.rewrite.rule import Invalid

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TOOL_NAME = re.compile(r"torchopt|\bTOP\d{3}\b", re.IGNORECASE)


def added_lines(before: str, after: str) -> list[str]:
    """Lines of ``after`` that a fix wrote (present in ``after``, not at that place in ``before``)."""
    old, new = before.splitlines(), after.splitlines()
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    return [line for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("insert", "replace") for line in new[j1:j2]]


def tool_named(before: str, after: str) -> list[str]:
    return [line for line in added_lines(before, after) if TOOL_NAME.search(line)]


EXAMPLES = [
    pytest.param(ex, id=f"{code}-{i}")
    for code, rule in all_rules().items()
    for i, ex in enumerate(rule.examples)
    if isinstance(ex, Invalid) and ex.after is not None
]
GOLDENS = [
    pytest.param(golden, id=f"{golden.parent.name}/{golden.name}")
    for golden in sorted(FIXTURES.glob("*/after*.py"))
    if (golden.parent / "before.py").is_file()
]


def test_the_cases_exist():
    assert EXAMPLES and GOLDENS


@pytest.mark.parametrize("ex", EXAMPLES)
def test_rule_example_fix_names_no_tool(ex):
    assert tool_named(ex.src, ex.after) == []


@pytest.mark.parametrize("golden", GOLDENS)
def test_fixture_golden_names_no_tool(golden):
    before = (golden.parent / "before.py").read_text(encoding="utf-8")
    assert tool_named(before, golden.read_text(encoding="utf-8")) == []


# --------------------------------------------------------------------------- the switches, on disk

CONV_SCRIPT = """\
import torch
import torch.nn as nn

net = nn.Conv2d(3, 8, 3).cuda()
for _ in range(3):
    net(torch.randn(2, 3, 8, 8).cuda()).sum().backward()
"""
LINEAR_SCRIPT = """\
import torch

model = torch.nn.Linear(64, 64).cuda()
for _ in range(3):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
"""
BENCHMARK_LINE = "torch.backends.cudnn.benchmark = True\n"
PRECISION_LINE = 'torch.set_float32_matmul_precision("high")\n'

FIRST_RUNS = [  # the switch goes after the imports and the blank line that follows them (as isort wants)
    pytest.param(
        "TOP501", CONV_SCRIPT, CONV_SCRIPT.replace("nn\n\n", "nn\n\n" + BENCHMARK_LINE + "\n", 1), id="TOP501"
    ),
    pytest.param(
        "TOP502", LINEAR_SCRIPT, LINEAR_SCRIPT.replace("torch\n\n", "torch\n\n" + PRECISION_LINE + "\n", 1), id="TOP502"
    ),
]
ALREADY_SET = [
    pytest.param("TOP501", CONV_SCRIPT.replace("nn\n\n", "nn\n" + BENCHMARK_LINE + "\n", 1), id="TOP501-plain"),
    pytest.param(
        "TOP501",
        CONV_SCRIPT.replace("nn\n\n", "nn\nimport torch.backends.cudnn as cudnn\ncudnn.benchmark = True\n\n", 1),
        id="TOP501-alias",
    ),
    pytest.param(
        "TOP501",
        CONV_SCRIPT.replace("nn\n\n", "nn\nfrom torch.backends import cudnn as tuner\ntuner.benchmark = True\n\n", 1),
        id="TOP501-from",
    ),
    pytest.param("TOP502", LINEAR_SCRIPT.replace("torch\n\n", "torch\n" + PRECISION_LINE + "\n", 1), id="TOP502-plain"),
    pytest.param(
        "TOP502",
        LINEAR_SCRIPT.replace(
            "torch\n\n", 'torch\nfrom torch import set_float32_matmul_precision as precision\nprecision("high")\n\n', 1
        ),
        id="TOP502-alias",
    ),
]


def tree_bytes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def make_tree(tmp_path: Path, main: str) -> Path:
    """``proj/main.py`` holding ``main``, a bystander next to it, and a file outside the folder."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "main.py").write_text(main, encoding="utf-8")
    (proj / "helpers.py").write_text("def unrelated():\n    return 1\n", encoding="utf-8")
    (tmp_path / "outside.py").write_text("import torch\nprint(torch.zeros(1))\n", encoding="utf-8")
    return proj / "main.py"


def rewrite(path: Path, code: str):
    return CliRunner().invoke(
        torchopt.cli.app,
        ["rewrite", str(path), "--no-cache", "--unsafe-fixes", "--select", code],
        catch_exceptions=False,
    )


@pytest.mark.parametrize("code,before,expected", FIRST_RUNS)
def test_switch_is_inserted_as_the_plain_statement_and_a_second_run_changes_nothing(tmp_path, code, before, expected):
    main = make_tree(tmp_path, before)
    start = tree_bytes(tmp_path)
    res = rewrite(main, code)
    assert res.exit_code == 0, res.output
    assert main.read_text(encoding="utf-8") == expected
    first = tree_bytes(tmp_path)
    assert {k for k in start if start[k] != first[k]} == {"proj/main.py"} and set(first) == set(start)
    res = rewrite(main, code)
    assert res.exit_code == 0, res.output
    assert tree_bytes(tmp_path) == first


@pytest.mark.parametrize("code,src", ALREADY_SET)
def test_switch_already_set_without_any_comment_is_left_alone(tmp_path, code, src):
    main = make_tree(tmp_path, src)
    start = tree_bytes(tmp_path)
    res = rewrite(main, code)
    assert res.exit_code == 0, res.output
    assert tree_bytes(tmp_path) == start
    assert main.read_text(encoding="utf-8") == src
