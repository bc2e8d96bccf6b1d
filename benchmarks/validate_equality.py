"""What `torchopt validate` runs is what `torchopt rewrite` writes, on real scripts.

    python benchmarks/validate_equality.py [--src /tmp/realworld] [--manifest benchmarks/real_world.json]
                                           [--json-out FILE] [PATH...]

For every script of the real-world manifest (docs/real-world.md; checked out under ``--src`` as
``<owner>+<repo>/<path>``, never committed here) and every PATH given, in safe mode and with
``--unsafe-fixes``: rewrite the text as `torchopt rewrite` does (the settings it would find for
that file), build the plan `torchopt validate` runs (the rewrite instrumented for record/replay),
and check that removing the instrumentation gives the written text back character for character,
with the same fixes at the same positions. Prints one line per script and mode (``equal`` or
``NOT EQUAL`` with the first differing line), the replay sites and the fixes listed as not
validated, and a total; exits 1 on any inequality. Runs no program (seconds in all).

Extract a repository at the manifest's commit without a checkout, e.g.::

    git --git-dir=DIR archive COMMIT $(git --git-dir=DIR ls-tree -r --name-only COMMIT | grep '\\.py$') \\
        | tar -x -C /tmp/realworld/OWNER+NAME
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check(path: str, unsafe: bool) -> dict:
    """One script in one mode: the validated text against the written text."""
    from torchopt.rewrite import notebook, source
    from torchopt.rewrite.config import Resolver
    from torchopt.rewrite.engine import fix_source
    from torchopt.validate import replay
    from torchopt.validate.command import plan_rewrite

    settings = Resolver().for_path(path)
    text = notebook.as_script(path, source.read(path, 0).text)
    written = fix_source(text, settings, path, unsafe=unsafe)
    plan = plan_rewrite(text, path, settings, unsafe)
    validated = replay.strip(plan.after)
    same_fixes = [(d.code, d.line, d.column) for d in plan.applied] == [
        (d.code, d.line, d.column) for d in written.applied
    ]
    row = {
        "fixes": len(written.applied),
        "sites": len(plan.sites),
        "unvalidated": sorted(d.code for d, _ in plan.unvalidated),
        "equal": validated == written.text and same_fixes and plan.before == text,
    }
    if validated != written.text:
        diff = difflib.unified_diff(written.text.splitlines(), validated.splitlines(), "written", "validated", n=0)
        row["first_difference"] = "\n".join(list(diff)[:6])
    elif not same_fixes:
        row["first_difference"] = "the validated plan lists other fixes than the rewrite applied"
    if plan.sites:
        compile(plan.after, path, "exec")  # the instrumented text must run
    return row


def scripts(src: Path, manifest: Path) -> list[tuple[str, Path]]:
    data = json.loads(manifest.read_text(encoding="utf-8"))
    out = []
    for s in data["scripts"]:
        name = f"{s['repository']}:{s['path']}"
        out.append((name, src / s["repository"].replace("/", "+") / s["path"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="/tmp/realworld")
    ap.add_argument("--manifest", default=str(ROOT / "benchmarks" / "real_world.json"))
    ap.add_argument("--json-out", default=None)
    ap.add_argument("paths", nargs="*", help="more scripts to check")
    a = ap.parse_args()
    todo = scripts(Path(a.src), Path(a.manifest)) + [(p, Path(p)) for p in a.paths]
    results, missing = [], []
    start = time.monotonic()
    for name, path in todo:
        if not path.is_file():
            missing.append(name)
            continue
        for mode in ("safe", "unsafe"):
            row = {"script": name, "mode": mode, **check(os.fspath(path), mode == "unsafe")}
            results.append(row)
            extra = f", {row['sites']} replayed" if row["sites"] else ""
            extra += f", not validated: {' '.join(row['unvalidated'])}" if row["unvalidated"] else ""
            print(f"{'equal' if row['equal'] else 'NOT EQUAL':9} {mode:6} {name} ({row['fixes']} fixes{extra})")
            if not row["equal"]:
                print(f"    {row['first_difference']}")
    took = time.monotonic() - start
    bad = [r for r in results if not r["equal"]]
    print(
        f"{len(results) - len(bad)} of {len(results)} rewrites equal ({len(results) // 2} scripts x safe/unsafe, "
        f"{sum(r['fixes'] for r in results)} fixes, {sum(r['sites'] for r in results)} replay sites) in {took:.1f} s"
    )
    if missing:
        print(f"missing under {a.src} (not checked): {', '.join(missing)}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 1 if bad or missing else 0


if __name__ == "__main__":
    sys.exit(main())
