"""Measure torchopt on the second real-world sample: whole projects, notebooks and scripts, judged per finding.

Usage:
    python benchmarks/real_world_sample.py ROOT [--half dev|held-back] [--markdown] [--details] [--stubs]
        [--only TEXT] [--manifest benchmarks/real_world_sample2.toml]

A manifest split into halves by the rule (the second sample) measures the dev half unless told; a manifest
with a manifest-level ``split = "held-back"`` (the third sample) is held back whole: every entry must say
so, and that half is measured unless told.

ROOT holds one folder per repository, named ``owner+name`` (or ``owner__name``), with the repository's files
at their paths inside it (extracted at the commit of the manifest; this script fetches nothing). An entry of
the manifest is a single script or notebook, or a project: a folder run as one unit (``torchopt check
folder/``). For each entry of the chosen half this runs ``torchopt check --output-format json``,
``torchopt rewrite --diff`` and ``torchopt rewrite --diff --unsafe-fixes``, checks that the rewritten output
compiles and that a second pass changes nothing, and joins every finding and fix with the judgements kept in
the manifest. A judgement is keyed by code, file and a snippet of the reported line (or of the message), not
by line number, so it survives line shifts (an optional ``line`` tells apart findings on identical lines of one
file); a finding that no judgement matches is listed as *unjudged* and
counted apart, never as true or false.

Rates (over the judged findings of the half): wrong fixes, precision (findings judged true / judged
findings), mixed precision inserted and judged right on the single-GPU float32 training steps the manifest
names (``amp_targets``), and misses per entry.

Exit status: 0 when every output compiles and is idempotent, 1 when one does not, 2 when an entry is
missing or torchopt failed on it. Third-party code is read from ROOT only; none of it is stored here.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import re
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from real_world import codes_text, first_line, fixes_from_summary, render, torchopt  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DEFAULT_MANIFEST = Path(__file__).with_name("real_world_sample2.toml")
HALVES = ("dev", "held-back")
UNSAFE_LINE = re.compile(
    r"^(?P<path>.+?):(?:cell (?P<cell>\d+):)?(?P<line>\d+):\d+: (?P<code>TOP\d+) unsafe fix:", re.M
)


def split_key(entry: dict) -> str:
    return hashlib.sha256(f"{entry['repository']}:{entry['path']}".encode()).hexdigest()


def assign_halves(entries: list[dict]) -> dict[tuple[str, str], str]:
    """The fixed split rule: within each group, entries sorted by sha256 of `repository:path` alternate dev, held-back.

    A project is one entry, so its files stay in one half; the groups (project, notebook, negative,
    inference, training) keep the kinds balanced between the halves.
    """
    halves: dict[tuple[str, str], str] = {}
    for group in sorted({e["group"] for e in entries}):
        members = sorted((e for e in entries if e["group"] == group), key=split_key)
        for i, e in enumerate(members):
            halves[(e["repository"], e["path"])] = HALVES[i % 2]
    return halves


def expected_halves(manifest: dict) -> dict[tuple[str, str], str]:
    """The half of each entry: the manifest-level `split` for all of them where it names one, else the split rule."""
    entries = manifest["entry"]
    split = manifest.get("split")
    if split is None:
        return assign_halves(entries)
    if split not in HALVES:
        raise ValueError(f"split {split!r} is none of {', '.join(HALVES)}")
    return {(e["repository"], e["path"]): split for e in entries}


@dataclass
class Finding:
    code: str
    file: str
    line: int
    cell: int | None
    text: str  # the reported source line, stripped
    message: str
    fix: str | None  # "safe", "unsafe" or None
    judgement: dict | None = None


@dataclass
class Result:
    findings: list[Finding] = field(default_factory=list)
    safe_fixes: Counter = field(default_factory=Counter)
    all_fixes: Counter = field(default_factory=Counter)
    unsafe_diff: str = ""
    problems: list[str] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)


def repo_folder(root: Path, repository: str) -> Path:
    for name in (repository.replace("/", "+"), repository.replace("/", "__")):
        if (root / name).is_dir():
            return root / name
    return root / repository.replace("/", "+")


def source_line(repo: Path, file: str, line: int, cell: int | None) -> str:
    """The text of the reported line (in a notebook, `cell` counts from 1), stripped; empty when unreadable."""
    try:
        text = (repo / file).read_text(encoding="utf-8")
        if cell is not None:
            source = json.loads(text)["cells"][cell - 1]["source"]
            text = "".join(source) if isinstance(source, list) else source
        return text.splitlines()[line - 1].strip()
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return ""


def matches(judgement: dict, finding: Finding) -> bool:
    file = judgement["file"]  # a path, or a folder ending in "/" for every file under it
    if judgement["code"] != finding.code or not (
        file == finding.file or (file.endswith("/") and finding.file.startswith(file))
    ):
        return False
    if "line" in judgement and judgement["line"] != finding.line:
        return False  # (two findings on identical lines of one file: the line tells them apart)
    snippet = judgement["snippet"]
    return snippet in finding.text or snippet in finding.message


def judge(findings: list[Finding], judgements: list[dict]) -> list[dict]:
    """Attach to each finding the first judgement that matches it and no earlier finding took (two
    findings on one line, `Linear(75, 50)` and `Linear(50, 25)`, match each other's snippet), else the
    first that matches; return the judgements that matched none."""
    used: set[int] = set()
    for finding in findings:
        matching = [i for i, judgement in enumerate(judgements) if matches(judgement, finding)]
        if matching:
            i = next((i for i in matching if i not in used), matching[0])
            finding.judgement = judgements[i]
            used.add(i)
    return [j for i, j in enumerate(judgements) if i not in used]


def rewrite_project(target: str, repo: Path, r: Result) -> None:
    """Rewrite a copy of the project with unsafe fixes: every changed file compiles, a second pass changes nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / target
        # links stay links: a repository may hold links to folders it does not ship (dangling here)
        shutil.copytree(repo / target, copy, symlinks=True, dirs_exist_ok=True)
        before = {p: p.read_text(encoding="utf-8", errors="replace") for p in copy.rglob("*.py")}
        first = torchopt(["rewrite", "--unsafe-fixes", "--no-cache", target], Path(tmp))
        if first.returncode == 2:
            r.tool_errors.append(f"rewrite --unsafe-fixes exited 2: {first_line(first.stderr)}")
        r.all_fixes = fixes_from_summary(first.stderr)
        r.unsafe_diff = first.stderr
        for path, old in before.items():
            new = path.read_text(encoding="utf-8", errors="replace")
            if new == old:
                continue
            name = str(path.relative_to(tmp))
            r.unsafe_diff += "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), name, name))
            try:
                compile(new, name, "exec")
            except SyntaxError as err:
                r.problems.append(f"{name} does not compile: line {err.lineno}: {err.msg}")
        second = torchopt(["rewrite", "--unsafe-fixes", "--diff", "--no-cache", target], Path(tmp))
        if second.stdout.strip():
            r.problems.append("output (with --unsafe-fixes) is not idempotent: a second pass changes it again")


def rewrite_script(target: str, repo: Path, r: Result) -> None:
    """Rewrite the script through stdin with unsafe fixes: the output parses, a second pass changes nothing."""
    source = (repo / target).read_text(encoding="utf-8")
    flags = ["rewrite", "--unsafe-fixes", "--no-cache", "--stdin-filename", target, "-"]
    first = torchopt(flags, repo, stdin=source)
    if first.returncode == 2:
        r.tool_errors.append(f"rewrite --unsafe-fixes exited 2: {first_line(first.stderr)}")
        return
    r.all_fixes = fixes_from_summary(first.stderr)
    diff = difflib.unified_diff(source.splitlines(True), first.stdout.splitlines(True), target, target)
    r.unsafe_diff = first.stderr + "".join(diff)
    try:
        if target.endswith(".ipynb"):
            json.loads(first.stdout)
        else:
            compile(first.stdout, target, "exec")
    except (SyntaxError, ValueError) as err:
        r.problems.append(f"output (with --unsafe-fixes) does not parse: {err}")
        return
    second = torchopt(flags, repo, stdin=first.stdout)
    if second.stdout != first.stdout:
        r.problems.append("output (with --unsafe-fixes) is not idempotent: a second pass changes it again")


def measure(entry: dict, repo: Path) -> Result:
    """Three runs: `check` (every finding, and which fixes are safe), a rewrite with unsafe fixes, a second pass."""
    r = Result()
    target = entry["path"]
    check = torchopt(["check", "--output-format", "json", "--no-cache", target], repo)
    if check.returncode == 2:
        r.tool_errors.append(f"check exited 2: {first_line(check.stderr)}")
    try:
        items = json.loads(check.stdout or "[]")
    except ValueError:
        items = []
    for item in items:
        file = item["path"]
        r.findings.append(
            Finding(
                code=item["code"],
                file=file,
                line=item["line"],
                cell=item.get("cell"),
                text=source_line(repo, file, item["line"], item.get("cell")),
                message=item["message"],
                fix=(item["fix"] or {}).get("safety"),
            )
        )
    r.safe_fixes = Counter(f.code for f in r.findings if f.fix == "safe")
    if entry["unit"] == "project":
        rewrite_project(target, repo, r)
    else:
        rewrite_script(target, repo, r)
    return r


def save(result: Result, path: Path) -> None:
    data = {
        "findings": [{k: v for k, v in vars(f).items() if k != "judgement"} for f in result.findings],
        "safe_fixes": dict(result.safe_fixes),
        "all_fixes": dict(result.all_fixes),
        "unsafe_diff": result.unsafe_diff,
        "problems": result.problems,
        "tool_errors": result.tool_errors,
    }
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def load(path: Path) -> Result:
    data = json.loads(path.read_text(encoding="utf-8"))
    return Result(
        findings=[Finding(**f) for f in data["findings"]],
        safe_fixes=Counter(data["safe_fixes"]),
        all_fixes=Counter(data["all_fixes"]),
        unsafe_diff=data["unsafe_diff"],
        problems=data["problems"],
        tool_errors=data["tool_errors"],
    )


@dataclass
class Tally:
    """Counts over the judged findings of one entry or of the whole half."""

    findings: int = 0
    true: int = 0
    false: int = 0
    unjudged: int = 0
    fixes: int = 0
    wrong_fixes: int = 0
    unjudged_fixes: int = 0
    misses: int = 0
    amp_targets: int = 0
    amp_inserted: int = 0
    amp_right: int = 0

    def add(self, other: Tally) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def amp_status(target: dict, findings: list[Finding], applied: Counter) -> tuple[bool, bool]:
    """(inserted, right) for one AMP target: a TOP202 fix at the target's line, applied with --unsafe-fixes."""
    hits = [
        f
        for f in findings
        if f.code == "TOP202" and f.fix and f.file == target["file"] and target.get("snippet", "") in f.text
    ]
    inserted = bool(hits) and applied["TOP202"] > 0
    right = inserted and all(f.judgement is not None and f.judgement.get("fix") == "right" for f in hits)
    return inserted, right


def tally(entry: dict, r: Result) -> Tally:
    # a miss a later commit finds (``found = "<commit>"``, judged by hand) no longer counts
    t = Tally(findings=len(r.findings), misses=sum(not m.get("found") for m in entry.get("misses", [])))
    for f in r.findings:
        verdict = f.judgement["verdict"] if f.judgement else None
        t.true += verdict == "true"
        t.false += verdict == "false"
        t.unjudged += verdict is None
        if f.fix:
            t.fixes += 1
            fix_verdict = f.judgement.get("fix") if f.judgement else None
            t.wrong_fixes += fix_verdict == "wrong"
            t.unjudged_fixes += fix_verdict not in ("right", "wrong")
    for target in entry.get("amp_targets", []):
        inserted, right = amp_status(target, r.findings, r.all_fixes)
        t.amp_targets += 1
        t.amp_inserted += inserted
        t.amp_right += right
    return t


def finding_lines(entry: dict, r: Result, stale: list[dict]) -> list[str]:
    out = [f"### {entry['repository']}:{entry['path']}"]
    for f in r.findings:
        where = f"{f.file}:{'cell ' + str(f.cell) + ':' if f.cell is not None else ''}{f.line}"
        fix = (
            f" [{f.fix} fix{': ' + f.judgement['fix'] if f.judgement and 'fix' in f.judgement else ''}]"
            if f.fix
            else ""
        )
        if f.judgement:
            out.append(f"- {where} {f.code}{fix}: {f.judgement['verdict']}: {f.judgement['why']}")
        else:
            out.append(f"- {where} {f.code}{fix}: UNJUDGED: `{f.text}` {f.message}")
    for j in stale:
        out.append(f"- (judged, no longer reported) {j['code']} {j['file']} `{j['snippet']}`: {j['verdict']}")
    for miss in entry.get("misses", []):
        state = f"FOUND at {miss['found']}" if miss.get("found") else "MISS"
        out.append(f"- {state} {miss['code']} {miss['file']}: {miss['what']}")
    for target in entry.get("amp_targets", []):
        inserted, right = amp_status(target, r.findings, r.all_fixes)
        state = "inserted, right" if right else "inserted, not right" if inserted else "not inserted"
        out.append(f"- AMP target {target['file']} `{target.get('snippet', '')}`: {state}: {target.get('why', '')}")
    for line in r.problems + r.tool_errors:
        out.append(f"- OUTPUT: {line}")
    return out


def stub_lines(r: Result) -> list[str]:
    """TOML stubs for the findings no judgement matches, to be filled in by the reviewer."""
    out = []
    for f in r.findings:
        if f.judgement is None:
            out += [
                "[[entry.judgements]]",
                f"code = {json.dumps(f.code)}",
                f"file = {json.dumps(f.file)}",
                f"snippet = {json.dumps(f.text[:60])}",
                'verdict = ""',
            ]
            if f.fix:
                out.append('fix = ""')
            out += ['why = ""', ""]
    return out


def pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f} %" if whole else "-"


def rates_text(t: Tally, entries: int) -> str:
    judged = t.true + t.false
    return "\n".join(
        [
            f"entries: {entries}; findings: {t.findings} ({t.true} true, {t.false} false, {t.unjudged} unjudged)",
            f"precision: {t.true} / {judged} judged findings = {pct(t.true, judged)}",
            f"fixes: {t.fixes} ({t.wrong_fixes} wrong, {t.unjudged_fixes} unjudged)",
            f"AMP: inserted on {t.amp_inserted} of {t.amp_targets} single-GPU float32 training steps, "
            f"right on {t.amp_right} ({pct(t.amp_right, t.amp_targets)})",
            f"misses: {t.misses} in {entries} entries ({t.misses / entries if entries else 0:.2f} per entry)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="folder with one owner+name (or owner__name) folder per repository")
    parser.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    parser.add_argument("--half", choices=HALVES, help="dev, or the manifest's `split` where it has one")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--details", action="store_true", help="list every finding, fix, miss and AMP target")
    parser.add_argument("--stubs", action="store_true", help="print TOML judgement stubs for unjudged findings")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT", help="entries whose name has TEXT")
    parser.add_argument(
        "--results",
        type=Path,
        metavar="DIR",
        help="keep each entry's raw result in DIR and reuse it on later runs (to re-judge without re-running)",
    )
    parser.add_argument("--no-run", action="store_true", help="with --results: show only entries already measured")
    args = parser.parse_args(argv)

    manifest = tomllib.loads(args.manifest.read_text(encoding="utf-8"))
    entries = manifest["entry"]
    try:
        halves = expected_halves(manifest)
    except ValueError as err:
        print(f"error: {args.manifest}: {err}", file=sys.stderr)
        return 2
    half = args.half or manifest.get("split", "dev")
    root = args.root.resolve()
    rows = [
        [
            "entry",
            "unit",
            "kind",
            "findings",
            "safe fixes",
            "unsafe fixes",
            "true / false / unjudged",
            "wrong fixes",
            "misses",
            "AMP",
            "output",
        ]
    ]
    total, details, stubs = Tally(), [], []
    missing = failed = broken = False
    measured = 0
    for entry in entries:
        name = f"{entry['repository']}:{entry['path']}"
        if entry["half"] != halves[(entry["repository"], entry["path"])]:
            print(f"error: {name}: half {entry['half']!r} is not the one the split gives", file=sys.stderr)
            return 2
        if entry["half"] != half or (args.only and not any(text in name for text in args.only)):
            continue
        saved = args.results / (re.sub(r"[^A-Za-z0-9.]+", "_", name) + ".json") if args.results else None
        if saved is not None and saved.is_file():
            r = load(saved)
            for f in r.findings:  # read again: the notebook cell numbering of older results
                f.text = source_line(repo_folder(root, entry["repository"]), f.file, f.line, f.cell)
        elif args.no_run:
            continue
        else:
            r = None
        repo = repo_folder(root, entry["repository"])
        if r is None and not (repo / entry["path"]).exists():
            print(
                f"error: {repo / entry['path']}: not found (extract {entry['repository']} at {entry['commit']})",
                file=sys.stderr,
            )
            missing = True
            continue
        if r is None:
            print(f"measuring {name}", file=sys.stderr)
            r = measure(entry, repo)
            if saved is not None:
                saved.parent.mkdir(parents=True, exist_ok=True)
                save(r, saved)
        stale = judge(r.findings, entry.get("judgements", []))
        t = tally(entry, r)
        total.add(t)
        measured += 1
        for message in r.tool_errors + r.problems:
            print(f"error: {name}: {message}", file=sys.stderr)
        failed |= bool(r.tool_errors)
        broken |= bool(r.problems)
        amp = f"{t.amp_right} / {t.amp_targets}" if t.amp_targets else "-"
        rows.append(
            [
                f"{name} @{entry['commit'][:7]}",
                entry["unit"],
                entry["kind"],
                f"{t.findings} ({codes_text(Counter(f.code for f in r.findings))})",
                f"{sum(r.safe_fixes.values())} ({codes_text(r.safe_fixes)})",
                f"{sum((r.all_fixes - r.safe_fixes).values())} ({codes_text(r.all_fixes - r.safe_fixes)})",
                f"{t.true} / {t.false} / {t.unjudged}",
                str(t.wrong_fixes),
                str(t.misses),
                amp,
                "; ".join(r.problems + r.tool_errors) or "compiles, idempotent",
            ]
        )
        details += finding_lines(entry, r, stale) + [""]
        if args.stubs and any(f.judgement is None for f in r.findings):
            stubs += [f"# {name}", *stub_lines(r)]
    print(render(rows, args.markdown))
    print()
    print(rates_text(total, measured))
    if args.details:
        print("\n" + "\n".join(details))
    if args.stubs:
        print("\n" + "\n".join(stubs))
    if missing or failed:
        return 2
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
