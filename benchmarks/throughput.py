"""Throughput of `torchopt check` and `torchopt rewrite --diff` over a corpus, cold (empty cache) and
warm (second run), beside LibCST parse-only time of the same files and, when installed, TorchFix.

    python benchmarks/throughput.py CORPUS [--jobs N] [--torchfix PATH] [--select CODES] [--markdown]

TorchFix is looked for in --torchfix, else $TORCHFIX (the path of its `torchfix` script; install it in
a separate venv: `python -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install torchfix`). Nothing is
written to the corpus: both tools only read it (check, --diff); the cache goes to a temp folder.
Wall seconds are what a user waits; CPU seconds (this process's children, user + system) are less
sensitive to other load on the machine. lines/s is lines over wall seconds.
"""

from __future__ import annotations

import argparse
import atexit
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass


@dataclass
class Row:
    what: str
    files: int
    lines: int
    wall: float
    cpu: float
    note: str = ""

    @property
    def rate(self) -> float:
        return self.lines / self.wall if self.wall else 0.0


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(
    cmd: list[str], env: dict | None = None, cwd: str | None = None
) -> tuple[float, float, subprocess.CompletedProcess]:
    cpu0, t0 = _children_cpu(), time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    return time.perf_counter() - t0, _children_cpu() - cpu0, out


def corpus_files(corpus: str) -> list[str]:
    """The files torchopt itself would process (same discovery: .gitignore, default excludes)."""
    from torchopt.rewrite.config import Resolver
    from torchopt.rewrite.discovery import discover

    return discover([corpus], Resolver().for_path)


def _count_lines(path: str) -> int:
    with open(path, "rb") as fh:
        return fh.read().count(b"\n")


def _parse_chunk(paths: list[str]) -> int:
    import libcst as cst

    bad = 0
    for p in paths:
        try:
            with open(p, encoding="utf-8") as fh:
                cst.parse_module(fh.read())
        except Exception:
            bad += 1
    return bad


def parse_only(files: list[str], jobs: int) -> tuple[float, float]:
    """LibCST parse of every file, in `jobs` worker processes (wall s, CPU s of the workers)."""
    chunks = [files[i :: jobs * 8] for i in range(jobs * 8)]
    t0 = time.perf_counter()
    before = _children_cpu()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(_parse_chunk, chunks))
    return time.perf_counter() - t0, _children_cpu() - before


def per_rule(files: list[str], sample: int) -> list[tuple[str, float, float, float]]:
    """For every enabled rule: the share of files (and of lines) its cheap text test lets through, and
    the CPU seconds it costs run alone (parse included) on an evenly spaced sample of the files that
    test lets through, scaled to the whole corpus. Sorted by the estimate, dearest first."""
    from torchopt.rewrite.config import Settings
    from torchopt.rewrite.engine import ParseError, active_rules, check_source
    from torchopt.rewrite.source import SourceError, read

    settings = Settings()
    texts = []
    for f in files:
        try:
            texts.append((f, read(f).text))
        except SourceError:
            pass
    total_lines = sum(t.count("\n") for _, t in texts) or 1
    out = []
    for rule in active_rules(settings.enabled_codes()):
        hit = [(f, t) for f, t in texts if rule.could_match(t)]
        hit_lines = sum(t.count("\n") for _, t in hit)
        step = max(1, len(hit) // sample) if hit else 1
        picked = hit[::step][:sample]
        cpu0 = time.process_time()
        for f, t in picked:
            try:
                check_source(t, settings, f, codes=[rule.code])
            except ParseError:
                pass
        cpu = time.process_time() - cpu0
        picked_lines = sum(t.count("\n") for _, t in picked) or 1
        estimate = cpu * hit_lines / picked_lines if picked else 0.0
        out.append((rule.code, len(hit) / len(texts), hit_lines / total_lines, estimate))
    return sorted(out, key=lambda r: -r[3])


def torchopt_cmd(sub: list[str], corpus: str, jobs: int, cache: str, select: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "torchopt", *sub, corpus, "--jobs", str(jobs), "--cache-dir", cache, "-q"]
    return cmd + (["--select", select] if select else [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus")
    ap.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--torchfix", default=os.environ.get("TORCHFIX"), help="path of the torchfix script")
    ap.add_argument("--select", default=None, help="torchopt rule selection (default: the configured one)")
    ap.add_argument("--skip", action="append", default=[], choices=["parse", "check", "rewrite", "torchfix"])
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    ap.add_argument(
        "--per-rule",
        type=int,
        default=0,
        metavar="N",
        help="also estimate each rule's cost alone from N sampled files it could match",
    )
    ap.add_argument(
        "--every",
        type=int,
        default=1,
        metavar="K",
        help="use every K-th file of the corpus only (copied to a temp folder): a quicker side-by-side",
    )
    args = ap.parse_args()

    files = corpus_files(args.corpus)
    if args.every > 1:
        sub = tempfile.mkdtemp(prefix="torchopt-corpus-")
        base = os.path.abspath(args.corpus)
        for f in files[:: args.every]:
            dest = os.path.join(sub, os.path.relpath(os.path.abspath(f), base))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(f, dest)
        args.corpus = sub
        files = corpus_files(sub)
    lines = sum(_count_lines(f) for f in files)
    print(f"corpus: {args.corpus}: {len(files)} files, {lines} lines; jobs: {args.jobs}", file=sys.stderr)
    try:
        return _measure(args, files, lines)
    finally:
        if args.every > 1:
            shutil.rmtree(args.corpus, ignore_errors=True)


def _measure(args: argparse.Namespace, files: list[str], lines: int) -> int:
    n = len(files)
    rows: list[Row] = []
    env = dict(os.environ)
    env.pop("TORCHOPT_CACHE_DIR", None)
    # Run a snapshot of the torchopt package: the cache is keyed by torchopt's own source, so an edit
    # to the working tree between the cold and the warm run would (rightly) make the warm run cold.
    import torchopt

    snap = tempfile.mkdtemp(prefix="torchopt-snapshot-")
    shutil.copytree(
        os.path.dirname(os.path.abspath(torchopt.__file__)),
        os.path.join(snap, "torchopt"),
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    env["PYTHONPATH"] = snap + os.pathsep + env.get("PYTHONPATH", "")
    atexit.register(shutil.rmtree, snap, True)
    corpus = os.path.abspath(args.corpus)  # the commands run in the snapshot folder (`-m` imports from there)

    if "parse" not in args.skip:
        wall, cpu = parse_only(files, args.jobs)
        rows.append(Row("LibCST parse only", n, lines, wall, cpu))
        print(f"  parse-only: {wall:.1f}s", file=sys.stderr)

    for name, sub in (("check", ["check"]), ("rewrite", ["rewrite", "--diff"])):
        if name in args.skip:
            continue
        cache = tempfile.mkdtemp(prefix="torchopt-cache-")
        try:
            for temp in ("cold", "warm"):
                wall, cpu, out = timed(torchopt_cmd(sub, corpus, args.jobs, cache, args.select), env, cwd=snap)
                failed = sum(1 for line in out.stderr.splitlines() if line.startswith("error:"))
                note = f"exit {out.returncode}" + (f", {failed} files not processed" if failed else "")
                rows.append(Row(f"torchopt {' '.join(sub)} ({temp})", n, lines, wall, cpu, note))
                print(f"  {name} {temp}: {wall:.1f}s ({note})", file=sys.stderr)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    if "torchfix" not in args.skip and args.torchfix:
        wall, cpu, out = timed([args.torchfix, "-j", str(args.jobs), args.corpus])
        summary = next((line for line in out.stderr.splitlines() if line.startswith("Finished checking")), "")
        rows.append(Row("TorchFix (check)", n, lines, wall, cpu, summary.strip()))
        print(f"  torchfix: {wall:.1f}s ({summary})", file=sys.stderr)

    if args.per_rule:
        print(
            f"\nper rule (alone, parse included; CPU s estimated for the whole corpus from {args.per_rule} "
            "sampled files each):"
        )
        print(f"{'rule':<8} {'files passing':>13} {'lines passing':>13} {'est. CPU s':>10}")
        for code, share_files, share_lines, est in per_rule(files, args.per_rule):
            print(f"{code:<8} {share_files:>12.0%} {share_lines:>13.0%} {est:>10.1f}")
        print()

    base = next((r for r in rows if r.what.startswith("TorchFix")), None)
    head = ["what", "files", "lines", "wall s", "CPU s", "lines/s", "vs TorchFix", "note"]
    table = []
    for r in rows:
        vs = f"{base.wall / r.wall:.1f}x" if base and r.wall else ""
        table.append(
            [r.what, str(r.files), str(r.lines), f"{r.wall:.1f}", f"{r.cpu:.1f}", f"{r.rate:,.0f}", vs, r.note]
        )
    if not table:
        return 0
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" for _ in head) + "|")
        for row in table:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(head)]
        print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        for row in table:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
