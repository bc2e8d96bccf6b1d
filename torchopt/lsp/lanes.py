"""Where the language server checks a document: in a thread of the server (most files), or in a
worker process of its own (a large file).

Threads share the interpreter: while LibCST or Python's parser turns a large text into a tree, no
other thread runs, for seconds on a 1 MB module. So a document of ``LARGE_DOC_CHARS`` or more is
checked in a process that serves only that document (started when it first gets that large, ended
when it is closed), and the small files beside it keep getting their diagnostics at once.

Either way a check stops early when the document changes: the thread reads the document's edit
count, the process a shared counter the server bumps on each edit (``Lane.touch``). And either way
the diagnostics are rendered to LSP JSON where they were found (render.py): for a large module with
thousands of findings that took seconds, which on the server's event loop held up every other
document's diagnostics.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from torchopt.rewrite import speedups
from torchopt.rewrite.budget import over_budget
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import Diagnostic
from torchopt.lsp.render import Renderer
from torchopt.rewrite.incremental import IncrementalChecker, Stale
from torchopt.rewrite.projectscope import LiveScope, in_scope

LARGE_DOC_CHARS = 200_000


class LaneDied(Exception):
    """The worker process of a large document ended (killed, out of memory, crashed)."""


Look = tuple[str, str]  # (position encoding, ruleUrl): what the LSP JSON of a diagnostic depends on
# (why the text cannot be analysed, or None; its diagnostics; their LSP JSON; the other files the
# diagnostics were read from: a change to one of them makes the server check the text again)
Checked = tuple[str | None, list[Diagnostic], tuple[Look, bytes] | None, frozenset[str]]


def check_text(
    checker: IncrementalChecker,
    text: str,
    settings: Settings,
    path: str,
    stale: Callable[[], bool],
    look: Look,
    renderer: Renderer,
    scope: LiveScope,
) -> Checked:
    """The check of ``text`` (its LSP JSON array rendered here rather than on the server's event
    loop), with the other modules of its project read through ``scope``: the unsaved text of the
    documents open in the editor, the files' own text otherwise. Raises what ``checker.check``
    raises (ParseError, Stale, RecursionError, ...)."""
    problem = over_budget(text)  # before LibCST sees the text: its parser crashes on deep nesting
    if problem is not None:
        return problem, [], None, frozenset()
    with in_scope(scope):
        diags = checker.check(text, settings, path, stale=stale)
    if stale():
        raise Stale  # not worth rendering: a newer text waits
    reads = frozenset(scope.paths(checker.last_deps))
    return None, diags, (look, renderer.array(diags, text, *look)), reads


class Lane:
    """A worker process for one document, and the pipe to it: :meth:`check` blocks (call it from a
    thread) and runs :func:`check_text` there with the document's own incremental checker."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        self._edits: Any = ctx.RawValue("q", 0)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve,
            args=(child, self._edits, speedups.worker_initializer()),
            name="torchopt-lsp-lane",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._lock = threading.Lock()

    def touch(self, edits: int) -> None:
        """The document's edit count changed: a check of an older text stops."""
        self._edits.value = edits

    def check(
        self, text: str, settings: Settings, path: str, edits: int, look: Look, others: dict[str, str]
    ) -> Checked:
        """``others``: the unsaved texts of the other documents open in the editor, by path."""
        with self._lock:
            try:
                self._conn.send((text, settings, path, edits, look, others))
                ok, value = self._conn.recv()
            except (EOFError, OSError) as exc:
                raise LaneDied(f"the worker process of this document ended ({type(exc).__name__})") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._conn.close()  # the worker sees the end of its input and exits
        self._proc.join(0.5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(1)


def _serve(conn: Any, edits: Any, init: Callable[[], object] | None) -> None:
    """The worker process: check each text sent until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server, which ends this process
    os.dup2(2, 1)  # stdout is the server's LSP stream: nothing here may write into it
    sys.stdout = sys.stderr
    if init is not None:
        init()
    checker, renderer, scope = IncrementalChecker(), Renderer(), LiveScope()
    while True:
        try:
            text, settings, path, gen, look, others = conn.recv()
        except (EOFError, OSError):
            return
        for p in scope.open_paths() - set(others):
            scope.set_text(p, None)
        for p, t in others.items():
            scope.set_text(p, t)
        result: tuple[bool, Any]
        try:
            stale = lambda: edits.value != gen  # noqa: E731
            result = (True, check_text(checker, text, settings, path, stale, look, renderer, scope))
        except Exception as exc:  # raised again in the server
            result = (False, exc)
        try:
            conn.send(result)
        except (EOFError, OSError):
            return
        except Exception as exc:  # an exception that does not pickle
            conn.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
