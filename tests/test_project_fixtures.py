"""Golden multi-file projects (fixtures/project_*/), run as projects: `torchopt check proj/` and
`torchopt rewrite proj/`, the way a user runs torchopt on a repository.

Each fixture holds ``before/`` (the project), ``check.txt`` (the findings expected from the rules
the fixture is about, paths as ``proj/...``), ``after_unsafe/`` and optionally ``after_safe/`` (the
files those rules rewrite, exactly; every other file stays byte for byte) and ``notes.md``. The rules
are selected by the codes in ``check.txt``, so what other rules do to the same files is left to their
own tests.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import torchopt.cli

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
PROJECTS = sorted(p.name for p in FIXTURES.glob("project_*") if (p / "before").is_dir())


def _cli(*args: str):
    return CliRunner().invoke(torchopt.cli.app, list(args), catch_exceptions=False)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _expected(name: str) -> tuple[list[str], list[str]]:
    lines = (FIXTURES / name / "check.txt").read_text(encoding="utf-8").splitlines()
    codes = sorted({m.group(1) for ln in lines if (m := re.search(r": (TOP\d{3}) ", ln))})
    return lines, codes


def _project(tmp_path: Path, name: str, monkeypatch) -> Path:
    proj = tmp_path / "proj"
    shutil.copytree(FIXTURES / name / "before", proj)
    monkeypatch.chdir(tmp_path)
    return proj


def test_project_fixtures_exist():
    assert {"project_cnn_models", "project_ddp_engine"} <= set(PROJECTS)
    for name in PROJECTS:
        assert (FIXTURES / name / "check.txt").is_file() and (FIXTURES / name / "notes.md").is_file()
        assert (FIXTURES / name / "after_unsafe").is_dir()


@pytest.mark.parametrize("name", PROJECTS)
def test_check_finds_what_the_other_modules_say(tmp_path, monkeypatch, name):
    _project(tmp_path, name, monkeypatch)
    lines, codes = _expected(name)
    r = _cli("check", "proj", "--no-cache", "-j", "1", "--select", ",".join(codes))
    assert r.exit_code == 1, r.output
    got = [ln for ln in r.stdout.splitlines() if re.search(r": TOP\d{3} ", ln)]
    assert sorted(got) == sorted(lines), r.stdout


@pytest.mark.parametrize("name", PROJECTS)
@pytest.mark.parametrize("unsafe", [False, True], ids=["safe", "unsafe"])
def test_rewrite_matches_golden_and_is_a_fix_point(tmp_path, monkeypatch, name, unsafe):
    proj = _project(tmp_path, name, monkeypatch)
    _, codes = _expected(name)
    before = _tree(proj)
    golden_dir = FIXTURES / name / ("after_unsafe" if unsafe else "after_safe")
    expected = {**before, **(_tree(golden_dir) if golden_dir.is_dir() else {})}
    flags = ["--unsafe-fixes"] if unsafe else []
    r = _cli("rewrite", "proj", "--no-cache", "-j", "1", "--select", ",".join(codes), *flags)
    assert r.exit_code == 0, r.output
    got = _tree(proj)
    for path in sorted(set(expected) | set(got)):
        assert got.get(path) == expected.get(path), f"{path} differs from the golden:\n{got.get(path, b'').decode()}"
    again = _cli("rewrite", "proj", "--no-cache", "-j", "1", "--select", ",".join(codes), *flags)
    assert again.exit_code == 0 and _tree(proj) == got, again.output
