"""One repository's migration: the task every executor runs (locally, in a process pool, or as a Ray
task). Plain data in, plain data out, so it pickles; it never raises (a failure is a result)."""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from torchopt.migrate import git
from torchopt.migrate.patch import file_patch
from torchopt.rewrite import interrupt, source
from torchopt.rewrite.config import ConfigError, Overrides, Settings, load_file

# Repository outcomes. `changed`/`unchanged` are done (skipped by --resume); the others are retried.
CHANGED, UNCHANGED, REFUSED, FAILED = "changed", "unchanged", "refused", "failed"
DONE = (CHANGED, UNCHANGED)


@dataclass(frozen=True)
class Pin:
    """The rule selection every repository gets, pinned when the run starts."""

    version: str
    select: tuple[str, ...] | None = None  # expanded codes; None: each repository's config decides
    ignore: tuple[str, ...] = ()  # expanded codes
    unsafe_fixes: bool | None = None  # None: each repository's config decides

    def overrides(self) -> Overrides:
        return Overrides(select=self.select, ignore=self.ignore, unsafe_fixes=self.unsafe_fixes)

    def to_json(self) -> dict:
        return {
            "torchopt": self.version,
            "select": list(self.select) if self.select is not None else None,
            "ignore": list(self.ignore),
            "unsafe_fixes": self.unsafe_fixes,
        }

    def describe(self) -> str:
        sel = ", ".join(self.select) if self.select is not None else "each repository's config (default ALL)"
        ign = f"; ignored: {', '.join(self.ignore)}" if self.ignore else ""
        uns = {None: "as each repository's config says (default off)", True: "applied", False: "not applied"}
        return f"rules: {sel}{ign}; unsafe fixes: {uns[self.unsafe_fixes]}"


@dataclass(frozen=True)
class Options:
    commit: bool = False
    branch: str = "torchopt/migrate"
    validate: str | None = None  # ENTRY, relative to each repository's top folder
    steps: int = 20
    timeout: float = 600.0
    allow_dirty: bool = False

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RepoTask:
    path: str  # absolute
    name: str  # unique in the run: the patch is <out>/<name>.patch
    pin: Pin
    options: Options
    patch_blocked: str | None = None  # why <out>/<name>.patch cannot be written: then nothing is written


@dataclass
class RepoResult:
    path: str
    name: str
    status: str = FAILED
    reason: str = ""
    head: str | None = None
    dirty: bool = False
    config: str | None = None  # the repository's pyproject.toml with [tool.torchopt], relative
    files_changed: list[str] = field(default_factory=list)
    fixes: dict[str, int] = field(default_factory=dict)  # code -> fixes applied
    unsafe_not_applied: dict[str, int] = field(default_factory=dict)  # code -> unsafe fixes left out
    no_fix: dict[str, int] = field(default_factory=dict)  # code -> diagnostics without an automatic fix
    rule_names: dict[str, str] = field(default_factory=dict)
    files_seen: int = 0
    skipped: list[list[str]] = field(default_factory=list)  # [path, reason]
    file_failures: list[list[str]] = field(default_factory=list)  # [path, reason]
    validation: dict[str, Any] | None = None
    branch: str | None = None
    commit: str | None = None
    patch_file: str | None = None  # set by the driver once written
    stale_removed: list[str] = field(default_factory=list)  # worktrees a killed earlier run had left
    seconds: float = 0.0
    patch: bytes = b""  # not stored in the JSON: the driver writes it to <out>/<name>.patch

    @property
    def done(self) -> bool:
        return self.status in DONE

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("patch")
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RepoResult":
        known = {f.name for f in fields(cls)} - {"patch"}
        return cls(**{k: v for k, v in d.items() if k in known})


class _Failed(Exception):
    pass


class RepoSettings:
    """Settings for files of one repository: the nearest pyproject.toml with [tool.torchopt] between
    the file and the repository's top folder (configs above the repository are not consulted), then
    the pinned selection on top."""

    def __init__(self, root: str, overrides: Overrides) -> None:
        self.root = os.path.abspath(root)
        self.overrides = overrides
        self._cache: dict[str, Settings] = {}

    def for_path(self, path: str) -> Settings:
        p = os.path.abspath(path)
        return self._for_dir(p if os.path.isdir(p) else os.path.dirname(p))

    def _for_dir(self, folder: str) -> Settings:
        hit = self._cache.get(folder)
        if hit is not None:
            return hit
        cand = os.path.join(folder, "pyproject.toml")
        found = load_file(cand) if os.path.isfile(cand) else None
        if found is not None:
            result = self.overrides.apply(found)
        elif folder == self.root or not folder.startswith(self.root + os.sep):
            result = self.overrides.apply(Settings(root=self.root))
        else:
            result = self._for_dir(os.path.dirname(folder))
        self._cache[folder] = result
        return result


def migrate_repo(task: RepoTask, file_jobs: int = 1) -> RepoResult:
    """Migrate one repository (its files in a pool of ``file_jobs`` processes when > 1). Never raises."""
    t0 = time.monotonic()
    res = RepoResult(path=task.path, name=task.name)
    try:
        _migrate(task, res, file_jobs)
    except (_Failed, git.GitError, ConfigError) as exc:
        res.status, res.reason = FAILED, str(exc)
    except Exception as exc:  # a bug of ours must not stop the run
        res.status, res.reason = FAILED, f"internal error: {type(exc).__name__}: {exc}"
    if res.status not in DONE:  # nothing of it was applied
        res.patch, res.files_changed, res.fixes, res.unsafe_not_applied = b"", [], {}, {}
    res.seconds = round(time.monotonic() - t0, 3)
    return res


def _migrate(task: RepoTask, res: RepoResult, file_jobs: int) -> None:
    opts = task.options
    repo = task.path
    top = git.toplevel(repo)
    if os.path.realpath(top) != os.path.realpath(repo):
        raise _Failed(f"not the top folder of its git repository (that is {top})")
    res.stale_removed = git.remove_stale_scratch(repo)
    res.head = git.head(repo)
    dirty = git.dirty_paths(repo)
    res.dirty = bool(dirty)
    if dirty and not opts.allow_dirty:
        shown = ", ".join(dirty[:3]) + (f" and {len(dirty) - 3} more" if len(dirty) > 3 else "")
        res.status = REFUSED
        res.reason = f"uncommitted changes ({shown}); commit or stash them, or pass --allow-dirty"
        return
    if not (opts.commit or opts.validate):
        _work(task, res, repo, file_jobs)  # patch mode: the working tree is only read
        return
    if res.head is None:
        raise _Failed("no commits yet (--commit and --validate work on a checkout of HEAD)")
    if opts.commit and git.branch_exists(repo, opts.branch):
        raise _Failed(f"branch {opts.branch!r} already exists; delete it or choose another with --branch")
    with git.scratch_checkout(repo, res.head) as (tree, modes):
        _work(task, res, tree, file_jobs, modes)


def _rel(path: str, tree: str) -> str:
    return os.path.relpath(path, tree).replace(os.sep, "/")


def _work(task: RepoTask, res: RepoResult, tree: str, file_jobs: int, modes: dict[str, str] | None = None) -> None:
    """Rewrite the files of ``tree``: the working tree itself (patch mode, only read), or a scratch copy of
    HEAD whose files and their modes are ``modes`` (then a commit is made from objects, with --commit)."""
    from torchopt.rewrite.discovery import discover

    settings = RepoSettings(tree, task.pin.overrides())
    root_settings = settings.for_path(tree)
    if root_settings.config_path:
        res.config = _rel(root_settings.config_path, tree)
    listed = set(modes) if modes is not None else git.listed_files(tree)
    # Python files only: patches are made by the engine's fix of each file's text (no notebook support yet)
    files = _tracked_files(tree, discover([tree], settings.for_path, suffixes=(".py",)), listed, res)
    res.files_seen = len(files)
    loaded: list[tuple[str, str, bytes, source.SourceText]] = []
    for f in files:
        rel = _rel(f, tree)
        try:
            limit = settings.for_path(f).max_file_size
            size = os.stat(f).st_size
            if limit and size > limit:
                raise source.SourceError(
                    f"file is {size / 1e6:.1f} MB, over the {limit / 1e6:.1f} MB limit "
                    "(raise `max-file-size` in [tool.torchopt] to process it)"
                )
            with open(f, "rb") as fh:
                data = fh.read()
            src = source.decode(data)
        except OSError as exc:
            res.file_failures.append([rel, f"cannot read: {exc.strerror or exc}"])
            continue
        except source.SourceError as exc:
            res.file_failures.append([rel, str(exc)])
            continue
        if source.is_generated(src.text):
            res.skipped.append([rel, "marked @generated"])
            continue
        loaded.append((f, rel, data, src))

    keep: set[str] | None = None
    if task.options.validate:
        keep = _validate(task, res, tree, [f for f, _, _, _ in loaded], settings, root_settings)

    changes: dict[str, bytes] = {}
    chunks: list[bytes] = []
    outcomes = _fix_all([(f, rel, src, settings.for_path(f), keep) for f, rel, _, src in loaded], file_jobs)
    for (f, rel, data, src), outcome in zip(loaded, outcomes):
        new = _record(rel, src, outcome, res)
        if new is not None and new != data:
            changes[rel] = new
            chunks.append(file_patch(rel, data, new))
    if changes and task.patch_blocked:
        raise _Failed(task.patch_blocked)
    res.files_changed = sorted(changes)
    res.patch = b"".join(chunks)
    res.status = CHANGED if changes else UNCHANGED
    if task.options.commit and changes:
        assert res.head is not None and modes is not None
        with interrupt.writing():  # after a stop none starts; one under way is let finish
            sha = git.commit_files(task.path, res.head, changes, modes, commit_message(task, res))
            git.create_branch(task.path, task.options.branch, sha)
        res.branch, res.commit = task.options.branch, sha


def _tracked_files(tree: str, found: list[str], listed: set[str], res: RepoResult) -> list[str]:
    """The tracked files to migrate, each once: a tracked symbolic link is kept a link (listed in the
    report as such) and its target migrated where it is tracked, also when the walk met the link first."""
    real_tree = os.path.realpath(tree)
    files: dict[str, str] = {}  # rel -> path
    for f in found:
        rel = _rel(f, tree)
        if rel not in listed:
            continue
        if not os.path.islink(f):
            files.setdefault(rel, f)
            continue
        target = _rel(os.path.realpath(f), real_tree)
        if target in listed and os.path.isfile(os.path.join(tree, target)):
            res.skipped.append([rel, f"symbolic link to {target}; migrated there, the link kept"])
            files.setdefault(target, os.path.join(tree, target))
        else:
            res.skipped.append([rel, "symbolic link to a file not tracked in the repository; the link kept"])
    return sorted(files.values(), key=lambda f: _rel(f, tree))


def _fix_text(path: str, rel: str, src: source.SourceText, s: Settings, keep: set[str] | None):
    """The engine's pure fix on one file's text: (fixed text, applied, remaining) or a failure reason."""
    from torchopt.rewrite.engine import FixError, ParseError, fix_source

    codes = None if keep is None else s.enabled_codes(path) & keep
    try:
        fixed = fix_source(src.text, s, path, codes=codes)
    except (ParseError, FixError) as exc:
        return str(exc)
    except RecursionError:
        return "too deeply nested to analyse"
    except Exception as exc:  # a bug in a rule: this file is left alone, the others go on
        return f"internal error: {type(exc).__name__}: {exc}"
    return fixed.text, fixed.applied, fixed.remaining


def _fix_chunk(items: list) -> list:
    return [_fix_text(*item) for item in items]


def _fix_all(items: list, jobs: int) -> list:
    """Fix every file, in a process pool over files when ``jobs`` > 1 (one big repository)."""
    if jobs <= 1 or len(items) < 8:
        return _fix_chunk(items)
    from torchopt.migrate.pool import run_in_pool
    from torchopt.rewrite import budget

    size = max(1, min(16, len(items) // (jobs * 4)))
    chunks = [items[i : i + size] for i in range(0, len(items), size)]
    outcomes: list[list] = [[] for _ in chunks]

    def on_done(index: int, fixed: list | None, error: BaseException | None) -> None:
        if error is not None:  # a worker died (out of memory, a crash in the parser): the repository fails
            raise error
        outcomes[index] = fixed or []

    run_in_pool(_fix_chunk, chunks, jobs, on_done, memory=budget.memory_budget(jobs))
    return [r for part in outcomes for r in part]


def _record(rel: str, src: source.SourceText, outcome, res: RepoResult) -> bytes | None:
    """Count one file's fixes into ``res``; returns its new bytes (None: unchanged or failed)."""
    if isinstance(outcome, str):
        res.file_failures.append([rel, outcome])
        return None
    text, applied, remaining = outcome
    try:
        new = src.encode(text) if text != src.text else None
    except UnicodeEncodeError as exc:
        res.file_failures.append([rel, f"cannot encode the result as {src.encoding}: {exc.reason}"])
        return None
    for d in applied:
        res.fixes[d.code] = res.fixes.get(d.code, 0) + 1
        res.rule_names[d.code] = d.name
    for d in remaining:
        if d.fix is None:
            res.no_fix[d.code] = res.no_fix.get(d.code, 0) + 1
        elif d.fix.safety == "unsafe":
            res.unsafe_not_applied[d.code] = res.unsafe_not_applied.get(d.code, 0) + 1
        else:
            continue
        res.rule_names[d.code] = d.name
    return new


_DIVERGES = re.compile(r"^\s*(TOP\d+): diverges")


def _validate(
    task: RepoTask, res: RepoResult, tree: str, files: list[str], settings: RepoSettings, root_settings: Settings
) -> set[str] | None:
    """Run ENTRY before and after the rewrite (torchopt.validate); returns the codes that may be
    written (None: all). Sets res.validation; raises _Failed when ENTRY cannot run."""
    from torchopt.validate.gate import check_rewrite

    entry_rel = task.options.validate or ""
    entry = os.path.join(tree, entry_rel)
    if not os.path.isfile(entry):
        raise _Failed(f"--validate: {entry_rel} is not a file in this repository")
    keep, lines = check_rewrite(
        files,
        settings.for_path,
        entry,
        unsafe=root_settings.unsafe_fixes,
        steps=task.options.steps,
        device="auto",
        timeout=task.options.timeout,
    )
    text = "\n".join(line.rstrip("\n") for line in lines).replace(tree + os.sep, "")
    withheld = sorted({m.group(1) for line in text.splitlines() if (m := _DIVERGES.match(line))})
    if keep is None:
        verdict = "nothing to validate" if "nothing would change" in text else "equivalent"
    elif not keep and "could not run" in text:
        verdict = "could not run"
    elif not keep:
        verdict = "diverged: no fix kept"
    else:
        verdict = f"diverged: kept {', '.join(sorted(keep))}; withheld {', '.join(withheld) or 'the rest'}"
    res.validation = {
        "entry": entry_rel,
        "steps": task.options.steps,
        "verdict": verdict,
        "kept": sorted(keep) if keep is not None else None,
        "withheld": withheld,
        "log": text[-6000:],
    }
    if verdict == "could not run":
        raise _Failed(f"--validate: {entry_rel} could not run; nothing written (see the validation log in report.json)")
    return keep


def plural(n: int, word: str) -> str:
    if n == 1:
        return f"1 {word}"
    return f"{n} {word[:-1] + 'ies' if word.endswith('y') else word + 'es' if word.endswith('x') else word + 's'}"


def commit_message(task: RepoTask, res: RepoResult) -> str:
    n = sum(res.fixes.values())
    lines = [
        f"torchopt: {plural(n, 'fix')} in {plural(len(res.files_changed), 'file')}",
        "",
        f"Rewritten by `torchopt migrate` (torchopt {task.pin.version}); {task.pin.describe()}.",
        "",
        "Fixes per code:",
    ]
    lines += [
        f"- {c} ({res.rule_names[c]}): {k}" if res.rule_names.get(c) else f"- {c}: {k}"
        for c, k in sorted(res.fixes.items())
    ]
    if res.unsafe_not_applied:
        left = ", ".join(f"{c} ×{k}" for c, k in sorted(res.unsafe_not_applied.items()))
        lines += ["", f"Unsafe fixes not applied: {left} (see `torchopt rule CODE`; --unsafe-fixes applies them)."]
    if res.validation:
        v = res.validation
        lines += ["", f"Validation: {v['entry']} ({v['steps']} steps): {v['verdict']}"]
    return "\n".join(lines) + "\n"


ResultCallback = Callable[[RepoResult], None]
