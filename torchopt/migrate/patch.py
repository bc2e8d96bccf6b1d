"""Patches that `git apply` takes: built from bytes (the file's own encoding and line endings), lines
split on LF only (as git does: a form feed or U+2028 inside a line stays inside it), git's quoting
for unusual file names."""

from __future__ import annotations

import difflib

_ESCAPES = {7: b"\\a", 8: b"\\b", 9: b"\\t", 10: b"\\n", 11: b"\\v", 12: b"\\f", 13: b"\\r", 34: b'\\"', 92: b"\\\\"}
NO_NEWLINE = b"\\ No newline at end of file\n"


def _needs_quote(name: bytes) -> bool:
    return any(b < 0x20 or b == 0x7F or b >= 0x80 or b in (34, 92) for b in name)


def quote(prefix: str, rel: str) -> bytes:
    """``a/path`` as git writes it: C-quoted when the name has control, non-ASCII, quote or backslash."""
    name = (prefix + rel).encode("utf-8", "surrogateescape")
    if not _needs_quote(name):
        return name
    body = b"".join(_ESCAPES.get(b) or (b"\\%03o" % b if b < 0x20 or b >= 0x7F else bytes([b])) for b in name)
    return b'"' + body + b'"'


def _lines(data: bytes) -> list[bytes]:
    parts = data.split(b"\n")
    lines = [p + b"\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1] + b"\n" + NO_NEWLINE)
    return lines


def file_patch(rel: str, old: bytes, new: bytes, context: int = 3) -> bytes:
    """A git-style patch turning ``old`` into ``new`` at ``rel`` (empty when they are equal)."""
    if old == new:
        return b""
    a, b = quote("a/", rel), quote("b/", rel)
    tab = b"\t" if b" " in a and not a.startswith(b'"') else b""
    body = difflib.diff_bytes(difflib.unified_diff, _lines(old), _lines(new), a, b, n=context)
    out = [b"diff --git " + a + b" " + b + b"\n"]
    for i, line in enumerate(body):
        if i < 2:  # ---/+++ header lines: difflib ends them with "\n" (no dates given)
            line = line.rstrip(b"\n") + tab + b"\n"
        out.append(line)
    return b"".join(out)
