"""Where a file is, pinned when the run found it, so that reading and writing it cannot be redirected.

A :class:`Place` is a folder by its real path and its identity (device, inode) when the files were
found (one of the folders given, or the real folder of a file named on the command line), and the
names that lead from it to the file. To read or write the file, :func:`opened` opens that folder again,
checks that it is the same folder (device and inode), walks down the names one at a time relative to it
without following links, and keeps the file's own folder open: every later step (read, temp file,
rename) is relative to that open folder, never a path resolved again. A folder replaced by a symbolic link
since the files were found (or replaced at all) is refused with a one-line reason; nothing is read or
written through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

from torchopt.rewrite.source import shown

_DIR_FLAGS = os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# A folder may be searchable but not readable (a home folder of mode 0711): O_PATH opens it all the same.
_SEARCH_ONLY = getattr(os, "O_PATH", 0)
# Walking by open folders needs openat(); without it (Windows) paths are resolved as before.
SUPPORTED = os.open in os.supports_dir_fd and bool(getattr(os, "O_NOFOLLOW", 0))


class Moved(Exception):
    """A folder on the way to the file is no longer the one found (a symbolic link now, or another
    folder): the file is neither read nor written. The message is one line, for the user."""


@dataclass(frozen=True)
class Place:
    root: str  # real path of the folder the file was found in
    root_id: tuple[int, int]  # its (st_dev, st_ino) then
    parts: tuple[str, ...]  # names from ``root`` to the file, the last one the file's

    @property
    def name(self) -> str:
        return self.parts[-1]


def pin(paths: Iterable[str], files: Iterable[str]) -> dict[str, Place]:
    """The place of each of ``files`` found under ``paths`` (as ``discover`` returns them): a file
    inside a folder given is pinned to that folder, any other (a file named itself, or a link named
    to a file elsewhere) to its own real folder."""
    paths = list(paths)
    folders = [p for p in paths if os.path.isdir(p)]
    named = set(paths) - set(folders)
    roots = sorted({_prefix(os.path.realpath(p)) for p in folders}, key=len, reverse=True)
    walked = tuple(_prefix(os.path.abspath(p)) for p in folders)
    ids: dict[str, tuple[int, int] | None] = {}
    out: dict[str, Place] = {}
    real_dirs: dict[str, str] = {}  # resolved once per folder, not once per file
    for f in files:
        given = os.path.abspath(f)
        folder, name = os.path.split(given)
        if folder not in real_dirs:
            real_dirs[folder] = _prefix(os.path.realpath(folder))
        real = os.path.realpath(f) if os.path.islink(f) else real_dirs[folder] + name
        prefix = next((r for r in roots if real.startswith(r)), None)
        if prefix is None and f not in named and given.startswith(walked):
            # Found inside a folder given, real path outside them all: a folder was swapped meanwhile.
            out[f] = Place(os.path.dirname(real), (-1, -1), (os.path.basename(real),))
            continue
        prefix = prefix or _prefix(os.path.dirname(real))
        if prefix not in ids:
            try:
                st = os.stat(prefix)
                ids[prefix] = (st.st_dev, st.st_ino)
            except OSError:
                ids[prefix] = None
        root_id = ids[prefix]
        if root_id is not None:
            out[f] = Place(prefix.rstrip(os.sep) or os.sep, root_id, tuple(real[len(prefix) :].split(os.sep)))
    return out


def _prefix(folder: str) -> str:
    """``folder`` ending in one separator, so that a plain ``startswith`` tests what is inside it."""
    return folder.rstrip(os.sep) + os.sep


def pin_one(path: str) -> Place | None:
    """A file's place now, in its own real folder (for a caller with no earlier discovery)."""
    return pin([], [path]).get(path)


def _open_dir(name: str, dir_fd: int | None, flags: int = _NOFOLLOW) -> int:
    try:
        return os.open(name, os.O_RDONLY | _DIR_FLAGS | flags, dir_fd=dir_fd)
    except PermissionError:
        if not _SEARCH_ONLY:
            raise
        return os.open(name, _SEARCH_ONLY | _DIR_FLAGS | flags, dir_fd=dir_fd)


def _step(name: str, dir_fd: int | None, where: str) -> int:
    try:
        return _open_dir(name, dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Moved(
                f"folder {shown(where)} was replaced by a symbolic link or a file since torchopt found the "
                "file; not read or written"
            ) from None
        raise


@contextlib.contextmanager
def opened(place: Place) -> Iterator[int]:
    """The file's own folder, open (a descriptor to use as ``dir_fd`` with ``place.name``), reached
    from the very folder found without following a link."""
    fds: list[int] = []
    try:
        # Whatever the path resolves to now, it is used only if it is the very folder found.
        where = place.root
        try:
            fds.append(_open_dir(where, None, flags=0))
            st = os.fstat(fds[-1])
            same = (st.st_dev, st.st_ino) == place.root_id
        except NotADirectoryError:
            same = False
        if not same:
            raise Moved(f"folder {shown(place.root)} was replaced since torchopt found the file; not read or written")
        for part in place.parts[:-1]:
            where = os.path.join(where, part)
            fds.append(_step(part, fds[-1], where))
        for fd in fds[:-1]:  # only the file's own folder stays open
            os.close(fd)
        fds[:-1] = []
        yield fds[-1]
    finally:
        for fd in fds:
            os.close(fd)
