"""`torchopt validate`: build the two versions, run them side by side, compare, report.

One file: the program against the rewrite torchopt would make of it, in memory. Two files: as given.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import Diagnostic, fix_source
from torchopt.validate import exits
from torchopt.validate.declared import inferred

if TYPE_CHECKING:
    from torchopt.validate.bench import BenchOptions
    from torchopt.validate.compare import Comparison
    from torchopt.validate.runner import RunOptions, Version
    from torchopt.validate.tolerance import Tolerance


@dataclass
class Plan:
    """What will be compared: the two sources and the fixes that turned one into the other.
    ``after`` is the rewrite as `torchopt rewrite` writes it, with the random-stream sites wrapped
    for record/replay (``replay.strip(after)`` gives it back exactly)."""

    before: str
    after: str
    applied: list[Diagnostic] = field(default_factory=list)
    sites: list = field(default_factory=list)  # replay.Site
    notes: list[str] = field(default_factory=list)
    replayed: bool = False  # every random-stream fix is wrapped for record/replay
    unvalidated: list[tuple[Diagnostic, str]] = field(default_factory=list)  # fixes this run cannot check, and why

    @property
    def tags(self) -> set[str]:
        return {t for d in self.applied if d.fix for t in d.fix.tags}


def fix_key(d: Diagnostic) -> tuple[str, str, int, int]:
    """Names one applied fix across runs of the engine over the same text: file, rule, position
    (in the original text)."""
    return (d.path, d.code, d.line, d.column)


# Fixes whose random-stream change the harness itself undoes: compiling a model (TOP911, and
# TOP921's CUDA graphs of that compile) only changes the stream because inductor draws random
# numbers its own way, and the harness sets `torch._inductor.config.fallback_random`, so compiled
# dropout draws what eager dropout draws from the same generator. Their rng tag needs no replay;
# their rounding is held to their other tags (tolerance).
HARNESS_ALIGNED = frozenset({"TOP911", "TOP921"})


def replayable(d: Diagnostic) -> bool:
    """A fix whose random numbers the validator replays (the padding fixes' streams are aligned by
    the weight transplant instead, compiled random ops by the harness)."""
    from torchopt.validate.transplant import CODES as TRANSPLANTED

    return d.fix is not None and "rng" in d.fix.tags and d.code not in TRANSPLANTED | HARNESS_ALIGNED


def instrumented(text: str, rewritten: str, applied: Sequence[Diagnostic], prefix: str = "s") -> Plan:
    """The plan for ``rewritten`` (the engine's rewrite of ``text`` by ``applied``): the rewrite
    with its random-stream fixes wrapped for record/replay; those that cannot be wrapped are
    listed as not validated."""
    from torchopt.validate import replay

    rng = [d for d in applied if replayable(d)]
    after, sites, refused = replay.instrument(text, rewritten, rng, prefix)
    plan = Plan(before=text, after=after, applied=list(applied), sites=sites, replayed=not refused)
    plan.unvalidated = [(d, f"it changes the random stream and cannot be replayed: {why}") for d, why in refused]
    if sites:
        plan.notes.append(
            f"{len(sites)} fix(es) change the random stream; they are validated by record/replay: the rewritten "
            "run evaluates each new expression under a forked RNG state, checks its shape, dtype, device and "
            "moments, and continues with the original's numbers so the rest of the program is compared exactly."
        )
    return plan


def plan_rewrite(text: str, path: str, settings: Settings, unsafe: bool, keys: frozenset | None = None) -> Plan:
    """The rewrite of ``text``, exactly as `torchopt rewrite` makes it (with ``keys``, see
    ``fix_key``, only those fixes), instrumented for record/replay after the rewrite. The
    original runs as it is, so one run of it serves every selection."""
    only = None if keys is None else (lambda d: fix_key(d) in keys)
    res = fix_source(text, settings, path, unsafe=unsafe, only=only)
    if res.text == text:
        return Plan(before=text, after=text)
    return instrumented(text, res.text, res.applied)


def autocast_dtype(device: str, applied: Sequence[Diagnostic], settings_for: Callable[[str], Settings]) -> str:
    """The dtype the applied mixed-precision fixes compute in on ``device``, which picks the AMP
    tolerance row: the rewrite autocasts to float16 on CUDA unless a rule's ``dtype`` option asks
    for bfloat16, and to bfloat16 everywhere else. Holding a bfloat16 program to the float16 row
    would call a correct rewrite diverged; the reverse would let a float16 one drift 5x further."""
    if device != "cuda":
        return "bfloat16"
    for d in applied:
        if d.fix is None or "numerics" not in d.fix.tags:
            continue
        if settings_for(d.path).options_for(d.code).get("dtype") == "bfloat16":
            return "bfloat16"
    return "float16"


def _fix_rows(applied: Sequence[Diagnostic]) -> list[dict]:
    return [
        {
            "code": d.code,
            "path": d.path,
            "line": d.line,
            "column": d.column,
            "title": d.fix.title if d.fix else "",
            "message": d.message,
            "safety": d.fix.safety if d.fix else "display-only",
            "tags": list(d.fix.tags) if d.fix else [],
        }
        for d in applied
    ]


@dataclass
class Outcome:
    exit_code: int
    text: str
    json: dict
    before_runs: list[dict] | None = None  # the original's probes, reusable for another selection


def run_and_compare(
    before: "Version",
    after: "Version",
    applied: Sequence[Diagnostic],
    notes: list[str],
    opts: "RunOptions",
    *,
    labels: tuple[str, str],
    keep: bool = False,
    replayed: bool = False,
    transplant: bool | None = None,
    before_runs: list[dict] | None = None,
    amp_dtype: str | None = None,
    declared: Sequence[str] = (),
    unvalidated: Sequence[tuple[Diagnostic, str]] = (),
    sites: Sequence = (),
) -> Outcome:
    """Run both versions side by side (two processes at once, each in a scratch copy of its
    folder), compare and report. With
    ``transplant`` (default: when a padding fix was applied) the original runs first and the
    rewrite starts from its weights (torchopt.validate.transplant). ``before_runs``: the
    original's probes from an earlier call (same text, same options): only the rewrite runs.
    ``amp_dtype``: what the AMP fixes compute in (``autocast_dtype``); by default the device's.
    ``declared``: classes of change the user declared (``--expect``; torchopt.validate.declared).
    A numerics change also runs the original at reduced precision: the noise floor.
    ``unvalidated``: fixes left out of the run, with the reason (listed in the report). An
    equivalent verdict that compared no value the program computed is INCONCLUSIVE."""
    from dataclasses import replace

    from torchopt.validate import scratch
    from torchopt.validate import transplant as tp
    from torchopt.validate.compare import compare
    from torchopt.validate.report import render_text, to_json
    from torchopt.validate.runner import Version, protected_roots

    workdir = os.path.realpath(tempfile.mkdtemp(prefix="torchopt-validate-"))
    roots = sorted({*protected_roots(before), *protected_roots(after)})
    opts = replace(opts, protect=tuple(roots))
    user_files = scratch.fingerprint(roots, {workdir})
    if transplant is None:
        transplant = tp.wanted(applied)
    tol = _tolerance(applied, opts.device, transplant, replayed, amp_dtype, declared)
    reference = None
    if tol.reference is not None:
        reference = (
            Version("reference", before.path, source=before.source, sources=dict(before.sources)),
            replace(opts, precision=tol.reference.spec(opts.device), transplant=None),
        )
    try:
        results = _run_versions(before, after, opts, workdir, transplant, before_runs, reference)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    touched = scratch.changes(user_files, scratch.fingerprint(roots, {workdir}))

    fixes = _fix_rows(applied)
    b, a = results[before.label][0], results[after.label][0]
    ref = results.pop("reference", [None])[0]
    cmp = compare(b, a, tol, fixes, reference=ref)
    extra = list(notes) + _run_notes(cmp, results, a, transplant)
    warnings, wrote = _disk_notes(results, touched)
    cmp.notes = list(cmp.notes) + warnings + extra + wrote
    unvalidated = [*unvalidated, *_replayed_objects(a, sites, applied)]
    if cmp.verdict == "equivalent" and not _compared_values(cmp):
        cmp.verdict = "inconclusive"
    failed = [runs[0].get("status") for runs in results.values()]
    if cmp.verdict == "could-not-run" and failed == ["error", "error"] and not opts.entry and opts.nproc == 1:
        plain = _without_harness(before, opts)
        if "bug in torchopt" in plain:  # not the program's fault: do not ask the user to fix it
            cmp.notes = [n for n in cmp.notes if "fix the original first" not in n]
        cmp.notes.insert(0, plain)
    kw: dict[str, Any] = dict(before_label=labels[0], after_label=labels[1], device=opts.device, applied=fixes)
    kw["unvalidated"] = [
        dict(row, why=why) for row, (_, why) in zip(_fix_rows([d for d, _ in unvalidated]), unvalidated)
    ]
    code = exits.exit_code(cmp.verdict)
    return Outcome(code, render_text(cmp, **kw), to_json(cmp, **kw), before_runs=results[before.label])


# What the program computed: a verdict needs at least one of these compared value for value (the
# RNG state and the step count alone say nothing about the computation).
_COMPUTED = frozenset({"loss", "param", "optim", "output", "global", "return"})


def _compared_values(cmp: "Comparison") -> bool:
    tol = cmp.tolerance
    if tol is not None and not tol.compare_values:
        return False
    # an --entry function's return values are named "return[...]" (kind "other")
    return any(r.verdict == "ok" and (r.kind in _COMPUTED or r.name.startswith("return")) for r in cmp.rows)


def _run_versions(
    before: "Version",
    after: "Version",
    opts: "RunOptions",
    workdir: str,
    transplant: bool,
    before_runs: list[dict] | None,
    reference: "tuple[Version, RunOptions] | None" = None,
) -> dict[str, list[dict]]:
    """Each version's runs, by label. Both at once when neither needs the other: with a weight
    transplant the original's record must exist before the rewrite starts, and an original already
    run (``before_runs``) is not run again. ``reference``: the original at reduced precision
    (the noise floor), run beside them."""
    from dataclasses import replace

    from torchopt.validate.runner import run_version

    results: dict[str, list[dict]] = {}
    cancel = threading.Event()
    options = {} if reference is None else {reference[0].label: reference[1]}

    def go(v: "Version") -> None:
        results[v.label] = run_version(v, options.get(v.label, opts), workdir, cancel)

    extra = [] if reference is None else [reference[0]]
    if before_runs is not None and not transplant:
        results[before.label] = before_runs
        pending = [after, *extra]
    elif transplant:
        opts = replace(opts, transplant=os.path.join(workdir, "transplant.pt"))
        go(before)
        pending = [after, *extra]
    else:
        pending = [before, after, *extra]
    if pending:
        threads = [threading.Thread(target=go, args=(v,)) for v in pending]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:  # Ctrl-C: stop both runs (and all they started) before leaving
            cancel.set()
            for t in threads:
                t.join()
            raise
        # Two versions run at once can fight over a port, a lock or a fixed path (the one that comes
        # second fails): a version that failed while the other ran is run again alone, in a fresh
        # scratch copy, before its failure counts.
        failed = [v for v in (before, after) if results[v.label][0].get("status") == "error"]
        if len(failed) == 1:
            alone = os.path.join(workdir, "alone")
            os.makedirs(alone, exist_ok=True)
            results[failed[0].label] = run_version(failed[0], opts, alone, cancel)
            results[failed[0].label][0].setdefault("notes", []).append(
                "failed while both versions ran at once; run again alone afterwards"
            )
    return results


def _tolerance(
    applied: Sequence[Diagnostic],
    device: str,
    transplant: bool,
    replayed: bool,
    amp_dtype: str | None,
    declared: Sequence[str] = (),
) -> "Tolerance":
    """How far the two versions may differ, given what the fixes (or the user's declared classes)
    change and how the runs were aligned (random values replayed, or weights transplanted)."""
    from dataclasses import replace

    from torchopt.validate import transplant as tp
    from torchopt.validate.declared import split
    from torchopt.validate.tolerance import precision_for, tolerance_for

    classes, kinds = split(declared)
    tags = sorted({t for d in applied if d.fix for t in d.fix.tags} | classes)
    if transplant:
        tags = sorted({*tags, "tolerance"})  # padded matmuls sum extra zeros in other blocks: not bitwise
    amp_dtype = amp_dtype or ("float16" if device == "cuda" else "bfloat16")
    if transplant and all(d.code in tp.CODES for d in applied if d.fix and "rng" in d.fix.tags):
        replayed = True  # the transplant restores the original's RNG state after each construction
    numerics = [d.code for d in applied if d.fix and "numerics" in d.fix.tags]
    precision = precision_for(numerics, amp_dtype, kinds) if "numerics" in tags else None
    tol = tolerance_for(
        tags,
        dtype=precision.autocast if precision and precision.autocast else amp_dtype,
        replayed=replayed,
        reference=precision,
    )
    if transplant:
        tol = replace(
            tol,
            transplant=True,
            reason=tol.reason.replace(
                "rng (replayed): random values replayed", "rng (transplant): initial weights and RNG state copied"
            ),
        )
    return tol


def _replayed_objects(a: dict, sites: Sequence, applied: Sequence[Diagnostic]) -> list[tuple[Diagnostic, str]]:
    """Replay sites whose value was not a tensor (a module, a DataLoader): the run went on with the
    original's object, so the fix there was not exercised."""
    found = {
        k: f"replay hands back the original's {v}, so the run used the original there"
        for k, v in (a.get("site_objects") or {}).items()
    }
    found.update(a.get("site_unchecked") or {})  # a loader compared up to where it may differ by design
    out = []
    for site in sites:
        if site.id not in found:
            continue
        why = found[site.id]
        # the site's own fix and the fixes it covers, those starting in its expression (TOP701 and
        # TOP703 both edit one DataLoader call)
        out += [
            (d, why)
            for d in applied
            if replayable(d) and d.path == site.path and (site.line, site.column) <= (d.line, d.column) < site.end
        ]
    return out


def _without_harness(before: "Version", opts: "RunOptions") -> str:
    """Both versions failed under the harness: does the original run on its own? If it does, the
    harness is at fault, not the program."""
    from torchopt.validate.runner import run_plain

    status, _ = run_plain(before, opts, PLAIN_SECONDS)
    if status == "error":
        return "the original fails without torchopt's harness too: fix it first"
    limit = min(opts.timeout, PLAIN_SECONDS)
    how = "runs to its end" if status == "ok" else f"was still running after {limit:g} s"
    return (
        f"the original {how} without torchopt's harness: the failure comes from the harness, a bug in torchopt "
        "(please report it), not from your program"
    )


def _run_notes(cmp: "Comparison", results: dict[str, list[dict]], a: dict, transplant: bool) -> list[str]:
    """What the runs themselves said (transplant, failed probe batches, ranks, replay sites); ranks
    that disagree or a replay site that failed turn an equivalent verdict into diverged."""
    from torchopt.validate.compare import ranks_agree

    extra: list[str] = []
    if transplant:
        extra.append(
            "weight transplant: the rewrite started from the original's weights, padded with zeros; "
            "padded tensors are compared on their leading slice"
        )
        extra += [n for n in a.get("notes", []) if n.startswith("transplant")]
    for label, runs in results.items():
        # A probe batch that failed in one version shows up as missing outputs; say why.
        extra += [f"{label} version: {n}" for n in runs[0].get("notes", []) if n.startswith("probe batch")]
        if len(runs) > 1:
            bad = ranks_agree(runs)
            if bad:
                extra.append(f"{label}: ranks disagree on {len(bad)} parameter(s), e.g. {bad[0]}")
                if cmp.verdict == "equivalent":
                    cmp.verdict = "diverged"
            else:
                extra.append(f"{label}: all {len(runs)} ranks agree on every parameter")
    if a.get("site_modules"):
        extra.append(
            f"{len(a['site_modules'])} module(s) a random-stream fix builds otherwise ran as the rewrite builds them, "
            "started from the original's values for the tensors both have (the original's construction drew its "
            "random numbers, so later draws line up)"
        )
    for site_id, n in sorted((a.get("site_loaders") or {}).items()):
        if any(e.startswith(f"{site_id}:") for e in a.get("site_errors", [])):
            continue
        how = f"{n['equal']} bit for bit" + (f", {n['moments']} by shape, dtype and moments" if n["moments"] else "")
        extra.append(f"replay site {site_id}: the rewrite's DataLoader yielded the original's batches ({how})")
    for err in a.get("site_errors", []):
        extra.append(f"replay site {err}")
        if cmp.verdict == "equivalent":
            cmp.verdict = "diverged"
    return extra


def _disk_notes(results: dict[str, list[dict]], touched: list[str]) -> tuple[list[str], list[str]]:
    """A warning for any change in the user's folders, and what each version wrote in its scratch copy."""
    from torchopt.validate import scratch

    warnings, notes = [], []
    if touched:
        warnings.append(
            "WARNING: files in your folder changed while the programs ran (a write torchopt "
            f"could not redirect, or another process): {scratch.listing(touched)}"
        )
    for label, runs in results.items():
        written = runs[0].get("written") or []
        if written:
            notes.append(
                f"{label} version wrote, in its scratch copy of its folder (discarded): {scratch.listing(written)}"
            )
        linked = runs[0].get("linked") or []
        if linked:
            notes.append(
                f"{label} version: {len(linked)} large file(s) or folder(s) were linked read-only "
                f"instead of copied, e.g. {linked[0]}"
            )
    return warnings, notes


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


PLAIN_SECONDS = 120.0  # how long the original may run without the harness to show it works
EXIT_INCONCLUSIVE = exits.INCONCLUSIVE
EXIT_UNVALIDATED = exits.UNVALIDATED


def validate(
    before_path: str,
    after_path: str | None,
    settings: Settings,
    *,
    unsafe: bool,
    steps: int,
    device: str,
    argv: Sequence[str],
    entry: str | None,
    nproc: int,
    timeout: float,
    keep: bool = False,
    transplant: bool = False,
    jobs: int = 1,
    bisect: bool = True,
    bench: "BenchOptions | None" = None,
    expect: Sequence[str] = (),
    allow_unvalidated: Sequence[str] = (),
) -> Outcome:
    """`torchopt validate BEFORE [AFTER]`. A divergence of a one-file rewrite with several fixes is
    bisected to the smallest set of fixes that still diverges. ``expect``: declared classes of a
    hand-made change (torchopt.validate.declared.parse); without them, a recognisable edit's class
    is inferred. Fixes the run cannot check are listed as not validated and left out of the run;
    unless their codes are in ``allow_unvalidated`` the exit status is then EXIT_UNVALIDATED."""
    from torchopt.rewrite import notebook, source
    from torchopt.validate import replay
    from torchopt.validate.runner import RunOptions, Version

    text = notebook.as_script(before_path, source.read(before_path, 0).text)
    plan, after_version, mode_unsafe = _plan_versions(text, before_path, after_path, settings, unsafe, entry)
    allowed = {c.upper() for c in allow_unvalidated}
    declared = list(expect) or inferred(plan, after_path)
    if expect:
        plan.notes[:] = [n for n in plan.notes if not n.startswith("two files given")]
        plan.notes.append(f"declared change: --expect {' --expect '.join(expect)}")
    if after_path is None and plan.after == plan.before:
        return _nothing_to_run(before_path, plan, allowed)
    opts = RunOptions(
        steps=steps, device=resolve_device(device), argv=tuple(argv), entry=entry, timeout=timeout, nproc=nproc
    )
    before_version = Version("before", before_path, source=plan.before)
    labels = (before_path, after_path or f"{before_path} (rewritten)")
    forced = True if transplant else None
    amp_dtype = autocast_dtype(opts.device, plan.applied, lambda _path: settings)
    out = run_and_compare(
        before_version,
        after_version,
        plan.applied,
        plan.notes,
        opts,
        labels=labels,
        keep=keep,
        replayed=plan.replayed,
        transplant=forced,
        amp_dtype=amp_dtype,
        declared=declared,
        unvalidated=plan.unvalidated,
        sites=plan.sites,
    )
    left_out = {f["code"] for f in out.json.get("unvalidated", [])}
    if left_out and out.exit_code in (0, EXIT_INCONCLUSIVE) and not left_out <= allowed:
        out.exit_code = EXIT_UNVALIDATED
    if bisect and mode_unsafe is not None and out.exit_code == 1 and len(plan.applied) > 1:

        def probe(keys: tuple) -> Outcome:
            sub = plan_rewrite(text, before_path, settings, mode_unsafe, keys=frozenset(keys))
            return run_and_compare(
                before_version,
                Version("after", after_version.path, source=sub.after),
                sub.applied,
                sub.notes,
                opts,
                labels=labels,
                replayed=sub.replayed,
                transplant=forced,
                before_runs=out.before_runs,
                amp_dtype=amp_dtype,
                sites=sub.sites,
            )

        _bisect(out, plan.applied, probe, jobs)
    if bench is not None and out.exit_code != 2:
        from torchopt.validate.bench import measure

        # Timed as the user would run them: without the record/replay wrappers.
        plain_after = Version("after", after_version.path, source=replay.strip(plan.after))
        measure(out, Version("before", before_path, source=text), plain_after, opts, bench)
    return out


def _nothing_to_run(path: str, plan: Plan, allowed: set[str]) -> Outcome:
    """The rewrite left to run changes nothing: say so, with the fixes that could not be validated."""
    rows = [dict(r, why=why) for r, (_, why) in zip(_fix_rows([d for d, _ in plan.unvalidated]), plan.unvalidated)]
    if not rows:
        msg = f"{path}: the rewrite changes nothing; nothing to validate.\n"
        return Outcome(0, msg, {"verdict": "equivalent", "notes": ["the rewrite changes nothing"], "applied": []})
    from torchopt.validate.report import fix_line

    lines = [f"{path}: no fix left to validate.", f"Not validated ({len(rows)}):"]
    lines += [f"  {fix_line(r)}, because {r['why']}" for r in rows]
    code = 0 if {r["code"] for r in rows} <= allowed else EXIT_UNVALIDATED
    data = {"verdict": "inconclusive", "notes": ["no fix left to validate"], "applied": [], "unvalidated": rows}
    return Outcome(code, "\n".join(lines) + "\n", data)


def _validated_plan(text: str, path: str, settings: Settings, unsafe: bool) -> Plan:
    """torchopt's rewrite of ``text``, instrumented; when some fixes cannot be validated, the
    rewrite without them (the run checks what is left), with them listed."""
    plan = plan_rewrite(text, path, settings, unsafe)
    left_out: list[tuple[Diagnostic, str]] = []
    for _ in range(4):  # leaving a fix out can change the passes after it; settle quickly or give up
        if not plan.unvalidated:
            break
        left_out += plan.unvalidated
        dropped = {fix_key(d) for d, _ in left_out}
        keys = frozenset(fix_key(d) for d in plan.applied if fix_key(d) not in dropped)
        plan = plan_rewrite(text, path, settings, unsafe, keys=keys)
    plan.unvalidated = left_out + plan.unvalidated
    return plan


def _plan_versions(
    text: str, before_path: str, after_path: str | None, settings: Settings, unsafe: bool, entry: str | None
) -> "tuple[Plan, Version, bool | None]":
    """The rewrite to validate, its "after" version, and the unsafe setting that produced it (None:
    the second file is not a torchopt rewrite of the first). One file: torchopt's own rewrite. Two
    files: when the second is exactly torchopt's rewrite of the first (with or without unsafe
    fixes), it is validated as that rewrite (random-stream fixes replayed, the tolerance its fixes
    allow); otherwise the two are compared bitwise. In entry mode the second file's text is served
    in place of the first's, so that the entry imports it."""
    from torchopt.rewrite import notebook, source
    from torchopt.validate.runner import Version

    if after_path is None:
        plan = _validated_plan(text, before_path, settings, unsafe)
        return plan, Version("after", before_path, source=plan.after), unsafe
    after_text = notebook.as_script(after_path, source.read(after_path, 0).text)
    run_as = before_path if entry else after_path
    for u in dict.fromkeys((unsafe, True)):
        if after_text != text and fix_source(text, settings, before_path, unsafe=u).text == after_text:
            plan = _validated_plan(text, before_path, settings, u)
            plan.notes.insert(0, f"{after_path} is torchopt's rewrite of {before_path}: validated as that rewrite")
            return plan, Version("after", run_as, source=plan.after), u
    plan = Plan(before=text, after=after_text)
    plan.notes.append("two files given: compared bitwise (no torchopt fix explains the difference)")
    return plan, Version("after", run_as, source=after_text), None


def _first_row(outcome: Outcome) -> dict:
    """The first divergence of a run with its numbers: name, step, detail, max abs/rel error."""
    first = dict(outcome.json.get("first_divergence") or {})
    row: dict = next((r for r in outcome.json.get("rows", []) if r.get("name") == first.get("name")), {})
    first.update(max_abs=row.get("max_abs"), max_rel=row.get("max_rel"), tolerance=row.get("tolerance"))
    return first


def _probe_text(first: dict) -> str:
    at = f" at step {first['step']}" if first.get("step") is not None else ""
    nums = ""
    if first.get("max_abs") is not None:
        nums = f" (max abs err {first['max_abs']:.3g}, max rel err {first['max_rel']:.3g}"
        nums += f", tolerance {first['tolerance']})" if first.get("tolerance") else ")"
    return f"{first.get('name', '?')}{at}: {first.get('detail', '')}{nums}"


def _bisect(out: Outcome, applied: Sequence[Diagnostic], probe, jobs: int) -> None:
    """Find the smallest diverging set of the applied fixes; add it to ``out``'s text and JSON."""
    from torchopt.validate.bisect import Search, smallest_failing
    from torchopt.validate.report import fix_line

    by_key = {fix_key(d): d for d in applied}
    search = Search(probe=probe, diverges=lambda o: cast(Outcome, o).exit_code == 1, jobs=jobs)
    search.known(tuple(by_key), out)
    found = smallest_failing(tuple(by_key), search)
    culprits = _fix_rows([by_key[k] for k in found.units])
    first = _first_row(cast(Outcome, found.outcome))
    runs = len(search.trials) - 1
    lines = [
        f"Bisect ({runs} more run(s)): the smallest set of fixes that diverges ({len(culprits)} of {len(applied)}):"
    ]
    lines += [f"  {fix_line(f)}" for f in culprits]
    lines.append(
        f"  first difference with only {'this fix' if len(culprits) == 1 else 'these fixes'}: {_probe_text(first)}"
    )
    out.text += "\n".join(lines) + "\n"
    out.json["bisect"] = {"culprits": culprits, "first_divergence": first, "runs": runs}
