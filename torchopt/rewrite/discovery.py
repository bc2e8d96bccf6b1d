"""Paths -> the Python files to process: folders walked with .gitignore files and `exclude`
patterns honoured; files named on the command line are always taken."""
from __future__ import annotations

import os
from typing import Callable, Iterable

import pathspec

from torchopt.rewrite.config import Settings, glob_match, relpath

DEFAULT_EXCLUDES = frozenset({
    ".git", ".hg", ".svn", ".bzr", ".venv", "venv", ".tox", ".nox", "__pycache__", "node_modules",
    "site-packages", "__pypackages__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".eggs",
    "build", "dist", ".ipynb_checkpoints",
})


def _gitignore(folder: str) -> pathspec.GitIgnoreSpec | None:
    path = os.path.join(folder, ".gitignore")
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return pathspec.GitIgnoreSpec.from_lines(fh)
    except OSError:
        return None


def _excluded(path: str, settings: Settings) -> bool:
    if not settings.exclude:
        return False
    rel = relpath(path, settings.root)
    return any(glob_match(rel, pat) for pat in settings.exclude)


def discover(paths: Iterable[str], settings_for: Callable[[str], Settings]) -> list[str]:
    """Files to process, sorted and without duplicates (by real path)."""
    out: dict[str, str] = {}
    for given in paths:
        if os.path.isdir(given):
            for f in _walk(given, settings_for):
                out.setdefault(os.path.realpath(f), os.path.normpath(f))
        else:
            # Named explicitly: taken even if excluded or not ending in .py; errors surface later.
            out.setdefault(os.path.realpath(given), given)
    return sorted(out.values())


def _walk(top: str, settings_for: Callable[[str], Settings]) -> Iterable[str]:
    # Each entry of the stack: (folder, [(spec, base folder)]) of the .gitignore files above it.
    stack: list[tuple[str, list[tuple[pathspec.PathSpec, str]]]] = [(top, [])]
    seen: set[tuple[int, int]] = set()
    while stack:
        folder, specs = stack.pop()
        try:
            st = os.stat(folder)
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:  # symlink loops and repeated folders
            continue
        seen.add(key)
        spec = _gitignore(folder)
        if spec is not None:
            specs = specs + [(spec, folder)]
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        for entry in entries:
            path = entry.path
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if _ignored(path, is_dir, specs):
                continue
            if is_dir:
                if entry.name in DEFAULT_EXCLUDES or entry.name.startswith("."):
                    continue
                if _excluded(path, settings_for(path)):
                    continue
                subdirs.append(path)
            elif entry.name.endswith(".py") or (entry.is_symlink() and entry.name.endswith(".py")):
                if not _excluded(path, settings_for(path)):
                    yield path
        for d in reversed(subdirs):
            stack.append((d, specs))


def _ignored(path: str, is_dir: bool, specs: list[tuple[pathspec.PathSpec, str]]) -> bool:
    for spec, base in specs:
        rel = os.path.relpath(path, base).replace(os.sep, "/")
        if is_dir:
            rel += "/"
        if spec.match_file(rel):
            return True
    return False
