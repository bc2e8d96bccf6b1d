"""Validate every fixture's rewrites on a GPU and measure what they buy.

    python benchmarks/gpu_validate.py                 # --device cuda (the point of this script)
    python benchmarks/gpu_validate.py --device cpu    # smoke test on a machine without a GPU

For each ``fixtures/*/before.py``:

1. **Validation.** ``torchopt validate before.py --device D --json`` for the safe rewrite and again
   with ``--unsafe-fixes`` (skipped when the unsafe rewrite is the safe one, or when a rewrite
   changes nothing). Several validations run at once (``--jobs``): each is its own processes with
   its own seeds, so sharing the GPU does not change what they compute; it only slows them.
2. **Timing**, after every validation has finished so nothing else runs on the device: one child
   process per version (the original, the safe and the unsafe text; a text already timed is not
   timed again), so that a global switch one version sets cannot leak into another. It execs the
   text ``--warmup`` times untimed (CUDA context, kernel selection, allocator), then ``--repeats``
   timed passes; ``torch.cuda.synchronize()`` is called before every clock read. Two rates per
   version, medians over the timed passes:

   * ``loop steps/s``: 1 / median time between consecutive optimizer steps (the training loop
     alone; a step's end is taken in an optimizer step post-hook, after a synchronize);
   * ``passes/s``: 1 / median time of a whole program pass (set-up included: most device fixes
     act on the tensors built there). For programs that never step an optimizer this is the only
     rate.

The fixtures are tiny (3 steps on toy models), so the numbers show per-step overhead (host
allocations, copies, synchronisations), not model throughput. Everything is bounded by
``--budget`` seconds (default 450, so the whole script stays under 8 minutes): work that would
start past it is reported as skipped. Prints a table; writes ``gpu_validate.json`` under $OUT when
that is set (or to ``--json-out``).
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("before", "safe", "unsafe")


# --------------------------------------------------------------------------- child: timing


def _child(spec_path: str) -> int:
    """Exec one version's text ``warmup + repeats`` times in this process; write the timings."""
    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    import torch
    import torch.optim.optimizer as optim_mod

    cuda = spec["device"] == "cuda"
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])

    def sync() -> None:
        if cuda and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    marks: list[float] = []

    def after_step(opt, args, kwargs):  # type: ignore[no-untyped-def]
        sync()
        marks.append(time.perf_counter())

    optim_mod.register_optimizer_step_post_hook(after_step)
    path = spec["path"]
    os.chdir(os.path.dirname(path))
    sys.path.insert(0, os.path.dirname(path))
    code = compile(spec["text"], path, "exec", dont_inherit=True)
    out: dict = {"passes": [], "intervals": [], "steps_per_pass": None, "error": None}
    devnull = open(os.devnull, "w")
    for i in range(spec["warmup"] + spec["repeats"]):
        torch.manual_seed(0)
        ns = {"__name__": "__main__", "__file__": path, "__builtins__": builtins}
        sys.argv = [path]
        marks.clear()
        stdout, sys.stdout = sys.stdout, devnull  # the fixtures print their metrics
        try:
            sync()
            t0 = time.perf_counter()
            exec(code, ns)
            sync()
            t1 = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - report it in the table
            out["error"] = f"{type(exc).__name__}: {exc}"
            break
        finally:
            sys.stdout = stdout
        out["steps_per_pass"] = len(marks)
        if i >= spec["warmup"]:  # warm-up passes (CUDA context, kernel choice, allocator) not timed
            out["passes"].append(t1 - t0)
            out["intervals"] += [b - a for a, b in zip(marks, marks[1:])]
    with open(spec["out"], "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return 0


# --------------------------------------------------------------------------- parent


def _rewrites(before: Path) -> dict[str, str]:
    """The texts to compare: the original, its safe rewrite and its unsafe rewrite (in memory)."""
    from torchopt.rewrite.config import Resolver
    from torchopt.rewrite.engine import fix_source

    text = before.read_text(encoding="utf-8")
    settings = Resolver().for_path(str(before))
    return {"before": text,
            "safe": fix_source(text, settings, str(before), unsafe=False).text,
            "unsafe": fix_source(text, settings, str(before), unsafe=True).text}


def _validate(before: Path, unsafe: bool, args: argparse.Namespace, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "torchopt", "validate", str(before), "--steps", str(args.steps),
           "--device", args.device, "--timeout", f"{max(timeout, 1):.0f}", "--json"]
    if unsafe:
        cmd.append("--unsafe-fixes")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=2 * timeout + 60)
    except subprocess.TimeoutExpired:
        return {"exit": None, "verdict": "timeout", "headline": "validation timed out", "fixes": None,
                "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"exit": proc.returncode, "verdict": "error", "headline": (proc.stderr or proc.stdout).strip()[-300:],
                "fixes": None, "wall_s": wall}
    return {"exit": proc.returncode, "verdict": out.get("verdict"), "headline": out.get("headline") or
            "; ".join(out.get("notes") or []), "fixes": len(out.get("applied") or []),
            "first_divergence": out.get("first_divergence"), "tolerance": (out.get("tolerance") or {}).get("reason"),
            "notes": out.get("notes"), "wall_s": wall}


def _time_one(before: Path, text: str, args: argparse.Namespace, timeout: float) -> dict:
    """Time one version in a fresh process, so that global switches one version sets (TF32,
    cudnn.benchmark, default dtype...) cannot leak into another version's passes."""
    with tempfile.TemporaryDirectory(prefix="torchopt-bench-") as tmp:
        spec = {"path": str(before), "text": text, "device": args.device, "warmup": args.warmup,
                "repeats": args.repeats, "threads": args.threads, "out": os.path.join(tmp, "out.json")}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as fh:
            json.dump(spec, fh)
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec_path],
                                  capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timing timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not os.path.exists(spec["out"]):
            return {"error": (proc.stderr or "timing child failed").strip()[-300:]}
        with open(spec["out"], encoding="utf-8") as fh:
            r = json.load(fh)
    row = {"error": r["error"], "steps_per_pass": r["steps_per_pass"], "timed_passes": len(r["passes"])}
    if r["passes"]:
        row["passes_per_s"] = 1.0 / statistics.median(r["passes"])
    if r["intervals"]:
        row["loop_steps_per_s"] = 1.0 / statistics.median(r["intervals"])
        row["timed_steps"] = len(r["intervals"])
    return row


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def _table(rows: list[dict]) -> str:
    head = ("fixture", "rewrite", "fixes", "validation", "loop st/s before", "after", "speed-up",
            "pass/s before", "after", "speed-up")
    lines = []
    for r in rows:
        t = r.get("timing") or {}
        b, a = t.get("before") or {}, t.get(r["rewrite"]) or {}
        v = r["validation"]
        verdict = v.get("headline") or v.get("verdict") or ""
        if v.get("exit") not in (0, None):
            verdict = f"[exit {v['exit']}] {verdict}"
        ls_b, ls_a = b.get("loop_steps_per_s"), a.get("loop_steps_per_s")
        ps_b, ps_a = b.get("passes_per_s"), a.get("passes_per_s")
        err = a.get("error") or b.get("error")
        lines.append((r["fixture"], r["rewrite"], str(v.get("fixes") if v.get("fixes") is not None else "—"),
                      verdict[:60], _fmt(ls_b), _fmt(ls_a),
                      _fmt(ls_a / ls_b, ".2f") + "x" if ls_a and ls_b else "—",
                      _fmt(ps_b), _fmt(ps_a), (_fmt(ps_a / ps_b, ".2f") + "x" if ps_a and ps_b else "—")
                      + (f"  ({err[:40]})" if err else "")))
    widths = [max(len(h), *(len(row[i]) for row in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % w if i < 4 else "{:>%d}" % w for i, w in enumerate(widths))
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per validation run")
    p.add_argument("--repeats", type=int, default=10, help="timed passes per version")
    p.add_argument("--warmup", type=int, default=2, help="untimed passes per version first")
    p.add_argument("--jobs", type=int, default=0, help="validations at once (default: 4 on cuda, 1 on cpu)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads in the timing child (0: torch's default)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole script")
    p.add_argument("--fixtures", default="", help="comma-separated fixture names (default: all)")
    p.add_argument("--json-out", default="", help="write the JSON here (default: $OUT/gpu_validate.json if $OUT)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child)

    start = time.perf_counter()
    deadline = start + args.budget
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available (use --device cpu for a smoke test)",
              file=sys.stderr)
        return 2
    names = [n for n in args.fixtures.split(",") if n] or sorted(
        d.parent.name for d in (ROOT / "fixtures").glob("*/before.py"))
    jobs = args.jobs or (4 if args.device == "cuda" else 1)
    env_info = {"device": args.device, "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                "steps": args.steps, "repeats": args.repeats, "warmup": args.warmup}
    print(f"torchopt gpu_validate: {len(names)} fixtures on {env_info['gpu'] or args.device}, "
          f"torch {torch.__version__}, {args.steps} steps per validation run", flush=True)

    # Which validations to run.
    plans: dict[str, dict[str, str]] = {}
    tasks: list[tuple[str, str]] = []
    rows: list[dict] = []
    for name in names:
        before = ROOT / "fixtures" / name / "before.py"
        texts = _rewrites(before)
        plans[name] = texts
        for rw in ("safe", "unsafe"):
            row = {"fixture": name, "rewrite": rw, "validation": {}, "timing": None}
            rows.append(row)
            if texts[rw] == texts["before"]:
                row["validation"] = {"exit": 0, "verdict": "equivalent", "headline": "rewrite changes nothing",
                                     "fixes": 0}
            elif rw == "unsafe" and texts["unsafe"] == texts["safe"]:
                row["validation"] = {"same_as": "safe"}
            else:
                tasks.append((name, rw))

    def run_task(task: tuple[str, str]) -> tuple[tuple[str, str], dict]:
        left = deadline - time.perf_counter()
        if left < 30:
            return task, {"exit": None, "verdict": "skipped", "headline": "skipped: time budget spent"}
        res = _validate(ROOT / "fixtures" / task[0] / "before.py", task[1] == "unsafe", args, min(240.0, left / 2))
        print(f"  validated {task[0]:<22} {task[1]:<6} exit {res.get('exit')}  {res.get('headline', '')[:70]}"
              f"  ({res.get('wall_s', 0):.1f} s)", flush=True)
        return task, res

    done: dict[tuple[str, str], dict] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for task, res in pool.map(run_task, tasks):
            done[task] = res
    for row in rows:
        key = (row["fixture"], row["rewrite"])
        if key in done:
            row["validation"] = done[key]
    for row in rows:  # unsafe == safe: same text, same verdict
        if row["validation"].get("same_as"):
            safe = next(r for r in rows if r["fixture"] == row["fixture"] and r["rewrite"] == "safe")
            row["validation"] = dict(safe["validation"], headline=f"same text as safe: {safe['validation'].get('headline', '')}")

    # Timing, one process at a time, nothing else on the device; a text timed once is not timed again.
    for name in names:
        timing: dict[str, dict] = {}
        for v in VERSIONS:
            same = next((w for w in timing if plans[name][w] == plans[name][v]), None)
            if same is not None:
                timing[v] = dict(timing[same], same_text_as=same)
                continue
            left = deadline - time.perf_counter()
            timing[v] = ({"error": "skipped: time budget spent"} if left < 20 else
                         _time_one(ROOT / "fixtures" / name / "before.py", plans[name][v], args, min(180.0, left - 10)))
        print(f"  timed     {name:<22} " + "  ".join(
            f"{v} {_fmt(timing[v].get('passes_per_s'))} pass/s" for v in VERSIONS), flush=True)
        for row in rows:
            if row["fixture"] == name:
                row["timing"] = timing

    print()
    print(_table(rows))
    total = time.perf_counter() - start
    failed = [r for r in rows if r["validation"].get("exit") not in (0, None)]
    skipped = [r for r in rows if r["validation"].get("verdict") == "skipped"]
    print(f"\n{len(rows)} rewrites of {len(names)} fixtures: {len(rows) - len(failed) - len(skipped)} equivalent, "
          f"{len(failed)} not, {len(skipped)} skipped; {total:.0f} s")
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
