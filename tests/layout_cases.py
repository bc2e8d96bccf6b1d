"""Shared helpers of the layout tests: build a small project under tmp_path, run the command line
on one file of it, and hash the whole tree before and after."""

from __future__ import annotations

import hashlib
from pathlib import Path

from typer.testing import CliRunner

import torchopt.cli


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def make_project(tmp_path: Path, main: str) -> tuple[Path, Path]:
    """``tmp_path/proj/main.py`` holding ``main``, next to a bystander file, and a file outside."""
    proj = tmp_path / "proj"
    proj.mkdir(parents=True)
    (proj / "main.py").write_text(main, encoding="utf-8")
    (proj / "helpers.py").write_text("def unrelated():\n    return 1\n", encoding="utf-8")
    (tmp_path / "outside.py").write_text("import torch\nprint(torch.zeros(1))\n", encoding="utf-8")
    return proj, proj / "main.py"


def rewrite(tmp_path: Path, main: str, *args: str):
    """Rewrite ``main.py`` of a fresh project; check that only it may have changed. Returns (result, new text)."""
    proj, path = make_project(tmp_path, main)
    before = tree_hashes(tmp_path)
    res = CliRunner().invoke(torchopt.cli.app, ["rewrite", str(path), "--no-cache", *args], catch_exceptions=False)
    after = tree_hashes(tmp_path)
    changed = {k for k in before if before[k] != after.get(k)} | (set(after) - set(before))
    assert changed <= {"proj/main.py"}, changed
    return res, path.read_text(encoding="utf-8")


def check(tmp_path: Path, main: str, *args: str):
    """``torchopt check`` on ``main.py`` of a fresh project; nothing in the tree may change."""
    proj, path = make_project(tmp_path, main)
    before = tree_hashes(tmp_path)
    res = CliRunner().invoke(torchopt.cli.app, ["check", str(path), "--no-cache", *args], catch_exceptions=False)
    assert tree_hashes(tmp_path) == before
    return res
