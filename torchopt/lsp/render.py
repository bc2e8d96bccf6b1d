"""Diagnostics in their LSP JSON form, built off the server's event loop.

A large module can have tens of thousands of findings; turning them into lsprotocol objects and
serialising those with cattrs took seconds (4.6 s for 15,000 on a busy 2-core machine), and while
the event loop did it no other document got its diagnostics. So the JSON text of each diagnostic is
built directly (``lsp_json``: the dict cattrs would produce) and remembered, and the whole
``diagnostics`` array is rendered where the document was checked: in the engine thread that checked
it, or in the worker process of a large document (lanes.py). Publishing is then one write.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from torchopt.lsp.text import Lines, units
from torchopt.rewrite.engine import Diagnostic

SOURCE = "torchopt"
# LSP's DiagnosticSeverity: a safe fix is a warning, an unsafe one information, advice a hint.
WARNING, INFORMATION, HINT = 2, 3, 4


def lsp_range(d: Diagnostic, lines: Lines, encoding: str) -> dict[str, Any]:
    def pos(line: int, col: int) -> dict[str, int]:
        return {"line": line - 1, "character": units(lines.line(line - 1)[: col - 1], encoding)}

    return {"start": pos(d.line, d.column), "end": pos(d.end_line, d.end_column)}


def lsp_json(d: Diagnostic, lines: Lines, encoding: str, rule_url: str) -> dict[str, Any]:
    """The LSP ``Diagnostic`` for ``d`` as JSON data (what lsprotocol's converter makes of it)."""
    if d.fix is None:
        severity, fix = HINT, None
    elif d.fix.safety == "safe":
        severity, fix = WARNING, "safe"
    else:
        severity, fix = INFORMATION, "unsafe"
    message = d.message
    if d.fix is not None and d.fix.safety == "unsafe":
        message += f" (unsafe fix: {d.fix.changes()})" if d.fix.changes() else " (unsafe fix)"
    return {
        "range": lsp_range(d, lines, encoding),
        "message": message,
        "severity": severity,
        "code": d.code,
        "codeDescription": {"href": rule_url.format(code=d.code)},
        "source": SOURCE,
        "data": {
            "code": d.code,
            "line": d.line,
            "column": d.column,
            "fix": fix,
            "title": d.fix.title if d.fix else None,
        },
    }


class Renderer:
    """The JSON text of diagnostics, remembered: after an edit most diagnostics are the ones
    rendered before (the same finding on the same lines). The key holds everything the text
    depends on. One per server (its engine threads share it) or per worker process."""

    def __init__(self, limit: int = 50_000) -> None:
        self._memo: dict[tuple, str] = {}
        self._limit = limit

    def fragment(self, d: Diagnostic, lines: Lines, encoding: str, rule_url: str) -> str:
        key = (
            d,
            encoding,
            rule_url,
            lines.line(d.line - 1),
            lines.line(d.end_line - 1) if d.end_line != d.line else None,
        )
        hit = self._memo.get(key)
        if hit is None:
            if len(self._memo) > self._limit:
                self._memo.clear()
            hit = self._memo[key] = json.dumps(lsp_json(d, lines, encoding, rule_url))
        return hit

    def array(self, diags: Iterable[Diagnostic], text: str, encoding: str, rule_url: str) -> bytes:
        """The JSON array of the LSP diagnostics of ``diags`` found in ``text``, in UTF-8 (JSON's
        escapes keep it ASCII)."""
        lines = Lines(text)
        return ("[" + ", ".join(self.fragment(d, lines, encoding, rule_url) for d in diags) + "]").encode("utf-8")


def publish_message(uri: str, version: int | None, diagnostics_json: bytes) -> bytes:
    """A framed ``textDocument/publishDiagnostics`` notification around a rendered (UTF-8) array."""
    params = '{"uri": ' + json.dumps(uri)
    if version is not None:
        params += ', "version": ' + json.dumps(version)
    head = ('{"method": "textDocument/publishDiagnostics", "params": ' + params + ', "diagnostics": ').encode("utf-8")
    tail = b'}, "jsonrpc": "2.0"}'
    length = len(head) + len(diagnostics_json) + len(tail)
    frame = b"Content-Length: %d\r\nContent-Type: application/vscode-jsonrpc; charset=utf-8\r\n\r\n" % length
    return b"".join((frame, head, diagnostics_json, tail))
