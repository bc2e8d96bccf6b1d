"""The language server publishes diagnostics as JSON rendered where they were checked (an engine
thread, or the worker process of a large document), never on its event loop, and that JSON is what
lsprotocol makes of the LSP diagnostics. An edit after a pause is checked without the debounce."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

pytest.importorskip("pygls")

from lsprotocol import types as lsp  # noqa: E402
from pygls.protocol import default_converter  # noqa: E402
from test_lsp_load import SMALL, start, wait_publish  # noqa: E402

from torchopt.lsp import render  # noqa: E402
from torchopt.lsp.render import Renderer, publish_message  # noqa: E402
from torchopt.lsp.server import Doc, create_server  # noqa: E402
from torchopt.lsp.text import UTF8, UTF16, UTF32  # noqa: E402
from torchopt.rewrite.config import Settings  # noqa: E402
from torchopt.rewrite.engine import check_source  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
URL = "https://docs.example/{code}.html"
# Safe, unsafe and display-only findings, on lines with accents and emoji and over several lines.
TEXT = (FIXTURES / "amp_plain_loop" / "before.py").read_text(encoding="utf-8") + (
    "\n\ndef f():\n    y = ('é😀', torch.zeros(3).cuda())  # ü\n    return torch.zeros(\n        3\n    ).cuda(), y\n"
)


def _diagnostics():
    diags = check_source(TEXT, Settings(select=("ALL",)), "m.py").diagnostics
    kinds = {None if d.fix is None else d.fix.safety for d in diags}
    assert kinds == {None, "safe", "unsafe"} and any(d.end_line > d.line for d in diags)
    return diags


@pytest.mark.parametrize("encoding", [UTF8, UTF16, UTF32])
def test_rendered_json_is_what_lsprotocol_makes_of_the_diagnostics(encoding):
    converter = default_converter()
    diags = _diagnostics()
    array = json.loads(Renderer().array(diags, TEXT, encoding, URL))
    assert len(array) == len(diags)
    for data in array:  # valid LSP diagnostics, unchanged by a round trip through lsprotocol
        assert converter.unstructure(converter.structure(data, lsp.Diagnostic)) == data
    frame = publish_message("file:///m.py", 7, json.dumps(array).encode())
    head, body = frame.split(b"\r\n\r\n", 1)
    assert head.startswith(b"Content-Length: %d\r\n" % len(body))
    message = json.loads(body)
    params = converter.structure(message["params"], lsp.PublishDiagnosticsParams)
    assert (message["method"], params.uri, params.version, len(params.diagnostics)) == (
        "textDocument/publishDiagnostics",
        "file:///m.py",
        7,
        len(diags),
    )


def test_publishing_renders_nothing_on_the_event_loop(monkeypatch):
    """The server checks a document with thousands of findings and publishes them: every
    diagnostic is rendered in the engine thread, none on the event loop (where rendering them
    held up every other document's diagnostics for seconds)."""
    text = "import torch\n" + "".join(f"x{i} = torch.zeros(3).cuda()\n" for i in range(1500))
    where: list[str] = []
    real = render.lsp_json

    def spy(*args, **kwargs):
        where.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(render, "lsp_json", spy)
    written: list[bytes] = []

    class Writer:
        def write(self, data: bytes) -> None:
            written.append(data)

    server = create_server()
    server.options.select = ("TOP1",)
    server.reload_settings()
    server.protocol.set_writer(Writer())
    doc = Doc(uri="file:///tmp/m.py", path="/tmp/m.py", text=text, version=3)
    server.docs[doc.uri] = doc

    async def main() -> None:
        await server.analyse_and_publish(doc)

    try:
        asyncio.run(main())
    finally:
        server.engine.shutdown(wait=True)
    (message,) = [json.loads(w.split(b"\r\n\r\n", 1)[1]) for w in written if b"publishDiagnostics" in w]
    assert message["params"]["version"] == 3 and len(message["params"]["diagnostics"]) == 1500
    assert len(where) == 1500 and threading.main_thread().name not in where


def test_an_edit_after_a_pause_does_not_wait_for_the_debounce(tmp_path):
    # With the longest debounce the server takes, a lone edit still gets its diagnostics at once:
    # the debounce only holds back edits that follow each other within it (fast typing).
    srv = start(tmp_path, {"select": ["TOP1"], "debounceMs": 10_000})
    try:
        uri = (tmp_path / "a.py").as_uri()
        srv.notify(
            "textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": SMALL}}
        )
        wait_publish(srv, uri, 30.0, version=1)
        srv.notify(
            "textDocument/didChange",
            {"textDocument": {"uri": uri, "version": 2}, "contentChanges": [{"text": "import torch\n" + SMALL}]},
        )
        # Well before the 10 s debounce could have run out.
        got = wait_publish(srv, uri, 8.0, version=2)
        assert [d["range"]["start"]["line"] for d in got["diagnostics"]] == [2]
    finally:
        srv.close()
