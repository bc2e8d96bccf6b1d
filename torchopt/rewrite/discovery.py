"""Paths -> the Python files to process: folders walked with .gitignore files and `exclude`
patterns honoured; files named on the command line are always taken. A walk never leaves the
folders it was given through a symbolic link and never returns what is not a regular file."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from torchopt.rewrite.config import Settings, glob_match, relpath
from torchopt.rewrite.source import file_kind, shown

if TYPE_CHECKING:
    import pathspec  # imported when a .gitignore is read: one file named on the command line needs none

# Told about each path a walk leaves out for a reason the user should hear: (path, reason).
OnSkip = Optional[Callable[[str, str], None]]

DEFAULT_EXCLUDES = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".bzr",
        ".venv",
        "venv",
        ".tox",
        ".nox",
        "__pycache__",
        "node_modules",
        "site-packages",
        "__pypackages__",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".eggs",
        "build",
        "dist",
        ".ipynb_checkpoints",
    }
)


def _gitignore(folder: str) -> pathspec.GitIgnoreSpec | None:
    path = os.path.join(folder, ".gitignore")
    try:
        if file_kind(os.stat(path).st_mode) is not None:  # a FIFO would block the walk
            return None
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    return gitignore_spec(lines)


def gitignore_spec(lines: list[str]) -> pathspec.GitIgnoreSpec:
    """Like git, drop the lines it cannot use (`!` alone, a trailing backslash, `[z-a]`, ...) and
    keep the rest working."""
    import pathspec

    try:
        return pathspec.GitIgnoreSpec.from_lines(lines)
    except Exception:  # pathspec raises several kinds for bad patterns; none may stop a run
        pass
    usable = []
    for line in lines:
        try:
            pathspec.GitIgnoreSpec.from_lines([line])
        except Exception:
            continue
        usable.append(line)
    return pathspec.GitIgnoreSpec.from_lines(usable)


def _excluded(path: str, settings: Settings) -> bool:
    if not settings.exclude:
        return False
    rel = relpath(path, settings.root)
    return any(glob_match(rel, pat) for pat in settings.exclude)


# Python files and Jupyter notebooks, like ruff; `exclude = ["*.ipynb"]` leaves notebooks out.
SUFFIXES = (".py", ".ipynb")


def discover(
    paths: Iterable[str], settings_for: Callable[[str], Settings], on_skip: OnSkip = None, suffixes=SUFFIXES
) -> list[str]:
    """Files to process, sorted and without duplicates (by real path: a file reached through a link
    inside the named folders is processed once). Folders give the files whose names end with one of
    ``suffixes``. ``on_skip`` hears of symbolic links that lead out of the named folders and of such
    names that are not regular files (FIFOs, sockets, devices)."""
    paths = list(paths)
    roots = [os.path.realpath(p) for p in paths if os.path.isdir(p)]
    out: dict[str, str] = {}
    for given in paths:
        if os.path.isdir(given):
            for f in _walk(given, settings_for, roots, on_skip or _ignore_skip, tuple(suffixes)):
                out.setdefault(os.path.realpath(f), os.path.normpath(f))
        else:
            # Named explicitly: taken even if excluded or not ending in .py; errors surface later.
            out.setdefault(os.path.realpath(given), given)
    return sorted(out.values())


def _ignore_skip(path: str, reason: str) -> None:
    pass


def _inside(real: str, roots: list[str]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def _leaves_roots(entry: os.DirEntry, roots: list[str], on_skip: Callable[[str, str], None]) -> bool:
    """A symbolic link found by the walk is followed only while it stays inside the named folders."""
    if not entry.is_symlink():
        return False
    real = os.path.realpath(entry.path)
    if _inside(real, roots):
        return False
    on_skip(entry.path, f"symbolic link to {shown(real)}, outside the folders given; not followed")
    return True


def _walk(
    top: str,
    settings_for: Callable[[str], Settings],
    roots: list[str],
    on_skip: Callable[[str, str], None],
    suffixes: tuple[str, ...],
) -> Iterable[str]:
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
                if _excluded(path, settings_for(path)) or _leaves_roots(entry, roots, on_skip):
                    continue
                subdirs.append(path)
            elif entry.name.endswith(suffixes):
                if _excluded(path, settings_for(path)) or _leaves_roots(entry, roots, on_skip):
                    continue
                try:
                    kind = file_kind(entry.stat().st_mode)
                except OSError:  # a dangling link: reading it reports the error
                    kind = None
                if kind is not None:
                    on_skip(path, f"not a regular file ({kind}); not opened")
                    continue
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
