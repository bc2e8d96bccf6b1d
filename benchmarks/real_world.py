"""Measure torchopt on real training scripts from public repositories.

Usage:
    python benchmarks/real_world.py CHECKOUTS [--manifest benchmarks/real_world.json] [--markdown] [--only TEXT]

CHECKOUTS is a folder holding one sub-folder per repository, named ``owner+name``, with each script of the
manifest at its path inside it (only the listed files are needed). For every script this runs
``torchopt check``, ``torchopt rewrite --diff`` and ``torchopt rewrite --diff --unsafe-fixes`` as
subprocesses, rewrites the script through stdin (safe, then with unsafe fixes) to check that every output
compiles and that a second pass changes nothing, and prints a table that joins the counts with the reviewed
judgements kept in the manifest (wrong fixes, false findings, misses). Scripts marked ``amp_target`` in
the manifest (single-GPU float32 training scripts whose step torchopt recognises) are counted for the
last line: on how many of them `--unsafe-fixes` inserts mixed precision (TOP202).

Exit status: 0 when every output compiles and is idempotent, 1 when one does not, 2 when a script is missing
or torchopt failed on it. Third-party code is read from CHECKOUTS only; none of it is stored here.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MANIFEST = Path(__file__).with_name("real_world.json")
TIMEOUT_S = 120
SUMMARY = re.compile(r"^(?:Would fix|Fixed) (\d+) issues? in \d+ files? \(([^)]*)\)", re.MULTILINE)
CODE_COUNT = re.compile(r"(TOP\d+) ×(\d+)")


@dataclass
class Measurement:
    """What torchopt did to one script, before it is joined with the reviewed judgements."""

    findings: Counter = field(default_factory=Counter)
    safe_fixes: Counter = field(default_factory=Counter)
    all_fixes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)

    @property
    def unsafe_fixes(self) -> Counter:
        return self.all_fixes - self.safe_fixes


def torchopt(args: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run the installed torchopt with this interpreter, so the measured version is the one importable here."""
    return subprocess.run(
        [sys.executable, "-m", "torchopt", *args],
        check=False,  # exit 1 (findings, pending changes) is an answer, not a failure
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=TIMEOUT_S,
    )


def fixes_from_summary(stderr: str) -> Counter:
    """Fix counts per code from the one-line summary that `rewrite` prints (`Would fix 3 issues ... (TOP101 ×2, ...)`)."""
    match = SUMMARY.search(stderr)
    if match is None:
        return Counter()
    return Counter({code: int(count) for code, count in CODE_COUNT.findall(match.group(2))})


def first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def rewrite_through_stdin(relpath: str, source: str, checkouts: Path, unsafe: bool, m: Measurement) -> None:
    """Rewrite the source twice through stdin; the first output must compile and the second pass must keep it."""
    flags = ["rewrite", "--no-cache", "--stdin-filename", relpath, "-"] + (["--unsafe-fixes"] if unsafe else [])
    label = "with --unsafe-fixes" if unsafe else "safe fixes"
    first = torchopt(flags, checkouts, stdin=source)
    if first.returncode == 2:
        m.tool_errors.append(f"rewrite ({label}) exited 2: {first_line(first.stderr)}")
        return
    try:
        compile(first.stdout, relpath, "exec")
    except SyntaxError as err:
        m.problems.append(f"output ({label}) does not compile: line {err.lineno}: {err.msg}")
        return
    second = torchopt(flags, checkouts, stdin=first.stdout)
    if second.returncode == 2:
        m.tool_errors.append(f"second rewrite ({label}) exited 2: {first_line(second.stderr)}")
    elif second.stdout != first.stdout:
        m.problems.append(f"output ({label}) is not idempotent: a second pass changes it again")


def measure(relpath: str, checkouts: Path) -> Measurement:
    m = Measurement()
    source = (checkouts / relpath).read_text(encoding="utf-8")

    check = torchopt(["check", "--output-format", "json", "--no-cache", relpath], checkouts)
    if check.returncode == 2:
        m.tool_errors.append(f"check exited 2: {first_line(check.stderr)}")
    else:
        m.findings = Counter(item["code"] for item in json.loads(check.stdout or "[]"))

    safe = torchopt(["rewrite", "--diff", "--no-cache", relpath], checkouts)
    unsafe = torchopt(["rewrite", "--diff", "--unsafe-fixes", "--no-cache", relpath], checkouts)
    for run, label in ((safe, "rewrite --diff"), (unsafe, "rewrite --diff --unsafe-fixes")):
        if run.returncode == 2:
            m.tool_errors.append(f"{label} exited 2: {first_line(run.stderr)}")
    m.safe_fixes = fixes_from_summary(safe.stderr)
    m.all_fixes = fixes_from_summary(unsafe.stderr)

    rewrite_through_stdin(relpath, source, checkouts, unsafe=False, m=m)
    rewrite_through_stdin(relpath, source, checkouts, unsafe=True, m=m)
    return m


def counted(items: list[dict]) -> str:
    """`TOP202 ×1, TOP601 ×2` for a list of judgements, or 0."""
    codes = Counter(item["code"] for item in items)
    return ", ".join(f"{code} ×{n}" for code, n in sorted(codes.items())) or "0"


def codes_text(counts: Counter) -> str:
    return ", ".join(f"{code} ×{n}" for code, n in sorted(counts.items())) or "-"


def render(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows[1:]]
        return "\n".join(out)
    return "\n".join("  ".join(row) for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", type=Path, help="folder with one owner+name sub-folder per repository")
    parser.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="measure only the scripts whose `repository:path` contains TEXT (repeatable)",
    )
    args = parser.parse_args(argv)

    manifest = json.loads(args.manifest.read_text(encoding="utf-8"))
    checkouts = args.checkouts.resolve()
    header = [
        "script",
        "kind",
        "layout",
        "findings",
        "safe fixes",
        "unsafe fixes",
        "wrong fixes",
        "false findings",
        "misses",
        "output",
        "validate",
    ]
    rows = [header]
    totals = Counter()
    amp_targets: list[str] = []
    amp_inserted: list[str] = []
    missing = failed = broken = False
    for entry in manifest["scripts"]:
        relpath = f"{entry['repository'].replace('/', '+')}/{entry['path']}"
        name = f"{entry['repository']}:{entry['path']}"
        if args.only and not any(text in name for text in args.only):
            continue
        if not (checkouts / relpath).is_file():
            print(
                f"error: {checkouts / relpath}: not found (check out {entry['repository']} at {entry['commit']})",
                file=sys.stderr,
            )
            missing = True
            continue
        print(f"measuring {name}", file=sys.stderr)
        m = measure(relpath, checkouts)
        for message in m.tool_errors:
            print(f"error: {relpath}: {message}", file=sys.stderr)
        for message in m.problems:
            print(f"error: {relpath}: {message}", file=sys.stderr)
        failed |= bool(m.tool_errors)
        broken |= bool(m.problems)
        status = "; ".join(m.problems + m.tool_errors) or "compiles, idempotent"
        if entry.get("amp_target"):
            amp_targets.append(name)
            if m.all_fixes["TOP202"]:
                amp_inserted.append(name)
        totals.update(
            findings=sum(m.findings.values()),
            safe=sum(m.safe_fixes.values()),
            unsafe=sum(m.unsafe_fixes.values()),
            wrong=len(entry["wrong_fixes"]),
            false=len(entry["false_findings"]),
            misses=len(entry["misses"]),
        )
        rows.append(
            [
                f"{name} @{entry['commit'][:7]}",
                entry["kind"],
                ",".join(entry["layout"]),
                f"{sum(m.findings.values())} ({codes_text(m.findings)})",
                f"{sum(m.safe_fixes.values())} ({codes_text(m.safe_fixes)})",
                f"{sum(m.unsafe_fixes.values())} ({codes_text(m.unsafe_fixes)})",
                counted(entry["wrong_fixes"]),
                counted(entry["false_findings"]),
                counted(entry["misses"]),
                status,
                entry.get("validate", "not run"),
            ]
        )
    rows.append(
        [
            f"total ({len(rows) - 1} scripts)",
            "",
            "",
            str(totals["findings"]),
            str(totals["safe"]),
            str(totals["unsafe"]),
            str(totals["wrong"]),
            str(totals["false"]),
            str(totals["misses"]),
            "",
            "",
        ]
    )
    print(render(rows, args.markdown))
    if amp_targets:
        share = 100 * len(amp_inserted) // len(amp_targets)
        left = sorted(set(amp_targets) - set(amp_inserted))
        print(
            f"\nAMP (TOP202) inserted on {len(amp_inserted)} of {len(amp_targets)} single-GPU float32 training "
            f"scripts ({share} %)" + (f"; not on: {', '.join(left)}" if left else "")
        )
    if missing or failed:
        return 2
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
