"""Execute two versions of a program on the CPU under the same seeds and compare what they computed,
bitwise: every tensor (values, dtype, device, requires_grad, is_leaf), module states, and the RNG
state afterwards (a safe fix must draw the same random numbers)."""

from __future__ import annotations

import contextlib
import os
import random
import runpy
import struct
import subprocess
import sys
import tempfile
from typing import Any, Iterator

import torch


@contextlib.contextmanager
def torch_globals_restored() -> Iterator[None]:
    """Programs run in this process may switch process-wide torch settings (default dtype,
    matmul precision, cuDNN and determinism flags, anomaly mode, grad mode); later tests must not
    inherit them."""
    saved = (
        torch.get_default_dtype(),
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.is_anomaly_enabled(),
        torch.is_grad_enabled(),
    )
    try:
        yield
    finally:
        dtype, precision, bench, det, algos, warn_only, anomaly, grad = saved
        torch.set_default_dtype(dtype)
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.benchmark = bench
        torch.backends.cudnn.deterministic = det
        torch.use_deterministic_algorithms(algos, warn_only=warn_only)
        torch.autograd.set_detect_anomaly(anomaly)
        torch.set_grad_enabled(grad)


# A program that sets up a process group runs in a child process: in this one, earlier tests leave
# threads behind, and freeing a DDP model can then wait forever inside the gloo process group's
# destructor, which holds the GIL (a test run stalled on it; no Python-level timeout can interrupt it).
DISTRIBUTED = ("init_process_group", "init_device_mesh", "new_group(")
CHILD_TIMEOUT_S = 240


def run_program(src: str, name: str = "prog", run_name: str = "__main__", cwd: str | None = None) -> dict[str, Any]:
    """Run ``src`` as a script (in a temp file so tracebacks name it) and return its globals plus
    the RNG state it left behind."""
    if any(word in src for word in DISTRIBUTED):
        return _run_in_child(src, name, run_name, cwd)
    return _run_here(src, name, run_name, cwd)


def _portable(value: Any) -> Any:
    """What :func:`describe_diff` compares, in a form ``torch.load`` reads in another process:
    a module becomes its state dict, containers are followed, other objects are dropped."""
    if isinstance(value, torch.nn.Module):
        return _ModuleState(value.state_dict())
    if isinstance(value, (torch.Tensor, int, float, str, bool, type(None))):
        return value
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_portable(v) for v in value)
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items() if isinstance(k, (str, int, float, bool, tuple))}
    return None


class _ModuleState(dict):
    """A module's state dict, compared as the module would be."""


def _run_in_child(src: str, name: str, run_name: str, cwd: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "globals.pt")
        code = (
            "import os, sys, torch\n"
            f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
            "import semantic\n"
            "src, name, run_name, cwd, out = sys.argv[1:]\n"
            "ns = semantic._run_here(src, name, run_name, cwd or None)\n"
            "torch.save({k: semantic._portable(v) for k, v in ns.items()}, out)\n"
            "sys.stdout.flush(); sys.stderr.flush()\n"
            "os._exit(0)  # no teardown of the process group's threads (see DISTRIBUTED)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, src, name, run_name, cwd or "", out],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed in its own process:\n{done.stderr[-4000:]}")
        return torch.load(out, weights_only=False)


def _run_here(src: str, name: str, run_name: str, cwd: str | None) -> dict[str, Any]:
    random.seed(0)
    torch.manual_seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:  # pragma: no cover
        pass
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(src)
        old_cwd = os.getcwd()
        os.chdir(cwd or tmp)
        old_argv = sys.argv
        sys.argv = [path]
        try:
            with torch_globals_restored():
                ns = runpy.run_path(path, run_name=run_name)
        finally:
            sys.argv = old_argv
            os.chdir(old_cwd)
    ns = {k: v for k, v in ns.items() if not k.startswith("__")}
    ns["__rng_state__"] = torch.get_rng_state()
    return ns


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def describe_diff(a: Any, b: Any, where: str) -> str | None:
    """None when ``a`` and ``b`` are the same down to the bits; else what differs."""
    if isinstance(a, float) and isinstance(b, torch.Tensor) and b.dtype == torch.float64 and b.dim() == 0:
        # TOP601 keeps a script's running loss on the device in float64: the global is a tensor now,
        # and every value the program reads from it (.item()) is the same Python float.
        same = struct.pack("<d", a) == struct.pack("<d", b.item())
        return None if same else f"{where}: {a!r} vs {b.item()!r}"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        for attr in ("dtype", "device", "shape", "requires_grad", "is_leaf"):
            if getattr(a, attr) != getattr(b, attr):
                return f"{where}: {attr} {getattr(a, attr)} vs {getattr(b, attr)}"
        if a.is_floating_point() or a.is_complex() or a.dtype == torch.bool or not a.is_floating_point():
            if not torch.equal(_bits(a), _bits(b)):
                return f"{where}: values differ"
        return None
    if isinstance(a, (torch.nn.Module, _ModuleState)) and isinstance(b, (torch.nn.Module, _ModuleState)):
        sa = a if isinstance(a, _ModuleState) else a.state_dict()
        sb = b if isinstance(b, _ModuleState) else b.state_dict()
        if list(sa) != list(sb):
            return f"{where}: state_dict keys {list(sa)} vs {list(sb)}"
        for k in sa:
            d = describe_diff(sa[k], sb[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = describe_diff(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            d = describe_diff(a[k], b[k], f"{where}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (int, float, str, bool, type(None))) and isinstance(b, (int, float, str, bool, type(None))):
        same = (a == b) or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
        return None if same else f"{where}: {a!r} vs {b!r}"
    return None  # functions, modules, classes: not data


def compare_programs(before: str, after: str) -> list[str]:
    """Run both and list every difference (empty: bitwise the same)."""
    a, b = run_program(before, "before"), run_program(after, "after")
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            if isinstance(a.get(key, b.get(key)), (torch.Tensor, torch.nn.Module, _ModuleState)):
                diffs.append(f"{key}: only in {'after' if key in b else 'before'}")
            continue
        d = describe_diff(a[key], b[key], key)
        if d:
            diffs.append(d)
    return diffs
