"""Where the per-repository tasks run: here (one after the other, or a process pool over
repositories), or on a Ray cluster. Every executor calls ``on_result`` once per task, as each
finishes, in the calling thread."""

from __future__ import annotations

import os
from typing import Sequence

from torchopt.migrate.pool import run_in_pool
from torchopt.migrate.task import FAILED, RepoResult, RepoTask, ResultCallback, migrate_repo
from torchopt.rewrite import interrupt

EXECUTORS = ("local", "ray")


class ExecutorError(Exception):
    """The executor cannot start (Ray missing, cluster unreachable); message for the user."""


def _lost(task: RepoTask, why: str) -> RepoResult:
    return RepoResult(path=task.path, name=task.name, status=FAILED, reason=why)


def run_local(tasks: Sequence[RepoTask], jobs: int | None, on_result: ResultCallback) -> None:
    """Here, one repository after the other, or a process pool over them. On Ctrl-C or SIGTERM:
    no repository starts, those under way stop (a commit under way finishes), and Interrupted is
    raised; what is not done stays pending for --resume."""
    jobs = jobs or os.cpu_count() or 1
    if jobs <= 1 or len(tasks) == 1:  # one repository: its files share the processes instead
        for t in tasks:
            on_result(migrate_repo(t, file_jobs=jobs))
            signum = interrupt.stop_requested()  # noted while a commit was being made
            if signum is not None:
                raise interrupt.Interrupted(signum)
        return

    def on_done(index: int, res: RepoResult | None, error: BaseException | None) -> None:
        if error is not None:  # the worker died (out of memory, killed)
            res = _lost(tasks[index], f"worker failed: {type(error).__name__}: {error}")
        assert res is not None
        if interrupt.stop_requested() is not None and not res.done:
            return  # cut short by the stop (its git was interrupted too): left for --resume
        on_result(res)

    # Repositories' workers start programs (git, --validate's runs): no address-space cap
    run_in_pool(migrate_repo, tasks, min(jobs, len(tasks)), on_done, memory=0)


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ExecutorError(
            f"--executor ray needs Ray, which cannot be imported here ({exc}); "
            "install it with: pip install 'torchopt-rewrite[ray]'"
        ) from None
    return ray


def run_ray(tasks: Sequence[RepoTask], jobs: int | None, on_result: ResultCallback, address: str | None = None) -> None:
    """One Ray task per repository. Connects to ``address`` (a cluster: "auto", "ray://head:10001",
    "host:6379") or starts a local instance when None; reuses a Ray already initialised in this
    process (and leaves it running)."""
    ray = import_ray()
    started = False
    if not ray.is_initialized():
        kw: dict = {"include_dashboard": False, "log_to_driver": False}
        if address:
            kw["address"] = address
        elif jobs:
            kw["num_cpus"] = jobs
        try:
            ray.init(**kw)
        except Exception as exc:
            where = f"at {address}" if address else "locally"
            raise ExecutorError(f"cannot start Ray {where}: {type(exc).__name__}: {exc}") from None
        started = True
    try:
        remote = ray.remote(num_cpus=1, max_retries=0)(migrate_repo)
        pending = {remote.remote(t): t for t in tasks}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                task = pending.pop(ref)
                try:
                    res = ray.get(ref)
                except Exception as exc:  # the task's worker or node was lost
                    res = _lost(task, f"Ray task failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
                on_result(res)
    finally:
        if started:
            ray.shutdown()
