"""Runs one command and leaves none of its processes behind.

    python -m torchopt.validate.reaper TIMEOUT -- CMD...

A validated program may start helpers (data servers, torchrun ranks, a daemon that calls
``setsid``); a process group cannot hold those, since ``setsid`` leaves it. On Linux this process
makes itself a *child subreaper*, so every orphaned descendant is re-parented to it instead of to
init; when the command ends, passes TIMEOUT seconds, or this process is told to stop (or its
parent dies), it kills every descendant it still has, reaps them, and exits: 124 after a
timeout, otherwise the command's own status.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TIMED_OUT = 124


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children_of() -> dict[int, list[int]]:
    """Parent pid -> live child pids, read from /proc (zombies left out: they are reaped below)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] in (b"Z", b"X"):
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    tree = _children_of()
    found, todo = [], list(tree.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(tree.get(p, []))
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(pid: int, deadline_s: float = 10.0) -> None:
    """SIGKILL every descendant of ``pid`` until none is left. A process forked while we list
    is orphaned when its parent dies and re-parented here (subreaper), so the next pass sees it."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = descendants(pid)
        if not found:
            return
        for p in found:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.02)
        if pid == os.getpid():
            _reap()


def main(argv: list[str]) -> int:
    timeout = float(argv[0])
    cmd = argv[argv.index("--") + 1 :]
    linux = sys.platform.startswith("linux") and os.path.isdir("/proc")
    if linux:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # torchopt died (Ctrl-C, kill): stop the run too
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    if linux and os.getppid() == 1:  # the parent died before the death signal was armed
        return 1
    child = subprocess.Popen(cmd)
    deadline = time.monotonic() + timeout
    status: int | None = None
    while status is None and not stop and time.monotonic() < deadline:
        try:
            status = child.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
    if linux:
        kill_tree(os.getpid())
    else:
        child.kill()
    if status is None:
        child.wait()
        status = 128 + stop[0] if stop else TIMED_OUT
    _reap()
    return 128 - status if status < 0 else status  # killed by a signal: the shell's convention


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
