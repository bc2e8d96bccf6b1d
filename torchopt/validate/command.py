"""`torchopt validate`: build the two versions, run them side by side, compare, report.

One file: the program against the rewrite torchopt would make of it, in memory. Two files: as given.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import Diagnostic, fix_source

if TYPE_CHECKING:
    from torchopt.validate.runner import RunOptions, Version


@dataclass
class Plan:
    """What will be compared: the two sources and the fixes that turned one into the other."""

    before: str
    after: str
    applied: list[Diagnostic] = field(default_factory=list)
    sites: list = field(default_factory=list)  # replay.Site
    notes: list[str] = field(default_factory=list)
    replayed: bool = False  # every random-stream fix is wrapped for record/replay

    @property
    def tags(self) -> set[str]:
        return {t for d in self.applied if d.fix for t in d.fix.tags}


def plan_rewrite(text: str, path: str, settings: Settings, unsafe: bool) -> Plan:
    """The rewrite of ``text`` with random-stream sites wrapped for record/replay (VAL-4)."""
    from torchopt.rewrite.engine import check_source
    from torchopt.validate import replay
    from torchopt.validate.transplant import CODES as TRANSPLANTED

    first = fix_source(text, settings, path, unsafe=unsafe)
    if first.text == text:
        return Plan(before=text, after=text)
    rng_sites = [d for d in check_source(text, settings, path).diagnostics
                 if d.fix is not None and "rng" in d.fix.tags and (unsafe or d.fix.safety == "safe")
                 and d.code not in TRANSPLANTED]  # padding: the weight transplant aligns the streams
    if not rng_sites:
        return Plan(before=text, after=first.text, applied=first.applied)
    wrapped, sites = replay.wrap_sites(text, rng_sites)
    second = fix_source(wrapped, settings, path, unsafe=unsafe)
    lost = replay.unwrap_check(second.text, sites)
    after = replay.add_originals(second.text, sites)
    plan = Plan(before=wrapped, after=after, applied=second.applied, sites=sites, replayed=not lost)
    plan.notes.append(
        f"{len(sites)} fix(es) change the random stream; they are validated by record/replay: the rewritten "
        "run evaluates each new expression under a forked RNG state, checks its shape, dtype, device and "
        "moments, and continues with the original's numbers so the rest of the program is compared exactly.")
    if lost:
        plan.notes.append(f"replay sites not rewritten: {', '.join(lost)}")
    return plan


def _fix_rows(applied: Sequence[Diagnostic]) -> list[dict]:
    return [{"code": d.code, "line": d.line, "column": d.column, "message": d.message,
             "safety": d.fix.safety if d.fix else "display-only", "tags": list(d.fix.tags) if d.fix else []}
            for d in applied]


@dataclass
class Outcome:
    exit_code: int
    text: str
    json: dict


def run_and_compare(before: "Version", after: "Version", applied: Sequence[Diagnostic], notes: list[str],
                    opts: "RunOptions", *, labels: tuple[str, str], keep: bool = False,
                    replayed: bool = False, transplant: bool | None = None) -> Outcome:
    """Run both versions side by side (two processes at once, each in a scratch copy of its
    folder), compare and report. With
    ``transplant`` (default: when a padding fix was applied) the original runs first and the
    rewrite starts from its weights (torchopt.validate.transplant)."""
    from dataclasses import replace

    from torchopt.validate import scratch
    from torchopt.validate import transplant as tp
    from torchopt.validate.compare import compare, ranks_agree
    from torchopt.validate.report import render_text, to_json
    from torchopt.validate.runner import protected_roots, run_version
    from torchopt.validate.tolerance import tolerance_for

    workdir = os.path.realpath(tempfile.mkdtemp(prefix="torchopt-validate-"))
    results: dict[str, list[dict]] = {}
    cancel = threading.Event()
    roots = sorted({*protected_roots(before), *protected_roots(after)})
    opts = replace(opts, protect=tuple(roots))
    user_files = scratch.fingerprint(roots, {workdir})

    def go(v: "Version") -> None:
        results[v.label] = run_version(v, opts, workdir, cancel)

    if transplant is None:
        transplant = tp.wanted(applied)
    try:
        if transplant:
            opts = replace(opts, transplant=os.path.join(workdir, "transplant.pt"))
            go(before)  # the record must exist before the rewrite starts
            go(after)
        else:
            threads = [threading.Thread(target=go, args=(v,)) for v in (before, after)]
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
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    touched = scratch.changes(user_files, scratch.fingerprint(roots, {workdir}))

    tags = sorted({t for d in applied if d.fix for t in d.fix.tags})
    fixes = _fix_rows(applied)
    b, a = results[before.label][0], results[after.label][0]
    # The AMP rewrite picks float16 on CUDA and bfloat16 elsewhere; hold it to that dtype's bounds.
    amp_dtype = "float16" if opts.device == "cuda" else "bfloat16"
    if transplant and all(d.code in tp.CODES for d in applied if d.fix and "rng" in d.fix.tags):
        replayed = True  # the transplant restores the original's RNG state after each construction
    tol = tolerance_for(tags, dtype=amp_dtype, replayed=replayed)
    if transplant:
        tol = replace(tol, transplant=True, reason=tol.reason.replace(
            "rng (replayed): random values replayed", "rng (transplant): initial weights and RNG state copied"))
    cmp = compare(b, a, tol, fixes)
    extra = list(notes)
    if transplant:
        extra.append("weight transplant: the rewrite started from the original's weights, padded with zeros; "
                     "padded tensors are compared on their leading slice")
        extra += [n for n in a.get("notes", []) if n.startswith("transplant")]
    for label, runs in results.items():
        if len(runs) > 1:
            bad = ranks_agree(runs)
            if bad:
                extra.append(f"{label}: ranks disagree on {len(bad)} parameter(s), e.g. {bad[0]}")
                if cmp.verdict == "equivalent":
                    cmp.verdict = "diverged"
            else:
                extra.append(f"{label}: all {len(runs)} ranks agree on every parameter")
    for err in a.get("site_errors", []):
        extra.append(f"replay site {err}")
        if cmp.verdict == "equivalent":
            cmp.verdict = "diverged"
    for label, runs in results.items():
        written = runs[0].get("written") or []
        if written:
            extra.append(f"{label} version wrote, in its scratch copy of its folder (discarded): "
                         f"{scratch.listing(written)}")
        linked = runs[0].get("linked") or []
        if linked:
            extra.append(f"{label} version: {len(linked)} large file(s) or folder(s) were linked read-only "
                         f"instead of copied, e.g. {linked[0]}")
    if touched:
        extra.insert(0, "WARNING: files in your folder changed while the programs ran (a write torchopt "
                        f"could not redirect, or another process): {scratch.listing(touched)}")
    cmp.notes = list(cmp.notes) + extra
    kw = dict(before_label=labels[0], after_label=labels[1], device=opts.device, applied=fixes)
    code = {"equivalent": 0, "diverged": 1}.get(cmp.verdict, 2)
    return Outcome(code, render_text(cmp, **kw), to_json(cmp, **kw))


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def validate(before_path: str, after_path: str | None, settings: Settings, *, unsafe: bool, steps: int,
             device: str, argv: Sequence[str], entry: str | None, nproc: int, timeout: float,
             keep: bool = False, transplant: bool = False) -> Outcome:
    """`torchopt validate BEFORE [AFTER]`."""
    from torchopt.rewrite import source
    from torchopt.validate.runner import RunOptions, Version

    text = source.read(before_path, 0).text
    if after_path is None:
        plan = plan_rewrite(text, before_path, settings, unsafe)
        if plan.after == plan.before:
            msg = f"{before_path}: the rewrite changes nothing; nothing to validate.\n"
            return Outcome(0, msg, {"verdict": "equivalent", "notes": ["the rewrite changes nothing"]})
        after_version = Version("after", before_path, source=plan.after)
    else:
        after_text = source.read(after_path, 0).text
        guess = fix_source(text, settings, before_path, unsafe=True)
        plan = Plan(before=text, after=after_text, applied=guess.applied if guess.text == after_text else [])
        if not plan.applied:
            plan.notes.append("two files given: compared bitwise (no torchopt fix explains the difference)")
        after_version = (Version("after", before_path, source=after_text) if entry
                         else Version("after", after_path, source=after_text))
    opts = RunOptions(steps=steps, device=resolve_device(device), argv=tuple(argv), entry=entry,
                      timeout=timeout, nproc=nproc)
    return run_and_compare(Version("before", before_path, source=plan.before), after_version, plan.applied,
                           plan.notes, opts, labels=(before_path, after_path or f"{before_path} (rewritten)"),
                           keep=keep, replayed=plan.replayed, transplant=True if transplant else None)


def _rewrites(files: Sequence[str], settings_for, codes: set[str] | None, unsafe: bool):  # type: ignore[no-untyped-def]
    """In-memory rewrites of ``files`` (restricted to ``codes`` when given): path -> (old, new, applied)."""
    from torchopt.rewrite import source
    from torchopt.rewrite.engine import FixError, ParseError

    out = {}
    for f in files:
        s = settings_for(f)
        try:
            text = source.read(f, s.max_file_size).text
            res = fix_source(text, s, f, unsafe=unsafe,
                             codes=None if codes is None else s.enabled_codes(f) & codes)
        except (source.SourceError, ParseError, FixError):
            continue
        if res.text != text:
            out[os.path.realpath(f)] = (text, res.text, res.applied)
    return out


def check_rewrite(files: Sequence[str], settings_for, entry_script: str, *, unsafe: bool, steps: int,  # type: ignore[no-untyped-def]
                  device: str, timeout: float) -> tuple[set[str] | None, list[str]]:
    """`rewrite --validate ENTRY`: run ENTRY with every rewritten file served from memory. Returns the
    codes whose fixes may be written (None: all of them) and report lines. When the whole rewrite
    diverges, codes are added one at a time (each run with those already kept) and only those that
    pass are kept, so the set written is one that was validated as a whole."""
    from torchopt.validate.runner import RunOptions, Version

    entry = os.path.realpath(entry_script)
    opts = RunOptions(steps=steps, device=resolve_device(device), timeout=timeout)

    def attempt(codes: set[str] | None) -> tuple[Outcome | None, set[str]]:
        rw = _rewrites(files, settings_for, codes, unsafe)
        if not rw:
            return None, set()
        applied = [d for _, _, ap in rw.values() for d in ap]
        entry_new = rw.get(entry, (None, None, None))[1]
        after = Version("after", entry_script, source=entry_new,
                        sources={p: new for p, (_, new, _) in rw.items() if p != entry})
        out = run_and_compare(Version("before", entry_script), after, applied, [], opts,
                              labels=(entry_script, f"{entry_script} (with rewritten files)"))
        return out, {d.code for d in applied}

    whole, codes = attempt(None)
    if whole is None:
        return None, ["validation: nothing would change"]
    if whole.exit_code == 0:
        return None, [f"validation: {entry_script} computes the same thing with every fix ({', '.join(sorted(codes))})"]
    if whole.exit_code == 2:  # ENTRY fails in both versions: nothing can be validated
        return set(), [whole.text, f"validation: {entry_script} could not run; fix it first"]
    lines = [whole.text, "validation failed for the whole rewrite; validating each rule in turn"]
    keep: set[str] = set()
    if len(codes) == 1:  # the whole rewrite was this one rule: no need to run it again
        lines.append(f"  {next(iter(codes))}: diverges: not written")
        return keep, lines
    for code in sorted(codes):
        # Each trial adds one rule to those already kept, so the set finally written was itself run.
        out, _ = attempt(keep | {code})
        ok = out is not None and out.exit_code == 0
        lines.append(f"  {code}: {'passes' if ok else 'diverges: not written'}")
        if ok:
            keep.add(code)
    return keep, lines
