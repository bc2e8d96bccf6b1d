"""The roll-up report of a migration, in JSON (for programs) and Markdown (for people)."""

from __future__ import annotations

import datetime as _dt
from typing import Sequence

from torchopt.migrate.task import CHANGED, FAILED, REFUSED, UNCHANGED, Options, Pin, RepoResult, plural


def _add(total: dict[str, int], part: dict[str, int]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


def summary(results: Sequence[RepoResult]) -> dict:
    fixes: dict[str, int] = {}
    unsafe: dict[str, int] = {}
    for r in results:
        _add(fixes, r.fixes)
        _add(unsafe, r.unsafe_not_applied)
    by = {s: sum(1 for r in results if r.status == s) for s in (CHANGED, UNCHANGED, REFUSED, FAILED)}
    return {
        "repos": len(results),
        **by,
        "files_changed": sum(len(r.files_changed) for r in results),
        "fixes": dict(sorted(fixes.items())),
        "unsafe_not_applied": dict(sorted(unsafe.items())),
        "file_failures": sum(len(r.file_failures) for r in results),
        "validation_failed": sum(
            1
            for r in results
            if r.validation
            and r.validation["verdict"] != "equivalent"
            and r.validation["verdict"] != "nothing to validate"
        ),
    }


def to_json(results: Sequence[RepoResult], pin: Pin, options: Options, meta: dict) -> dict:
    return {
        "tool": "torchopt migrate",
        "generated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "selection": pin.to_json(),
        "options": options.to_json(),
        **meta,
        "summary": summary(results),
        "repos": [r.to_json() for r in results],
    }


def per_code(counts: dict[str, int]) -> str:
    return ", ".join(f"{c} ×{n}" for c, n in sorted(counts.items())) or "—"


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _output(r: RepoResult) -> str:
    parts = []
    if r.patch_file:
        parts.append(f"`{r.patch_file}`")
    if r.branch:
        parts.append(f"branch `{r.branch}` ({(r.commit or '')[:10]})")
    return ", ".join(parts) or "—"


def to_markdown(results: Sequence[RepoResult], pin: Pin, options: Options, meta: dict) -> str:
    s = summary(results)
    mode = f"commits on branch `{options.branch}` (and patches)" if options.commit else "patches"
    lines = [
        "# torchopt migrate report",
        "",
        f"- torchopt {pin.version}; {pin.describe()}",
        f"- output: {mode} in `{meta.get('out', '')}`; executor: {meta.get('executor', 'local')}",
        f"- validation: `{options.validate}` ({options.steps} steps)"
        if options.validate
        else "- validation: not requested",
        f"- {plural(s['repos'], 'repository')}: {s['changed']} changed, {s['unchanged']} unchanged, "
        f"{s['refused']} refused, {s['failed']} failed"
        + (f" ({meta['resumed']} done by an earlier run)" if meta.get("resumed") else ""),
        f"- {plural(s['files_changed'], 'file')} changed; fixes: {per_code(s['fixes'])}",
        f"- unsafe fixes not applied: {per_code(s['unsafe_not_applied'])}",
        "",
        "| Repository | Status | Files changed | Fixes | Unsafe fixes not applied | Validation | Output |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        status = r.status if not r.reason else f"{r.status}: {r.reason}"
        val = r.validation["verdict"] if r.validation else "—"
        lines.append(
            f"| `{_cell(r.name)}` | {_cell(status)} | {len(r.files_changed)} | {per_code(r.fixes)} | "
            f"{per_code(r.unsafe_not_applied)} | {_cell(val)} | {_output(r)} |"
        )
    for r in results:
        details = []
        if r.files_changed:
            details.append("Files changed: " + ", ".join(f"`{f}`" for f in r.files_changed))
        if r.no_fix:
            details.append(f"Diagnostics without an automatic fix (see `torchopt check`): {per_code(r.no_fix)}")
        for path, why in r.skipped:
            details.append(f"Skipped `{path}`: {why}")
        for path, why in r.file_failures:
            details.append(f"Could not process `{path}`: {why}")
        if r.validation and r.validation.get("withheld"):
            details.append(f"Fixes withheld by validation: {', '.join(r.validation['withheld'])}")
        if details:
            lines += ["", f"## {r.name}", "", f"`{r.path}`" + (f" (config: `{r.config}`)" if r.config else ""), ""]
            lines += [f"- {d}" for d in details]
    return "\n".join(lines) + "\n"
