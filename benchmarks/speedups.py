"""What each LibCST fast path (torchopt/rewrite/speedups.py) buys, in CPU seconds of one process.

    python benchmarks/speedups.py /tmp/torchopt-corpus/transformers [--every 9] [--rounds 3]

Runs ``check_source`` with all rules over every K-th ``.py`` file of CORPUS (sorted paths, so the
sample is fixed) under these configurations: none of the fast paths, all of them, and all but one for
each. Configurations are interleaved round by round (after one warm-up run) and the minimum CPU time
(``time.process_time``) of each is reported, so load from other processes on the machine and the
first run's warm-up weigh little. "share" is what leaving that one path out costs, as a % of the run
with all paths. Every configuration must give the same diagnostics; the script exits 1 if not.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchopt.rewrite import speedups  # noqa: E402
from torchopt.rewrite.config import Settings  # noqa: E402
from torchopt.rewrite.engine import ParseError, check_source  # noqa: E402
from torchopt.rewrite.runner import tune_gc  # noqa: E402


def sample(corpus: Path, every: int) -> list[tuple[str, str]]:
    paths = sorted(p for p in corpus.rglob("*.py") if p.is_file())[::every]
    out = []
    for p in paths:
        try:
            out.append((str(p), p.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            pass
    return out


def run_once(files: list[tuple[str, str]], settings: Settings, names: tuple[str, ...]) -> tuple[float, list]:
    speedups.uninstall()
    speedups.install(names)
    assert speedups.installed() == names or not names, (speedups.installed(), names)
    found = []
    start = time.process_time()
    for path, text in files:
        try:
            found.append([d.to_json() for d in check_source(text, settings, path).diagnostics])
        except ParseError as exc:
            found.append(str(exc))
    spent = time.process_time() - start
    speedups.uninstall()
    return spent, found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--every", type=int, default=9, help="measure every K-th file (default 9)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each configuration (default 3)")
    ap.add_argument(
        "--leave-out",
        action="append",
        choices=speedups.DEFAULT,
        metavar="NAME",
        help="measure 'all but NAME' for these paths only (repeatable; default: every one)",
    )
    args = ap.parse_args()
    if not speedups.supported(speedups.libcst_version()):
        print("this LibCST version is outside the tested range: nothing to measure", file=sys.stderr)
        return 2
    tune_gc()  # as the command line runs
    files = sample(args.corpus, args.every)
    settings = Settings()
    everything = speedups.DEFAULT
    configs = {"none": (), "all": everything}
    measured = tuple(args.leave_out or everything)
    for name in measured:
        configs[f"all but {name}"] = tuple(n for n in everything if n != name)
    run_once(files, settings, everything)  # warm-up: per-class plans, imports, rule set-up
    best: dict[str, float] = {}
    reference = None
    for _ in range(args.rounds):
        for label, names in configs.items():
            spent, found = run_once(files, settings, names)
            best[label] = min(best.get(label, spent), spent)
            if reference is None:
                reference = found
            elif found != reference:
                print(f"diagnostics differ with {label!r}", file=sys.stderr)
                return 1
            print(f"  {label}: {spent:.2f} s", file=sys.stderr, flush=True)
    lines = sum(text.count("\n") for _, text in files)
    total = best["all"]
    print(
        f"{len(files)} files, {lines} lines, every {args.every}th file of {args.corpus}, "
        f"min of {args.rounds} rounds, CPU s of one process"
    )
    print("| configuration | CPU s | share |")
    print("|---|---|---|")
    print(f"| all fast paths | {total:.2f} | |")
    print(f"| none | {best['none']:.2f} | {100 * (best['none'] - total) / total:+.1f}% |")
    for name in measured:
        t = best[f"all but {name}"]
        print(f"| all but {name} | {t:.2f} | {100 * (t - total) / total:+.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
