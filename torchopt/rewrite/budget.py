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
# The deepest expression LibCST is given, counted as LibCST nests it: CPython's tree is flat for
# `a or b or c` and `"a" "b" "c"` where LibCST's nests one level per term. Measured with the default
# recursion limit and an 8 MB stack: a rewrite's transform raises RecursionError at 244 levels (four
# Python frames a level), LibCST's parser raises RecursionError at ~3000 adjacent string literals and
# crashes the process (SIGSEGV) at ~7000 `or` terms.
MAX_EXPRESSION_DEPTH = 200
# LibCST's peak memory per byte of source, measured: a rewrite of dense code (short statements of
# lists and literals) grows the address space by 1,000-1,100 bytes per source byte.
MEMORY_PER_SOURCE_BYTE = 1200
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
    override, else 80% of what this process may still take (physical memory, the cgroup's
    ``memory.max``, both shared between the workers; ``RLIMIT_AS`` and ``RLIMIT_DATA``, which
    each worker has for itself), 0 when unknown."""
    override = os.environ.get(MEMORY_ENV, "").strip()
    if override:
        got = _SIZE.match(override)
        if got:
            return int(float(got.group(1)) * _UNITS[got.group(2).upper()])
    shared = [m for m in (_physical_memory(), _cgroup_memory_left()) if m is not None]
    own = [m for m in _rlimits_left() if m is not None]
    if not shared and not own:
        return 0
    each = [int(m * 0.8) // max(1, workers) for m in shared] + [int(m * 0.8) for m in own]
    return max(1, min(each))


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _rlimits_left() -> list[int | None]:
    """What ``ulimit -v`` (RLIMIT_AS) and RLIMIT_DATA still allow this process: the limit less the
    address space (or data segment) already in use."""
    try:
        import resource

        with open("/proc/self/statm") as fh:
            fields = fh.read().split()
        page = os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError, AttributeError):
        return []
    out: list[int | None] = []
    for which, used in ((resource.RLIMIT_AS, int(fields[0]) * page), (resource.RLIMIT_DATA, int(fields[5]) * page)):
        soft, _ = resource.getrlimit(which)
        out.append(None if soft == resource.RLIM_INFINITY else max(0, soft - used))
    return out


def _cgroup_memory_left(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """``memory.max`` less ``memory.current`` of this process's cgroup (v2), None without a limit."""
    try:
        with open(proc) as fh:
            entry = next((line.split(":", 2)[2].strip() for line in fh if line.startswith("0::")), None)
    except OSError:
        return None
    if entry is None:
        return None
    root = os.path.normpath(root)
    folder = os.path.normpath(os.path.join(root, entry.lstrip("/")))
    while True:  # the nearest limit up the tree (a child cgroup may have none of its own)
        try:
            with open(os.path.join(folder, "memory.max")) as fh:
                limit = fh.read().strip()
            if limit != "max":
                with open(os.path.join(folder, "memory.current")) as fh:
                    return max(0, int(limit) - int(fh.read().strip()))
        except (OSError, ValueError):
            pass
        if folder == root or len(folder) <= len(root):
            return None
        folder = os.path.dirname(folder)


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
    if isinstance(tree, RecursionError):
        return "too deeply nested to analyse (CPython's own parser gives up on it too)"
    if isinstance(tree, MemoryError):
        # CPython's parser raises a bare MemoryError both past its own stack (deep nesting) and when
        # an allocation fails under this process's memory limit: the two cannot be told apart.
        return "too deeply nested or too big to analyse in the memory this process may use (MemoryError in CPython's parser)"
    if isinstance(tree, SyntaxError):
        if any(limit in str(tree.msg) for limit in _CPYTHON_NESTING_LIMITS):
            return f"too deeply nested to analyse ({tree.msg}, line {tree.lineno})"
        # CPython stopped at the first error: the rest of the file was never checked for depth
        return _bracket_problem(text)
    if isinstance(tree, ast.Module) and len(text) > MAX_EXPRESSION_DEPTH:
        depth = deepest_long_expression(tree, text)
        if depth > MAX_EXPRESSION_DEPTH:
            return (
                f"too deeply nested for the parser (expressions {depth} levels deep as LibCST nests them; "
                f"the limit is {MAX_EXPRESSION_DEPTH})"
            )
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
                    deepest = max(deepest, expression_depth(child, text, ends))
    return deepest


def expression_depth(tree: ast.AST, text: str = "", ends: list[int] | None = None) -> int:
    """The deepest nesting of expressions in ``tree`` as LibCST builds it (iterative: the depth may
    be in the thousands). CPython keeps ``a or b or c`` as one node and adjacent string literals as
    one constant; LibCST nests a BooleanOperation per operator and a ConcatenatedString per literal
    (given the ``text`` and its line ``ends``, the literals are counted)."""
    deepest = 0
    stack: list[tuple[ast.AST, int, bool]] = [(tree, 0, False)]
    expr, children = ast.expr, ast.iter_child_nodes
    while stack:
        node, depth, in_fstring = stack.pop()
        if isinstance(node, expr):
            depth += 1
            if isinstance(node, ast.BoolOp):
                depth += len(node.values) - 2
            elif not in_fstring and ends and _is_string(node):
                depth += _adjacent_literals(node, text, ends) - 1
            if depth > deepest:
                deepest = depth
        inner = in_fstring or isinstance(node, ast.JoinedStr)
        stack.extend((child, depth, inner) for child in children(node))
    return deepest


def _is_string(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)))


def _adjacent_literals(node: ast.expr, text: str, ends: list[int]) -> int:
    """How many adjacent literals make up the string ``node`` (1 for a short one, without looking)."""
    first, last = node.lineno, node.end_lineno
    if last is None or last > len(ends) - 1:
        return 1
    start = ends[first - 1] + _byte_to_char(text, ends[first - 1], node.col_offset)
    end = ends[last - 1] + _byte_to_char(text, ends[last - 1], node.end_col_offset or 0)
    if end - start <= 2 * MAX_EXPRESSION_DEPTH:  # every literal takes two characters or more
        return 1
    import io
    import tokenize

    count = nested = 0
    starts = {tokenize.STRING, getattr(tokenize, "FSTRING_START", -1), getattr(tokenize, "TSTRING_START", -1)}
    finishes = {getattr(tokenize, "FSTRING_END", -1), getattr(tokenize, "TSTRING_END", -1)}
    try:
        for tok in tokenize.generate_tokens(io.StringIO("(" + text[start:end] + ")").readline):
            if tok.type in starts:
                count += nested == 0
                nested += tok.type != tokenize.STRING
            elif tok.type in finishes:
                nested -= 1
    except (tokenize.TokenError, SyntaxError):
        pass  # what was read so far still counts
    return max(1, count)


def _byte_to_char(text: str, line_start: int, col: int) -> int:
    """CPython's column offsets count UTF-8 bytes; the text is indexed by characters."""
    line_end = text.find("\n", line_start)
    line = text[line_start : len(text) if line_end < 0 else line_end]
    if line.isascii():
        return col
    return len(line.encode("utf-8")[:col].decode("utf-8", "replace"))


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
    """A size with the unit that shows it in a few digits: ``512 bytes``, ``600 KB``, ``1.5 GB``."""
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{nbytes} bytes"
