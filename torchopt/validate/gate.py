"""`torchopt rewrite --validate ENTRY` (and `migrate --validate`): run ENTRY with every rewritten
file served from memory, and write only what validates (docs/validation.md).
"""

from __future__ import annotations

import os
from typing import Sequence, cast

from torchopt.rewrite.engine import Diagnostic, fix_source
from torchopt.validate.command import (
    EXIT_INCONCLUSIVE,
    Outcome,
    _first_row,
    _fix_rows,
    _probe_text,
    autocast_dtype,
    instrumented,
    resolve_device,
    run_and_compare,
)
from torchopt.rewrite.config import Settings


def _rewrites(files: Sequence[str], settings_for, units: "set[tuple[str, str]] | None", unsafe: bool):
    """In-memory rewrites of ``files``, instrumented for record/replay: path -> (old, new, plan).
    With ``units`` ((real path, rule code) pairs; the path "*" stands for every file), each file
    gets only the fixes of its selected codes."""
    from torchopt.rewrite import source
    from torchopt.rewrite.engine import FixError, ParseError

    out = {}
    for i, f in enumerate(files):
        s = settings_for(f)
        real = os.path.realpath(f)
        codes = None if units is None else s.enabled_codes(f) & {c for p, c in units if p in (real, "*")}
        if codes is not None and not codes:
            continue
        try:
            text = source.read(f, s.max_file_size).text
            res = fix_source(text, s, f, unsafe=unsafe, codes=codes)
        except (source.SourceError, ParseError, FixError):
            continue
        if res.text != text:
            out[real] = (text, res.text, instrumented(text, res.text, res.applied, prefix=f"f{i}s"))
    return out


def check_rewrite(
    files: Sequence[str],
    settings_for,
    entry_script: str,
    *,
    unsafe: bool,
    steps: int,
    device: str,
    timeout: float,
    argv: Sequence[str] = (),
    entry: str | None = None,
    nproc: int = 1,
    jobs: int = 1,
    per_file: bool = False,
) -> tuple[set | None, list[str]]:
    """`rewrite --validate ENTRY`: run ENTRY with every rewritten file served from memory. Returns
    what may be written (None: all of it) and report lines. A unit with a fix the run cannot check
    is never written. When the rest diverges, `validate`'s delta debugging leaves units out until
    what is left validates as a whole. The unit is a rule in one file with ``per_file`` (returns
    (real path, code) pairs), else a rule in every file (returns codes)."""
    from torchopt.validate.bisect import Search, largest_passing
    from torchopt.validate.report import fix_line
    from torchopt.validate.runner import RunOptions, Version

    real_entry = os.path.realpath(entry_script)
    opts = RunOptions(
        steps=steps, device=resolve_device(device), timeout=timeout, argv=tuple(argv), entry=entry, nproc=nproc
    )
    before_runs: list[dict] | None = None
    applied_by_unit: dict[tuple[str, str], list[Diagnostic]] = {}

    def unit_of(p: str, d: Diagnostic) -> tuple[str, str]:
        return (p if per_file else "*", d.code)

    def attempt(units: "tuple[tuple[str, str], ...] | None") -> Outcome | None:
        nonlocal before_runs
        rw = _rewrites(files, settings_for, None if units is None else set(units), unsafe)
        if not rw:
            return None
        applied = [d for _, _, plan in rw.values() for d in plan.applied]
        entry_new = rw[real_entry][2].after if real_entry in rw else None
        after = Version(
            "after",
            entry_script,
            source=entry_new,
            sources={p: plan.after for p, (_, _, plan) in rw.items() if p != real_entry},
        )
        out = run_and_compare(
            Version("before", entry_script),
            after,
            applied,
            [n for _, _, plan in rw.values() for n in plan.notes],
            opts,
            labels=(entry_script, f"{entry_script} (with rewritten files)"),
            before_runs=before_runs,
            replayed=all(plan.replayed for _, _, plan in rw.values()),
            amp_dtype=autocast_dtype(opts.device, applied, settings_for),
            sites=[site for _, _, plan in rw.values() for site in plan.sites],
        )
        before_runs = before_runs or out.before_runs
        return out

    everything = _rewrites(files, settings_for, None, unsafe)
    if not everything:
        return None, ["validation: nothing would change"]
    refused, lines = _static_units(everything, unit_of, applied_by_unit)
    units = tuple(sorted(u for u in applied_by_unit if u not in refused))
    whole = attempt(None if not refused else units) if units else None
    while whole is not None and whole.json.get("unvalidated"):  # sites the run found it could not check
        late = {unit_of(os.path.realpath(f["path"]), f["code"]) for f in whole.json["unvalidated"]} - refused
        if not late:
            break
        refused |= late
        lines += [
            f"  not validated, so not written: {fix_line(f)}, because {f['why']}"
            for f in whole.json["unvalidated"]
            if unit_of(os.path.realpath(f["path"]), f["code"]) in late
        ]
        units = tuple(u for u in units if u not in refused)
        whole = attempt(units) if units else None
    codes = sorted({c for _, c in units})
    if whole is None:
        return set(), [*lines, "validation: no fix can be validated; nothing written"]
    if whole.exit_code == 0:
        which = "the other fixes" if refused else "every fix"
        lines.append(f"validation: {entry_script} computes the same thing with {which} ({', '.join(codes)})")
        return (None if not refused else set(units) if per_file else {c for _, c in units}), lines
    if whole.exit_code == 2:  # ENTRY fails in both versions: nothing can be validated
        return set(), [whole.text, *lines, f"validation: {entry_script} could not run; fix it first"]
    if whole.exit_code == EXIT_INCONCLUSIVE:  # no value compared: nothing is validated
        return set(), [whole.text, *lines, "validation: inconclusive (no computed value compared); nothing written"]
    search = Search(probe=attempt, diverges=lambda o: o is None or cast(Outcome, o).exit_code != 0, jobs=jobs)
    search.known(units, whole)
    kept, left, _ = largest_passing(units, search)
    lines = [whole.text, *lines, "validation failed for the whole rewrite; searching for the fixes that break it"]
    lines += _search_lines(kept, left, applied_by_unit)
    lines.append(
        f"validation: {len(kept)} of {len(units)} selection(s) kept, validated as a whole ({len(search.trials)} run(s))"
    )
    return (set(kept) if per_file else {c for _, c in kept}), lines


def _static_units(everything: dict, unit_of, applied_by_unit: dict) -> tuple[set[tuple[str, str]], list[str]]:
    """Learn the units of the whole rewrite (into ``applied_by_unit``); returns the units holding a
    fix that cannot be validated, with a line for each such fix."""
    from torchopt.validate.report import fix_line

    refused: set[tuple[str, str]] = set()
    lines: list[str] = []
    for p, (_, _, plan) in everything.items():
        for d in plan.applied:
            applied_by_unit.setdefault(unit_of(p, d), []).append(d)
        for d, why in plan.unvalidated:
            refused.add(unit_of(p, d))
            lines.append(f"  not validated, so not written: {fix_line(_fix_rows([d])[0])}, because {why}")
    return refused, lines


def _search_lines(
    kept: Sequence, left: Sequence, applied_by_unit: dict[tuple[str, str], list[Diagnostic]]
) -> list[str]:
    """One line per unit the search settled: why a left-out one diverges (and with which others),
    or that a kept one passes, each with an example of its fixes."""
    from torchopt.validate.report import fix_line

    def name(u: tuple[str, str]) -> str:
        return u[1] if u[0] == "*" else f"{u[1]} in {os.path.relpath(u[0])}"

    def fixes(u: tuple[str, str]) -> str:
        ds = applied_by_unit[u]
        return f"{len(ds)} fix(es), e.g. {fix_line(_fix_rows(ds)[0])}"

    lines = []
    for lo in left:
        why = (
            _probe_text(_first_row(cast(Outcome, lo.trial.outcome)))
            if lo.trial.outcome is not None
            else "could not run"
        )
        with_ = f" together with {', '.join(name(p) for p in lo.partners)}" if lo.partners else ""
        lines.append(f"  {name(lo.unit)}: diverges{with_}: not written: {why}; {fixes(lo.unit)}")
    for u in kept:
        lines.append(f"  {name(u)}: passes ({fixes(u)})")
    return lines


class KeptResolver:
    """A settings resolver that leaves out, per file, the rule codes `rewrite --validate` dropped."""

    def __init__(self, base, dropped: dict[str, set[str]]) -> None:
        self.base = base
        self.dropped = dropped  # real path -> codes not to apply there

    def for_path(self, path: str) -> Settings:
        from dataclasses import replace

        s = self.base.for_path(path)
        codes = self.dropped.get(os.path.realpath(path))
        return replace(s, ignore=s.ignore + tuple(sorted(codes))) if codes else s

    def __getattr__(self, name: str):
        return getattr(self.base, name)
