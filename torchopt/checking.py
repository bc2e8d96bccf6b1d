"""What `torchopt check` does besides reporting: the summary line, `--output-file`, `--add-noqa`."""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional

from torchopt.rewrite import report, source
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import Diagnostic, FixError, ParseError, fix_edits
from torchopt.rewrite.runner import FileResult
from torchopt.rewrite.suppress import UNUSED_CODE, add_comments
from torchopt.rewrite.write import WriteRefused, atomic_write

EXIT_OK, EXIT_ERROR = 0, 2


def write_output(text: str, path: Optional[str]) -> None:
    """The report on stdout, or in ``path`` (its folder is created, as ruff's `--output-file`)."""
    if path is None:
        sys.stdout.write(text)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def summary(diags: list[Diagnostic], applied: list[Diagnostic], fix: bool, n_failed: int) -> str:
    """The last line of `check`: never "All checks passed." when a file could not be checked."""
    failed = f"; {report.plural(n_failed, 'file')} could not be checked" if n_failed else ""
    if fix and applied:
        total = report.plural(len(diags) + len(applied), "diagnostic")
        return f"Found {total} ({len(applied)} fixed, {len(diags)} remaining){failed}."
    if diags:
        safe = sum(1 for d in diags if d.fix and d.fix.safety == "safe")
        unsafe = sum(1 for d in diags if d.fix and d.fix.safety == "unsafe")
        more = f", {unsafe} more with `--fix --unsafe-fixes`" if unsafe else ""
        return (
            f"Found {report.plural(len(diags), 'diagnostic')} ({report.per_code(diags)}){failed}: "
            f"{safe} fixable with `--fix`{more}."
        )
    if n_failed:
        return f"{report.plural(n_failed, 'file')} could not be checked (no diagnostic in the others)."
    return "All checks passed."


def add_noqa(results: list[FileResult], quiet: bool) -> int:
    """`check --add-noqa`: a suppression comment on a line of every diagnostic, written in place only
    when the file is still what was checked; the new text must still compile."""
    added, n_failed = 0, 0
    for r in results:
        if r.status == "failed":
            sys.stderr.write(f"error: {source.shown(r.path)}: {r.reason}\n")
            n_failed += 1
        if r.status != "ok" or not r.diagnostics:
            continue
        try:
            src = source.read(r.path)
            # an unused suppression is removed (--fix), not suppressed
            wanted: list[tuple[str, tuple[int, ...]]] = [
                (d.code, (d.line, d.end_line)) for d in r.diagnostics if d.code != UNUSED_CODE
            ]
            text, n = add_comments(src.text, wanted)
            if n:
                compile(text, r.path, "exec", dont_inherit=True)
                atomic_write(r.path, src.encode(text), expect=src.state)
            added += n
        except (source.SourceError, WriteRefused, OSError, SyntaxError, ValueError) as exc:
            sys.stderr.write(f"error: {source.shown(r.path)}: cannot add suppressions: {exc}\n")
            n_failed += 1
    if not quiet:
        sys.stderr.write(f"Added {report.plural(added, 'suppression comment')}.\n")
    return EXIT_ERROR if n_failed else EXIT_OK


def edits_of(
    results: list[FileResult], diags: list[Diagnostic], settings_for: Callable[[str], Settings]
) -> Callable[[Diagnostic], list[dict] | None]:
    """For `--output-format json`: the edits of each fixable diagnostic's fix, made on the file as
    it is now (None where the file cannot be read again, e.g. stdin)."""
    wanted = {d for d in diags if d.fix is not None}
    table: dict[Diagnostic, list[dict]] = {}
    for r in results:
        mine = [d for d in (*r.diagnostics, *r.remaining) if d in wanted]
        if r.status != "ok" or not mine:
            continue
        try:
            text = source.read(r.path).text
        except (source.SourceError, OSError):
            continue
        settings = settings_for(r.path)
        for d in mine:
            try:
                table[d] = fix_edits(text, settings, d.path, d)
            except (ParseError, FixError, RecursionError):
                continue
    return table.get
