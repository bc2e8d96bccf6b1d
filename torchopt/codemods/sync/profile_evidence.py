"""`torchopt check --profile trace.json`: map the synchronising operations a torch.profiler trace
recorded back to source lines, and join them with the static SYNC diagnostics.

A Chrome trace from ``torch.profiler.profile(with_stack=True)`` holds ``cpu_op`` events (``aten::item``,
``aten::_local_scalar_dense``, ``aten::is_nonzero``, ``aten::nonzero``...) and ``cuda_runtime`` events
(``cudaStreamSynchronize``...), and ``python_function`` events named ``file.py(LINE): func`` whose LINE
is the first line of the function. An operation is attributed to the innermost Python function of a
checked file whose event encloses it in time on the same thread; within that function, to the
static SYNC diagnostics of the matching kind (the exact line), or to the function itself when no
static finding matches. Pure JSON: no torch import.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import libcst as cst

from torchopt.rewrite.engine import Diagnostic

# operation name -> (kind, the static codes that report that kind)
SYNC_OPS = {
    "aten::_local_scalar_dense": ("a host read of a device value", ("TOP601", "TOP602", "TOP607", "TOP608")),
    "aten::is_nonzero": ("`bool()` of a tensor", ("TOP605", "TOP601")),
    "aten::nonzero": ("a data-dependent shape", ("TOP604",)),
    "aten::nonzero_numpy": ("a data-dependent shape", ("TOP604",)),
    "aten::masked_select": ("a data-dependent shape", ("TOP604",)),
    "aten::_unique2": ("a data-dependent shape", ("TOP604",)),
    "aten::unique_dim": ("a data-dependent shape", ("TOP604",)),
    "aten::unique_consecutive": ("a data-dependent shape", ("TOP604",)),
    "aten::repeat_interleave": ("a data-dependent shape", ("TOP604",)),
    "cudaStreamSynchronize": ("a stream synchronisation", ("TOP601", "TOP603", "TOP604", "TOP605", "TOP606")),
    "cudaDeviceSynchronize": ("a device synchronisation", ("TOP606",)),
    "cudaEventSynchronize": ("an event synchronisation", ("TOP606",)),
}
_FRAME = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<func>.+)$")


class ProfileError(Exception):
    pass


@dataclass
class Hit:
    func: str
    def_line: int
    op: str
    count: int = 0
    total_us: float = 0.0


def load_events(trace_path: str) -> list[dict]:
    try:
        with open(trace_path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ProfileError(f"cannot read the profile {trace_path}: {exc}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ProfileError(f"{trace_path}: not a Chrome trace (no traceEvents)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]


def _same_file(trace_file: str, path: str) -> bool:
    a = trace_file.replace("\\", "/").lstrip("./")
    b = path.replace("\\", "/")
    return bool(a) and (b == a or b.endswith("/" + a))


def hits_for(events: Sequence[dict], path: str) -> list[Hit]:
    """Sync operations attributed to functions of ``path``, one Hit per (function, op)."""
    frames: dict[tuple, list[tuple[float, float, str, int]]] = defaultdict(list)
    for e in events:
        if e.get("cat") != "python_function":
            continue
        m = _FRAME.match(str(e.get("name", "")))
        if not m or not _same_file(m.group("file"), path):
            continue
        start = float(e["ts"])
        frames[(e.get("pid"), e.get("tid"))].append(
            (start, start + float(e.get("dur", 0)), m.group("func"), int(m.group("line")))
        )
    # `bool(t)` runs `aten::is_nonzero`, which calls `_local_scalar_dense`: one sync, counted once.
    truth: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("name") == "aten::is_nonzero":
            truth[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
    out: dict[tuple[int, str], Hit] = {}
    for e in events:
        op = str(e.get("name", ""))
        if op not in SYNC_OPS or e.get("cat") not in ("cpu_op", "cuda_runtime", "cuda_driver", None):
            continue
        ts = float(e["ts"])
        if op == "aten::_local_scalar_dense" and any(
            s <= ts <= t for s, t in truth.get((e.get("pid"), e.get("tid")), ())
        ):
            continue
        inner = None
        for start, end, func, line in frames.get((e.get("pid"), e.get("tid")), ()):
            if start <= ts <= end and (inner is None or start >= inner[0]):
                inner = (start, end, func, line)
        if inner is None:
            continue
        h = out.setdefault((inner[3], op), Hit(inner[2], inner[3], op))
        h.count += 1
        h.total_us += float(e.get("dur", 0.0))
    # `aten::item` calls `_local_scalar_dense`: only the inner op is listed (the same sync).
    return sorted(out.values(), key=lambda h: (h.def_line, h.op))


def _function_spans(text: str) -> dict[int, tuple[int, int]]:
    """First line (the `def` or its first decorator, as Python reports) -> (start, end) lines."""
    from libcst.metadata import MetadataWrapper, PositionProvider

    wrapper = MetadataWrapper(cst.parse_module(text))
    pos = wrapper.resolve(PositionProvider)
    spans = {}
    for node, rng in pos.items():
        if isinstance(node, cst.FunctionDef):
            first = rng.start.line
            spans[first] = (first, rng.end.line)
            body = pos.get(node.name)
            if body is not None:
                spans[body.start.line] = (first, rng.end.line)  # `def` line of a decorated function
    return spans


def merge(static: Iterable[Diagnostic], hits: Sequence[Hit], path: str, text: str) -> list[Diagnostic]:
    """The static diagnostics, with profile counts appended to the ones the profile confirms, plus
    one diagnostic per profiled sync that no static finding explains."""
    static = list(static)
    spans = _function_spans(text)
    extra: dict[int, list[str]] = defaultdict(list)
    out_new: list[Diagnostic] = []
    for h in hits:
        kind, codes = SYNC_OPS[h.op]
        start, end = spans.get(h.def_line, (h.def_line, h.def_line))
        matched = [i for i, d in enumerate(static) if d.code in codes and start <= d.line <= end]
        note = f"profile: `{h.op}` ran {h.count}× in `{h.func}` ({h.total_us / 1000:.3f} ms)"
        if matched:
            for i in matched:
                extra[i].append(note)
            continue
        out_new.append(
            Diagnostic(
                code=codes[0],
                name="profiled-sync",
                message=f"{note}: {kind} that no static finding explains (look for it in `{h.func}` or what it calls)",
                path=path,
                line=start,
                column=1,
                end_line=start,
                end_column=1,
                fix=None,
            )
        )
    merged = [
        replace(d, message=d.message + " [" + "; ".join(extra[i]) + "]") if i in extra else d
        for i, d in enumerate(static)
    ]
    return sorted(merged + out_new, key=lambda d: d.sort_key())


def apply_profile(trace_path: str, diags: Sequence[Diagnostic]) -> list[Diagnostic]:
    """`check --profile`: join the trace with the diagnostics of every file that has some."""
    import os

    events = load_events(trace_path)
    by_path: dict[str, list[Diagnostic]] = defaultdict(list)
    for d in diags:
        by_path[d.path].append(d)
    out: list[Diagnostic] = []
    for path, ds in by_path.items():
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError:
            out.extend(ds)
            continue
        hits = hits_for(events, os.path.abspath(path))
        out.extend(merge(ds, hits, path, text) if hits else ds)
    return sorted(out, key=lambda d: d.sort_key())
