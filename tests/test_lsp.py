"""`torchopt lsp` driven by a real LSP client over stdio (pytest-lsp).

The server runs as `python -m torchopt lsp`. Most tests select the device rules (TOP1) through
`initializationOptions` so that other families' findings do not change what they look at.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

pytest.importorskip("pygls")
pytest_lsp = pytest.importorskip("pytest_lsp")

from lsprotocol import types as lsp  # noqa: E402
from pytest_lsp import ClientServerConfig, LanguageClient, client_capabilities  # noqa: E402

from torchopt.lsp.text import Lines  # noqa: E402
from torchopt.rewrite.config import Settings  # noqa: E402
from torchopt.rewrite.engine import fix_source  # noqa: E402
from torchopt.rewrite.registry import all_rules  # noqa: E402
from torchopt.rewrite.rule import Invalid  # noqa: E402

SERVER = [sys.executable, "-m", "torchopt", "lsp"]
TOP1 = {"select": ["TOP1"], "debounceMs": 20}
SRC = "import torch\n\nx = torch.zeros(3).cuda()\ny = 1\n"
FIXED = 'import torch\n\nx = torch.zeros(3, device="cuda")\ny = 1\n'
TIMEOUT = 30


# One server for most tests (each opens its own files): starting one costs seconds.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_lsp.fixture(
    config=ClientServerConfig(server_command=SERVER),
    loop_scope="module",
    params=["visual-studio-code", "neovim@v0.11.0", "emacs"],
)
async def any_client(lsp_client: LanguageClient, request, tmp_path):
    await _init(lsp_client, tmp_path, request.param, TOP1)
    yield
    await lsp_client.shutdown_session()


@pytest_lsp.fixture(config=ClientServerConfig(server_command=SERVER), scope="module")
async def client(lsp_client: LanguageClient, tmp_path_factory):
    await _init(lsp_client, tmp_path_factory.mktemp("ws"), "visual-studio-code", TOP1)
    yield
    await lsp_client.shutdown_session()


class _Published(dict):
    """pytest-lsp stores each publishDiagnostics in ``client.diagnostics[uri]``; this also keeps every
    one, per document, so a test can wait for the next publish of *its* document even when publishes
    for several documents arrive in one read (waiting on the notification itself would miss those)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: dict[str, list[lsp.PublishDiagnosticsParams]] = {}

    def __setitem__(self, uri: str, diagnostics) -> None:  # type: ignore[no-untyped-def]
        super().__setitem__(uri, diagnostics)
        self.log.setdefault(uri, []).append(lsp.PublishDiagnosticsParams(uri=uri, diagnostics=list(diagnostics)))


async def _init(c: LanguageClient, root: Path, spec: str, options: dict) -> None:
    c.registrations = []  # type: ignore[attr-defined]
    c.diagnostics = _Published()

    @c.feature(lsp.CLIENT_REGISTER_CAPABILITY)
    def register(client: LanguageClient, params: lsp.RegistrationParams) -> None:
        client.registrations.extend(params.registrations)  # type: ignore[attr-defined]

    result = await c.initialize_session(
        lsp.InitializeParams(
            capabilities=client_capabilities(spec),
            root_uri=root.as_uri(),
            workspace_folders=[lsp.WorkspaceFolder(uri=root.as_uri(), name="ws")],
            initialization_options=options,
        )
    )
    enc = result.capabilities.position_encoding
    c.encoding = str(getattr(enc, "value", enc) or "utf-16")  # type: ignore[attr-defined]
    c.root = root  # type: ignore[attr-defined]
    c.versions = {}  # type: ignore[attr-defined]


# helpers ------------------------------------------------------------------------------------------


async def _publish(c: LanguageClient, uri: str, timeout: float = TIMEOUT) -> lsp.PublishDiagnosticsParams:
    """The first publishDiagnostics for ``uri`` that arrives after this call."""
    log = c.diagnostics.log.setdefault(uri, [])  # type: ignore[attr-defined]
    seen = len(log)

    async def wait() -> lsp.PublishDiagnosticsParams:
        while len(log) <= seen:
            await asyncio.sleep(0.005)
        return log[seen]

    return await asyncio.wait_for(wait(), timeout)


async def _open(c: LanguageClient, name: str, text: str) -> tuple[str, list[lsp.Diagnostic]]:
    path = c.root / name  # type: ignore[attr-defined]
    path.write_text(text, encoding="utf-8")
    uri = path.as_uri()
    c.versions[uri] = 1  # type: ignore[attr-defined]
    c.text_document_did_open(
        lsp.DidOpenTextDocumentParams(
            text_document=lsp.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)
        )
    )
    return uri, list((await _publish(c, uri)).diagnostics)


def _change(c: LanguageClient, uri: str, text: str) -> None:
    c.versions[uri] += 1  # type: ignore[attr-defined]
    c.text_document_did_change(
        lsp.DidChangeTextDocumentParams(
            text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=c.versions[uri]),  # type: ignore[attr-defined]
            content_changes=[lsp.TextDocumentContentChangeWholeDocument(text=text)],
        )
    )


async def _actions(c: LanguageClient, uri: str, rng: lsp.Range, diags, only=None) -> list[lsp.CodeAction]:
    res = await c.text_document_code_action_async(
        lsp.CodeActionParams(
            text_document=lsp.TextDocumentIdentifier(uri=uri),
            range=rng,
            context=lsp.CodeActionContext(diagnostics=list(diags), only=only),
        )
    )
    out = []
    for a in res or []:
        assert isinstance(a, lsp.CodeAction)
        if a.edit is None and a.data is not None:
            a = await c.code_action_resolve_async(a)
        out.append(a)
    return out


def _edits(c: LanguageClient, action: lsp.CodeAction, uri: str) -> list[lsp.TextEdit]:
    edit = action.edit
    assert edit is not None, action.title
    if edit.document_changes:
        (dc,) = edit.document_changes
        assert isinstance(dc, lsp.TextDocumentEdit) and dc.text_document.uri == uri
        assert dc.text_document.version == c.versions[uri]  # type: ignore[attr-defined]
        return list(dc.edits)  # type: ignore[arg-type]
    assert edit.changes is not None
    return list(edit.changes[uri])


def _apply(c: LanguageClient, text: str, edits: list[lsp.TextEdit]) -> str:
    """What an editor does with the edits (positions in the negotiated encoding)."""
    lines = Lines(text)
    enc = c.encoding  # type: ignore[attr-defined]
    spans = [
        (
            lines.from_client(e.range.start.line, e.range.start.character, enc),
            lines.from_client(e.range.end.line, e.range.end.character, enc),
            e.new_text,
        )
        for e in edits
    ]
    for a, b, new in sorted(spans, reverse=True):
        text = text[:a] + new + text[b:]
    return text


def _one(actions: list[lsp.CodeAction], pred) -> lsp.CodeAction:
    hits = [a for a in actions if pred(a)]
    assert len(hits) == 1, [a.title for a in actions]
    return hits[0]


# tests --------------------------------------------------------------------------------------------


async def test_diagnostics_on_open(client: LanguageClient):
    uri, diags = await _open(client, "train.py", SRC)
    (d,) = diags
    assert d.code == "TOP101" and d.source == "torchopt"
    assert d.severity == lsp.DiagnosticSeverity.Warning  # a safe fix
    assert d.range == lsp.Range(lsp.Position(2, 4), lsp.Position(2, 25))
    assert d.code_description is not None and d.code_description.href.endswith("/TOP101.md")
    assert d.data["code"] == "TOP101" and d.data["fix"] == "safe"

    # An unsafe fix (random numbers from another generator) is information, not a warning.
    _change(client, uri, "import torch\nx = torch.rand(3).cuda()\n")
    (d,) = (await _publish(client, uri)).diagnostics
    assert d.severity == lsp.DiagnosticSeverity.Information and d.data["fix"] == "unsafe"
    assert "rng" in d.message

    # Advice without a fix (display-only) is a hint, and offers only the ignore action.
    src = next(e.src for e in all_rules()["TOP105"].examples if isinstance(e, Invalid))
    _change(client, uri, src)
    (d,) = [d for d in (await _publish(client, uri)).diagnostics if d.code == "TOP105"]
    assert d.severity == lsp.DiagnosticSeverity.Hint and d.data["fix"] is None
    actions = await _actions(client, uri, d.range, [d], only=[lsp.CodeActionKind.QuickFix])
    assert [a.title for a in actions] == ["Ignore TOP105 on this line"]

    _change(client, uri, "import torch\nx = torch.rand(3).cuda()\n")
    await _publish(client, uri)
    hover = await client.text_document_hover_async(
        lsp.HoverParams(text_document=lsp.TextDocumentIdentifier(uri=uri), position=lsp.Position(1, 10))
    )
    assert hover is not None and "# TOP101 `factory-then-move`" in hover.contents.value  # type: ignore[union-attr]
    assert (
        await client.text_document_hover_async(
            lsp.HoverParams(text_document=lsp.TextDocumentIdentifier(uri=uri), position=lsp.Position(0, 2))
        )
        is None
    )


async def test_quick_fix_yields_expected_text(client: LanguageClient):
    uri, diags = await _open(client, "train.py", SRC)
    actions = await _actions(client, uri, diags[0].range, diags, only=[lsp.CodeActionKind.QuickFix])
    fix = _one(actions, lambda a: a.is_preferred)
    assert fix.kind == lsp.CodeActionKind.QuickFix and "device='cuda'" in fix.title
    edits = _edits(client, fix, uri)
    assert all(e.range.start.line == 2 and e.range.end.line == 2 for e in edits)  # not the whole file
    assert _apply(client, SRC, edits) == FIXED


async def test_quick_fix_touches_only_its_diagnostic(client: LanguageClient):
    src = "import torch\na = torch.zeros(3).cuda()\nb = torch.ones(2).cuda()\n"
    uri, diags = await _open(client, "two.py", src)
    assert [d.range.start.line for d in diags] == [1, 2]
    actions = await _actions(client, uri, diags[1].range, diags[1:], only=[lsp.CodeActionKind.QuickFix])
    fix = _one(actions, lambda a: a.is_preferred)
    assert _apply(client, src, _edits(client, fix, uri)) == (
        'import torch\na = torch.zeros(3).cuda()\nb = torch.ones(2, device="cuda")\n'
    )


async def test_fix_all(client: LanguageClient):
    src = "import torch\n\na = torch.zeros(3).cuda()\nb = torch.ones(2).to('cuda')\nc = torch.rand(4).cuda()\n"
    uri, diags = await _open(client, "all.py", src)
    assert len(diags) == 3
    rng = lsp.Range(lsp.Position(0, 0), lsp.Position(0, 0))
    (safe,) = await _actions(client, uri, rng, [], only=[lsp.CodeActionKind.SourceFixAll])
    assert safe.kind == "source.fixAll.torchopt"
    settings = Settings(select=("TOP1",))
    assert _apply(client, src, _edits(client, safe, uri)) == fix_source(src, settings, unsafe=False).text
    # Unsafe fixes only on explicit request, never under source.fixAll (editors run those on save).
    (unsafe,) = await _actions(client, uri, rng, [], only=["source.unsafeFixAll"])
    assert not unsafe.kind.startswith("source.fixAll")
    out = _apply(client, src, _edits(client, unsafe, uri))
    assert out == fix_source(src, settings, unsafe=True).text and "torch.rand(4, device='cuda')" in out
    everything = await _actions(client, uri, rng, [])
    assert {a.kind for a in everything} == {"source.fixAll.torchopt", "source.unsafeFixAll.torchopt"}


async def test_ignore_comment(client: LanguageClient):
    src = "import torch\nx = torch.zeros(3).cuda()\ny = torch.ones(3).cuda()  # noqa: TOP102\n"
    uri, diags = await _open(client, "ign.py", src)
    assert len(diags) == 2
    actions = await _actions(client, uri, diags[0].range, diags[:1])
    ignore = _one(actions, lambda a: a.title == "Ignore TOP101 on this line")
    text = _apply(client, src, _edits(client, ignore, uri))
    actions = await _actions(client, uri, diags[1].range, diags[1:])
    ignore = _one(actions, lambda a: a.title == "Ignore TOP101 on this line")
    text = _apply(client, text, _edits(client, ignore, uri))
    assert text == (
        "import torch\nx = torch.zeros(3).cuda()  # noqa: TOP101\ny = torch.ones(3).cuda()  # noqa: TOP102, TOP101\n"
    )
    _change(client, uri, text)
    assert list((await _publish(client, uri)).diagnostics) == []


async def test_non_ascii_line(any_client: LanguageClient):
    c = any_client
    src = "import torch\ns = 'héllo wörld 😀'; x = torch.zeros(3).cuda()  # ünïcode\n"
    uri, (d,) = await _open(c, "uni.py", src)
    prefix = "s = 'héllo wörld 😀'; x = "
    want = {"utf-8": len(prefix.encode()), "utf-16": len(prefix.encode("utf-16-le")) // 2, "utf-32": len(prefix)}[
        c.encoding
    ]  # type: ignore[attr-defined]
    assert d.range.start == lsp.Position(1, want)
    assert d.range.end.character - d.range.start.character == len("torch.zeros(3).cuda()")
    actions = await _actions(c, uri, d.range, [d], only=[lsp.CodeActionKind.QuickFix])
    for title, want_text in [
        (None, "import torch\ns = 'héllo wörld 😀'; x = torch.zeros(3, device='cuda')  # ünïcode\n"),
        (
            "Ignore TOP101 on this line",
            "import torch\ns = 'héllo wörld 😀'; x = torch.zeros(3).cuda()  # ünïcode  # noqa: TOP101\n",
        ),
    ]:
        action = _one(actions, (lambda a: a.is_preferred) if title is None else (lambda a: a.title == title))
        assert _apply(c, src, _edits(c, action, uri)) == want_text
    # An incremental change after the emoji lands where the client meant it.
    col = {
        "utf-8": len("s = 'héllo wörld 😀".encode()),
        "utf-16": len("s = 'héllo wörld 😀".encode("utf-16-le")) // 2,
        "utf-32": len("s = 'héllo wörld 😀"),
    }[c.encoding]  # type: ignore[attr-defined]
    c.versions[uri] += 1  # type: ignore[attr-defined]
    c.text_document_did_change(
        lsp.DidChangeTextDocumentParams(
            text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=c.versions[uri]),  # type: ignore[attr-defined]
            content_changes=[
                lsp.TextDocumentContentChangePartial(
                    range=lsp.Range(lsp.Position(1, col), lsp.Position(1, col)), text="!!"
                )
            ],
        )
    )
    (d2,) = (await _publish(c, uri)).diagnostics
    assert d2.range.start.character == want + 2


async def test_syntax_error_mid_edit_keeps_diagnostics(client: LanguageClient):
    uri, diags = await _open(client, "edit.py", SRC)
    assert len(diags) == 1
    logs_before = len(client.log_messages)
    for broken in (
        "import torch\n\nx = torch.zeros(3).cuda(\ny = 1\n",
        "import torch\n\nx = torch.zeros(3).cuda(dev\ny = 1\n",
    ):
        _change(client, uri, broken)
        with pytest.raises(asyncio.TimeoutError):
            await _publish(client, uri, timeout=1.0)  # nothing replaces the last good diagnostics
    assert list(client.diagnostics[uri]) == list(diags)
    new_logs = [m.message for m in client.log_messages[logs_before:]]
    assert len(new_logs) == 1 and "syntax error" in new_logs[0], new_logs
    # Still serving requests, and back to normal once the code parses again.
    actions = await _actions(client, uri, diags[0].range, diags)
    assert actions == []
    _change(client, uri, "import torch\n\nx = torch.zeros(3).cuda(); z = torch.ones(2).cuda()\ny = 1\n")
    assert len((await _publish(client, uri)).diagnostics) == 2


async def test_pyproject_change_disables_rule(client: LanguageClient):
    root: Path = client.root / "project"  # type: ignore[attr-defined]
    root.mkdir()
    (root / "pyproject.toml").write_text('[tool.torchopt]\nselect = ["ALL"]\n')
    uri, diags = await _open(client, "project/cfg.py", SRC)
    assert [d.code for d in diags] == ["TOP101"]
    # VS Code registers file watchers dynamically: the server asked for pyproject.toml files.
    (reg,) = client.registrations  # type: ignore[attr-defined]
    assert reg.method == lsp.WORKSPACE_DID_CHANGE_WATCHED_FILES
    assert reg.register_options["watchers"][0]["globPattern"] == "**/pyproject.toml"
    (root / "pyproject.toml").write_text('[tool.torchopt]\nignore = ["TOP101"]\n')
    client.workspace_did_change_watched_files(
        lsp.DidChangeWatchedFilesParams(
            changes=[lsp.FileEvent(uri=(root / "pyproject.toml").as_uri(), type=lsp.FileChangeType.Changed)]
        )
    )
    assert list((await _publish(client, uri)).diagnostics) == []
    # And back.
    (root / "pyproject.toml").write_text("[tool.torchopt]\n")
    client.workspace_did_change_watched_files(
        lsp.DidChangeWatchedFilesParams(
            changes=[lsp.FileEvent(uri=(root / "pyproject.toml").as_uri(), type=lsp.FileChangeType.Changed)]
        )
    )
    assert [d.code for d in (await _publish(client, uri)).diagnostics] == ["TOP101"]


@pytest_lsp.fixture(config=ClientServerConfig(server_command=SERVER), loop_scope="module")
async def options_client(lsp_client: LanguageClient, tmp_path):
    await _init(lsp_client, tmp_path, "neovim", {"select": ["TOP1"], "ignore": ["TOP105"], "unsafeFixes": True})
    yield
    await lsp_client.shutdown_session()


async def test_initialization_options(options_client: LanguageClient):
    c = options_client
    src = next(e.src for e in all_rules()["TOP105"].examples if isinstance(e, Invalid))
    src += "\nz = torch.rand(4).cuda()\n"
    uri, diags = await _open(c, "opt.py", src)
    codes = {d.code for d in diags}
    assert "TOP101" in codes and "TOP105" not in codes  # `ignore` from the client
    # `unsafeFixes`: fix all applies unsafe fixes too, and there is no separate unsafe action.
    (fix_all,) = await _actions(c, uri, lsp.Range(lsp.Position(0, 0), lsp.Position(0, 0)), [], only=["source"])
    assert fix_all.kind == "source.fixAll.torchopt"
    want = fix_source(src, Settings(select=("TOP1",), ignore=("TOP105",)), unsafe=True).text
    assert 'torch.rand(4, device="cuda")' in want
    assert _apply(c, src, _edits(c, fix_all, uri)) == want


async def test_client_settings_change(options_client: LanguageClient):
    """`workspace/didChangeConfiguration` replaces the client settings and re-checks open documents."""
    c = options_client
    uri, diags = await _open(c, "cfgchange.py", SRC)
    assert [d.code for d in diags] == ["TOP101"]
    c.workspace_did_change_configuration(
        lsp.DidChangeConfigurationParams(settings={"torchopt": {"select": ["TOP1"], "ignore": ["TOP101"]}})
    )
    assert list((await _publish(c, uri)).diagnostics) == []
    # Settings for other tools only, or none at all (pull-model clients): nothing changes.
    c.workspace_did_change_configuration(lsp.DidChangeConfigurationParams(settings={"pylsp": {"x": 1}}))
    c.workspace_did_change_configuration(lsp.DidChangeConfigurationParams(settings=None))
    c.workspace_did_change_configuration(lsp.DidChangeConfigurationParams(settings={"select": ["TOP1"]}))
    assert [d.code for d in (await _publish(c, uri)).diagnostics] == ["TOP101"]
