"""Atomic writes that keep the file's mode, encoding and bytes we did not change."""
from __future__ import annotations

import os
import stat
import tempfile


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and an atomic rename.
    A symlink is followed: its target is rewritten, the link stays a link."""
    real = os.path.realpath(path)
    folder = os.path.dirname(real) or "."
    mode = stat.S_IMODE(os.stat(real).st_mode)
    fd, tmp = tempfile.mkstemp(prefix=".torchopt-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
