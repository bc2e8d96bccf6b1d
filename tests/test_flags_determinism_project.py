"""TOP501/TOP502 respect a program that asks for reproducible runs through a function of its own
project (`init_seeds(seed, deterministic=True)` in `utils.py` calling
`torch.use_deterministic_algorithms(True)`): the project index answers whether the call turns a
determinism switch on, and says why when a value known only at run time decides."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest
from typer.testing import CliRunner

import torchopt.cli

UTILS = """\
import os
import random

import torch


def init_seeds(seed=0, deterministic=False):
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic and torch.__version__ >= "1.12":
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
"""

MAIN = """\
import argparse

import torch
import torch.nn as nn

from utils import init_seeds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--det", action="store_true")
    args = parser.parse_args()
    init_seeds(0, CALL)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 30 * 30, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(10):
        loss = model(torch.randn(16, 3, 32, 32, device="cuda")).mean()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
"""


def _check(tmp_path: Path, call: str):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "utils.py").write_text(UTILS, encoding="utf-8")
    (proj / "train.py").write_text(MAIN.replace("CALL", call), encoding="utf-8")
    return CliRunner().invoke(
        torchopt.cli.app, ["check", str(proj), "--no-cache", "--select", "TOP501,TOP502"], catch_exceptions=False
    )


@pytest.mark.parametrize("call", ["deterministic=True", "True"])
def test_a_project_function_asked_for_determinism_keeps_the_switches_off(tmp_path, call):
    r = _check(tmp_path, call)
    assert r.exit_code == 0 and "TOP50" not in r.stdout, r.output


@pytest.mark.parametrize("call", ["deterministic=False", "seed=1"])
def test_a_call_that_does_not_ask_leaves_the_rules_as_they_were(tmp_path, call):
    r = _check(tmp_path, call)
    assert "TOP501 [unsafe fix] This program builds convolutions" in r.stdout, r.output
    assert "TOP502 [unsafe fix]" in r.stdout, r.output


def test_a_value_known_only_at_run_time_is_reported_without_a_fix(tmp_path):
    r = _check(tmp_path, "deterministic=args.det")
    assert r.exit_code == 1, r.output
    assert r.stdout.strip().endswith(
        "TOP501 This program builds convolutions with the cuDNN auto-tuner off, and whether it asks for "
        "reproducible runs is unknown: `init_seeds` (utils.py) sets a determinism switch when "
        "`deterministic` is true, and this call passes `args.det`, known only at run time; the "
        "auto-tuner is not switched on"
    ), r.output
    assert "TOP502" not in r.stdout


def test_the_index_answers_from_the_summary_alone():
    import ast

    from torchopt.analysis.project_summary import summarize

    fns = summarize(ast.parse(dedent(UTILS) + "\n\ndef always():\n    torch.use_deterministic_algorithms(True)\n"))
    assert fns.functions["init_seeds"].determinism == ["deterministic:False"] * 3
    assert fns.functions["always"].determinism == [""]
