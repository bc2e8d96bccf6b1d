"""`torchopt lsp` fed what a broken or hostile client sends, byte for byte over stdio: each bad
message gets its JSON-RPC error, the server keeps serving the next request, `exit` reports whether
`shutdown` came first, and a document nested too deeply for LibCST gets no diagnostics instead of
killing the server. The editor's files are never written."""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pygls")

from torchopt.rewrite.budget import over_budget

SRC = "import torch\nx = torch.zeros(3).cuda()\n"
WAIT = 30.0  # seconds for one reply: a liveness bound, not a speed test (the server answers in well under one; CI under load took over 5)
START = 30.0  # the first reply and diagnostics (imports, rule registry) on a busy machine


def frame(message: dict | bytes) -> bytes:
    body = message if isinstance(message, bytes) else json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class Server:
    """`python -m torchopt lsp` on pipes, read with timeouts (a deaf server fails, never hangs)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torchopt", "lsp"],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.buf = b""
        self.seen: list[dict] = []

    def send(self, data: dict | bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data if isinstance(data, bytes) else frame(data))
        self.proc.stdin.flush()

    def _next(self, deadline: float) -> dict | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            head, sep, rest = self.buf.partition(b"\r\n\r\n")
            if sep:
                length = int(
                    next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
                )
                if len(rest) >= length:
                    self.buf = rest[length:]
                    return json.loads(rest[:length])
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buf += chunk

    def wait_for(self, pred, what: str, wait: float = WAIT) -> dict:
        deadline = time.monotonic() + wait
        while True:
            msg = self._next(deadline)
            assert msg is not None, f"no {what} within {WAIT}s (server deaf or dead)"
            self.seen.append(msg)
            if pred(msg):
                return msg

    def reply(self, msg_id, wait: float = WAIT) -> dict:  # type: ignore[no-untyped-def]
        return self.wait_for(lambda m: "method" not in m and m.get("id") == msg_id, f"reply to {msg_id!r}", wait)

    def request(self, msg_id: int, method: str, params, wait: float = WAIT) -> dict:  # type: ignore[no-untyped-def]
        self.send({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        return self.reply(msg_id, wait)

    def notify(self, method: str, params) -> None:  # type: ignore[no-untyped-def]
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    def initialize(self) -> None:
        got = self.request(
            0,
            "initialize",
            {
                "processId": None,
                "rootUri": self.root.as_uri(),
                "capabilities": {},
                "initializationOptions": {"select": ["TOP1"], "debounceMs": 0},
            },
            wait=START,
        )
        assert "capabilities" in got["result"]
        self.notify("initialized", {})

    def open(self, name: str, text: str, wait: float = WAIT) -> tuple[str, dict]:
        uri = (self.root / name).as_uri()
        self.notify(
            "textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}}
        )
        published = self.wait_for(
            lambda m: m.get("method") == "textDocument/publishDiagnostics" and m["params"]["uri"] == uri,
            f"diagnostics for {name}",
            wait,
        )
        return uri, published["params"]

    def hover_works(self, msg_id: int, uri: str) -> None:
        """The server still answers a valid request, with the rule page of the finding on line 2."""
        got = self.request(
            msg_id, "textDocument/hover", {"textDocument": {"uri": uri}, "position": {"line": 1, "character": 6}}
        )
        assert "TOP101" in got["result"]["contents"]["value"]

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        return self.proc.returncode


@pytest.fixture
def server(tmp_path):
    (tmp_path / "a.py").write_text(SRC)
    before = tree_digest(tmp_path)
    srv = Server(tmp_path)
    srv.initialize()
    uri, published = srv.open("a.py", SRC, wait=START)
    assert [d["code"] for d in published["diagnostics"]] == ["TOP101"]
    srv.uri = uri  # type: ignore[attr-defined]
    yield srv
    srv.close()
    assert tree_digest(tmp_path) == before, "the language server changed a file on disk"


def error_code(msg: dict) -> int:
    assert "error" in msg and "result" not in msg, msg
    return msg["error"]["code"]


def test_frame_without_content_length_is_a_parse_error_and_the_next_request_is_served(server):
    # A header block without Content-Length, its body, then a good frame right after the body.
    server.send(
        b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\n\r\n"
        b'{"jsonrpc": "2.0", "id": 5, "method": "textDocument/hover", "params": {}}'
    )
    err = server.reply(None)
    assert error_code(err) == -32700 and "Content-Length" in err["error"]["message"]
    server.hover_works(6, server.uri)
    # A bare body with no header at all, glued to the next frame's header: reported, not run.
    server.send(b'{"jsonrpc": "2.0", "id": 7, "method": "shutdown"}')
    server.hover_works(8, server.uri)
    parse_errors = [m for m in server.seen if "method" not in m and m.get("id", 0) is None]
    assert [error_code(m) for m in parse_errors] == [-32700, -32700]
    assert server.proc.poll() is None


def test_bad_content_length_and_bad_json_are_parse_errors(server):
    server.send(b"Content-Length: lots\r\n\r\n{}")
    assert error_code(server.reply(None)) == -32700
    server.hover_works(1, server.uri)
    server.send(frame(b'{"jsonrpc": "2.0", "id": 2, "meth'))
    assert error_code(server.reply(None)) == -32700
    server.send(frame(b"[1, 2]"))
    assert error_code(server.reply(None)) == -32600
    server.send(frame({"jsonrpc": "2.0", "id": 3, "method": 42}))
    assert error_code(server.reply(3)) == -32600
    server.hover_works(4, server.uri)


@pytest.mark.parametrize(
    "method, params, why",
    [
        ("textDocument/hover", "not an object", "text_document"),
        ("textDocument/hover", {"position": {"line": 0, "character": 0}}, "text_document"),
        (
            "textDocument/codeAction",
            {
                "textDocument": {"uri": "URI"},
                "context": {"diagnostics": []},
                "range": {"start": {"line": -1, "character": 0}, "end": {"line": 0, "character": -5}},
            },
            "range",
        ),
        (
            "textDocument/hover",
            {"textDocument": {"uri": "URI"}, "position": {"line": 99, "character": 0}},
            "past the end",
        ),
        (
            "textDocument/codeAction",
            {
                "textDocument": {"uri": "URI"},
                "context": {"diagnostics": []},
                "range": {"start": {"line": 1, "character": 9}, "end": {"line": 1, "character": 2}},
            },
            "ends before it starts",
        ),
    ],
)
def test_invalid_params_get_32602_and_the_server_keeps_serving(server, method, params, why):
    params = json.loads(json.dumps(params).replace("URI", server.uri))
    got = server.request(11, method, params)
    assert error_code(got) == -32602 and why in got["error"]["message"]
    server.hover_works(12, server.uri)

    # Not invalid: LSP says a character past its line's end means the line's end.
    got = server.request(
        13, "textDocument/hover", {"textDocument": {"uri": server.uri}, "position": {"line": 1, "character": 500}}
    )
    assert "error" not in got


def test_invalid_or_unknown_notifications_are_logged_not_shown_and_unknown_methods_get_32601(server):
    server.notify("textDocument/didOpen", {"textDocument": {"uri": 5}})
    server.notify("torchopt/noSuchNotification", {})
    assert error_code(server.request(2, "torchopt/noSuchMethod", {})) == -32601
    server.hover_works(3, server.uri)
    assert not [m for m in server.seen if m.get("method") == "window/showMessage"], "an error popup in the editor"
    assert any(
        m.get("method") == "window/logMessage" and "textDocument/didOpen" in m["params"]["message"] for m in server.seen
    )


def test_exit_without_shutdown_exits_1(server):
    server.notify("exit", None)
    assert server.proc.wait(WAIT) == 1


def test_shutdown_then_exit_exits_0_and_requests_between_are_refused(server):
    assert server.request(1, "shutdown", None)["result"] is None
    got = server.request(
        2, "textDocument/hover", {"textDocument": {"uri": server.uri}, "position": {"line": 1, "character": 6}}
    )
    assert error_code(got) == -32600
    server.notify("exit", None)
    assert server.proc.wait(WAIT) == 0


@pytest.mark.parametrize(
    "name, text",
    [
        ("parens.py", "import torch\nx = " + "(" * 5000 + "1" + ")" * 5000 + "\n"),
        ("chain.py", "import torch\nx = torch" + ".a" * 20000 + "\n"),
        # flat in CPython's tree, nested in LibCST's: the server died (SIGSEGV) on these before
        ("or.py", "import torch\nx = " + " or ".join(["a"] * 10000) + "\ny = torch.zeros(3).cuda()\n"),
        ("strings.py", "import torch\nx = " + " ".join(['"s"'] * 60000) + "\ny = torch.zeros(3).cuda()\n"),
    ],
)
def test_deep_nesting_gets_no_diagnostics_and_the_server_stays_up(server, name, text):
    uri, published = server.open(name, text)
    assert published["diagnostics"] == []
    assert any(
        m.get("method") == "window/logMessage"
        and name in m["params"]["message"]
        and "too deeply nested" in m["params"]["message"]
        for m in server.seen
    )
    hover = server.request(
        5, "textDocument/hover", {"textDocument": {"uri": uri}, "position": {"line": 1, "character": 2}}
    )
    assert hover.get("result") is None and "error" not in hover
    server.hover_works(6, server.uri)
    assert server.proc.poll() is None


@pytest.mark.parametrize(
    "name, text",
    [
        # CPython parses these and they are within the nesting budget: deep, but analysed.
        (
            "calls.py",
            "import torch\nx = "
            + "torch.f(" * 150
            + "torch.zeros(1)"
            + "+torch.zeros(1).cuda()" * 50
            + ")" * 150
            + "\n",
        ),
        ("operators.py", "import torch\nx = torch.zeros(1)" + " + torch.zeros(1).cuda()" * 600 + "\n"),
    ],
)
def test_deep_but_parsable_code_is_answered_and_the_server_stays_up(server, name, text):
    uri, published = server.open(name, text)
    codes = {d["code"] for d in published["diagnostics"]}
    assert codes <= {"TOP101"}  # analysed (the host-then-cuda tensors), or shown with no diagnostics
    server.hover_works(6, server.uri)
    assert server.proc.poll() is None


def test_depth_check_passes_real_code_and_names_the_problem():
    real = (Path(__file__).parent.parent / "torchopt" / "lsp" / "server.py").read_text()
    assert over_budget(real) is None
    assert over_budget("s = '((((' * 3  # " + "(" * 5000 + "\n") is None  # strings and comments do not count
    why = over_budget("x = 1\ny = 2\nz = " + "[" * 300 + "]" * 300 + "\n")
    assert why is not None and "too deeply nested" in why


def test_deep_toml_is_a_short_message_and_the_server_keeps_working(tmp_path):
    """A RecursionError traceback of 170 KB in the log before."""
    (tmp_path / "pyproject.toml").write_text("[tool.torchopt]\nexclude = " + "[" * 5000 + "]" * 5000 + "\n")
    srv = Server(tmp_path)
    try:
        srv.initialize()
        uri, _ = srv.open("a.py", SRC, wait=START)
        shown = [m["params"]["message"] for m in srv.seen if m.get("method") == "window/showMessage"]
        assert len(shown) == 1, srv.seen
        message = shown[0]
        assert "pyproject.toml: invalid TOML: arrays or tables nested too deeply" in message
        assert len(message) < 300 and "Traceback" not in message
        assert not any("Traceback" in json.dumps(m) for m in srv.seen)
        got = srv.request(
            9, "textDocument/hover", {"textDocument": {"uri": uri}, "position": {"line": 0, "character": 0}}
        )
        assert "error" not in got
        assert srv.proc.poll() is None
    finally:
        srv.close()
