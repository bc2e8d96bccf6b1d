"""The driver of `torchopt migrate`: repositories in, tasks out to an executor, and as each result
comes back its patch is written, the state file updated (atomically, for --resume) and, at the end,
the roll-up report written in Markdown and JSON."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torchopt.migrate import report
from torchopt.migrate.executors import run_local, run_ray
from torchopt.migrate.task import CHANGED, FAILED, Options, Pin, RepoResult, RepoTask

STATE_FILE = "migrate-state.json"
STATE_VERSION = 1


class MigrateError(Exception):
    """Bad usage found while preparing the run (state from another selection, bad repos file)."""


@dataclass
class Outcome:
    results: list[RepoResult]  # in the order the repositories were given
    resumed: int = 0  # repositories skipped because --resume found them done
    report_md: str = ""
    report_json: str = ""
    patches: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)  # repositories an interrupted earlier run had not finished


_UMASK = os.umask(0o22)
os.umask(_UMASK)


def write_atomic(path: str, data: bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".torchopt-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes it private; a report is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_repos_file(path: str) -> list[str]:
    """One repository per line; blank lines and lines starting with `#` ignored; relative paths are relative to
    the file's folder."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise MigrateError(f"--repos-file {path}: cannot read: {exc}") from None
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(os.path.join(base, os.path.expanduser(line)))
    return out


def unique_names(paths: Sequence[str]) -> dict[str, str]:
    """Absolute path -> a file-name-safe name, the folder's name unless two repositories share it."""

    def clean(s: str) -> str:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in s).strip(".") or "repo"

    base = {p: clean(os.path.basename(p.rstrip(os.sep))) for p in paths}
    counts: dict[str, int] = {}
    for n in base.values():
        counts[n] = counts.get(n, 0) + 1
    return {p: n if counts[n] == 1 else f"{n}-{hashlib.sha1(p.encode()).hexdigest()[:8]}" for p, n in base.items()}


def _state_key(pin: Pin, options: Options) -> dict:
    return {"selection": pin.to_json(), "options": options.to_json()}


def _foreign(path: str) -> MigrateError:
    return MigrateError(
        f"{path}: exists and was not written by torchopt migrate; it is left alone (move it, or choose another --out)"
    )


def read_state(out: str) -> dict | None:
    """The state file an earlier run left in ``out`` (None: there is none). A file of that name that
    torchopt did not write is refused, never overwritten."""
    path = os.path.join(out, STATE_FILE)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError) as exc:
        if isinstance(exc, ValueError) or os.path.isfile(path):
            raise _foreign(path) from None
        raise MigrateError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if not (isinstance(state, dict) and isinstance(state.get("repos"), dict) and "key" in state):
        raise _foreign(path)
    return state


def _check_reports_are_ours(out: str) -> None:
    """report.md and report.json are rewritten by every run: refuse when they are someone else's."""
    md = os.path.join(out, "report.md")
    if os.path.lexists(md):
        try:
            with open(md, "rb") as fh:
                ours = fh.read(64).startswith(b"# torchopt migrate report")
        except OSError:
            ours = False
        if not ours:
            raise _foreign(md)
    js = os.path.join(out, "report.json")
    if os.path.lexists(js):
        try:
            with open(js, encoding="utf-8") as fh:
                ours = json.load(fh).get("tool") == "torchopt migrate"
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise _foreign(js)


def load_state(out: str, pin: Pin, options: Options, state: dict | None = None) -> dict[str, dict]:
    """Results of repositories already done by an earlier run with the same selection and options."""
    if state is None:
        state = read_state(out)
    if state is None:
        return {}
    if state.get("key") != _state_key(pin, options):
        raise MigrateError(
            f"--resume: {os.path.join(out, STATE_FILE)} was written by a run with another selection, "
            "torchopt version or options; use the same ones, another --out, or drop --resume to "
            "start again"
        )
    return {
        p: r for p, r in state["repos"].items() if isinstance(r, dict) and r.get("status") in ("changed", "unchanged")
    }


def _patches_written(state: dict | None) -> set[str]:
    """Names of the patches torchopt wrote in this --out (the only ones it may replace or remove)."""
    if not state:
        return set()
    names = {n for n in state.get("written", []) if isinstance(n, str)}
    names |= {r["patch_file"] for r in state["repos"].values() if isinstance(r, dict) and r.get("patch_file")}
    return names


def _blocked(out: str, name: str, written: set[str]) -> str | None:
    """Why the repository's patch could not be written: a file of that name that torchopt did not write."""
    path = os.path.join(out, f"{name}.patch")
    return str(_foreign(path)) if os.path.lexists(path) and f"{name}.patch" not in written else None


def _prepare_out(out: str) -> None:
    if os.path.lexists(out) and not os.path.isdir(out):
        raise MigrateError(f"{out}: --out must be a folder, and this is not one")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise MigrateError(f"{out}: cannot create the --out folder: {exc.strerror or exc}") from None


def _write(path: str, data: bytes) -> None:
    try:
        write_atomic(path, data)
    except OSError as exc:
        raise MigrateError(f"{path}: cannot write: {exc.strerror or exc}") from None


def migrate(
    repos: Sequence[str],
    out: str,
    pin: Pin,
    options: Options,
    *,
    jobs: int | None = None,
    resume: bool = False,
    executor: str = "local",
    ray_address: str | None = None,
    on_progress: Callable[[RepoResult], None] | None = None,
) -> Outcome:
    paths = _repository_paths(repos, out)
    _prepare_out(out)
    previous = read_state(out)
    _check_reports_are_ours(out)
    names = unique_names(paths)
    earlier = load_state(out, pin, options, previous) if resume else {}
    run = RunState(out, _state_key(pin, options), earlier, _patches_written(previous), on_progress)
    run.done.update((p, RepoResult.from_json(earlier[p])) for p in paths if p in earlier)
    resumed = len(run.done)
    tasks = [
        RepoTask(path=p, name=names[p], pin=pin, options=options, patch_blocked=_blocked(out, names[p], run.written))
        for p in paths
        if p not in run.done
    ]
    unfinished = [p for p in (previous or {}).get("pending", []) if p not in earlier] if resume else []
    run.start([t.path for t in tasks])
    t0 = time.monotonic()
    if tasks:
        if executor == "ray":
            run_ray(tasks, jobs, run.record, ray_address)
        else:
            run_local(tasks, jobs, run.record)
    results = [run.done[p] for p in paths]
    meta = {
        "out": os.path.abspath(out),
        "executor": executor,
        "seconds": round(time.monotonic() - t0, 2),
        "resumed": resumed,
        "interrupted_earlier": unfinished,
        "python": sys.version.split()[0],
    }
    doc, md = _write_reports(out, results, pin, options, meta)
    return Outcome(
        results=results,
        resumed=resumed,
        report_md=md,
        report_json=json.dumps(doc),
        patches=run.patches,
        unfinished=unfinished,
    )


def _repository_paths(repos: Sequence[str], out: str) -> list[str]:
    """The repositories, absolute and each once (by real path: a symbolic link to a repository already
    listed is that repository); --out inside one of them is refused, since their
    working trees are never written to."""
    by_real: dict[str, str] = {}  # a repository is its real path: a link to one is the same repository
    for r in repos:
        p = os.path.abspath(os.path.expanduser(r))
        by_real.setdefault(os.path.realpath(p), p)
    paths = list(by_real.values())
    real_out = os.path.realpath(out)
    for p in paths:
        if os.path.isdir(p) and (real_out + os.sep).startswith(os.path.realpath(p) + os.sep):
            raise MigrateError(
                f"--out {out} is inside the repository {p}: choose a folder outside the "
                "repositories (their working trees are not written to)"
            )
    return paths


class RunState:
    """What one run keeps in --out as results come back: the patches, and the state file that
    --resume reads, saved after every change so that a run killed at any moment leaves it true."""

    def __init__(
        self,
        out: str,
        key: dict,
        earlier: dict[str, dict],
        written: set[str],
        on_progress: Callable[[RepoResult], None] | None,
    ) -> None:
        self.out = out
        self.written = written  # the patches in --out that are ours to replace or remove
        self.done: dict[str, RepoResult] = {}
        self.patches: list[str] = []  # written by this run
        self.on_progress = on_progress
        self.state: dict[str, Any] = {
            "version": STATE_VERSION,
            "key": key,
            "repos": dict(earlier),  # done ones, also of repositories not named this time
            "pending": [],  # what a run killed before its end had not finished
            "written": sorted(written),
        }

    def start(self, pending: list[str]) -> None:
        self.state["pending"] = pending
        self.save()

    def save(self) -> None:
        self.state["written"] = sorted(self.written)
        _write(os.path.join(self.out, STATE_FILE), json.dumps(self.state, indent=1).encode())

    def record(self, res: RepoResult) -> None:
        """One repository's result: its patch written (or an outdated one of ours removed), the
        state saved."""
        self._place_patch(res)
        res.patch = b""
        self.done[res.path] = res
        self.state["repos"][res.path] = res.to_json()
        self.state["pending"] = [p for p in self.state["pending"] if p != res.path]
        self.save()
        if self.on_progress:
            self.on_progress(res)

    def _place_patch(self, res: RepoResult) -> None:
        patch_name = f"{res.name}.patch"
        patch_path = os.path.join(self.out, patch_name)
        if res.status == CHANGED and res.patch:
            if os.path.lexists(patch_path) and patch_name not in self.written:
                res.status, res.reason = FAILED, str(_foreign(patch_path))
                res.files_changed = []
            else:
                self.written.add(patch_name)
                self.save()  # claimed before it exists: a run killed in between still knows it is ours
                _write(patch_path, res.patch)
                res.patch_file = patch_name
                self.patches.append(patch_path)
        elif patch_name in self.written and os.path.lexists(patch_path):  # ours, from an earlier run: no longer true
            os.unlink(patch_path)
            self.written.discard(patch_name)


def _write_reports(out: str, results: list[RepoResult], pin: Pin, options: Options, meta: dict) -> tuple[dict, str]:
    doc = report.to_json(results, pin, options, meta)
    md = report.to_markdown(results, pin, options, meta)
    _write(os.path.join(out, "report.json"), (json.dumps(doc, indent=2) + "\n").encode())
    _write(os.path.join(out, "report.md"), md.encode())
    return doc, md
