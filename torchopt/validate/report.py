"""Show a ``Comparison`` to a person (rich text) or a program (JSON).

Rendering goes through a rich Console writing to a string with ``force_terminal=False``, so the
same text comes out in a terminal, a pipe or a CI log; long probe lists are summarised so a
model with hundreds of parameters still fits on a screen.
"""

from __future__ import annotations

import io
import math
from dataclasses import asdict
from typing import Any, Iterable, Mapping, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .compare import Comparison, Row

__all__ = ["headline", "render_text", "to_json", "fix_line"]

LOSS_ROWS = 20  # losses shown one by one (AMP losses have a tighter bound over the first 20 steps)
GROUP_ROWS = 12  # tensors shown one by one per kind before summarising
_OK = ("ok", "skipped")


def headline(cmp: Comparison) -> str:
    """One line: EQUIVALENT (bitwise) / DIVERGED at step 3, loss[3] / COULD NOT RUN."""
    if cmp.verdict == "could-not-run":
        return "COULD NOT RUN"
    if cmp.verdict == "inconclusive":
        tol = cmp.tolerance
        if tol is not None and not tol.compare_values:
            return f"INCONCLUSIVE (values not compared: {', '.join(tol.tags) or 'rng'}; structure only)"
        return "INCONCLUSIVE (no value the program computed was compared)"
    if cmp.verdict == "equivalent":
        tol = cmp.tolerance
        if tol is None or tol.bitwise:
            return "EQUIVALENT (bitwise)"
        if not tol.compare_values:
            return f"EQUIVALENT (structure only; values not compared: {', '.join(tol.tags) or 'rng'})"
        return f"EQUIVALENT (within tolerance: {', '.join(tol.tags)})"
    d = cmp.first_divergence
    if d is None:
        return "DIVERGED"
    return f"DIVERGED at step {d.step}, {d.name}" if d.step is not None else f"DIVERGED: {d.name}"


def fix_line(f: Mapping) -> str:
    """`TOP101 train.py:12:5 Pass device= to the factory [safe]` or `[unsafe: numerics]`."""
    where = f"{f.get('path') or '?'}:{f.get('line', '?')}:{f.get('column', '?')}"
    tags = ", ".join(f.get("tags") or ())
    safety = f.get("safety", "safe") + (f": {tags}" if tags else "")
    return f"{f.get('code', '?')} {where} {f.get('title') or f.get('message', '')} [{safety}]"


def _num(x: float | None) -> str:
    if x is None:
        return "—"
    return "inf" if math.isinf(x) else ("nan" if math.isnan(x) else f"{x:.3g}")


def _summary(label: str, rows: list[Row]) -> Row:
    """Collapse rows into one: worst errors, and how many failed."""

    def worst(vals: Iterable[float | None]) -> float | None:
        known = [v for v in vals if v is not None]
        return max(known) if known else None

    bad = [r for r in rows if r.verdict not in _OK]
    verdict = f"{len(bad)} not ok" if bad else ("skipped" if all(r.verdict == "skipped" for r in rows) else "ok")
    tols = sorted({r.tolerance for r in rows if r.tolerance})
    return Row(
        label,
        rows[0].kind,
        worst(r.max_abs for r in rows),
        worst(r.max_rel for r in rows),
        tols[0] if len(tols) == 1 else "mixed",
        verdict,
    )


def _display_rows(rows: list[Row]) -> list[Row]:
    """Losses one by one up to LOSS_ROWS (plus failures and the final loss); tensors grouped by kind."""
    losses = [r for r in rows if r.kind == "loss"]
    shown: list[Row] = losses[:LOSS_ROWS]
    rest = losses[LOSS_ROWS:]
    keep = {id(r) for r in [r for r in rest if r.verdict not in _OK][:3] + rest[-1:]}
    run: list[Row] = []
    for r in rest:  # fold each run of rows between the kept ones into one summary row
        if id(r) not in keep:
            run.append(r)
            continue
        if run:
            shown.append(_summary(f"{run[0].name}..{run[-1].name} ({len(run)} summarised)", run))
            run = []
        shown.append(r)
    kinds = list(dict.fromkeys(r.kind for r in rows if r.kind != "loss"))
    for kind in kinds:
        group = [r for r in rows if r.kind == kind]
        if len(group) <= GROUP_ROWS:
            shown += group
            continue
        bad = [r for r in group if r.verdict not in _OK][:GROUP_ROWS]
        shown += bad
        others = [r for r in group if r not in bad]
        if others:
            shown.append(_summary(f"{kind}/* ({len(others)} {'more ' if bad else ''}summarised)", others))
    return shown


def _table(cmp: Comparison) -> Table:
    table = Table(show_header=True, header_style="bold", expand=False)
    # Numbers keep 8 columns (".3g" fits); names, criteria and the verdict's detail fold when the console is narrow.
    table.add_column("probe", overflow="fold", min_width=12)
    table.add_column("step", justify="right", no_wrap=True, min_width=4)
    table.add_column("max abs err", justify="right", min_width=8)
    table.add_column("max rel err", justify="right", min_width=8)
    table.add_column("tolerance", overflow="fold", min_width=10)
    table.add_column("verdict", overflow="fold", min_width=8)
    for r in _display_rows(cmp.rows):
        verdict = r.verdict + (f" ({r.detail})" if r.detail and r.verdict not in _OK else "")
        style = None if r.verdict in _OK else "bold red"
        table.add_row(
            Text(r.name),
            "" if r.step is None else str(r.step),
            _num(r.max_abs),
            _num(r.max_rel),
            Text(r.tolerance),
            Text(verdict),
            style=style,
        )
    return table


def _numerics_involved(cmp: Comparison, applied: Sequence[Mapping]) -> bool:
    tags = set(cmp.tolerance.tags if cmp.tolerance else ())
    for f in applied:
        tags.update(f.get("tags") or ())
    return "numerics" in tags


def render_text(
    cmp: Comparison,
    *,
    before_label: str,
    after_label: str,
    device: str,
    applied: Sequence[Mapping],
    unvalidated: Sequence[Mapping] = (),
    console_width: int = 100,
) -> str:
    """The human report: headline, probe table, first divergence, explanations, notes, tracebacks."""
    text_out = io.StringIO()
    console = Console(
        file=text_out, width=console_width, force_terminal=False, color_system=None, highlight=False, emoji=False
    )

    def say(text: Text) -> None:  # a line is never folded: paths and tracebacks stay whole
        console.print(text, soft_wrap=True)

    style = {"equivalent": "bold green", "diverged": "bold red"}.get(cmp.verdict, "bold yellow")
    say(Text(headline(cmp), style=style))
    say(Text(f"before: {before_label}   after: {after_label}   device: {device}"))
    say(Text(f"Fixes applied ({len(applied)}):"))
    for f in applied:
        say(Text(f"  {fix_line(f)}"))
    if unvalidated:
        say(Text(f"Not validated ({len(unvalidated)}):", style="bold yellow"))
        for f in unvalidated:
            say(Text(f"  {fix_line(f)}, because {f.get('why', '')}"))
    if cmp.tolerance is not None and cmp.tolerance.reason:
        say(Text(f"tolerance: {cmp.tolerance.reason}"))
    if cmp.rows:
        console.print(_table(cmp))
    d = cmp.first_divergence
    if d is not None:
        at = f" at step {d.step}" if d.step is not None else ""
        say(Text(f"First divergence: {d.name}{at}: {d.detail}"))
    for line in cmp.explanations:
        say(Text(line))
    notes = [n.splitlines()[0] for n in cmp.notes]
    if device == "cpu" and _numerics_involved(cmp, applied):
        notes.append(
            "CPU autocast numerics (bfloat16) are not CUDA numerics: re-validate on a GPU "
            "before trusting the numerics tolerance there"
        )
    if notes:
        say(Text("Notes:", style="bold"))
        for n in notes:
            say(Text(f"  - {n}"))
    for side, tb in cmp.tracebacks.items():
        say(Text(f"Traceback ({side} version):", style="bold"))
        say(Text(tb.rstrip()))
    return text_out.getvalue()


def _plain(x: Any) -> Any:
    """JSON-safe: non-finite floats become the strings "inf"/"-inf"/"nan" (strict JSON has none)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def to_json(
    cmp: Comparison,
    *,
    before_label: str | None = None,
    after_label: str | None = None,
    device: str | None = None,
    applied: Sequence[Mapping] = (),
    unvalidated: Sequence[Mapping] = (),
) -> dict:
    """The machine report: every row (not summarised), verdict and reasons; passes json.dumps(allow_nan=False)."""
    tol = cmp.tolerance
    return _plain(
        {
            "verdict": cmp.verdict,
            "headline": headline(cmp),
            "before": before_label,
            "after": after_label,
            "device": device,
            "tolerance": None
            if tol is None
            else {
                "tags": list(tol.tags),
                "bitwise": tol.bitwise,
                "compare_values": tol.compare_values,
                "criterion": tol.describe(),
                "reason": tol.reason,
            },
            "first_divergence": None if cmp.first_divergence is None else asdict(cmp.first_divergence),
            "rows": [asdict(r) for r in cmp.rows],
            "explanations": list(cmp.explanations),
            "notes": list(cmp.notes),
            "tracebacks": dict(cmp.tracebacks),
            "applied": [dict(f) for f in applied],
            "unvalidated": [dict(f) for f in unvalidated],
        }
    )
