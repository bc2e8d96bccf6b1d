"""Atomic writes that keep the file's mode, owner, user extended attributes, ACL, encoding and the
bytes we did not change, and that refuse rather than lose something: a file edited since it was read, a
read-only file, a file with several hard links, or one whose owner or attributes cannot be kept. Every
step happens relative to the file's open folder (``dir_fd``), never through a path resolved again."""

from __future__ import annotations

import errno
import os
import stat

from torchopt.rewrite import place as placemod
from torchopt.rewrite.source import FileState, content_digest

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# What is copied to the new file besides the bytes: user attributes (user.*), and the POSIX ACL.
# security.* (an SELinux label) and trusted.* are the system's: the new file gets what its folder gives.
ACL = "system.posix_acl_access"


class WriteRefused(Exception):
    """The file was left as it is; the message is one line, for the user."""


def atomic_write(path: str, data: bytes, expect: FileState | None = None, dir_fd: int | None = None) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and an atomic rename. With
    ``dir_fd``, ``path`` is a name in that open folder and nothing is resolved again; without it, a
    symlink is followed (its target is rewritten, the link stays a link) and its real folder is
    opened first. With ``expect`` (what the file was when read), the rename happens only if the file
    still is exactly that."""
    if dir_fd is None and placemod.SUPPORTED:
        where = placemod.pin_one(path)
        if where is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        with placemod.opened(where) as folder:
            return atomic_write(where.name, data, expect, folder)
    if dir_fd is None:  # no openat() on this platform
        path = os.path.realpath(path)
    try:
        orig = _open_file(path, dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise WriteRefused("was replaced by a symbolic link since torchopt read it; not written") from None
        raise
    try:
        _write_beside(orig, path, data, expect, dir_fd)
    finally:
        os.close(orig)
    _sync_folder(path, dir_fd)


def _write_beside(orig: int, path: str, data: bytes, expect: FileState | None, dir_fd: int | None) -> None:
    st = os.fstat(orig)
    if expect is not None and not expect.same_stat(st):
        raise WriteRefused(_CHANGED)
    _refuse_unsafe_target(path, st, dir_fd)
    folder = dir_fd
    fd, tmp = _temp_file(os.path.dirname(path) if dir_fd is None else "", folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
            _keep_owner(fh.fileno(), st)
            # After chown, which clears set-id bits; by descriptor where the platform can.
            os.chmod(fh.fileno() if os.chmod in os.supports_fd else tmp, stat.S_IMODE(st.st_mode))
            copy_attributes(orig, fh.fileno())
        if expect is not None:
            _check_unchanged(path, dir_fd, expect)
        os.replace(tmp, path, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=folder)
        except OSError:
            pass
        raise


def _temp_file(tmp_dir: str, dir_fd: int | None) -> tuple[int, str]:
    """A new, empty file of ours beside the target (never an existing name, never through a link)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    import secrets  # (imported when a file is written)

    for _ in range(100):
        tmp = os.path.join(tmp_dir, f".torchopt-{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o600, dir_fd=dir_fd), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", tmp_dir or ".")


def copy_attributes(src: int, dst: int) -> None:
    """Copy the user extended attributes and the POSIX ACL of ``src`` onto ``dst`` (open files), and
    drop an ACL ``dst`` inherited from its folder that ``src`` does not have. A file system without
    extended attributes has nothing to copy; any other failure refuses the write."""
    if not hasattr(os, "listxattr"):
        return
    try:
        names = [n for n in os.listxattr(src) if n.startswith("user.") or n == ACL]
        if ACL not in names and ACL in os.listxattr(dst):
            os.removexattr(dst, ACL)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return
        raise WriteRefused(f"cannot read the file's extended attributes ({exc.strerror}); not written") from None
    for name in names:
        try:
            os.setxattr(dst, name, os.getxattr(src, name))
        except OSError as exc:
            raise WriteRefused(f"cannot keep the extended attribute {name} ({exc.strerror}); not written") from None


_CHANGED = "changed on disk since torchopt read it; not written (run torchopt again)"


def _refuse_unsafe_target(path: str, st: os.stat_result, dir_fd: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise WriteRefused(_CHANGED)
    mode = stat.S_IMODE(st.st_mode)
    # Root may write anything, so the mode bits are checked too: a read-only file stays read-only.
    if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(path, os.W_OK, dir_fd=dir_fd):
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


def _open_file(path: str, dir_fd: int | None) -> int:
    # O_NONBLOCK: a FIFO put in the file's place must not block; its inode differs and fails the checks.
    return os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC | _NOFOLLOW, dir_fd=dir_fd)


def _check_unchanged(path: str, dir_fd: int | None, expect: FileState) -> None:
    """Last look before the rename, at what the name holds now: same inode, size and mtime, and the
    same bytes (an mtime can stay the same across a quick edit on coarse-clock file systems or with
    tools that restore it)."""
    try:
        with os.fdopen(_open_file(path, dir_fd), "rb") as fh:
            same = expect.same_stat(os.fstat(fh.fileno())) and content_digest(fh.read()) == expect.digest
    except OSError:
        same = False
    if not same:
        raise WriteRefused(_CHANGED)


def _sync_folder(path: str, dir_fd: int | None) -> None:
    """Make the rename itself durable; not every platform can open a folder."""
    try:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY, dir_fd=dir_fd)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
