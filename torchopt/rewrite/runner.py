"""Runs the engine over files, in a process pool. Every file ends as ok, failed (with a one-line
reason; the file is left byte-for-byte as it was) or skipped; one file's failure never stops a run."""

from __future__ import annotations

import enum
import gc
import os
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from torchopt.rewrite import diff as diffmod
from torchopt.rewrite import budget, interrupt, notebook, projectscope, source, speedups
from torchopt.rewrite import place as placemod
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import Diagnostic, FixError, ParseError, check_source, fix_source
from torchopt.rewrite.place import Place
from torchopt.rewrite.write import WriteRefused, atomic_write

if TYPE_CHECKING:
    from concurrent.futures import Future, ProcessPoolExecutor  # (the pool is imported when a run needs one)

    from torchopt.rewrite.cache import Cache, Entry


class Mode(str, enum.Enum):
    CHECK = "check"  # report every diagnostic
    FIX = "fix"  # write fixes in place
    DIFF = "diff"  # print a diff, write nothing
    LIST = "list"  # list files that would change, write nothing


@dataclass
class FileResult:
    path: str
    status: str = "ok"  # ok | failed | skipped
    reason: str = ""
    changed: bool = False
    diff: str = ""
    new_text: str | None = None
    applied: list[Diagnostic] = field(default_factory=list)
    remaining: list[Diagnostic] = field(default_factory=list)
    diagnostics: list[Diagnostic] = field(default_factory=list)
    untrusted_cache: bool = False  # its cache entry was not this user's and was ignored


def process_text(text: str, path: str, settings: Settings, mode: Mode, unsafe: bool | None = None) -> FileResult:
    """The pure part: text in, result out (no file access). A notebook's code cells are one program."""
    if notebook.is_notebook(path):
        return _notebook(text, path, mode, settings, lambda code: _process_python(code, path, settings, mode, unsafe))
    return _process_python(text, path, settings, mode, unsafe)


def _process_python(text: str, path: str, settings: Settings, mode: Mode, unsafe: bool | None) -> FileResult:
    res = FileResult(path=path)
    try:
        if mode is Mode.CHECK:
            res.diagnostics = check_source(text, settings, path).diagnostics
            return res
        fixed = fix_source(text, settings, path, unsafe=unsafe)
    except ParseError as exc:
        return FileResult(path=path, status="failed", reason=str(exc))
    except FixError as exc:
        return FileResult(path=path, status="failed", reason=str(exc))
    except RecursionError:
        return FileResult(path=path, status="failed", reason="too deeply nested to analyse")
    res.applied, res.remaining = fixed.applied, fixed.remaining
    res.changed = fixed.text != text
    unkept = source.unkept_bytes(text) if res.changed else None  # a fix would take those bytes with it
    if unkept is not None:
        return FileResult(path=path, status="failed", reason=unkept)
    res.new_text = fixed.text
    if res.changed and mode is Mode.DIFF:
        res.diff = diffmod.unified(text, fixed.text, path)
    return res


def _kind(settings: Settings, mode: Mode, unsafe: bool | None) -> str:
    if mode is Mode.CHECK:
        return "check"
    return "fix-unsafe" if (settings.unsafe_fixes if unsafe is None else unsafe) else "fix"


def _to_entry(res: FileResult, text: str) -> "Entry":
    from torchopt.rewrite.cache import Entry

    return Entry(
        status=res.status,
        reason=res.reason,
        diagnostics=res.diagnostics,
        applied=res.applied,
        remaining=res.remaining,
        new_text=res.new_text if res.changed else None,
    )


def _from_entry(entry: "Entry", text: str, path: str, mode: Mode) -> FileResult:
    res = FileResult(path=path, status=entry.status, reason=entry.reason)
    if entry.status != "ok":
        return res
    res.diagnostics, res.applied, res.remaining = entry.diagnostics, entry.applied, entry.remaining
    if mode is not Mode.CHECK:
        res.new_text = text if entry.new_text is None else entry.new_text
        res.changed = res.new_text != text
        if res.changed and mode is Mode.DIFF:
            res.diff = diffmod.unified(text, res.new_text, path)
    return res


def process_cached(
    text: str, path: str, settings: Settings, mode: Mode, unsafe: bool | None = None, cache: "Cache | None" = None
) -> FileResult:
    """process_text through the cache: a hit answers without analysing the file again; an entry this
    user's torchopt did not write is ignored (and replaced), and the result says so."""
    if cache is None:
        return process_text(text, path, settings, mode, unsafe)
    if notebook.is_notebook(path):  # the program is cached; its positions in cells are found each time
        return _notebook(
            text,
            path,
            mode,
            settings,
            lambda program: _through_cache(program, path, settings, mode, unsafe, cache, _process_python),
        )
    return _through_cache(text, path, settings, mode, unsafe, cache, process_text)


def _through_cache(
    text: str,
    path: str,
    settings: Settings,
    mode: Mode,
    unsafe: bool | None,
    cache: "Cache",
    analyse: Callable[[str, str, Settings, Mode, bool | None], FileResult],
) -> FileResult:
    from torchopt.rewrite.cache import Untrusted

    kind = _kind(settings, mode, unsafe)
    untrusted = False
    try:
        hit = cache.get(text, path, settings, kind)
    except Untrusted:
        hit, untrusted = None, True
    if hit is not None and projectscope.unchanged(hit.depends):
        return _from_entry(hit, text, path, mode)
    with projectscope.recorded() as depends:  # the other files of the project the rules asked about
        res = analyse(text, path, settings, mode, unsafe)
    entry = _to_entry(res, text)
    entry.depends = depends
    cache.put(text, path, settings, kind, entry)
    res.untrusted_cache = untrusted
    return res


def _notebook(text: str, path: str, mode: Mode, settings: Settings, analyse: Callable[[str], FileResult]) -> FileResult:
    """A notebook's JSON text -> its program -> ``analyse`` -> positions in cells and, when fixed,
    the JSON text with only the changed cells' sources replaced."""
    try:
        nb = notebook.Notebook.load(text)
    except notebook.NotebookError as exc:
        return FileResult(path=path, status="failed", reason=str(exc))
    if nb.language() != "python":
        return FileResult(path=path, status="skipped", reason=f"a {nb.language()} notebook")
    size = len(nb.program.encode("utf-8", "surrogatepass"))
    if settings.max_file_size and size > settings.max_file_size:
        reason = (
            f"its code cells are {size / 1e6:.1f} MB, over the {settings.max_file_size / 1e6:.1f} MB limit "
            "(raise `max-file-size` in [tool.torchopt] to process it)"
        )
        return FileResult(path=path, status="failed", reason=reason)
    res = analyse(nb.program)
    if res.status != "ok":
        return FileResult(path=path, status=res.status, reason=nb.place_reason(res.reason))
    fixed = nb.program if res.new_text is None else res.new_text
    res.diagnostics = nb.place(res.diagnostics, nb.program)
    res.applied = nb.place(res.applied, nb.program)
    res.remaining = nb.place(res.remaining, fixed)
    res.diff, res.new_text = "", None if mode is Mode.CHECK else text
    if mode is Mode.CHECK or not res.changed:
        res.changed = False
        return res
    try:
        new_text, cells = nb.write(fixed)
    except notebook.NotebookError as exc:
        return FileResult(path=path, status="failed", reason=str(exc))
    res.new_text, res.changed = new_text, new_text != text
    if mode is Mode.DIFF:
        res.diff = "".join(diffmod.unified(c.text, new, f"{path}:cell {c.number}") for c, new in cells)
    return res


def compiles(text: str, path: str) -> str | None:
    """Why ``text`` is not Python this interpreter compiles, in one line; None when it compiles.
    Every text is checked so just before it is written, wherever it came from."""
    try:
        compile(text, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        return " ".join(str(exc).split())
    except (RecursionError, MemoryError):
        return "too deeply nested to compile"
    return None


def process_file(
    path: str,
    settings: Settings,
    mode: Mode,
    unsafe: bool | None = None,
    cache: "Cache | None" = None,
    place: Place | None = None,
) -> FileResult:
    """Read, analyse and (in FIX mode) write ``path``. With ``place`` (where discovery found it), the
    file is read and written relative to its folder opened again without following links, and a
    folder swapped since is refused; without it, the file's real folder now is used."""
    if not placemod.SUPPORTED:
        return _process_opened(path, path, None, settings, mode, unsafe, cache)
    place = place or placemod.pin_one(path)
    if place is None:
        return FileResult(path=path, status="failed", reason="cannot read: No such file or directory")
    try:
        with placemod.opened(place) as folder:
            return _process_opened(path, place.name, folder, settings, mode, unsafe, cache)
    except placemod.Moved as exc:
        return FileResult(path=path, status="failed", reason=str(exc))
    except OSError as exc:
        return FileResult(path=path, status="failed", reason=f"cannot read: {exc.strerror or exc}")


def _process_opened(
    path: str, name: str, folder: int | None, settings: Settings, mode: Mode, unsafe: bool | None, cache: "Cache | None"
) -> FileResult:
    try:
        # In a notebook the limit is on its code (checked later), not on its outputs' images.
        src = source.read(name, 0 if notebook.is_notebook(path) else settings.max_file_size, dir_fd=folder)
    except source.SourceError as exc:
        return FileResult(path=path, status="failed", reason=str(exc))
    if source.is_generated(src.text):
        return FileResult(path=path, status="skipped", reason="marked @generated")
    # Diagnostics and diff headers carry a printable name; the result keeps the real one.
    res = process_cached(src.text, source.shown(path), settings, mode, unsafe, cache)
    res.path = path
    if res.status != "ok":
        return res
    if res.changed and mode is Mode.FIX:
        written = res.new_text or ""
        broken = compiles(notebook.Notebook.load(written).program if notebook.is_notebook(path) else written, path)
        if broken is not None:
            return FileResult(
                path=path, status="failed", reason=f"the fixed text does not compile ({broken}); not written"
            )
        try:
            with interrupt.writing():
                atomic_write(name, src.encode(res.new_text or ""), expect=src.state, dir_fd=folder)
        except (source.SourceError, WriteRefused) as exc:
            return FileResult(path=path, status="failed", reason=str(exc))
        except (OSError, UnicodeEncodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            return FileResult(path=path, status="failed", reason=f"cannot write: {reason}")
    res.new_text = None  # not needed past this point; keeps results small across processes
    return res


def tune_gc() -> None:
    """LibCST builds millions of small objects per large file, and CPython's default collector
    thresholds make it scan them again and again (~15% of a run, measured); the trees hold no
    cycles worth collecting early. Process-wide, for processes that do analysis only."""
    if gc.get_threshold()[0] < GC_THRESHOLD:
        gc.set_threshold(GC_THRESHOLD, 50, 100)


GC_THRESHOLD = 100_000

# A file to process: its path, its settings, and where discovery found it (None: where it is now).
Item = tuple[str, Settings, "Place | None"]


def _chunk(
    files: Sequence[Item],
    mode: Mode,
    unsafe: bool | None,
    cache: "Cache | None" = None,
    scope: projectscope.ProjectScope | None = None,
) -> list[FileResult]:
    """Process ``files`` one after the other. After a stop signal: the results so far (a write under
    way finishes first; the files not reached have no result). ``scope``: which other files of the
    project the rules may read (see rewrite/projectscope.py)."""
    tune_gc()
    out: list[FileResult] = []
    try:
        with interrupt.abandoning(), projectscope.in_scope(scope):
            for path, settings, place in files:
                if interrupt.stop_requested() is not None:
                    break
                out.append(_one_file(path, settings, mode, unsafe, cache, place))
    except interrupt.Interrupted:
        pass
    interrupt.exit_if_orphaned()
    return out


def _one_file(
    path: str, settings: Settings, mode: Mode, unsafe: bool | None, cache: "Cache | None", place: Place | None
) -> FileResult:
    too_big = None if notebook.is_notebook(path) else budget.file_over_budget(path)  # the engine checks the code
    if too_big is not None:
        return FileResult(path=path, status="failed", reason=too_big)
    try:
        with budget.time_limit(budget.FILE_SECONDS, deferred=interrupt.is_writing):
            return process_file(path, settings, mode, unsafe, cache, place)
    except budget.TimeBudgetExceeded as exc:  # not cached: a faster machine may manage it
        return FileResult(path=path, status="failed", reason=str(exc))
    except Exception as exc:  # a bug of ours must not stop the run or touch the file
        return FileResult(path=path, status="failed", reason=f"internal error: {type(exc).__name__}: {exc}")


def worker_count(jobs: int | None, files: int) -> int:
    """Workers for ``files`` files: ``--jobs`` (default: the CPUs), never more than the CPUs this
    process may use nor than the files."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(jobs or cpus, cpus, files))


def run(
    files: Sequence[str],
    settings_for: Callable[[str], Settings],
    mode: Mode,
    jobs: int | None = None,
    unsafe: bool | None = None,
    on_progress: Callable[[int], None] | None = None,
    cache: "Cache | None" = None,
    places: Mapping[str, Place] | None = None,
) -> list[FileResult]:
    """Process ``files``; results come back in the order of ``files``. With ``cache``, files whose
    text, path and settings were analysed before (by this torchopt) are answered from it. ``places``
    (from ``place.pin`` right after discovery) keep each file's reads and writes inside the folder it
    was found in.
    On SIGINT/SIGTERM: no new file is started, writes under way finish, and Interrupted is raised
    with the number of files written."""
    places = places or {}
    items = [(f, settings_for(f), places.get(f)) for f in files]
    scope = _scope(files, places, cache)
    jobs = worker_count(jobs, len(items))
    results: dict[str, FileResult] = {}
    progress = on_progress or (lambda n: None)
    try:
        with interrupt.handle_stop_signals(abandon=False):
            if jobs <= 1 or len(items) < 8:
                for item in items:
                    for res in _chunk([item], mode, unsafe, cache, scope):
                        results[res.path] = res
                        progress(1)
                    signum = interrupt.stop_requested()
                    if signum is not None:
                        raise interrupt.Interrupted(signum)
            else:
                _run_pool(items, (mode, unsafe, cache, scope), jobs, progress, results)
    except interrupt.Interrupted as stop:
        written = sum(1 for r in results.values() if r.status == "ok" and r.changed and mode is Mode.FIX)
        raise interrupt.Interrupted(stop.signum, written=written) from None
    finally:
        interrupt.reset_after_run()
    if cache is not None:
        cache.prune()
    return [results[f] for f in files]


# How far ahead of the workers files are handed out: enough to keep them busy, little to cancel.
CHUNKS_AHEAD_PER_WORKER = 2
WORKER_DIED = "the worker process analysing it died (a crash in LibCST's parser, or out of memory); left unchanged"


def _scope(files: Sequence[str], places: Mapping[str, Place], cache: "Cache | None") -> projectscope.ProjectScope:
    """The run's project scope: the folders given (a place that holds several files of the run, or one
    below its top), and the files named on their own."""
    by_root: dict[str, list[Place]] = {}
    for f in files:
        p = places.get(f)
        if p is not None:
            by_root.setdefault(p.root, []).append(p)
    folders = {r for r, ps in by_root.items() if len(ps) > 1 or len(ps[0].parts) > 1}
    named = [f for f in files if f not in places or places[f].root not in folders]
    return projectscope.ProjectScope(folders=folders, files=named, cache=cache)


def _run_pool(
    items: list[Item], args: tuple, jobs: int, progress: Callable[[int], None], results: dict[str, FileResult]
) -> None:
    """Chunks of files in a process pool. A worker that dies takes only its own file with it: the
    files of every chunk the broken pool lost are run again one at a time in a new pool, so that a
    second death names the file that caused it."""
    from concurrent.futures import ProcessPoolExecutor

    _import_rules()
    size = max(1, min(16, len(items) // (jobs * 4) or 1))
    pending = deque(items[i : i + size] for i in range(0, len(items), size))
    suspects: deque[Item] = deque()
    while pending or suspects:
        # spawn/forkserver workers do not inherit this process's LibCST speed-ups: install them there too
        pool = ProcessPoolExecutor(
            max_workers=jobs,
            initializer=interrupt.init_worker,
            initargs=(os.getpid(), budget.memory_budget(jobs), speedups.worker_initializer()),
        )
        inflight: dict[Future, tuple[list[Item], bool]] = {}
        try:
            _feed_pool(pool, inflight, pending, suspects, args, jobs, progress, results)
        except interrupt.Interrupted:
            interrupt.ignore_stop_signals()
            _stop_pool(pool, inflight, progress, results)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _import_rules() -> None:
    """Every rule module, imported before the workers start: they analyse under a memory limit
    (``budget.limit_worker_memory``), where loading a module's shared library can fail, and forked
    workers share what this process imported. A one-file run (no pool) imports only what it needs.
    LibCST's native parser is a shared library too, loaded at its first parse: load it here."""
    import importlib

    from torchopt.rewrite.registry import all_rules

    importlib.import_module("libcst.native")

    rules = all_rules()
    for code in rules:
        rules[code]


def _feed_pool(
    pool: ProcessPoolExecutor,
    inflight: dict[Future, tuple[list[Item], bool]],
    pending: deque,
    suspects: deque,
    args: tuple,
    jobs: int,
    progress: Callable[[int], None],
    results: dict[str, FileResult],
) -> None:
    """Keep ``pool`` busy until the work is done or the pool breaks (then return: the caller starts
    a new one for what is left)."""
    from concurrent.futures import FIRST_COMPLETED, wait

    while True:
        signum = interrupt.stop_requested()
        if signum is not None:
            raise interrupt.Interrupted(signum)
        if suspects:
            if not inflight:
                single = [suspects.popleft()]
                inflight[pool.submit(_chunk, single, *args)] = (single, True)
        else:
            while pending and len(inflight) < CHUNKS_AHEAD_PER_WORKER * jobs:
                chunk = pending.popleft()
                inflight[pool.submit(_chunk, chunk, *args)] = (chunk, False)
        if not inflight:
            return
        # a short timeout: stop signals are only noted here, and seen at the top of the loop
        done, _ = wait(inflight, timeout=0.2, return_when=FIRST_COMPLETED)
        broken = False
        for fut in done:
            chunk, alone = inflight.pop(fut)
            broken |= _collect(fut, chunk, alone, suspects, progress, results)
        if broken:  # the others of this pool fail the same way, or finished before it broke
            for fut in wait(list(inflight)).done:
                chunk, alone = inflight.pop(fut)
                _collect(fut, chunk, alone, suspects, progress, results)
            return


def _collect(
    fut: Future,
    chunk: list[Item],
    alone: bool,
    suspects: deque,
    progress: Callable[[int], None],
    results: dict[str, FileResult],
) -> bool:
    """Record what ``fut`` produced; True when its pool broke."""
    from concurrent.futures.process import BrokenProcessPool

    try:
        done = fut.result()
    except BrokenProcessPool:
        if alone:
            results[chunk[0][0]] = FileResult(path=chunk[0][0], status="failed", reason=WORKER_DIED)
            progress(1)
        else:
            suspects.extend(chunk)
        return True
    except Exception as exc:  # e.g. a result that cannot be sent back: report, keep going
        done = [
            FileResult(path=p, status="failed", reason=f"internal error: {type(exc).__name__}: {exc}")
            for p, *_ in chunk
        ]
    for res in done:
        results[res.path] = res
    for path, *_ in chunk[len(done) :]:  # a worker stopped by someone else's SIGTERM
        results[path] = FileResult(path=path, status="failed", reason="its worker process was stopped; left unchanged")
    progress(len(chunk))
    return False


def _stop_pool(
    pool: ProcessPoolExecutor, inflight: dict, progress: Callable[[int], None], results: dict[str, FileResult]
) -> None:
    """After a stop signal: nothing new starts, workers stop after the write under way (the files
    they finished are recorded), and any still running after a grace period are killed."""

    def record(fut: Future) -> None:
        for res in fut.result():
            results[res.path] = res

    interrupt.stop_pool(pool, inflight, record)
