"""`torchopt migrate`: arguments -> pinned selection -> batch driver -> summary and exit code.

Exit codes follow the rest of the CLI (like ruff's --diff): 0 nothing to change, or every change
committed (--commit); 1 patches written that are not applied yet (patch mode, like `rewrite --diff`);
2 bad usage, or some repository was refused or failed, or some file could not be processed, or
--validate could not run (every other repository is still migrated)."""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from torchopt import __version__
from torchopt.migrate import git
from torchopt.migrate.batch import MigrateError, migrate, read_repos_file
from torchopt.migrate.executors import EXECUTORS, ExecutorError, import_ray
from torchopt.migrate.report import per_code, summary
from torchopt.migrate.task import CHANGED, FAILED, REFUSED, Options, Pin, RepoResult, plural
from torchopt.rewrite.selection import SelectorError, expand_all, split_arg

EXIT_OK, EXIT_PENDING, EXIT_ERROR = 0, 1, 2


def _err(msg: str) -> None:
    sys.stderr.write(msg + "\n")


def make_pin(select: Optional[Sequence[str]], ignore: Optional[Sequence[str]], unsafe: Optional[bool]) -> Pin:
    try:
        sel = split_arg(select)
        ign = split_arg(ignore)
        codes = tuple(sorted(expand_all(sel))) if sel else None
        ignored = tuple(sorted(expand_all(ign)))
    except SelectorError as exc:
        raise MigrateError(str(exc)) from None
    if codes is not None and not codes:
        raise MigrateError("--select matches no rule")
    return Pin(version=__version__, select=codes, ignore=ignored, unsafe_fixes=unsafe)


def exit_code(results: Sequence[RepoResult], commit: bool) -> int:
    if any(r.status in (FAILED, REFUSED) or r.file_failures for r in results):
        return EXIT_ERROR
    if not commit and any(r.status == CHANGED for r in results):
        return EXIT_PENDING
    return EXIT_OK


def _progress(total: int):
    if total < 2 or not sys.stderr.isatty():
        return None, lambda res: None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(
        TextColumn("torchopt migrate"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=Console(stderr=True),
        transient=True,
        auto_refresh=False,
    )  # no refresh thread: the executors fork worker processes
    task = prog.add_task("", total=total)
    return prog, lambda res: prog.update(task, advance=1, description=f"{res.name}: {res.status}", refresh=True)


def run_command(
    repos: Sequence[str],
    repos_file: Optional[str],
    out: str,
    branch: str,
    commit: bool,
    validate: Optional[str],
    steps: int,
    select,
    ignore,
    unsafe_fixes: Optional[bool],
    jobs: Optional[int],
    resume: bool,
    allow_dirty: bool,
    executor: str,
    ray_address: Optional[str],
    quiet: bool,
) -> int:
    try:
        all_repos = list(repos)
        if repos_file:
            all_repos += read_repos_file(repos_file)
        if not all_repos:
            raise MigrateError("no repositories: name them, or give --repos-file FILE")
        if executor not in EXECUTORS:
            raise MigrateError(f"unknown --executor {executor!r} (choose from {', '.join(EXECUTORS)})")
        if ray_address and executor != "ray":
            raise MigrateError("--ray-address needs --executor ray")
        if commit and not git.valid_branch_name(branch):
            raise MigrateError(f"--branch {branch!r} is not a valid branch name (or git is not installed)")
        if validate and (os.path.isabs(validate) or validate.startswith("..")):
            raise MigrateError("--validate ENTRY is a path relative to each repository's top folder")
        if executor == "ray":
            import_ray()
        pin = make_pin(select, ignore, unsafe_fixes)
        options = Options(commit=commit, branch=branch, validate=validate, steps=steps, allow_dirty=allow_dirty)
        total = len(dict.fromkeys(os.path.abspath(r) for r in all_repos))
        prog, advance = _progress(total)
        if prog is None:
            outcome = migrate(
                all_repos,
                out,
                pin,
                options,
                jobs=jobs,
                resume=resume,
                executor=executor,
                ray_address=ray_address,
                on_progress=advance,
            )
        else:
            with prog:
                outcome = migrate(
                    all_repos,
                    out,
                    pin,
                    options,
                    jobs=jobs,
                    resume=resume,
                    executor=executor,
                    ray_address=ray_address,
                    on_progress=advance,
                )
    except (MigrateError, ExecutorError) as exc:
        _err(f"error: {exc}")
        return EXIT_ERROR
    results = outcome.results
    if outcome.unfinished:
        shown = ", ".join(outcome.unfinished[:5]) + (
            f" and {len(outcome.unfinished) - 5} more" if len(outcome.unfinished) > 5 else ""
        )
        _err(
            f"--resume: the earlier run stopped before finishing {plural(len(outcome.unfinished), 'repository')}: "
            f"{shown}"
        )
    for r in results:
        if r.stale_removed:
            _err(f"{r.path}: removed what an interrupted run had left: {', '.join(r.stale_removed)}")
        if r.status in (FAILED, REFUSED):
            _err(f"{r.status}: {r.path}: {r.reason}")
        for path, why in r.file_failures:
            _err(f"error: {r.path}/{path}: {why}")
    if not quiet:
        s = summary(results)
        _err(
            f"{plural(s['repos'], 'repository')}: {s['changed']} changed, {s['unchanged']} unchanged, "
            f"{s['refused']} refused, {s['failed']} failed"
            + (f" ({outcome.resumed} done by an earlier run, skipped)" if outcome.resumed else "")
            + "."
        )
        if s["fixes"]:
            what = "committed" if commit else "in patches"
            _err(f"{plural(s['files_changed'], 'file')} changed, fixes {what}: {per_code(s['fixes'])}.")
        if s["unsafe_not_applied"]:
            _err(
                f"Unsafe fixes not applied: {per_code(s['unsafe_not_applied'])} (--unsafe-fixes applies them "
                "after reading `torchopt rule CODE`)."
            )
        _err(f"Report: {os.path.join(out, 'report.md')} and report.json")
    return exit_code(results, commit)
