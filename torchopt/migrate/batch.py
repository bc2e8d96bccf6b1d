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
from typing import Callable, Sequence

from torchopt.migrate import report
from torchopt.migrate.executors import run_local, run_ray
from torchopt.migrate.task import CHANGED, Options, Pin, RepoResult, RepoTask

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


def load_state(out: str, pin: Pin, options: Options) -> dict[str, dict]:
    """Results of repositories already done by an earlier run with the same selection and options."""
    path = os.path.join(out, STATE_FILE)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
        repos = state["repos"]
        key = state["key"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MigrateError(f"--resume: {path} is unreadable ({exc}); remove it to start again") from None
    if key != _state_key(pin, options):
        raise MigrateError(f"--resume: {path} was written by a run with another selection, torchopt version "
                           "or options; use the same ones, another --out, or drop --resume to start again")
    return {p: r for p, r in repos.items() if r.get("status") in ("changed", "unchanged")}


def migrate(repos: Sequence[str], out: str, pin: Pin, options: Options, *, jobs: int | None = None,
            resume: bool = False, executor: str = "local", ray_address: str | None = None,
            on_progress: Callable[[RepoResult], None] | None = None) -> Outcome:
    paths = list(dict.fromkeys(os.path.abspath(os.path.expanduser(r)) for r in repos))
    real_out = os.path.realpath(out)
    for p in paths:
        if os.path.isdir(p) and (real_out + os.sep).startswith(os.path.realpath(p) + os.sep):
            raise MigrateError(f"--out {out} is inside the repository {p}: choose a folder outside the "
                               "repositories (their working trees are not written to)")
    os.makedirs(out, exist_ok=True)
    names = unique_names(paths)
    earlier = load_state(out, pin, options) if resume else {}
    done: dict[str, RepoResult] = {p: RepoResult.from_json(earlier[p]) for p in paths if p in earlier}
    tasks = [RepoTask(path=p, name=names[p], pin=pin, options=options) for p in paths if p not in done]
    state = {"version": STATE_VERSION, "key": _state_key(pin, options),
             "repos": dict(earlier)}  # done ones, also of repositories not named this time
    patches: list[str] = []

    def on_result(res: RepoResult) -> None:
        patch_path = os.path.join(out, f"{res.name}.patch")
        if res.status == CHANGED and res.patch:
            write_atomic(patch_path, res.patch)
            res.patch_file = os.path.basename(patch_path)
            patches.append(patch_path)
        elif os.path.exists(patch_path):  # from an earlier run: no longer true
            os.unlink(patch_path)
        res.patch = b""
        done[res.path] = res
        state["repos"][res.path] = res.to_json()
        write_atomic(os.path.join(out, STATE_FILE), json.dumps(state, indent=1).encode())
        if on_progress:
            on_progress(res)

    t0 = time.monotonic()
    if tasks:
        if executor == "ray":
            run_ray(tasks, jobs, on_result, ray_address)
        else:
            run_local(tasks, jobs, on_result)
    results = [done[p] for p in paths]
    meta = {"out": os.path.abspath(out), "executor": executor, "seconds": round(time.monotonic() - t0, 2),
            "resumed": len(paths) - len(tasks), "python": sys.version.split()[0]}
    doc = report.to_json(results, pin, options, meta)
    md = report.to_markdown(results, pin, options, meta)
    write_atomic(os.path.join(out, "report.json"), (json.dumps(doc, indent=2) + "\n").encode())
    write_atomic(os.path.join(out, "report.md"), md.encode())
    return Outcome(results=results, resumed=len(paths) - len(tasks), report_md=md,
                   report_json=json.dumps(doc), patches=patches)
