"""Launches one version of a program under the harness, in its own process (or `nproc` processes
under torchrun), in a scratch copy of its folder, bounded by a timeout, and returns the probes it
saved. The reaper (reaper.py) between us and the harness kills whatever the run started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from torchopt.validate import reaper, scratch


@dataclass
class Version:
    """One side of a comparison: a script (or entry module) and in-memory sources to serve."""

    label: str
    path: str  # the script (script mode) or the file the entry imports from (entry mode)
    source: str | None = None  # in-memory text of `path` (None: read it from disk)
    sources: dict[str, str] = field(default_factory=dict)  # other files to serve from memory


@dataclass
class RunOptions:
    steps: int = 20
    device: str = "auto"  # auto | cpu | cuda
    argv: tuple[str, ...] = ()
    entry: str | None = None  # "pkg.mod:func"
    timeout: float = 300.0
    nproc: int = 1
    seed: int = 0
    threads: int = 1
    transplant: str | None = None  # record file: the "before" run records, the others apply (transplant.py)
    protect: tuple[str, ...] = ()  # more of the user's folders no run may write into
    bench: bool = False  # time the optimizer steps instead of recording probes (bench.py)
    precision: dict | None = None  # the noise-floor reference run: {"autocast": dtype, "device": ..., "tf32": bool}


def _env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")  # no __pycache__ next to the user's files
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    # The harness must import torchopt even when the program's folder is the working directory.
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    return env


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()[-limit:]
    except OSError:
        return ""


def protected_roots(version: Version) -> list[str]:
    """The user's folders a run must not write into: the script's folder and those of the files
    served from memory."""
    roots = {os.path.dirname(os.path.realpath(version.path))}
    roots.update(os.path.dirname(os.path.realpath(p)) for p in version.sources)
    return sorted(roots)


def _wait(proc: subprocess.Popen, limit: float, cancel: threading.Event | None) -> bool:
    """Wait for ``proc`` up to ``limit`` seconds; False if it is still running (or cancelled)."""
    end = time.monotonic() + limit
    while time.monotonic() < end and not (cancel is not None and cancel.is_set()):
        try:
            proc.wait(timeout=0.2)
            return True
        except subprocess.TimeoutExpired:
            pass
    return False


def _stop(proc: subprocess.Popen) -> None:
    """Ask the reaper to kill its tree; if it does not exit in time, kill its group ourselves."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


def run_version(
    version: Version, opts: RunOptions, workdir: str | None = None, cancel: threading.Event | None = None
) -> list[dict]:
    """Run ``version`` in a scratch copy of its folder and return its probes, one dict per rank
    (status ok | error | timeout). Every process the run started is gone when this returns."""
    tmp = os.path.realpath(workdir or tempfile.mkdtemp(prefix="torchopt-validate-"))
    tag = version.label.replace(" ", "_")
    real_script = os.path.realpath(version.path)
    try:
        box = scratch.make(
            os.path.dirname(real_script),
            os.path.join(tmp, tag, os.path.basename(os.path.dirname(real_script)) or "root"),
            {tmp},
        )
    except OSError as exc:
        why = f"could not copy {os.path.dirname(real_script)} to a scratch folder: {exc}"
        return [_no_probes(opts, rank, "error", why) for rank in range(max(1, opts.nproc))]
    script = box.mapped(real_script)
    spec = _spec(version, opts, box, script, tmp, tag)
    spec_path = os.path.join(tmp, f"{tag}.json")
    with open(spec_path, "w", encoding="utf-8") as fh:
        json.dump(spec, fh)
    log = os.path.join(tmp, f"{tag}.log")
    status, returncode = _launch(_command(opts, spec_path), os.path.dirname(script), opts, log, cancel)
    return _probes(box, opts, spec["out"], log, status, returncode)


def _no_probes(opts: RunOptions, rank: int, status: str, why: str) -> dict:
    """The record of a rank that saved no probes: it failed or timed out (``why``)."""
    return {
        "losses": [],
        "loss_steps": [],
        "steps_done": 0,
        "tensors": {},
        "notes": [],
        "status": status,
        "traceback": why,
        "device": opts.device,
        "rank": rank,
    }


def _spec(version: Version, opts: RunOptions, box: scratch.Scratch, script: str, tmp: str, tag: str) -> dict:
    """What the harness is told: the program (in the scratch copy, with the in-memory sources that
    replace files there), how to run it, where to save probes, and which folders it must not write to."""
    sources = {box.mapped(p): text for p, text in version.sources.items()}
    if opts.entry and version.source is not None:
        sources[script] = version.source
    spec: dict[str, Any] = {
        "mode": "entry" if opts.entry else "script",
        "path": script,
        "source": None if opts.entry else version.source,
        "sources": sources,
        "entry": opts.entry,
        "argv": list(opts.argv),
        "steps": opts.steps,
        "seed": opts.seed,
        "threads": opts.threads,
        "sys_path": [os.path.dirname(script)],
        "out": os.path.join(tmp, f"{tag}.rank{{rank}}.pt"),
        "transplant": (
            {"mode": "record" if version.label == "before" else "apply", "path": opts.transplant}
            if opts.transplant
            else None
        ),
        "protect": sorted({*protected_roots(version), *opts.protect}),
        "allow": [tmp],
        "bench": opts.bench,
        "precision": opts.precision,
    }
    return spec


def _command(opts: RunOptions, spec_path: str) -> list[str]:
    """The harness (under torchrun for several ranks), under the reaper that enforces the timeout."""
    if opts.nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={opts.nproc}",
            "-m",
            "torchopt.validate.harness",
            spec_path,
        ]
    else:
        cmd = [sys.executable, "-m", "torchopt.validate.harness", spec_path]
    return [sys.executable, "-m", "torchopt.validate.reaper", repr(float(opts.timeout)), "--", *cmd]


def _launch(
    cmd: list[str], cwd: str, opts: RunOptions, log: str, cancel: threading.Event | None
) -> tuple[str, int | None]:
    """Run ``cmd`` with its output in ``log``; returns ("ok" | "timeout", its exit status). On
    Ctrl-C, cancel or timeout its whole process tree is stopped before this returns."""
    status = "ok"
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=_env(opts.device),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            # The reaper enforces the timeout itself; the margin covers its clean-up.
            if not _wait(proc, opts.timeout + 30, cancel):
                _stop(proc)
                status = "timeout"
        except BaseException:  # Ctrl-C: nothing of the run may outlive us
            _stop(proc)
            raise
    if proc.returncode == reaper.TIMED_OUT:
        status = "timeout"
    return status, proc.returncode


def _probes(
    box: scratch.Scratch, opts: RunOptions, out_pattern: str, log: str, status: str, returncode: int | None
) -> list[dict]:
    """Each rank's saved probes (paths in them shown as the user's, not the scratch copy's), or why
    it has none; with the run's log and what it wrote or linked in its scratch folder."""
    import torch

    results = []
    written = box.written()
    for rank in range(max(1, opts.nproc)):
        path = out_pattern.format(rank=rank)
        if status == "ok" and os.path.exists(path):
            probes = torch.load(path, weights_only=False)
            if probes.get("traceback"):
                probes["traceback"] = box.unmapped(probes["traceback"])
            probes["notes"] = [box.unmapped(n) for n in probes.get("notes", [])]
        elif status == "timeout":
            probes = _no_probes(opts, rank, "timeout", f"timed out after {opts.timeout:g} s")
        else:
            why = f"the harness exited with {returncode}:\n{box.unmapped(_tail(log))}"
            probes = _no_probes(opts, rank, "error", why)
        probes["log"] = box.unmapped(_tail(log))
        probes["written"] = written
        probes["linked"] = list(box.linked)
        results.append(probes)
    return results


def run_plain(version: Version, opts: RunOptions, seconds: float = 120.0) -> tuple[str, str]:
    """Run the script as the user would (`python SCRIPT ARGS`, no harness but the write guard) in a
    scratch copy of its folder, for at most ``seconds`` (or the run timeout): ("ok" | "error" | "timeout", log tail)."""
    from dataclasses import replace

    tmp = os.path.realpath(tempfile.mkdtemp(prefix="torchopt-plain-"))
    try:
        real_script = os.path.realpath(version.path)
        box = scratch.make(os.path.dirname(real_script), os.path.join(tmp, "plain"), {tmp})
        script = box.mapped(real_script)
        if version.source is not None:
            with open(script, "w", encoding="utf-8") as fh:
                fh.write(version.source)
        limit = replace(opts, timeout=min(opts.timeout, seconds))
        cmd = [sys.executable, "-m", "torchopt.validate.reaper", repr(float(limit.timeout)), "--"]
        protect = json.dumps(sorted({*protected_roots(version), *opts.protect}))
        cmd += [sys.executable, "-m", "torchopt.validate.plain", protect, script, *opts.argv]
        log = os.path.join(tmp, "plain.log")
        status, code = _launch(cmd, os.path.dirname(script), limit, log, None)
        if status == "ok" and code != 0:
            status = "error"
        return status, box.unmapped(_tail(log))
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
