"""Atomic writes that keep the file's mode, owner, encoding and bytes we did not change, and that
refuse rather than lose something: a file edited since it was read, a read-only file, a file with
several hard links, or one whose owner cannot be kept."""

from __future__ import annotations

import os
import stat
import tempfile

from torchopt.rewrite.source import FileState, content_digest


class WriteRefused(Exception):
    """The file was left as it is; the message is one line, for the user."""


def atomic_write(path: str, data: bytes, expect: FileState | None = None) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and an atomic rename.
    A symlink is followed: its target is rewritten, the link stays a link. With ``expect`` (what the
    file was when read), the rename happens only if the file still is exactly that."""
    real = os.path.realpath(path)
    folder = os.path.dirname(real) or "."
    st = os.stat(real)
    if expect is not None and not expect.same_stat(st):
        raise WriteRefused(_CHANGED)
    _refuse_unsafe_target(real, st)
    fd, tmp = tempfile.mkstemp(prefix=".torchopt-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
            _keep_owner(fh.fileno(), st)
        os.chmod(tmp, stat.S_IMODE(st.st_mode))  # after chown, which clears set-id bits
        if expect is not None:
            _check_unchanged(real, expect)
        os.replace(tmp, real)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _sync_folder(folder)


_CHANGED = "changed on disk since torchopt read it; not written (run torchopt again)"


def _refuse_unsafe_target(real: str, st: os.stat_result) -> None:
    mode = stat.S_IMODE(st.st_mode)
    # Root may write anything, so the mode bits are checked too: a read-only file stays read-only.
    if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(real, os.W_OK):
        raise WriteRefused(f"file is read-only (mode {mode:04o}); not written")
    if st.st_nlink > 1:
        raise WriteRefused(f"file has {st.st_nlink} hard links and replacing it would split them; not written")


def _keep_owner(fd: int, st: os.stat_result) -> None:
    """Give the new file the old one's owner and group, or refuse when this process may not."""
    now = os.fstat(fd)
    if (now.st_uid, now.st_gid) == (st.st_uid, st.st_gid) or not hasattr(os, "fchown"):  # no owners on Windows
        return
    try:
        os.fchown(fd, st.st_uid, st.st_gid)
    except OSError:
        try:  # not root: the group alone may still be ours to give
            os.fchown(fd, -1, st.st_gid)
        except OSError:
            pass
    now = os.fstat(fd)
    if (now.st_uid, now.st_gid) != (st.st_uid, st.st_gid):
        raise WriteRefused(f"cannot keep the file's owner {st.st_uid}:{st.st_gid} with a new file; not written")


def _check_unchanged(real: str, expect: FileState) -> None:
    """Last look before the rename: same inode, size and mtime, and the same bytes (an mtime can
    stay the same across a quick edit on coarse-clock file systems or with tools that restore it)."""
    try:
        # O_NONBLOCK: a FIFO put in its place must not block; its inode differs and fails the check.
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as fh:
            same = expect.same_stat(os.fstat(fh.fileno())) and content_digest(fh.read()) == expect.digest
    except OSError:
        same = False
    if not same:
        raise WriteRefused(_CHANGED)


def _sync_folder(folder: str) -> None:
    """Make the rename itself durable; not every platform can open a folder."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
