"""`torchopt validate --rev BASE..HEAD ENTRY.py`: a repository's entry point compared at two commits,
as a CI gate would, without running anything of the repository's git set-up (hooks, filters)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from test_validate_declared import AMP_OK, BASE
from torchopt.cli import app
from torchopt.validate.command import Outcome
from torchopt.validate.revisions import Revisions, github_lines, parse_range, reached_files


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(repo.parent)}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def commit(repo: Path, files: dict[str, str], message: str) -> None:
    for rel, text in files.items():
        (repo / rel).write_text(text)
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", message)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "proj"
    repo.mkdir()
    git(repo, "init", "-q")
    model = "import torch.nn as nn\n\n\ndef make():\n    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))\n"
    train = BASE.replace("model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))", "model = make()")
    train = train.replace(
        "import torch.nn.functional as F\n", "import torch.nn.functional as F\nfrom model import make\n"
    )
    commit(repo, {"model.py": model, "train.py": train, "notes.txt": "v1\n"}, "float32")
    amp = AMP_OK.replace("model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))", "model = make()")
    amp = amp.replace("import torch.nn.functional as F\n", "import torch.nn.functional as F\nfrom model import make\n")
    commit(repo, {"train.py": amp, "notes.txt": "v2\n"}, "mixed precision")
    commit(repo, {"train.py": amp.replace("lr=0.1", "lr=0.12")}, "mixed precision and another learning rate")
    # Set-up a checkout would run: a hook and a filter driver, each leaving a marker.
    marker = tmp_path / "marker"
    hook = repo / ".git" / "hooks" / "post-checkout"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
    hook.chmod(0o755)
    git(repo, "config", "filter.mark.smudge", f"sh -c 'touch {marker}; cat'")
    git(repo, "config", "filter.mark.clean", f"sh -c 'touch {marker}; cat'")
    (repo / ".git" / "info" / "attributes").write_text("* filter=mark\n")
    return repo


def run_rev(repo: Path, *args: str):  # type: ignore[no-untyped-def]
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        return CliRunner().invoke(app, ["validate", *args, "--device", "cpu", "--steps", "4"], catch_exceptions=False)
    finally:
        os.chdir(cwd)


def snapshot(repo: Path) -> dict[str, bytes]:
    """Every file of the repository, .git included (read directly: a git command would run the filter)."""
    return {str(p.relative_to(repo)): p.read_bytes() for p in sorted(repo.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_rev_compares_two_commits_without_hooks_or_filters(repo: Path) -> None:
    before = snapshot(repo)
    res = run_rev(repo, "train.py", "--rev", "HEAD~2..HEAD~1", "--output-format", "json")
    out = json.loads(res.stdout)
    assert res.exit_code == 0, (out["headline"], out.get("first_divergence"))
    assert out["revisions"]["changed"] == ["notes.txt", "train.py"]
    assert out["revisions"]["reached"] == ["train.py"]
    assert any(n.startswith("inferred --expect numerics=bf16: train.py: AFTER adds") for n in out["notes"])
    assert not (repo.parent / "marker").exists()
    assert snapshot(repo) == before


@pytest.mark.slow
def test_rev_fails_a_learning_rate_change_riding_with_amp_for_github(repo: Path) -> None:
    res = run_rev(repo, "train.py", "--rev", "HEAD~2", "--expect", "numerics=bf16", "--output-format", "github")
    assert res.exit_code == 1, res.stdout
    assert res.stdout.startswith("::error file=train.py,title=torchopt validate::DIVERGED at step 1, loss[1]")
    assert "::group::torchopt validate report" in res.stdout
    assert not (repo.parent / "marker").exists()


@pytest.mark.slow
def test_rev_uses_the_tolerance_of_torchopts_own_rewrite(tmp_path: Path) -> None:
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "amp_plain_loop"
    repo = tmp_path / "proj"
    repo.mkdir()
    git(repo, "init", "-q")
    commit(repo, {"train.py": (fixture / "before.py").read_text()}, "float32")
    commit(repo, {"train.py": (fixture / "after_unsafe.py").read_text()}, "torchopt rewrite --unsafe-fixes")
    res = run_rev(repo, "train.py", "--rev", "HEAD~1", "--output-format", "json")
    out = json.loads(res.stdout)
    assert res.exit_code == 0, (out["headline"], out.get("first_divergence"))
    assert {f["code"] for f in out["applied"]} >= {"TOP202", "TOP502"}
    assert any(n.startswith("train.py at HEAD is torchopt's rewrite") for n in out["notes"])
    assert "noise floor" in out["tolerance"]["criterion"]


def test_rev_with_an_unknown_commit_or_a_missing_entry_could_not_run(repo: Path, tmp_path: Path) -> None:
    res = run_rev(repo, "train.py", "--rev", "nosuchbranch")
    assert res.exit_code == 2 and "is not a commit" in res.stdout
    res = run_rev(repo, "missing.py", "--rev", "HEAD~1")
    assert res.exit_code == 2 and "missing.py does not exist" in res.stdout


def test_ranges_of_revisions() -> None:
    assert parse_range("main") == ("main", "HEAD")
    assert parse_range("v1..feature") == ("v1", "feature")
    for bad in ("a...b", "..b", "a.."):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_the_files_an_entry_reaches_through_its_imports(tmp_path: Path) -> None:
    files = {
        "scripts/train.py": "import helpers\nfrom pkg.models import net\nimport torch\n",
        "scripts/helpers.py": "from . import nothing\n",
        "pkg/__init__.py": "",
        "pkg/models/__init__.py": "from .layers import Block\n",
        "pkg/models/net.py": "from ..data import load\n",
        "pkg/models/layers.py": "",
        "pkg/data.py": "",
        "pkg/unused.py": "",
        "docs/readme.md": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert reached_files(str(tmp_path), "scripts/train.py") == {
        "scripts/train.py",
        "scripts/helpers.py",
        "pkg/__init__.py",
        "pkg/models/__init__.py",
        "pkg/models/net.py",
        "pkg/models/layers.py",
        "pkg/data.py",
    }


def test_github_output_annotates_the_entry_with_the_verdict() -> None:
    out = Outcome(
        1,
        "DIVERGED at step 1, loss[1]\nrest of the report\n",
        {
            "verdict": "diverged",
            "headline": "DIVERGED at step 1, loss[1]",
            "first_divergence": {"name": "loss[1]", "detail": "diverged: 1 of 1, outside"},
        },
    )
    lines = github_lines(out, Revisions("a" * 40, "b" * 40, "src/train.py")).splitlines()
    assert (
        lines[0]
        == "::error file=src/train.py,title=torchopt validate::DIVERGED at step 1, loss[1] (loss[1]: diverged: 1 of 1, outside)"
    )
    assert lines[1:] == [
        "::group::torchopt validate report",
        "DIVERGED at step 1, loss[1]",
        "rest of the report",
        "::endgroup::",
    ]
