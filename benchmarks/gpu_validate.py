"""Validate every fixture's rewrites on a GPU and measure what they buy, with `torchopt validate --bench`.

    python benchmarks/gpu_validate.py                 # --device cuda (the point of this script)
    python benchmarks/gpu_validate.py --device cpu    # smoke test on a machine without a GPU
    python benchmarks/gpu_validate.py --dry-run       # print the commands it would run; runs nothing

For each ``fixtures/*/before.py``, the safe rewrite and the ``--unsafe-fixes`` one (skipped when it
changes nothing, or when it is the safe text again) go through

    torchopt validate before.py --device D --steps N --json [--unsafe-fixes]
                     --bench --bench-repeats R --bench-warmup W

which first compares the two versions (the verdict) and then, only if both ran, times each version
alone, in alternating order, without probes or determinism switches. Its ``bench`` object gives,
per version, the median step time, steps/s and peak memory (CUDA: ``max_memory_allocated``), and
the speed-up (geometric mean of the rounds' before/after ratios) with its 95 % interval.

With ``--bench`` the validations run **one at a time**: two programs timed at once on one device
would slow each other down and the figures would mean nothing. ``--no-bench`` only validates, and
then runs ``--jobs`` validations at once (each is its own processes with its own seeds, so sharing
the device changes nothing they compute).

The fixtures are tiny (a few steps on toy models), so the figures show per-step overhead (host
allocations, copies, synchronisations), not model throughput. Everything is bounded by ``--budget``
seconds: work that would start past it is reported as skipped. Prints a table; writes
``gpu_validate.json`` under $OUT when that is set (or to ``--json-out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REWRITES = ("safe", "unsafe")


def rewrites(before: Path) -> dict[str, str]:
    """The texts to compare: the original, its safe rewrite and its unsafe rewrite (in memory)."""
    from torchopt.rewrite.config import Resolver
    from torchopt.rewrite.engine import fix_source

    text = before.read_text(encoding="utf-8")
    settings = Resolver().for_path(str(before))
    return {
        "before": text,
        "safe": fix_source(text, settings, str(before), unsafe=False).text,
        "unsafe": fix_source(text, settings, str(before), unsafe=True).text,
    }


def validate_command(before: Path, rewrite: str, args: argparse.Namespace, timeout: float) -> list[str]:
    """The `torchopt validate` command line for one rewrite of one fixture."""
    cmd = [
        sys.executable,
        "-m",
        "torchopt",
        "validate",
        str(before),
        "--steps",
        str(args.steps),
        "--device",
        args.device,
        "--timeout",
        f"{max(timeout, 1):.0f}",
        "--json",
        "--jobs",
        "1",
    ]
    if rewrite == "unsafe":
        cmd.append("--unsafe-fixes")
    if args.bench:
        cmd += ["--bench", "--bench-repeats", str(args.repeats), "--bench-warmup", str(args.warmup)]
    return cmd


def summarize(out: dict, exit_code: int | None, wall_s: float) -> dict:
    """One table row's worth of a `validate --json` answer: the verdict and, with --bench, the timings."""
    row = {
        "exit": exit_code,
        "verdict": out.get("verdict"),
        "wall_s": wall_s,
        "headline": out.get("headline") or "; ".join(out.get("notes") or []),
        "fixes": len(out.get("applied") or []),
        "first_divergence": out.get("first_divergence"),
        "tolerance": (out.get("tolerance") or {}).get("reason")
        if isinstance(out.get("tolerance"), dict)
        else out.get("tolerance"),
    }
    bench = out.get("bench")
    if bench:
        row["bench"] = {
            side: {k: bench[side].get(k) for k in ("median_step_s", "steps_per_s", "peak_memory_bytes", "memory_kind")}
            for side in ("before", "after")
        }
        row["bench"].update(
            speedup=bench.get("speedup"),
            speedup_ci95=bench.get("speedup_ci95"),
            notes=bench.get("notes") or [],
            errors=bench.get("errors") or [],
        )
    return row


def run_validation(before: Path, rewrite: str, args: argparse.Namespace, timeout: float) -> dict:
    cmd = validate_command(before, rewrite, args, timeout)
    runs = 2 + (2 * args.repeats if args.bench else 0)  # the comparison, then each timed run
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=runs * timeout + 60)
    except subprocess.TimeoutExpired:
        return {
            "exit": None,
            "verdict": "timeout",
            "headline": "validation timed out",
            "fixes": None,
            "wall_s": time.perf_counter() - t0,
        }
    wall = time.perf_counter() - t0
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {
            "exit": proc.returncode,
            "verdict": "error",
            "headline": (proc.stderr or proc.stdout).strip()[-300:],
            "fixes": None,
            "wall_s": wall,
        }
    return summarize(out, proc.returncode, wall)


def _ms(seconds: float | None) -> str:
    return "—" if not seconds else f"{seconds * 1e3:.3g}"


def _rate(x: float | None) -> str:
    return "—" if not x else f"{x:.3g}"


def _mib(n: int | None) -> str:
    return "—" if not n else f"{n / 2**20:.1f}"


def speedup_text(bench: dict | None) -> str:
    if not bench or bench.get("speedup") is None:
        return "—"
    ci = bench.get("speedup_ci95")
    return f"{bench['speedup']:.3g}x" + (f" [{ci[0]:.3g}, {ci[1]:.3g}]" if ci else " (1 round)")


def table(rows: list[dict]) -> str:
    head = (
        "fixture",
        "rewrite",
        "fixes",
        "validation",
        "ms/step before",
        "after",
        "steps/s before",
        "after",
        "peak MiB before",
        "after",
        "speed-up [95% CI]",
    )
    lines = []
    for r in rows:
        v = r["validation"]
        verdict = v.get("headline") or v.get("verdict") or ""
        if v.get("exit") not in (0, None):
            verdict = f"[exit {v['exit']}] {verdict}"
        b = (v.get("bench") or {}).get("before") or {}
        a = (v.get("bench") or {}).get("after") or {}
        lines.append(
            (
                r["fixture"],
                r["rewrite"],
                "—" if v.get("fixes") is None else str(v["fixes"]),
                verdict[:60],
                _ms(b.get("median_step_s")),
                _ms(a.get("median_step_s")),
                _rate(b.get("steps_per_s")),
                _rate(a.get("steps_per_s")),
                _mib(b.get("peak_memory_bytes")),
                _mib(a.get("peak_memory_bytes")),
                speedup_text(v.get("bench")),
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % w if i < 4 else "{:>%d}" % w for i, w in enumerate(widths))
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in lines]
    return "\n".join(out)


def plan(names: list[str]) -> tuple[list[dict], list[tuple[str, str]]]:
    """Every (fixture, rewrite) row, and the ones that need a validation run."""
    rows, tasks = [], []
    for name in names:
        texts = rewrites(ROOT / "fixtures" / name / "before.py")
        for rw in REWRITES:
            row = {"fixture": name, "rewrite": rw, "validation": {}}
            rows.append(row)
            if texts[rw] == texts["before"]:
                row["validation"] = {
                    "exit": 0,
                    "verdict": "equivalent",
                    "headline": "rewrite changes nothing",
                    "fixes": 0,
                }
            elif rw == "unsafe" and texts["unsafe"] == texts["safe"]:
                row["validation"] = {"same_as": "safe"}
            else:
                tasks.append((name, rw))
    return rows, tasks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument(
        "--bench",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time both versions after each validation (default); --no-bench only validates",
    )
    p.add_argument("--repeats", type=int, default=3, help="--bench-repeats: rounds of (before, after) timed runs")
    p.add_argument("--warmup", type=int, default=2, help="--bench-warmup: optimizer steps not timed per run")
    p.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="validations at once with --no-bench (default: 4 on cuda, 1 on cpu); always 1 with --bench",
    )
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole script")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per run of one version")
    p.add_argument("--fixtures", default="", help="comma-separated fixture names (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print the validate commands and exit; runs nothing")
    p.add_argument("--json-out", default="", help="write the JSON here (default: $OUT/gpu_validate.json if $OUT)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.budget
    names = [n for n in args.fixtures.split(",") if n] or sorted(
        d.parent.name for d in (ROOT / "fixtures").glob("*/before.py")
    )
    missing = [n for n in names if not (ROOT / "fixtures" / n / "before.py").is_file()]
    if missing:
        print(f"error: no such fixture: {', '.join(missing)}", file=sys.stderr)
        return 2
    rows, tasks = plan(names)
    if args.dry_run:
        for name, rw in tasks:
            print(shlex.join(validate_command(ROOT / "fixtures" / name / "before.py", rw, args, args.timeout)))
        return 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda but no CUDA device is available (use --device cpu for a smoke test)", file=sys.stderr
        )
        return 2
    jobs = 1 if args.bench else (args.jobs or (4 if args.device == "cuda" else 1))
    env_info = {
        "device": args.device,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "steps": args.steps,
        "bench": args.bench,
        "repeats": args.repeats,
        "warmup": args.warmup,
    }
    print(
        f"torchopt gpu_validate: {len(names)} fixtures, {len(tasks)} rewrites to validate"
        f"{' and time' if args.bench else ''} on {env_info['gpu'] or args.device}, torch {torch.__version__}, "
        f"{args.steps} steps per run",
        flush=True,
    )

    def run_task(task: tuple[str, str]) -> tuple[tuple[str, str], dict]:
        left = deadline - time.perf_counter()
        if left < 30:
            return task, {"exit": None, "verdict": "skipped", "headline": "skipped: time budget spent"}
        res = run_validation(ROOT / "fixtures" / task[0] / "before.py", task[1], args, min(args.timeout, left / 2))
        print(
            f"  {task[0]:<24} {task[1]:<6} exit {res.get('exit')}  {str(res.get('headline', ''))[:60]}"
            f"  speed-up {speedup_text(res.get('bench'))}  ({res.get('wall_s', 0):.1f} s)",
            flush=True,
        )
        return task, res

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(pool.map(run_task, tasks))
    for row in rows:
        key = (row["fixture"], row["rewrite"])
        if key in done:
            row["validation"] = done[key]
    for row in rows:  # unsafe == safe: same text, same verdict and timings
        if row["validation"].get("same_as"):
            safe = next(r for r in rows if r["fixture"] == row["fixture"] and r["rewrite"] == "safe")
            row["validation"] = dict(
                safe["validation"], headline=f"same text as safe: {safe['validation'].get('headline', '')}"
            )

    print()
    print(table(rows))
    total = time.perf_counter() - start
    failed = [r for r in rows if r["validation"].get("exit") not in (0, None)]
    skipped = [r for r in rows if r["validation"].get("verdict") == "skipped"]
    print(
        f"\n{len(rows)} rewrites of {len(names)} fixtures: {len(rows) - len(failed) - len(skipped)} equivalent, "
        f"{len(failed)} not, {len(skipped)} skipped; {total:.0f} s"
    )
    if args.device == "cpu":
        print("note: --device cpu is a smoke test; the device fixes only pay off (and only differ) on a GPU")
    report = {"env": env_info, "wall_s": total, "rows": rows}
    out_path = args.json_out or (os.path.join(os.environ["OUT"], "gpu_validate.json") if os.environ.get("OUT") else "")
    if out_path:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {out_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
