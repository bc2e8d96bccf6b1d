"""Unified diffs for the CLI, and diff statistics."""

from __future__ import annotations

import difflib


def unified(old: str, new: str, path: str) -> str:
    old_lines = old.splitlines(keepends=True)
    new_lines = new.splitlines(keepends=True)
    # Keep every line newline-terminated in the diff output so hunks never run together.
    old_lines = [
        line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n" for line in old_lines
    ]
    new_lines = [
        line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n" for line in new_lines
    ]
    return "".join(difflib.unified_diff(old_lines, new_lines, fromfile=f"a/{path}", tofile=f"b/{path}"))


def stats(diff_text: str) -> tuple[int, int]:
    """(added, removed) line counts of a unified diff."""
    from unidiff import PatchSet

    patch = PatchSet(diff_text)
    return sum(f.added for f in patch), sum(f.removed for f in patch)
