"""`validate --bench`: what the rewrite buys, measured after the comparison.

The original and the rewrite run again, one at a time (never side by side on one device), in
alternating order over ``repeats`` rounds, without the validator's probes and determinism switches
(they cost time the program does not spend on its own). The harness takes a clock reading in an
optimizer step post-hook, after synchronising the device; the first ``warmup`` step intervals
(CUDA context, kernel selection, allocator growth) are dropped. Per version: median step time,
steps/s and peak memory (CUDA: ``max_memory_allocated``; CPU: the process's peak resident set).
The speed-up is the median step time before over after, with a 95 % confidence interval from the
rounds (Student t on the log of each round's ratio).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from torchopt.validate.command import Outcome
    from torchopt.validate.runner import RunOptions, Version

# Two-sided 95 % Student t quantiles for 1..10 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
CPU_NOTE = "measured on the CPU: CPU speed says nothing of GPU speed; run with --device cuda on a GPU for that"


@dataclass(frozen=True)
class BenchOptions:
    repeats: int = 3
    warmup: int = 2


def step_times(marks: Sequence[float], warmup: int) -> tuple[list[float], bool]:
    """Intervals between consecutive optimizer steps, warm-up dropped; True when there were too
    few steps to drop all of it (the last interval is then kept alone)."""
    intervals = [b - a for a, b in zip(marks, marks[1:])]
    if len(intervals) > warmup:
        return intervals[warmup:], False
    return intervals[-1:], bool(intervals)


def speedup_interval(before: Sequence[float], after: Sequence[float]) -> tuple[float, float | None, float | None]:
    """(speed-up, low, high): per-round ratios of median step times, geometric mean and a 95 %
    t interval on their logs; no interval from a single round."""
    logs = [math.log(b / a) for b, a in zip(before, after) if a > 0 and b > 0]
    if not logs:
        return math.nan, None, None
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None, None
    t = _T975[len(logs) - 2] if len(logs) - 1 <= len(_T975) else 1.96
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def _side(runs: list[dict], warmup: int) -> dict:
    medians, short = [], False
    for r in runs:
        times, was_short = step_times(r.get("marks") or [], warmup)
        short |= was_short
        if times:
            medians.append(statistics.median(times))
    med = statistics.median(medians) if medians else None
    peak = max((r.get("peak_memory") or 0 for r in runs), default=0)
    return {
        "median_step_s": med,
        "steps_per_s": (1.0 / med) if med else None,
        "peak_memory_bytes": peak,
        "memory_kind": runs[0].get("memory_kind", "") if runs else "",
        "run_medians_s": medians,
        "warmup_too_long": short,
    }


def measure(out: "Outcome", before: "Version", after: "Version", opts: "RunOptions", bench: BenchOptions) -> None:
    """Run both versions ``bench.repeats`` times each, one at a time; add the figures to ``out``."""
    from torchopt.validate.runner import run_version

    bench_opts = replace(opts, bench=True, transplant=None)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    errors: list[str] = []
    for i in range(bench.repeats):
        order = (before, after) if i % 2 == 0 else (after, before)  # alternate: drift hits both alike
        for v in order:
            res = run_version(v, bench_opts)[0]
            if res.get("status") != "ok":
                last = (res.get("traceback") or "").strip().splitlines()[-1:]
                errors.append(f"{v.label} (round {i + 1}): {res.get('status')}: {last[0] if last else ''}")
                continue
            runs[v.label].append(res)
    b, a = _side(runs["before"], bench.warmup), _side(runs["after"], bench.warmup)
    paired = [(x, y) for x, y in zip(b["run_medians_s"], a["run_medians_s"])]
    speed, low, high = speedup_interval([x for x, _ in paired], [y for _, y in paired])
    device = opts.device
    notes = [CPU_NOTE] if device == "cpu" else []
    if b["warmup_too_long"] or a["warmup_too_long"]:
        notes.append(
            f"fewer than {bench.warmup + 2} optimizer steps: the warm-up could not be skipped entirely; raise --steps"
        )
    if not b["median_step_s"] and not a["median_step_s"] and not errors:
        notes.append("no optimizer step was timed (the program never steps an optimizer)")
    result = {
        "device": device,
        "repeats": bench.repeats,
        "warmup_steps": bench.warmup,
        "before": b,
        "after": a,
        "speedup": None if math.isnan(speed) else speed,
        "speedup_ci95": None if low is None else [low, high],
        "notes": notes,
        "errors": errors,
    }
    out.json["bench"] = result
    out.text += render(result)


def _mem(n: int, kind: str) -> str:
    return f"{n / 2**20:.1f} MiB ({kind})" if n else "n/a"


def render(result: dict) -> str:
    lines = [
        f"Benchmark ({result['repeats']} round(s), each version alone, {result['warmup_steps']} warm-up "
        f"step(s) skipped, device {result['device']}):"
    ]
    for side in ("before", "after"):
        r = result[side]
        if r["median_step_s"]:
            lines.append(
                f"  {side + ':':7} median step {r['median_step_s'] * 1e3:.3g} ms, "
                f"{r['steps_per_s']:.3g} steps/s, peak memory "
                f"{_mem(r['peak_memory_bytes'], r['memory_kind'])}"
            )
        else:
            lines.append(f"  {side + ':':7} not timed")
    if result["speedup"] is not None:
        ci = result["speedup_ci95"]
        interval = f" (95% CI {ci[0]:.3g}x-{ci[1]:.3g}x)" if ci else " (one round: no interval)"
        lines.append(f"  speed-up: {result['speedup']:.3g}x{interval}")
    lines += [f"  error: {e}" for e in result["errors"]]
    lines += [f"  note: {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"
