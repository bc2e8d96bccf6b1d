"""`torchopt validate --rev BASE[..HEAD] ENTRY.py`: the entry point of a repository at two commits.

Both commits are written out as stored (`git ls-tree` and `cat-file`, through the helpers of
`torchopt.migrate.git`) into plain temporary folders: no checkout, so no hook, filter, fsmonitor
or repository config of the user's repository runs, and the user's working tree, index and HEAD are
not touched. ENTRY runs in each under the validator's harness and the two runs are compared as
two files are (the class of the change declared with `--expect`, or inferred from the changed
files the entry imports). The report lists the files that changed between the commits and which
of them the entry reaches through its own imports.
"""

from __future__ import annotations

import ast
import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Sequence

from torchopt.migrate import git
from torchopt.validate.command import Outcome, run_and_compare
from torchopt.validate.exits import COULD_NOT_RUN

__all__ = ["Revisions", "parse_range", "reached_files", "validate_revisions", "github_lines", "render", "run_cli"]


@dataclass
class Revisions:
    """What was compared: the two commits, the files that differ, and those the entry reaches."""

    base: str
    head: str
    entry: str  # relative to the repository's top folder, '/'-separated
    changed: list[str] = field(default_factory=list)
    reached: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return {
            "base": self.base,
            "head": self.head,
            "entry": self.entry,
            "changed": self.changed,
            "reached": self.reached,
        }


def parse_range(spec: str) -> tuple[str, str]:
    """`BASE..HEAD` -> (BASE, HEAD); `BASE` -> (BASE, "HEAD"). (`...` is not a range of two commits.)"""
    if "..." in spec:
        raise ValueError(f"--rev {spec!r}: give BASE or BASE..HEAD (two dots)")
    base, sep, head = spec.partition("..")
    if not base or (sep and not head):
        raise ValueError(f"--rev {spec!r}: give BASE or BASE..HEAD")
    return base, head or "HEAD"


def _commit(repo: str, rev: str) -> str:
    proc = git.git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}", check=False)
    sha = proc.stdout.decode().strip()
    if proc.returncode != 0 or not sha:
        raise git.GitError(f"{rev!r} is not a commit of {repo}")
    return sha


def _changed(repo: str, base: str, head: str) -> list[str]:
    raw = git.git(repo, "diff-tree", "-r", "-z", "--name-only", "--no-renames", base, head).stdout
    return sorted(p.decode("utf-8", "surrogateescape") for p in raw.split(b"\0") if p)


# --------------------------------------------------------------------------- what the entry imports


def _module_files(root: str, bases: Sequence[str], dotted: str) -> list[str]:
    """Files under ``root`` that importing ``dotted`` from one of ``bases`` runs: each package's
    `__init__.py` on the way and the module itself."""
    parts = [p for p in dotted.split(".") if p]
    for base in bases:
        found, folder = [], base
        for i, part in enumerate(parts):
            candidate = os.path.join(folder, part)
            if os.path.isdir(candidate):
                init = os.path.join(candidate, "__init__.py")
                if os.path.isfile(init):
                    found.append(init)
                folder = candidate
            elif os.path.isfile(candidate + ".py"):
                found.append(candidate + ".py")
                break
            else:
                found = found if i else []
                break
        if found:
            return [f for f in found if os.path.realpath(f).startswith(os.path.realpath(root) + os.sep)]
    return []


def _imports(path: str) -> list[tuple[int, str, list[str]]]:
    """(level, module, names) of every import statement of ``path``; [] if it does not parse."""
    try:
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read(), path)
    except (OSError, SyntaxError, ValueError, RecursionError):
        return []
    out: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(0, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or "", [a.name for a in node.names if a.name != "*"]))
    return out


def reached_files(root: str, entry: str) -> set[str]:
    """The files of the tree at ``root`` that ``entry`` (relative) reaches through its imports,
    followed with CPython's `ast` from the entry's folder (what `python ENTRY` puts on sys.path)
    and the top folder; the entry included. Relative, '/'-separated."""
    entry_dir = os.path.dirname(os.path.join(root, entry))
    todo, seen = [os.path.join(root, entry)], set()
    while todo:
        path = todo.pop()
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(path):
            continue
        seen.add(real)
        for level, module, names in _imports(path):
            if level:
                base = os.path.dirname(path)
                for _ in range(level - 1):
                    base = os.path.dirname(base)
                bases = [base]
            else:
                bases = [entry_dir, root]
            todo += _module_files(root, bases, module) if module else []
            for name in names:  # `from pkg import sub` may import the module pkg/sub.py
                todo += _module_files(root, bases, f"{module}.{name}" if module else name)
    root_real = os.path.realpath(root)
    return {os.path.relpath(p, root_real).replace(os.sep, "/") for p in seen}


# --------------------------------------------------------------------------- the comparison


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return None


def _inferred(base_dir: str, head_dir: str, files: Sequence[str], notes: list[str]) -> list[str]:
    """The classes of the recognisable edits in the changed files the entry reaches."""
    from torchopt.validate import declared

    found: dict[str, str] = {}
    for rel in files:
        if not rel.endswith(".py"):
            continue
        old, new = _read(os.path.join(base_dir, rel)), _read(os.path.join(head_dir, rel))
        if old is None or new is None:
            continue
        for f in declared.infer(old, new):
            found.setdefault(f.declared, f"{rel}: {f.reason}")
    for cls, why in found.items():
        notes.append(f"inferred --expect {cls}: {why} (declare the class with --expect to override)")
    if not found and files:
        notes.append(
            f"compared bitwise (no recognisable edit in the files the entry reaches); {declared.HOW_TO_DECLARE}"
        )
    return list(found)


def _own_rewrite(base_dir: str, head_dir: str, files: Sequence[str], notes: list[str]) -> list:
    """The fixes of torchopt's own rewrite (unsafe fixes included), when the one changed file the
    entry reaches is exactly that rewrite of its base version: they then set the tolerance, as in
    two-file mode."""
    from torchopt.rewrite.config import Resolver
    from torchopt.rewrite.engine import FixError, ParseError, fix_source

    if len(files) != 1 or not files[0].endswith(".py"):
        return []
    old, new = _read(os.path.join(base_dir, files[0])), _read(os.path.join(head_dir, files[0]))
    if old is None or new is None or old == new:
        return []
    try:
        guess = fix_source(old, Resolver().for_path(os.path.join(base_dir, files[0])), files[0], unsafe=True)
    except (ParseError, FixError):
        return []
    if guess.text != new:
        return []
    notes.append(f"{files[0]} at HEAD is torchopt's rewrite of its base version: the tolerance of its fixes applies")
    return list(guess.applied)


def validate_revisions(
    cwd: str, spec: str, entry: str, opts, *, expect: Sequence[str] = (), keep: bool = False
) -> tuple[Outcome, Revisions | None]:
    """Compare ENTRY (relative to ``cwd``) at the two commits of ``spec``. ``opts``: RunOptions."""
    from torchopt.validate.runner import Version

    try:
        repo = git.toplevel(cwd)
        base_rev, head_rev = parse_range(spec)
        base, head = _commit(repo, base_rev), _commit(repo, head_rev)
    except (git.GitError, ValueError) as exc:
        return _failed(f"--rev {spec}: {exc}"), None
    rel = os.path.relpath(os.path.abspath(os.path.join(cwd, entry)), os.path.realpath(repo)).replace(os.sep, "/")
    revs = Revisions(base, head, rel, _changed(repo, base, head))
    with ExitStack() as stack:
        try:
            base_dir, _ = stack.enter_context(git.scratch_checkout(repo, base))
            head_dir, _ = stack.enter_context(git.scratch_checkout(repo, head))
        except (git.GitError, OSError) as exc:
            return _failed(f"--rev {spec}: cannot write the commits out: {exc}"), revs
        missing = [c[:12] for c, d in ((base, base_dir), (head, head_dir)) if not os.path.isfile(os.path.join(d, rel))]
        if missing:
            return _failed(f"{rel} does not exist at {', '.join(missing)}"), revs
        reached = reached_files(base_dir, rel) | reached_files(head_dir, rel)
        revs.reached = sorted(set(revs.changed) & reached)
        notes = [_change_note(revs)]
        applied = [] if expect else _own_rewrite(base_dir, head_dir, revs.reached, notes)
        declared = list(expect) or ([] if applied else _inferred(base_dir, head_dir, revs.reached, notes))
        if expect:
            notes.append(f"declared change: --expect {' --expect '.join(expect)}")
        before = Version("before", os.path.join(base_dir, rel))
        after = Version("after", os.path.join(head_dir, rel))
        out = run_and_compare(
            before,
            after,
            applied,
            notes,
            opts,
            labels=(f"{rel}@{base[:12]}", f"{rel}@{head[:12]}"),
            keep=keep,
            declared=declared,
        )
    out.json["revisions"] = revs.as_json()
    return out, revs


def _change_note(revs: Revisions) -> str:
    if not revs.changed:
        return "the two commits hold the same files"
    reached = ", ".join(revs.reached) if revs.reached else "none"
    return f"{len(revs.changed)} file(s) changed between the commits; the entry reaches: {reached}"


def _failed(why: str) -> Outcome:
    return Outcome(
        COULD_NOT_RUN, f"COULD NOT RUN\n{why}\n", {"verdict": "could-not-run", "headline": why, "notes": [why]}
    )


# --------------------------------------------------------------------------- GitHub Actions


def _escape(text: str, prop: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if prop else text


def github_lines(out: Outcome, revs: Revisions | None) -> str:
    """The report as GitHub Actions workflow commands: one annotation with the verdict (an error
    on the entry file unless equivalent) and the full text report in a collapsed group."""
    verdict = out.json.get("verdict", "could-not-run")
    headline = out.json.get("headline") or out.text.splitlines()[0]
    level = "notice" if verdict == "equivalent" else ("warning" if verdict == "inconclusive" else "error")
    where = f"file={_escape(revs.entry, True)}," if revs is not None else ""
    detail = headline
    first = out.json.get("first_divergence") or {}
    if first:
        detail += f" ({first.get('name')}: {first.get('detail', '')})"
    lines = [f"::{level} {where}title={_escape('torchopt validate', True)}::{_escape(detail)}"]
    lines += ["::group::torchopt validate report", out.text.rstrip("\n"), "::endgroup::"]
    return "\n".join(lines) + "\n"


def run_cli(
    spec: str,
    entry: str,
    expect: Sequence[str],
    output_format: str,
    steps: int,
    device: str,
    argv: Sequence[str],
    timeout: float,
    nproc: int,
) -> int:
    """`torchopt validate --rev`: print the report in ``output_format``; returns the exit status."""
    import sys

    from torchopt.validate.command import resolve_device
    from torchopt.validate.declared import parse
    from torchopt.validate.runner import RunOptions

    try:
        declared = parse(expect)
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return COULD_NOT_RUN
    opts = RunOptions(steps=steps, device=resolve_device(device), argv=tuple(argv), timeout=timeout, nproc=nproc)
    out, revs = validate_revisions(os.getcwd(), spec, entry, opts, expect=declared)
    sys.stdout.write(render(out, revs, output_format))
    return out.exit_code


def render(out: Outcome, revs: Revisions | None, output_format: str) -> str:
    """The report as ``output_format`` says: text, json or github (workflow commands)."""
    import json

    if output_format == "json":
        return json.dumps(out.json, indent=2) + "\n"
    if output_format == "github":
        return github_lines(out, revs)
    return out.text
