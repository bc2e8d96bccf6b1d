"""How sharp is each rule's prefilter on a corpus? For every rule: files (and lines) its cheap
``could_match`` lets through, files it really reports on (run without the prefilter), and files it
would report on that the prefilter hides (must be 0: a hidden file is a missed finding).

    python benchmarks/prefilter_audit.py CORPUS [--every K] [--select TOP105,TOP205]

Parsing every file for every rule is slow (this is what the prefilters save): use --every to sample.
A hidden finding is printed as soon as it is met; Ctrl-C (or SIGTERM) prints the table of the files
audited so far.
Exit 1 when some prefilter hides a finding, 130 when interrupted before the end without one.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _stop(signum, frame):
    """SIGTERM ends a long run the way Ctrl-C does: with the table of what was audited."""
    raise KeyboardInterrupt


def main() -> int:
    from throughput import corpus_files

    from torchopt.rewrite.audit import RuleAudit, audit
    from torchopt.rewrite.source import SourceError, read

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--select", default=None, help="rule codes, comma-separated (default: all)")
    args = ap.parse_args()
    files = corpus_files(args.corpus)[:: args.every]

    def texts():
        for i, f in enumerate(files, 1):
            if i % 50 == 0:
                print(f"  {i}/{len(files)}", file=sys.stderr, flush=True)
            try:
                yield f, read(f).text
            except SourceError:
                continue

    codes = args.select.split(",") if args.select else None
    signal.signal(signal.SIGTERM, _stop)
    result: dict[str, RuleAudit] = {}
    audited = 0
    finished = False
    try:
        for name, text in texts():
            # One file at a time, so that a long run that is stopped still shows what it saw.
            for code, a in audit([(name, text)], codes).items():
                total = result.setdefault(code, RuleAudit(code))
                total.passed += a.passed
                total.passed_lines += a.passed_lines
                total.found += a.found
                total.hidden += a.hidden
                for hidden in a.hidden:
                    print(f"  hidden: {code} {hidden}", file=sys.stderr, flush=True)
            audited += 1
        finished = True
    except KeyboardInterrupt:
        print(f"interrupted: {audited} of {len(files)} files audited", file=sys.stderr)
    print(f"{len(files)} files" if finished else f"{audited} of {len(files)} files (interrupted)")
    print(f"{'rule':<8} {'passed':>7} {'lines':>8} {'found':>6} {'wasted':>7} {'hidden':>6}")
    bad = 0
    for code, a in sorted(result.items(), key=lambda kv: -kv[1].passed_lines):
        print(f"{code:<8} {a.passed:>7} {a.passed_lines:>8} {a.found:>6} {a.wasted:>7} {len(a.hidden):>6}")
        for name in a.hidden:
            print(f"    hidden: {name}")
        bad += len(a.hidden)
    return 1 if bad else (0 if finished else 130)


if __name__ == "__main__":
    sys.exit(main())
