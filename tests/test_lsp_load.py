"""`torchopt lsp` under load and with bad client settings: a 1.5 MB document open in the server does
not hold up the diagnostics of a small one, an edit of a large document is analysed without waiting
for the stale text's analysis to finish, and invalid options are rejected with a message while the
server keeps publishing diagnostics with the defaults."""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pygls")

from test_reliability_lsp import START, Server, tree_digest  # noqa: E402

from torchopt.lsp.options import DEBOUNCE_S, RULE_URL, ClientOptions  # noqa: E402
from torchopt.rewrite.config import Settings  # noqa: E402
from torchopt.rewrite.incremental import IncrementalChecker, Stale  # noqa: E402

SMALL = "import torch\nx = torch.zeros(3).cuda()\n"
BLOCK = '''

def make_{i}(n):
    """Block {i}."""
    t = torch.zeros(n).cuda()
    return t * {i}
'''
LOAD_WAIT = 240.0  # seconds: generous on a busy machine; the old server took minutes here


def large_module(size: int) -> str:
    """A module of independent functions, each with a finding, of at least ``size`` characters."""
    parts, i, n = ["import torch\n"], 0, 0
    while n < size:
        parts.append(BLOCK.format(i=i))
        n += len(parts[-1])
        i += 1
    return "".join(parts)


def workers(pid: int) -> list[int]:
    """The live worker processes (multiprocessing's spawn) of ``pid``; Linux /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if fields[1] == str(pid) and fields[0] != "Z" and b"spawn_main" in cmdline:
            out.append(int(entry.name))
    return out


def publishes(srv: Server, uri: str) -> list[dict]:
    return [
        m["params"]
        for m in srv.seen
        if m.get("method") == "textDocument/publishDiagnostics" and m["params"]["uri"] == uri
    ]


def start(root, options: dict) -> Server:
    srv = Server(root)
    got = srv.request(
        0,
        "initialize",
        {"processId": None, "rootUri": root.as_uri(), "capabilities": {}, "initializationOptions": options},
        wait=START,
    )
    assert "capabilities" in got["result"]
    srv.notify("initialized", {})
    return srv


def did_open(srv: Server, name: str, text: str) -> str:
    uri = (srv.root / name).as_uri()
    srv.notify(
        "textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}}
    )
    return uri


def wait_publish(srv: Server, uri: str, wait: float, version: int | None = None) -> dict:
    msg = srv.wait_for(
        lambda m: (
            m.get("method") == "textDocument/publishDiagnostics"
            and m["params"]["uri"] == uri
            and (version is None or m["params"].get("version") == version)
        ),
        f"diagnostics for {uri}",
        wait,
    )
    return msg["params"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_large_open_document_does_not_hold_up_a_small_ones_diagnostics(tmp_path):
    big = large_module(1_500_000)
    srv = start(tmp_path, {"select": ["TOP1"], "debounceMs": 0})
    try:
        big_uri = did_open(srv, "big.py", big)
        small_uri = did_open(srv, "small.py", SMALL)
        got = wait_publish(srv, small_uri, LOAD_WAIT)
        assert [d["code"] for d in got["diagnostics"]] == ["TOP101"]
        # The small document did not wait for the large one's analysis (minutes on this text).
        assert publishes(srv, big_uri) == []
        # Closing the large document ends the process that was checking it.
        assert workers(srv.proc.pid), "the large document is not checked in a process of its own"
        srv.notify("textDocument/didClose", {"textDocument": {"uri": big_uri}})
        assert wait_publish(srv, big_uri, START)["diagnostics"] == []
        deadline = time.monotonic() + 30
        while workers(srv.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers(srv.proc.pid) == []
    finally:
        srv.close()


@pytest.mark.slow
def test_an_edit_of_a_large_document_stops_the_analysis_of_the_stale_text(tmp_path):
    big = large_module(1_500_000)
    srv = start(tmp_path, {"select": ["TOP1"], "debounceMs": 0})
    try:
        uri = did_open(srv, "big.py", big)
        srv.notify(
            "textDocument/didChange",
            {"textDocument": {"uri": uri, "version": 2}, "contentChanges": [{"text": large_module(2_000)}]},
        )
        got = wait_publish(srv, uri, LOAD_WAIT)
        # The first diagnostics are the new text's: the old text's analysis stopped at the edit.
        assert got["version"] == 2
        assert [d["range"]["start"]["line"] for d in got["diagnostics"]] == [
            i for i, line in enumerate(large_module(2_000).splitlines()) if ".cuda()" in line
        ]
    finally:
        srv.close()


def test_a_stale_check_stops_and_keeps_what_it_analysed():
    text = large_module(3_000)
    settings = Settings(select=("TOP1",))
    calls = []

    def stale_after_two() -> bool:
        calls.append(1)
        return len(calls) > 2

    checker = IncrementalChecker()
    with pytest.raises(Stale):
        checker.check(text, settings, "m.py", stale=stale_after_two)
    assert IncrementalChecker().check(text, settings, "m.py") == checker.check(text, settings, "m.py")
    groups = text.count("def make_") + 1  # each function, and the header alone
    assert checker.last_misses == groups - 2  # the two analysed before it stopped were kept


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"ruleUrl": "https://docs.example/rules/"}, "ruleUrl"),
        ({"ruleUrl": "https://docs.example/{cod}.md"}, "ruleUrl"),
        ({"ruleUrl": "https://docs.example/{code}/{page}"}, "ruleUrl"),
        ({"ruleUrl": "https://docs.example/{code"}, "ruleUrl"),
        ({"ruleUrl": "https://docs.example/{code}{0}"}, "ruleUrl"),
        ({"ruleUrl": "https://docs.example/{code.x}"}, "ruleUrl"),
        ({"ruleUrl": 42}, "ruleUrl"),
        ({"debounceMs": math.inf}, "debounceMs"),
        ({"debounceMs": math.nan}, "debounceMs"),
        ({"debounceMs": -1}, "debounceMs"),
        ({"debounceMs": 1e12}, "debounceMs"),
        ({"debounceMs": True}, "debounceMs"),
        ({"debounceMs": "50"}, "debounceMs"),
        ({"unsafeFixes": "yes"}, "unsafeFixes"),
    ],
)
def test_invalid_options_are_reported_and_the_defaults_kept(raw, key):
    opts, problems = ClientOptions.parse({**raw, "select": ["TOP1"]})
    assert len(problems) == 1 and key in problems[0]
    assert (opts.rule_url, opts.debounce_s, opts.unsafe_fixes) == (RULE_URL, DEBOUNCE_S, None)
    assert opts.select == ("TOP1",)  # the valid options still apply


def test_valid_options_are_taken():
    opts, problems = ClientOptions.parse(
        {"ruleUrl": "https://docs.example/{code}.html?x={{y}}", "debounceMs": 0, "unsafeFixes": True}
    )
    assert problems == []
    assert (opts.rule_url.format(code="TOP101"), opts.debounce_s, opts.unsafe_fixes) == (
        "https://docs.example/TOP101.html?x={y}",
        0,
        True,
    )


def test_invalid_options_show_a_message_and_diagnostics_keep_coming(tmp_path):
    (tmp_path / "a.py").write_text(SMALL)
    before = tree_digest(tmp_path)
    # A non-finite debounce would have delayed every check after an edit forever.
    srv = start(tmp_path, {"select": ["TOP1"], "ruleUrl": "https://docs.example/{cod}", "debounceMs": math.inf})
    try:
        uri = did_open(srv, "a.py", SMALL)
        (diag,) = wait_publish(srv, uri, START)["diagnostics"]
        assert diag["codeDescription"]["href"] == RULE_URL.format(code="TOP101")
        srv.notify(
            "textDocument/didChange",
            {"textDocument": {"uri": uri, "version": 2}, "contentChanges": [{"text": "import torch\n" + SMALL}]},
        )
        assert [d["range"]["start"]["line"] for d in wait_publish(srv, uri, START, version=2)["diagnostics"]] == [2]
        (shown,) = [m["params"]["message"] for m in srv.seen if m.get("method") == "window/showMessage"]
        assert "ruleUrl" in shown and "debounceMs" in shown
        # Settings changed to other invalid values: one more message, diagnostics still published.
        srv.notify("workspace/didChangeConfiguration", {"settings": {"torchopt": {"ruleUrl": "{code"}}})
        wait_publish(srv, uri, START)
        shown = [m["params"]["message"] for m in srv.seen if m.get("method") == "window/showMessage"]
        assert len(shown) == 2 and "ruleUrl" in shown[1]
    finally:
        srv.close()
    assert tree_digest(tmp_path) == before


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_worker_is_reported_and_the_document_checked_again(tmp_path):
    srv = start(tmp_path, {"select": ["TOP1"], "debounceMs": 0})
    try:
        uri = did_open(srv, "big.py", large_module(300_000))
        deadline = time.monotonic() + START
        while not workers(srv.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (worker,) = workers(srv.proc.pid)
        os.kill(worker, signal.SIGKILL)
        srv.wait_for(
            lambda m: m.get("method") == "window/logMessage" and "worker process" in m["params"]["message"],
            "a log line about the worker",
            START,
        )
        srv.notify(
            "textDocument/didChange", {"textDocument": {"uri": uri, "version": 2}, "contentChanges": [{"text": SMALL}]}
        )
        assert [d["code"] for d in wait_publish(srv, uri, START, version=2)["diagnostics"]] == ["TOP101"]
        assert srv.proc.poll() is None
    finally:
        srv.close()
