"""Runs the engine over files, in a process pool. Every file ends as ok, failed (with a one-line
reason; the file is left byte-for-byte as it was) or skipped; one file's failure never stops a run."""
from __future__ import annotations

import enum
import gc
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from torchopt.rewrite import diff as diffmod
from torchopt.rewrite import source
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import Diagnostic, FixError, ParseError, check_source, fix_source
from torchopt.rewrite.write import atomic_write

if TYPE_CHECKING:
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


def process_text(text: str, path: str, settings: Settings, mode: Mode, unsafe: bool | None = None) -> FileResult:
    """The pure part: text in, result out (no file access)."""
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

    return Entry(status=res.status, reason=res.reason, diagnostics=res.diagnostics, applied=res.applied,
                 remaining=res.remaining, new_text=res.new_text if res.changed else None)


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


def process_cached(text: str, path: str, settings: Settings, mode: Mode, unsafe: bool | None = None,
                   cache: "Cache | None" = None) -> FileResult:
    """process_text through the cache: a hit answers without analysing the file again."""
    if cache is None:
        return process_text(text, path, settings, mode, unsafe)
    kind = _kind(settings, mode, unsafe)
    hit = cache.get(text, path, settings, kind)
    if hit is not None:
        return _from_entry(hit, text, path, mode)
    res = process_text(text, path, settings, mode, unsafe)
    cache.put(text, path, settings, kind, _to_entry(res, text))
    return res


def process_file(path: str, settings: Settings, mode: Mode, unsafe: bool | None = None,
                 cache: "Cache | None" = None) -> FileResult:
    try:
        src = source.read(path, settings.max_file_size)
    except source.SourceError as exc:
        return FileResult(path=path, status="failed", reason=str(exc))
    if source.is_generated(src.text):
        return FileResult(path=path, status="skipped", reason="marked @generated")
    res = process_cached(src.text, path, settings, mode, unsafe, cache)
    if res.status != "ok":
        return res
    if res.changed and mode is Mode.FIX:
        try:
            atomic_write(path, src.encode(res.new_text or ""))
        except (OSError, UnicodeEncodeError) as exc:
            return FileResult(path=path, status="failed", reason=f"cannot write: {exc}")
    res.new_text = None  # not needed past this point; keeps results small across processes
    return res


def tune_gc() -> None:
    """LibCST builds millions of small objects per large file, and CPython's default collector
    thresholds make it scan them again and again (~15% of a run, measured); the trees hold no
    cycles worth collecting early. Process-wide, for processes that do analysis only."""
    if gc.get_threshold()[0] < GC_THRESHOLD:
        gc.set_threshold(GC_THRESHOLD, 50, 100)


GC_THRESHOLD = 100_000


def _chunk(files: Sequence[tuple[str, Settings]], mode: Mode, unsafe: bool | None,
           cache: "Cache | None" = None) -> list[FileResult]:
    tune_gc()
    out = []
    for path, settings in files:
        try:
            out.append(process_file(path, settings, mode, unsafe, cache))
        except Exception as exc:  # a bug of ours must not stop the run or touch the file
            out.append(FileResult(path=path, status="failed", reason=f"internal error: {type(exc).__name__}: {exc}"))
    return out


def run(files: Sequence[str], settings_for: Callable[[str], Settings], mode: Mode, jobs: int | None = None,
        unsafe: bool | None = None, on_progress: Callable[[int], None] | None = None,
        cache: "Cache | None" = None) -> list[FileResult]:
    """Process ``files``; results come back in the order of ``files``. With ``cache``, files whose
    text, path and settings were analysed before (by this torchopt) are answered from it."""
    items = [(f, settings_for(f)) for f in files]
    jobs = jobs or os.cpu_count() or 1
    results: dict[str, FileResult] = {}
    if jobs <= 1 or len(items) < 8:
        for item in items:
            results[item[0]] = _chunk([item], mode, unsafe, cache)[0]
            if on_progress:
                on_progress(1)
    else:
        size = max(1, min(16, len(items) // (jobs * 4) or 1))
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_chunk, c, mode, unsafe, cache): c for c in chunks}
            for fut in as_completed(futures):
                chunk = futures[fut]
                try:
                    done = fut.result()
                except Exception as exc:  # a worker died: report its files, keep going
                    done = [FileResult(path=p, status="failed", reason=f"worker failed: {exc}") for p, _ in chunk]
                for r in done:
                    results[r.path] = r
                if on_progress:
                    on_progress(len(chunk))
    if cache is not None:
        cache.prune()
    return [results[f] for f in files]
