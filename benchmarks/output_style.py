"""Measure whether rewritten real scripts still pass ruff's formatter and import/line-length checks.

Usage:
    python benchmarks/output_style.py CHECKOUTS [--manifest benchmarks/real_world.json] [--only TEXT]
        [--torchopt-path DIR] [--details]

CHECKOUTS is laid out as for ``benchmarks/real_world.py`` (one ``owner+name`` folder per repository, each
script of the manifest at its path inside it). For every script, on copies in a fresh temporary folder
where no project configuration applies (so torchopt and ruff both use ruff's defaults: 88 columns, double
quotes), this measures two starting points:

- as written: the script itself;
- in ruff's style: the script after ``ruff format --isolated`` and ``ruff check --isolated --select I --fix``.

A starting point is *accepted* when ``ruff format --isolated --check`` and
``ruff check --isolated --select I,E501`` both pass on it. Each starting point is rewritten by
``torchopt rewrite --no-cache`` (safe fixes, then on a fresh copy with ``--unsafe-fixes``) and checked
again. The table gives, per starting point and fix mode, how many accepted files are still accepted
(the strict measure), and over all files how many rewrites add no violation: the formatter still accepts
the file if it did, the imports are still sorted if they were, and no more lines exceed 88 columns (a
script in ruff's style often keeps long strings and comments that ruff format does not split).
``--torchopt-path DIR`` puts DIR first on ``PYTHONPATH`` so another checkout of torchopt is measured
(e.g. an older commit added with ``git worktree add``). ``--details`` prints, for every rewrite that adds
a violation, ruff's diff and messages.

Exit status: 0 when no rewrite adds a violation, 1 when one does, 2 when a script is missing or torchopt
failed. Third-party code is read from CHECKOUTS only; none of it is stored here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MANIFEST = Path(__file__).with_name("real_world.json")
TIMEOUT_S = 120
STARTS = ("as written", "in ruff's style")
MODES = ("safe", "unsafe")


@dataclass
class Verdict:
    """Whether ruff accepts one file, and what it said when it does not."""

    formatted: bool
    imports_sorted: bool
    long_lines: int
    messages: str = ""

    @property
    def accepted(self) -> bool:
        return self.formatted and self.imports_sorted and not self.long_lines

    def no_new_violation(self, before: Verdict) -> bool:
        """Formatted and imports sorted where ``before`` was, and no more lines over 88 columns."""
        return (
            (self.formatted or not before.formatted)
            and (self.imports_sorted or not before.imports_sorted)
            and self.long_lines <= before.long_lines
        )


@dataclass
class ScriptResult:
    """Per starting point: accepted before, and per fix mode: (changed by torchopt, verdict after)."""

    name: str
    before: dict[str, Verdict] = field(default_factory=dict)
    after: dict[tuple[str, str], tuple[bool, Verdict]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def ruff(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args],
        check=False,  # a non-zero exit is the verdict being measured
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def ruff_verdict(path: Path) -> Verdict:
    """Run both checks of the measurement on one file."""
    formatted = ruff(["format", "--isolated", "--diff", path.name], path.parent)
    linted = ruff(["check", "--isolated", "--select", "I,E501", "--output-format", "concise", path.name], path.parent)
    messages = ""
    if formatted.returncode:
        messages += formatted.stdout + formatted.stderr
    if linted.returncode:
        messages += linted.stdout
    found = linted.stdout.splitlines()
    return Verdict(
        formatted=not formatted.returncode,
        imports_sorted=not any(" I001 " in line or " I002 " in line for line in found),
        long_lines=sum(" E501 " in line for line in found),
        messages=messages,
    )


def rewrite(path: Path, unsafe: bool, torchopt_path: str | None) -> str | None:
    """Rewrite ``path`` in place; return an error text, or None when torchopt ran."""
    env = dict(os.environ)
    if torchopt_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (torchopt_path, env.get("PYTHONPATH")) if p)
    args = [sys.executable, "-m", "torchopt", "rewrite", "--no-cache", path.name]
    if unsafe:
        args.append("--unsafe-fixes")
    done = subprocess.run(
        args,
        check=False,  # exit 1 only reports remaining findings
        cwd=path.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if done.returncode not in (0, 1):
        return f"torchopt exit {done.returncode}: {done.stderr.strip()[-400:]}"
    return None


def into_ruff_style(path: Path) -> None:
    ruff(["format", "--isolated", path.name], path.parent)
    ruff(["check", "--isolated", "--select", "I", "--fix", path.name], path.parent)


def measure(source: Path, name: str, torchopt_path: str | None, work: Path) -> ScriptResult:
    result = ScriptResult(name)
    text = source.read_bytes()
    for start in STARTS:
        base = work / f"{start.replace(' ', '_').replace(chr(39), '')}" / source.name
        base.parent.mkdir(parents=True)
        base.write_bytes(text)
        if start == "in ruff's style":
            into_ruff_style(base)
        result.before[start] = ruff_verdict(base)
        for mode in MODES:
            copy = work / f"{base.parent.name}_{mode}" / source.name
            copy.parent.mkdir(parents=True)
            shutil.copyfile(base, copy)
            error = rewrite(copy, mode == "unsafe", torchopt_path)
            if error:
                result.errors.append(f"{start}, {mode}: {error}")
                continue
            changed = copy.read_bytes() != base.read_bytes()
            result.after[(start, mode)] = (changed, ruff_verdict(copy))
    return result


def table(results: list[ScriptResult]) -> str:
    lines = [
        "| Starting point | Fixes | Accepted before | changed by torchopt | still accepted after "
        "| Changed by torchopt (all files) | no new violation after |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for start in STARTS:
        for mode in MODES:
            strict = [r for r in results if r.before[start].accepted and (start, mode) in r.after]
            loose = [r for r in results if (start, mode) in r.after]
            accepted = sum(r.before[start].accepted for r in results)
            lines.append(
                f"| {start} | {mode} | {accepted} / {len(results)} "
                f"| {sum(r.after[(start, mode)][0] for r in strict)} "
                f"| {sum(r.after[(start, mode)][1].accepted for r in strict)} / {accepted} "
                f"| {sum(r.after[(start, mode)][0] for r in loose)} "
                f"| {sum(r.after[(start, mode)][1].no_new_violation(r.before[start]) for r in loose)} / {len(loose)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", type=Path)
    parser.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    parser.add_argument("--only", default="")
    parser.add_argument("--torchopt-path", default=None)
    parser.add_argument("--details", action="store_true")
    args = parser.parse_args(argv)
    scripts = json.loads(args.manifest.read_text(encoding="utf-8"))["scripts"]
    results: list[ScriptResult] = []
    status = 0
    for script in scripts:
        name = f"{script['repository']}:{script['path']}"
        if args.only not in name:
            continue
        source = args.checkouts / script["repository"].replace("/", "+") / script["path"]
        if not source.is_file():
            print(f"missing: {source}", file=sys.stderr)
            status = 2
            continue
        with tempfile.TemporaryDirectory() as work:
            result = measure(source, name, args.torchopt_path, Path(work))
        results.append(result)
        for error in result.errors:
            print(f"{name}: {error}", file=sys.stderr)
            status = 2
        for (start, mode), (_, verdict) in result.after.items():
            if verdict.no_new_violation(result.before[start]):
                continue
            status = max(status, 1)
            print(f"NEW VIOLATION after rewrite: {name} ({start}, {mode} fixes)")
            if args.details:
                print(verdict.messages)
    print(table(results))
    return status


if __name__ == "__main__":
    sys.exit(main())
