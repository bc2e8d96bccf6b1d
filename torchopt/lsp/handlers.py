"""The language server's handlers of LSP messages, registered on a server by :func:`register`."""

from __future__ import annotations

import asyncio
import functools
import os
from typing import TYPE_CHECKING, Any, Callable

from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcInvalidParams

from torchopt.lsp.options import OPTION_KEYS, ClientOptions
from torchopt.lsp.document import Doc, uri_to_path
from torchopt.lsp.text import Lines, apply_change, ignore_edit
from torchopt.rewrite.engine import Diagnostic
from torchopt.rewrite.registry import all_rules

if TYPE_CHECKING:
    from torchopt.lsp.server import TorchoptServer

FIX_ALL = "source.fixAll.torchopt"
# Deliberately not under `source.fixAll`: editors run every `source.fixAll.*` action on save, and
# unsafe fixes must only ever be applied on request.
FIX_ALL_UNSAFE = "source.unsafeFixAll.torchopt"


@functools.lru_cache(maxsize=None)
def rule_page(code: str) -> str:
    from torchopt.rewrite.ruledoc import render

    return render(all_rules()[code])


def _check_range(lines: Lines, start: lsp.Position, end: lsp.Position | None = None) -> None:
    """Positions on a line past the document's end, or a range that ends before it starts, are
    invalid params (a character past its line's end is not: LSP says it means the line's end)."""
    for pos in (start, end or start):
        if pos.line >= len(lines):
            raise JsonRpcInvalidParams(
                f"Invalid params: line {pos.line} is past the end of the document ({len(lines)} lines)"
            )
    if end is not None and (end.line, end.character) < (start.line, start.character):
        raise JsonRpcInvalidParams("Invalid params: the range ends before it starts")


def _kind_wanted(kind: str, only: list[str] | None) -> bool:
    return only is None or any(kind == k or kind.startswith(k + ".") for k in only)


def _overlaps(d: Diagnostic, lines: Lines, start: int, end: int) -> bool:
    a = lines.offset(d.line - 1, d.column - 1)
    b = lines.offset(d.end_line - 1, d.end_column - 1)
    return a <= end and start <= b


def feature(*args: Any) -> Callable[[Callable], Callable]:
    """Mark a function as the handler of an LSP method (pygls's ``server.feature`` arguments);
    :func:`register` registers the functions listed in ``HANDLERS``."""

    def mark(fn: Callable) -> Callable:
        fn.lsp_feature = args  # type: ignore[attr-defined]
        return fn

    return mark


def register(server: TorchoptServer) -> None:
    for fn in HANDLERS:
        server.feature(*getattr(fn, "lsp_feature"))(fn)


@feature(lsp.INITIALIZE)
def initialize(ls: TorchoptServer, params: lsp.InitializeParams) -> None:
    ls.options, problems = ClientOptions.parse(params.initialization_options)
    ls.report_option_problems(problems)
    folders = params.workspace_folders or []
    root_uri = folders[0].uri if folders else params.root_uri
    if root_uri:
        ls.root = uri_to_path(root_uri, os.getcwd())
    ls.reload_settings()


@feature(lsp.INITIALIZED)
async def initialized(ls: TorchoptServer, params: lsp.InitializedParams) -> None:
    caps = ls.client_capabilities.workspace
    watched = caps.did_change_watched_files if caps else None
    if watched is not None and watched.dynamic_registration:
        reg = lsp.Registration(
            id="torchopt-pyproject",
            method=lsp.WORKSPACE_DID_CHANGE_WATCHED_FILES,
            register_options=lsp.DidChangeWatchedFilesRegistrationOptions(
                watchers=[lsp.FileSystemWatcher(glob_pattern="**/pyproject.toml")]
            ),
        )
        try:
            await ls.client_register_capability_async(lsp.RegistrationParams(registrations=[reg]))
        except Exception as exc:  # the client said no; settings then reload on save only
            ls.log_line(f"could not watch pyproject.toml files: {exc}", lsp.MessageType.Warning)


@feature(lsp.TEXT_DOCUMENT_DID_OPEN)
async def did_open(ls: TorchoptServer, params: lsp.DidOpenTextDocumentParams) -> None:
    td = params.text_document
    doc = Doc(uri=td.uri, path=uri_to_path(td.uri, ls.root), text=td.text, version=td.version)
    old = ls.docs.get(td.uri)
    if old is not None:
        ls.retire(old)
    ls.docs[td.uri] = doc
    ls.schedule(doc, 0.0)
    ls.text_changed(doc, doc.text)


@feature(lsp.TEXT_DOCUMENT_DID_CHANGE)
async def did_change(ls: TorchoptServer, params: lsp.DidChangeTextDocumentParams) -> None:
    doc = ls.docs.get(params.text_document.uri)
    if doc is None:
        return
    enc = ls.encoding
    for ch in params.content_changes:
        rng = getattr(ch, "range", None)
        if rng is None:
            doc.text = ch.text
        else:
            doc.text = apply_change(
                doc.text, (rng.start.line, rng.start.character), (rng.end.line, rng.end.character), ch.text, enc
            )
    doc.version = params.text_document.version
    doc.touch()
    # The debounce holds back checks while the user types fast: an edit that comes within
    # debounceMs of the one before waits for a pause that long; an edit after a pause (the
    # first keystroke, a paste, a quick fix applied) is checked at once.
    now = asyncio.get_running_loop().time()
    typing = now - doc.last_edit < ls.options.debounce_s
    doc.last_edit = now
    ls.schedule(doc, ls.options.debounce_s if typing else 0.0)
    ls.text_changed(doc, doc.text)


@feature(lsp.TEXT_DOCUMENT_DID_SAVE, lsp.SaveOptions(include_text=False))
async def did_save(ls: TorchoptServer, params: lsp.DidSaveTextDocumentParams) -> None:
    uri = params.text_document.uri
    if os.path.basename(uri_to_path(uri, ls.root)) == "pyproject.toml":
        await _settings_changed(ls)
        return
    doc = ls.docs.get(uri)
    if doc is not None:
        ls.schedule(doc, 0.0)


@feature(lsp.TEXT_DOCUMENT_DID_CLOSE)
def did_close(ls: TorchoptServer, params: lsp.DidCloseTextDocumentParams) -> None:
    doc = ls.docs.pop(params.text_document.uri, None)
    if doc is not None:
        ls.retire(doc)
        ls.text_changed(doc, None)
    ls.text_document_publish_diagnostics(lsp.PublishDiagnosticsParams(uri=params.text_document.uri, diagnostics=[]))


async def _settings_changed(ls: TorchoptServer) -> None:
    ls.reload_settings()
    for doc in list(ls.docs.values()):
        doc.checked_text = None  # force a re-check under the new settings
        doc.broken = False
        ls.schedule(doc, 0.0)


@feature(lsp.WORKSPACE_DID_CHANGE_CONFIGURATION)
async def did_change_configuration(ls: TorchoptServer, params: lsp.DidChangeConfigurationParams) -> None:
    """Client settings changed (the same keys as ``initializationOptions``, optionally under
    ``torchopt``). A client that sends no settings here (the pull model) keeps the current ones."""
    raw = params.settings
    if not isinstance(raw, dict) or not raw:
        return
    if isinstance(raw.get("torchopt"), dict):
        raw = raw["torchopt"]
    elif not any(k in raw for k in OPTION_KEYS):
        return  # settings for other tools only
    ls.options, problems = ClientOptions.parse(raw)
    ls.report_option_problems(problems)
    ls.log_line("client settings changed; settings reloaded")
    await _settings_changed(ls)


@feature(lsp.WORKSPACE_DID_CHANGE_WATCHED_FILES)
async def did_change_watched(ls: TorchoptServer, params: lsp.DidChangeWatchedFilesParams) -> None:
    if any(c.uri.rstrip("/").endswith("pyproject.toml") for c in params.changes):
        ls.log_line("pyproject.toml changed; settings reloaded")
        await _settings_changed(ls)


@feature(
    lsp.TEXT_DOCUMENT_CODE_ACTION,
    lsp.CodeActionOptions(
        code_action_kinds=[lsp.CodeActionKind.QuickFix, FIX_ALL, FIX_ALL_UNSAFE], resolve_provider=True
    ),
)
async def code_action(ls: TorchoptServer, params: lsp.CodeActionParams) -> list[lsp.CodeAction] | None:
    doc = ls.docs.get(params.text_document.uri)
    if doc is None:
        return None
    _check_range(doc.lines(doc.text), params.range.start, params.range.end)
    if params.context.trigger_kind == lsp.CodeActionTriggerKind.Automatic and doc.checked_text != doc.text:
        # Lightbulb requests come with every cursor move while typing: wait for the debounced
        # check (editors ask again when the diagnostics arrive) instead of checking now.
        return None
    cur = await ls.current(doc)
    if cur is None:
        return None
    text, diags = cur
    lines = doc.lines(text)
    enc = ls.encoding
    start = lines.from_client(params.range.start.line, params.range.start.character, enc)
    end = lines.from_client(params.range.end.line, params.range.end.character, enc)
    only = [str(getattr(k, "value", k)) for k in params.context.only] if params.context.only else None
    ca = ls.client_capabilities.text_document
    resolve = ca and ca.code_action and ca.code_action.resolve_support
    lazy = bool(resolve and "edit" in resolve.properties)
    base = {"uri": doc.uri, "version": doc.version}
    actions: list[tuple[lsp.CodeAction, dict | None]] = []
    if _kind_wanted(lsp.CodeActionKind.QuickFix.value, only):
        ignored: set[tuple[str, int]] = set()
        for d in diags:
            if not _overlaps(d, lines, start, end):
                continue
            ld = ls.to_lsp(d, lines)
            if d.fix is not None:
                title = d.fix.title or f"Fix {d.code}"
                if d.fix.safety == "unsafe":
                    title += f" (unsafe: {d.fix.changes() or 'changes behaviour'})"
                fix_data = {**base, "op": "fix", "code": d.code, "line": d.line, "column": d.column}
                actions.append(
                    (
                        lsp.CodeAction(
                            title=title,
                            kind=lsp.CodeActionKind.QuickFix,
                            diagnostics=[ld],
                            is_preferred=d.fix.safety == "safe",
                        ),
                        fix_data,
                    )
                )
            if (d.code, d.line) not in ignored:
                ignored.add((d.code, d.line))
                edit = ignore_edit(text, d.code, (d.line - 1, d.end_line - 1))
                if edit is not None:
                    actions.append(
                        (
                            lsp.CodeAction(
                                title=f"Ignore {d.code} on this line",
                                kind=lsp.CodeActionKind.QuickFix,
                                diagnostics=[ld],
                                edit=ls.workspace_edit(doc, text, [edit]),
                            ),
                            None,
                        )
                    )
    settings = ls.settings_for(doc.path)
    has_safe = any(d.fix is not None and d.fix.safety == "safe" for d in diags)
    has_unsafe = any(d.fix is not None and d.fix.safety == "unsafe" for d in diags)
    if has_safe or (has_unsafe and settings.unsafe_fixes):
        if _kind_wanted(FIX_ALL, only):
            actions.append(
                (
                    lsp.CodeAction(
                        title="torchopt: fix all (safe fixes)"
                        if not settings.unsafe_fixes
                        else "torchopt: fix all (unsafe fixes enabled)",
                        kind=FIX_ALL,
                    ),
                    {**base, "op": "fixAll"},
                )
            )
    if has_unsafe and not settings.unsafe_fixes and _kind_wanted(FIX_ALL_UNSAFE, only):
        actions.append(
            (
                lsp.CodeAction(title="torchopt: fix all, unsafe fixes too", kind=FIX_ALL_UNSAFE),
                {**base, "op": "fixAllUnsafe"},
            )
        )
    out = []
    for action, data in actions:
        if data is not None:
            if lazy:
                action.data = data
            else:
                edits = await ls.edit_for(doc, text, data)
                if edits is None:
                    continue
                action.edit = ls.workspace_edit(doc, text, edits)
        out.append(action)
    return out


@feature(lsp.CODE_ACTION_RESOLVE)
async def code_action_resolve(ls: TorchoptServer, action: lsp.CodeAction) -> lsp.CodeAction:
    data = action.data if isinstance(action.data, dict) else {}
    doc = ls.docs.get(data.get("uri", ""))
    if doc is None or doc.version != data.get("version"):
        return action  # the document changed: no edit rather than a stale one
    text = doc.text
    edits = await ls.edit_for(doc, text, data)
    if edits is not None and doc.text == text:
        action.edit = ls.workspace_edit(doc, text, edits)
    return action


@feature(lsp.TEXT_DOCUMENT_HOVER)
async def hover(ls: TorchoptServer, params: lsp.HoverParams) -> lsp.Hover | None:
    doc = ls.docs.get(params.text_document.uri)
    if doc is None:
        return None
    _check_range(doc.lines(doc.text), params.position)
    cur = await ls.current(doc)
    text, diags = cur if cur is not None else (doc.checked_text, doc.diags)
    if text is None:
        return None
    lines = doc.lines(text)
    at = lines.from_client(params.position.line, params.position.character, ls.encoding)
    hits = [d for d in diags if _overlaps(d, lines, at, at)]
    if not hits:
        return None
    codes = list(dict.fromkeys(d.code for d in hits))
    pages = await ls.run(lambda: [rule_page(c) for c in codes])
    return lsp.Hover(
        contents=lsp.MarkupContent(kind=lsp.MarkupKind.Markdown, value="\n\n---\n\n".join(pages)),
        range=ls.lsp_range(hits[0], lines),
    )


HANDLERS: tuple[Callable, ...] = (
    initialize,
    initialized,
    did_open,
    did_change,
    did_save,
    did_close,
    did_change_configuration,
    did_change_watched,
    code_action,
    code_action_resolve,
    hover,
)
