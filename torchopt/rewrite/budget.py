"""What analysing one file may cost: nesting depth, memory and time.

LibCST's native parser does not fail cleanly on pathological input: very deep nesting overflows its
stack (SIGSEGV, which takes the whole process with it) and a very large file can take gigabytes.
So before LibCST sees a text, :func:`over_budget` refuses what it could not survive, from cheap facts
(the size, CPython's own parse, bracket depth); :func:`time_limit` bounds the time a file may take.
Workers also get an address-space limit (:func:`limit_worker_memory`), as a last line of defence.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from torchopt.rewrite import pyast

# CPython's tokenizer refuses deeper brackets, so nothing that runs is refused here.
MAX_BRACKET_DEPTH = 200
# Expressions nested deeper than this (attribute, call or operator chains) take LibCST seconds per
# line, and not far past CPython's own limit (~3000) its parser crashes.
MAX_EXPRESSION_DEPTH = 1000
# LibCST's peak memory per byte of source, measured (a 20 MB file drives it past 11 GB).
MEMORY_PER_SOURCE_BYTE = 600
# Seconds one file may take to analyse (one-line deep files stay well under a second a file).
FILE_SECONDS = 60.0
# Overrides the memory one file may use (bytes; "512MB" and "4GB" also work).
MEMORY_ENV = "TORCHOPT_MAX_FILE_MEMORY"

# How CPython's SyntaxError names its own nesting limits.
_CPYTHON_NESTING_LIMITS = ("too many nested", "too many levels", "too many statically nested")

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}


class TimeBudgetExceeded(BaseException):
    """Raised in the analysis when a file took longer than its time budget. A BaseException so
    that no broad ``except Exception`` inside a rule can swallow it."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"took longer than {seconds:g} s to analyse (the limit for one file)")


def memory_budget(workers: int = 1) -> int:
    """Bytes one file may use when ``workers`` files are analysed at once: the environment's
    override, else 80% of physical memory shared between the workers (0 when unknown)."""
    override = os.environ.get(MEMORY_ENV, "").strip()
    if override:
        got = _SIZE.match(override)
        if got:
            return int(float(got.group(1)) * _UNITS[got.group(2).upper()])
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0
    return int(physical * 0.8) // max(1, workers)


# The budget of this process: the main process shares memory with nobody it knows of; a pool
# worker is told its share when it starts (set_memory_budget).
_process_budget = {"bytes": -1}


def set_memory_budget(nbytes: int) -> None:
    _process_budget["bytes"] = nbytes


def _memory_for_this_process() -> int:
    if _process_budget["bytes"] < 0:
        _process_budget["bytes"] = memory_budget(1)
    return _process_budget["bytes"]


def over_budget(text: str) -> str | None:
    """Why LibCST must not be given ``text`` (too big for the memory budget, or nested too deep
    for its parser to survive), as a one-line reason; None when it is safe. Cheap: it reuses
    CPython's parse of the text that the rules' prefilters already made. The language server and
    the engine call it before every LibCST parse."""
    too_big = _memory_problem(len(text))
    if too_big is not None:
        return too_big
    tree = pyast.parse(text)
    if isinstance(tree, (RecursionError, MemoryError)):
        return "too deeply nested to analyse (CPython's own parser gives up on it too)"
    if isinstance(tree, SyntaxError):
        if any(limit in str(tree.msg) for limit in _CPYTHON_NESTING_LIMITS):
            return f"too deeply nested to analyse ({tree.msg}, line {tree.lineno})"
        # CPython stopped at the first error: the rest of the file was never checked for depth
        return _bracket_problem(text)
    if isinstance(tree, ast.Module) and len(text) > 2 * MAX_EXPRESSION_DEPTH:
        depth = deepest_long_expression(tree, text)
        if depth > MAX_EXPRESSION_DEPTH:
            return f"too deeply nested to analyse (expressions {depth} deep; the limit is {MAX_EXPRESSION_DEPTH})"
    return None


def file_over_budget(path: str) -> str | None:
    """The memory check of :func:`over_budget` from the file's size, before it is even read (and
    outside the result cache: the budget depends on --jobs and the environment, not the file)."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return None  # reading it reports that
    return _memory_problem(size)


def _memory_problem(source_size: int) -> str | None:
    allowed = _memory_for_this_process()
    need = source_size * MEMORY_PER_SOURCE_BYTE
    if allowed and need > allowed:
        return (
            f"too large to analyse within the memory budget (needs about {_mb(need)}, "
            f"{_mb(allowed)} allowed; set {MEMORY_ENV} or lower --jobs)"
        )
    return None


def deepest_long_expression(tree: ast.Module, text: str) -> int:
    """The deepest nesting among the expressions that are long enough to be too deep. Every level of
    an expression takes at least one character, so an expression whose lines hold no more than
    MAX_EXPRESSION_DEPTH characters cannot be too deep and is not walked: only statements are
    visited, and only the rare long expression is measured (walking every expression of every file
    cost about a tenth of a check)."""
    ends = [0]
    for line in text.splitlines(keepends=True):
        ends.append(ends[-1] + len(line))
    deepest = 0
    stack: list[ast.AST] = list(tree.body)
    while stack:
        stmt = stack.pop()
        for child in ast.iter_child_nodes(stmt):
            if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                stack.append(child)
            elif isinstance(child, ast.AST):
                first = getattr(child, "lineno", None)
                last = getattr(child, "end_lineno", None)
                if first is None or last is None:  # arguments, keywords, aliases: measure their parts
                    stack.append(child)
                elif ends[min(last, len(ends) - 1)] - ends[first - 1] > MAX_EXPRESSION_DEPTH:
                    deepest = max(deepest, expression_depth(child))
    return deepest


def expression_depth(tree: ast.AST) -> int:
    """The deepest nesting of expressions in ``tree`` (iterative: the depth may be in the thousands)."""
    deepest = 0
    stack: list[tuple[ast.AST, int]] = [(tree, 0)]
    expr, children = ast.expr, ast.iter_child_nodes
    while stack:
        node, depth = stack.pop()
        if isinstance(node, expr):
            depth += 1
            if depth > deepest:
                deepest = depth
        stack.extend((child, depth) for child in children(node))
    return deepest


def _bracket_problem(text: str) -> str | None:
    """Bracket depth for a text CPython could not parse. Brackets in strings and comments are
    counted too, which can only over-estimate; a precise count runs only past the limit."""
    if _max_depth(re.sub(r"[^()\[\]{}]+", "", text)) <= MAX_BRACKET_DEPTH:
        return None
    depth = _token_bracket_depth(text)
    if depth > MAX_BRACKET_DEPTH:
        return f"too deeply nested to analyse (brackets {depth} deep; the limit is {MAX_BRACKET_DEPTH})"
    return None


def _max_depth(brackets: str) -> int:
    depth = deepest = 0
    for ch in brackets:
        if ch in "([{":
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
    return deepest


def _token_bracket_depth(text: str) -> int:
    import io
    import tokenize

    ops = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.OP and tok.string in "()[]{}":
                ops.append(tok.string)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass  # what was read so far still counts
    return _max_depth("".join(ops))


@contextmanager
def time_limit(seconds: float, deferred: Callable[[], bool] | None = None) -> Iterator[None]:
    """Raise TimeBudgetExceeded in the code inside once ``seconds`` have passed (the main thread of
    a process only: elsewhere it does nothing). ``deferred()`` true when the alarm rings (a write
    is under way) lets the code finish instead."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def ring(signum, frame):
        if deferred is not None and deferred():
            return
        raise TimeBudgetExceeded(seconds)

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def limit_worker_memory(nbytes: int) -> None:
    """Cap this process's address space at what it uses now plus ``nbytes``: a file that needs more
    fails inside this worker (reported, the run goes on) instead of exhausting the machine. For pool
    workers only: the main process must never be capped."""
    try:
        import resource

        with open("/proc/self/statm") as fh:
            in_use = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = in_use + nbytes
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError):
        pass  # no address-space limits here (not Linux): the size check before parsing still holds


def _mb(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.1f} GB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.0f} MB"
