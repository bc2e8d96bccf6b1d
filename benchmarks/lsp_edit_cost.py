"""Where the language server's per-edit work goes, in instructions (a count the other load on a shared
machine does not change): an edit of the latency benchmark's connected training script
(``IncrementalChecker.check`` after a new value typed over a number, as benchmarks/lsp_latency.py
does), beside a full ``check_source``, the two parses, the cheapest checks of one rule, and the full
check without each family of the whole-program rules.

    valgrind --tool=callgrind --dump-before='zlib_crc32*' --callgrind-out-file=/tmp/cg.out \\
        "$(python -c 'import sys; print(sys.executable)')" benchmarks/lsp_edit_cost.py
    python benchmarks/lsp_edit_cost.py --read /tmp/cg.out

Each phase runs between two calls of ``zlib.crc32``, at which callgrind writes the instructions
counted since the last one (``/tmp/cg.out.N``); ``--read`` prints each phase's median over the rounds
and its share of the full check. Under valgrind a round takes a few minutes.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lsp_latency import apply, number_edit  # noqa: E402
from lsp_script import TRAINING_SCRIPT  # noqa: E402

FAMILIES = {
    "TOP60x": {"TOP601", "TOP603", "TOP606", "TOP609"},
    "TOP501/502": {"TOP501", "TOP502"},
    "TOP80x": {"TOP801", "TOP802", "TOP803"},
}
PHASES = ["edit", "all", "ast.parse", "LibCST parse", "TOP951 alone", "TOP701 alone"] + [
    f"all but {f}" for f in FAMILIES
]


def run(rounds: int) -> None:
    import libcst as cst

    from torchopt.rewrite import speedups
    from torchopt.rewrite.config import Settings
    from torchopt.rewrite.engine import check_source
    from torchopt.rewrite.incremental import IncrementalChecker

    speedups.install()
    s, text = Settings(), TRAINING_SCRIPT
    every = frozenset(s.enabled_codes("train.py"))
    checks = {"all": every, "TOP951 alone": frozenset({"TOP951"}), "TOP701 alone": frozenset({"TOP701"})}
    checks.update({f"all but {f}": every - codes for f, codes in FAMILIES.items()})
    checker = IncrementalChecker()
    checker.check(text, s, "train.py")
    for codes in checks.values():  # warm: rule imports
        check_source(TRAINING_SCRIPT, s, "train.py", codes)
    k = 0
    for _ in range(rounds):
        for phase in PHASES:
            zlib.crc32(b"")
            if phase == "edit":
                k += 1
                text = apply(text, *number_edit(text, k))
                checker.check(text, s, "train.py")
            elif phase == "ast.parse":
                ast.parse(TRAINING_SCRIPT)
            elif phase == "LibCST parse":
                cst.parse_module(TRAINING_SCRIPT)
            else:
                check_source(TRAINING_SCRIPT, s, "train.py", checks[phase])
    zlib.crc32(b"")


def read(prefix: str) -> None:
    counts = []
    n = 2  # dump 1 is the start-up and the warm-up
    while os.path.exists(f"{prefix}.{n}"):
        with open(f"{prefix}.{n}") as fh:
            counts.append(next(int(line.split()[1]) for line in fh if line.startswith("totals:")))
        n += 1
    by_phase = {
        p: statistics.median(counts[i :: len(PHASES)]) for i, p in enumerate(PHASES) if counts[i :: len(PHASES)]
    }
    full = by_phase["all"]
    print("| phase | instructions | share of a full check |\n|---|---|---|")
    for p, c in by_phase.items():
        print(f"| {p} | {c / 1e9:.2f} G | {100 * c / full:.0f}% |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--read", metavar="PREFIX", help="print the table from callgrind's dumps PREFIX.N")
    args = ap.parse_args()
    if args.read:
        read(args.read)
    else:
        run(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
