"""Throughput and safety on real code: copies a corpus (default: the timm and torchvision sources
unpacked as CONTRIBUTING.md, "Measuring throughput", shows) to a temp folder, runs
`torchopt rewrite --unsafe-fixes` on it, and reports wall time, files, fixes per code; then checks
that every output compiles and that a second run changes nothing.

    python benchmarks/corpus.py [SRC ...] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

DEFAULT = ["/tmp/torchopt-corpus/timm", "/tmp/torchopt-corpus/torchvision"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", nargs="*", default=DEFAULT)
    ap.add_argument("--jobs", type=int, default=None)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="torchopt-bench-")
    for s in args.src:
        shutil.copytree(s, os.path.join(work, os.path.basename(s.rstrip("/"))))
    files = [os.path.join(d, f) for d, _, fs in os.walk(work) for f in fs if f.endswith(".py")]
    jobs = ["--jobs", str(args.jobs)] if args.jobs else []
    cmd = [sys.executable, "-m", "torchopt", "rewrite", work, "--unsafe-fixes", "--output-format", "json", *jobs]
    t0 = time.perf_counter()
    first = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rows = json.loads(first.stdout or "[]")
    fixed = Counter(r["code"] for r in rows if r["fixed"])
    left = Counter(r["code"] for r in rows if not r["fixed"])
    broken = []
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        try:
            compile(data, f, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            broken.append(f"{f}: {exc}")
    second = subprocess.run(
        [sys.executable, "-m", "torchopt", "rewrite", work, "--unsafe-fixes", "--check", *jobs],
        capture_output=True,
        text=True,
    )
    errors = [line for line in first.stderr.splitlines() if line.startswith("error:")]
    print(f"files: {len(files)}   wall: {wall:.1f}s   ({len(files) / wall:.0f} files/s)   exit: {first.returncode}")
    print("fixes applied: " + (", ".join(f"{c} {n}" for c, n in sorted(fixed.items())) or "none"))
    print(
        "diagnostics left (no fix or not applied): "
        + (", ".join(f"{c} {n}" for c, n in sorted(left.items())) or "none")
    )
    print(f"files not processed: {len(errors)}")
    for e in errors[:20]:
        print("  " + e)
    print(f"outputs that do not compile: {len(broken)}")
    for b in broken[:20]:
        print("  " + b)
    print(f"second run: {'no changes' if second.returncode == 0 else 'CHANGES: ' + second.stdout[:2000]}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if not broken and second.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
