"""Scratch working folders: each version of a program runs in its own copy of its folder.

A program that checkpoints to ``model.pt`` or appends to ``log.txt`` must neither change the
user's files nor see what the other version wrote. Each version therefore runs with its working
directory in a copy of its script's folder (small files copied; large files, and whatever is left
once the copy budget is spent, linked read-only: the harness refuses writes through the links).
The user's folders are also snapshotted (size, mtime, inode) before and after, so a write the
harness could not intercept (a C extension writing to an absolute path) is at least reported.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass, field

# Folders that never hold what a program reads by relative path, and can be huge.
SKIP_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        ".venv",
        "venv",
        ".tox",
        ".nox",
        "node_modules",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".torchopt_cache",
        ".ipynb_checkpoints",
    }
)
COPY_FILE_LIMIT = 16 * 1024 * 1024  # a larger file is linked, not copied
COPY_TOTAL_LIMIT = 256 * 1024 * 1024  # bytes copied per version
ENTRY_LIMIT = 20_000  # entries copied per version; the rest of a folder is linked whole
LISTED = 10  # file names listed per note


def _skipped(dirpath: str, name: str, avoid: set[str]) -> bool:
    full = os.path.join(dirpath, name)
    return name in SKIP_DIRS or os.path.realpath(full) in avoid or os.path.exists(os.path.join(full, "pyvenv.cfg"))


def _walk(root: str, avoid: set[str]):
    """os.walk without links, skipping SKIP_DIRS, virtual environments and ``avoid`` (our own
    temporary folder, when it lies inside the user's folder)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skipped(dirpath, d, avoid))
        yield dirpath, dirnames, sorted(filenames)


def fingerprint(roots: list[str], avoid: set[str], limit: int = ENTRY_LIMIT) -> dict[str, tuple]:
    """What changes when a file is written: size, mtime and inode of every file under ``roots``
    (bounded). Compared before and after a run to report writes the harness did not stop."""
    seen: dict[str, tuple] = {}
    for root in roots:
        for dirpath, dirnames, filenames in _walk(root, avoid):
            for name in [*filenames, *dirnames]:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                seen[path] = (st.st_size, st.st_mtime_ns, st.st_ino, stat.S_IFMT(st.st_mode))
                if len(seen) >= limit:
                    return seen
    return seen


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """Paths created, changed or deleted between two fingerprints, each with what happened."""
    out = [f"{p} (new)" for p in after if p not in before]
    out += [f"{p} (changed)" for p in after if p in before and after[p] != before[p]]
    out += [f"{p} (deleted)" for p in before if p not in after]
    return sorted(out)


def listing(items: list[str]) -> str:
    shown = ", ".join(items[:LISTED])
    return shown + (f" and {len(items) - LISTED} more" if len(items) > LISTED else "")


@dataclass
class Scratch:
    """A copy of ``source`` at ``root`` for one version; ``linked`` lists what was linked instead."""

    source: str  # the user's folder (real path)
    root: str  # its copy
    linked: list[str] = field(default_factory=list)
    initial: dict[str, tuple] = field(default_factory=dict)

    def mapped(self, path: str) -> str:
        """``path`` in the user's folder -> the same path in the copy (others unchanged)."""
        real = os.path.realpath(path)
        if real == self.source or real.startswith(self.source + os.sep):
            return self.root + real[len(self.source) :]
        return path

    def unmapped(self, text: str) -> str:
        """Paths of the copy in ``text`` (tracebacks, logs) named as the user knows them."""
        return text.replace(self.root + os.sep, self.source + os.sep)

    def written(self) -> list[str]:
        """What the program created, changed or deleted in its copy, relative to the folder."""
        now = fingerprint([self.root], set())
        return [c[len(self.root) + 1 :] for c in changes(self.initial, now)]


def _link_target(link: str, source_dir: str) -> str:
    """A relative link that stays inside the folder keeps pointing into the copy; any other
    points where the user's link points."""
    target = os.readlink(link)
    resolved = os.path.realpath(os.path.join(os.path.dirname(link), target))
    if not os.path.isabs(target) and (resolved == source_dir or resolved.startswith(source_dir + os.sep)):
        return target
    return resolved


def make(source_dir: str, dest: str, avoid: set[str]) -> Scratch:
    """Copy ``source_dir`` to ``dest`` within the budgets; link (read-only through the harness's
    guard) what does not fit. Links inside the folder are recreated as they are."""
    source_dir = os.path.realpath(source_dir)
    os.makedirs(dest, exist_ok=True)
    dest = os.path.realpath(dest)
    scratch = Scratch(source=source_dir, root=dest)
    copied_bytes = 0
    entries = 0
    for dirpath, dirnames, filenames in _walk(source_dir, avoid):
        target_dir = dest + dirpath[len(source_dir) :]
        for name in list(dirnames):
            src, dst = os.path.join(dirpath, name), os.path.join(target_dir, name)
            entries += 1
            if os.path.islink(src):
                os.symlink(_link_target(src, source_dir), dst)
                dirnames.remove(name)
            elif entries > ENTRY_LIMIT:
                os.symlink(src, dst)
                scratch.linked.append(src)
                dirnames.remove(name)
            else:
                os.mkdir(dst)
        for name in filenames:
            src, dst = os.path.join(dirpath, name), os.path.join(target_dir, name)
            entries += 1
            try:
                st = os.lstat(src)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                os.symlink(_link_target(src, source_dir), dst)
            elif not stat.S_ISREG(st.st_mode):
                continue  # sockets, fifos: nothing a program reads as data
            elif entries > ENTRY_LIMIT or st.st_size > COPY_FILE_LIMIT or copied_bytes + st.st_size > COPY_TOTAL_LIMIT:
                os.symlink(src, dst)
                scratch.linked.append(src)
            else:
                try:
                    shutil.copy2(src, dst)
                except OSError:
                    continue  # unreadable here: the program could not have read it either
                copied_bytes += st.st_size
    scratch.initial = fingerprint([dest], set())
    return scratch
