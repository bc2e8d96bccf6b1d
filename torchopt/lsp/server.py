"""`torchopt lsp`: a language server on pygls 2 over stdio.

It uses only the engine's pure functions (the incremental form of check_source, fix_source on the
editor's text): no file discovery, no process pool, and it never writes a file (fixes go back to the
editor as edits). After an edit only the part of the module the edit can affect is re-analysed
(rewrite/incremental.py); the diagnostics equal `torchopt check`'s.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

from cattrs import transform_error
from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcInternalError, JsonRpcInvalidParams, JsonRpcInvalidRequest, JsonRpcParseError
from pygls.io_ import StdinAsyncReader, StdoutWriter
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol

from torchopt import __version__
from torchopt.lsp.frames import FrameError, read_frames
from torchopt.lsp.lanes import LARGE_DOC_CHARS, Lane, LaneDied, check_text
from torchopt.lsp.options import OPTION_KEYS, ClientOptions
from torchopt.lsp.render import Renderer, lsp_json, lsp_range, publish_message
from torchopt.lsp.text import UTF16, Edit, Lines, apply_change, ignore_edit, minimal_edits
from torchopt.rewrite.config import ConfigError, Resolver, Settings
from torchopt.rewrite.engine import Diagnostic, FixError, ParseError, fix_source
from torchopt.rewrite.incremental import IncrementalChecker, Stale
from torchopt.rewrite.registry import all_rules
from torchopt.rewrite.source import is_generated

log = logging.getLogger("torchopt.lsp")

FIX_ALL = "source.fixAll.torchopt"
# Deliberately not under `source.fixAll`: editors run every `source.fixAll.*` action on save, and
# unsafe fixes must only ever be applied on request.
FIX_ALL_UNSAFE = "source.unsafeFixAll.torchopt"
# Documents analysed at the same time, each in its own thread (one slow document never holds up the
# others); more than this many busy documents queue for a thread.
ENGINE_THREADS = 32


@dataclass
class Doc:
    uri: str
    path: str
    text: str
    version: int | None
    # The last text that parsed, and its diagnostics (kept while the user types broken code).
    checked_text: str | None = None
    diags: list[Diagnostic] = field(default_factory=list)
    # The LSP JSON array of ``diags`` and the (encoding, ruleUrl) it was rendered with, when it was
    # rendered off the event loop along with the check.
    rendered: tuple[tuple[str, str], bytes] | None = field(default=None, repr=False)
    broken: bool = False
    task: asyncio.Task | None = None
    # Its own incremental checker (results per group of statements), or its own worker process once
    # it is large (lanes.py); the engine job now running for it (one at a time per document, since
    # the checker is not thread-safe); how many times it changed (a check of an older text stops).
    checker: IncrementalChecker = field(default_factory=IncrementalChecker, repr=False)
    lane: Lane | None = field(default=None, repr=False)
    job: Future | None = field(default=None, repr=False)
    edits: int = 0
    last_edit: float = float("-inf")  # the event loop's clock at the last change
    no_lane: bool = False  # a process could not be started for it
    _lines_cache: dict[str, Lines] = field(default_factory=dict, repr=False)

    def touch(self) -> None:
        """The text changed, or the document was closed: checks of the text before stop."""
        self.edits += 1
        if self.lane is not None:
            self.lane.touch(self.edits)

    def lines(self, text: str) -> Lines:
        cache = self._lines_cache
        hit = cache.get(text)
        if hit is None:
            cache.clear()  # keeps at most the texts asked for since the last change
            hit = cache[text] = Lines(text)
        return hit


def uri_to_path(uri: str, root: str) -> str:
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        path = unquote(parsed.path)
        if os.name == "nt" and len(path) > 2 and path[0] == "/" and path[2] == ":":
            path = path[1:]
        return os.path.normpath(path)
    # Unsaved buffers (untitled:...) take the settings of the workspace folder.
    return os.path.join(root, "untitled.py")


@functools.lru_cache(maxsize=None)
def rule_page(code: str) -> str:
    from torchopt.rewrite.ruledoc import render

    return render(all_rules()[code])


def _why(exc: BaseException) -> str:
    """A short reason for params that do not fit the method's type (cattrs explains by field)."""
    cause = exc.__cause__ or exc
    try:
        reasons = transform_error(cause) if isinstance(cause, Exception) else []
    except Exception:  # a shape transform_error does not know
        reasons = []
    reasons = [r.replace("$.", "") for r in reasons] or [str(cause) or type(cause).__name__]
    return "; ".join(reasons[:3])


class TorchoptProtocol(LanguageServerProtocol):
    """pygls's protocol, strict about what the client sends: every request gets an answer (a parse
    error, an invalid request or invalid params as the JSON-RPC error response), and nothing a
    client sends stops the server from reading the next message."""

    def __init__(self, server, converter) -> None:
        super().__init__(server, converter)
        self.shutdown_requested = False

    def send_error(self, msg_id: int | str | None, code: int, message: str) -> None:
        # A plain dict: lsprotocol's converter drops `"id": null`, which JSON-RPC requires when
        # the request's id could not be read.
        self._send_data({"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}})

    def send_bytes(self, data: bytes) -> None:
        """Write one framed message that is already serialised."""
        if self.writer is None:
            return
        res = self.writer.write(data)
        if inspect.isawaitable(res):
            asyncio.ensure_future(res)

    def log(self, message: str) -> None:
        self.notify(lsp.WINDOW_LOG_MESSAGE, lsp.LogMessageParams(type=lsp.MessageType.Warning, message=message))

    def receive(self, body: bytes) -> None:
        """Check and dispatch one framed message."""
        try:
            raw = json.loads(body)
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurd nesting
            self.send_error(None, JsonRpcParseError.CODE, f"Parse error: {exc}")
            return
        if not isinstance(raw, dict):
            self.send_error(None, JsonRpcInvalidRequest.CODE, "Invalid request: a message must be a JSON object")
            return
        msg_id = raw.get("id")
        good_id = isinstance(msg_id, (int, str)) and not isinstance(msg_id, bool)
        method = raw.get("method")
        if "method" not in raw:  # a response to one of our requests
            if raw.get("jsonrpc") != "2.0" or not good_id:
                self.log(f"ignored a malformed response from the client: {body[:200]!r}")
                return
        elif raw.get("jsonrpc") != "2.0" or not isinstance(method, str) or ("id" in raw and not good_id):
            self.send_error(
                msg_id if good_id else None,
                JsonRpcInvalidRequest.CODE,
                'Invalid request: needs "jsonrpc": "2.0", a string "method" and an integer or string "id"',
            )
            return
        is_request = "method" in raw and "id" in raw
        if self.shutdown_requested and method != lsp.EXIT:
            if is_request:
                self.send_error(msg_id, JsonRpcInvalidRequest.CODE, f"Invalid request: {method} after shutdown")
            return
        try:
            message = self.structure_message(raw)
        except Exception as exc:
            if is_request:
                self.send_error(msg_id, JsonRpcInvalidParams.CODE, f"Invalid params for {method}: {_why(exc)}")
            else:
                self.log(f"ignored {method or 'a response'}: invalid params: {_why(exc)}")
            return
        if is_request and method == lsp.SHUTDOWN:
            self.shutdown_requested = True
        try:
            self.handle_message(message)
        except (SystemExit, KeyboardInterrupt):
            raise
        except Exception as exc:  # pygls answers requests itself; never let one message end the loop
            log.exception("cannot handle %s", method)
            if is_request:
                self.send_error(msg_id, JsonRpcInternalError.CODE, f"Internal error: {type(exc).__name__}: {exc}")


class TorchoptServer(LanguageServer):
    def __init__(self) -> None:
        super().__init__(
            "torchopt",
            __version__,
            text_document_sync_kind=lsp.TextDocumentSyncKind.Incremental,
            protocol_cls=TorchoptProtocol,
        )
        self.docs: dict[str, Doc] = {}
        self.options = ClientOptions()
        self.resolver = Resolver(self.options.overrides())
        self.root = os.getcwd()
        # Analyses run off the event loop (so new edits are read while one runs), one thread per
        # document being analysed: a large document does not hold up the diagnostics of the others.
        # A document's analysis stops early when its text changes (Stale); stale results are dropped.
        self.engine = ThreadPoolExecutor(max_workers=ENGINE_THREADS, thread_name_prefix="torchopt-engine")
        self._good_settings: dict[str, Settings] = {}
        self._config_errors: set[str] = set()
        self.renderer = Renderer()  # the JSON of diagnostics checked in this process

    # transport ----------------------------------------------------------------------------------

    def start_io(self, stdin=None, stdout=None) -> int:
        """Serve on stdio until `exit` (or the end of input) and return the exit code: 0 after
        `shutdown`, 1 for `exit` without it (pygls's own loop swallows that code)."""
        reader = StdinAsyncReader(stdin or sys.stdin.buffer, self.thread_pool)
        self.protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
        try:
            asyncio.run(self.serve(reader))
        except SystemExit as exc:  # the `exit` notification
            return exc.code if isinstance(exc.code, int) else 1
        except BrokenPipeError:
            log.error("the client closed the connection")
            return 1
        except KeyboardInterrupt:
            return 130
        finally:
            for doc in self.docs.values():
                if doc.lane is not None:
                    doc.lane.close()
            self.shutdown()
        return 0

    async def serve(self, reader: StdinAsyncReader) -> None:
        protocol = self.protocol
        assert isinstance(protocol, TorchoptProtocol)  # (__init__ passes it as protocol_cls)
        async for frame in read_frames(reader):
            if isinstance(frame, FrameError):
                protocol.send_error(None, JsonRpcParseError.CODE, f"Parse error: {frame.reason}")
            else:
                protocol.receive(frame)

    # plumbing -----------------------------------------------------------------------------------

    @property
    def encoding(self) -> str:
        enc = self.workspace.position_encoding if self.protocol._workspace is not None else None
        return str(getattr(enc, "value", enc) or UTF16)

    def log_line(self, message: str, kind: lsp.MessageType = lsp.MessageType.Info) -> None:
        self.window_log_message(lsp.LogMessageParams(type=kind, message=message))

    def report_option_problems(self, problems: list[str]) -> None:
        """Client settings the server rejected (the defaults stand in for them): one message the
        user sees, and each problem in the log."""
        if not problems:
            return
        for p in problems:
            self.log_line(p, lsp.MessageType.Warning)
        shown = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more in the log)" if len(problems) > 3 else "")
        self.window_show_message(
            lsp.ShowMessageParams(type=lsp.MessageType.Warning, message=f"torchopt: invalid settings: {shown}")
        )

    def settings_for(self, path: str) -> Settings:
        folder = os.path.dirname(path)
        try:
            s = self.resolver.for_path(path)
        except ConfigError as exc:
            msg = str(exc)
            if msg not in self._config_errors:
                self._config_errors.add(msg)
                self.window_show_message(
                    lsp.ShowMessageParams(type=lsp.MessageType.Warning, message=f"torchopt: {msg}")
                )
                self.log_line(f"configuration error: {msg}", lsp.MessageType.Warning)
            return self._good_settings.get(folder) or self.options.overrides().apply(Settings(root=self.root))
        self._good_settings[folder] = s
        return s

    def reload_settings(self) -> None:
        self.resolver = Resolver(self.options.overrides())
        self._config_errors.clear()

    async def run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.engine, functools.partial(fn, *args, **kwargs))

    async def check_text(
        self, doc: Doc, text: str, edits: int, settings: Settings
    ) -> tuple[str | None, list[Diagnostic], tuple[tuple[str, str], bytes] | None]:
        """Check ``text`` in the document's lane (lanes.check_text), after the document's previous
        job has finished: a cancelled caller leaves its job running, and the next one waits for it
        rather than share the checker. ``edits`` is the document's edit count when it had ``text``."""
        while doc.job is not None and not doc.job.done():
            await asyncio.wait([asyncio.wrap_future(doc.job)])
        if doc.lane is None and len(text) >= LARGE_DOC_CHARS and not doc.no_lane:
            try:
                doc.lane = Lane()
                self.log_line(f"{doc.path}: {len(text)} characters: checked in a process of its own")
            except OSError as exc:  # no process to be had: checked in a thread, like a small file
                doc.no_lane = True
                self.log_line(f"{doc.path}: cannot start a process to check it in: {exc}", lsp.MessageType.Warning)
        look = (self.encoding, self.options.rule_url)
        if doc.lane is not None:
            doc.job = self.engine.submit(doc.lane.check, text, settings, doc.path, edits, look)
        else:
            doc.job = self.engine.submit(
                check_text, doc.checker, text, settings, doc.path, lambda: doc.edits != edits, look, self.renderer
            )
        return await asyncio.wrap_future(doc.job)

    def retire(self, doc: Doc) -> None:
        """The document was closed (or opened again): stop its checks and end its process."""
        doc.touch()
        if doc.task is not None:
            doc.task.cancel()
        if doc.lane is not None:
            self.engine.submit(doc.lane.close)
            doc.lane = None

    # analysis -------------------------------------------------------------------------------------

    async def analyse(self, doc: Doc) -> bool:
        """Check the document's current text; True when its diagnostics are now current."""
        text, version, edits = doc.text, doc.version, doc.edits
        if doc.checked_text == text and not doc.broken:
            return True
        settings = self.settings_for(doc.path)
        if is_generated(text) or (settings.max_file_size and len(text) > settings.max_file_size):
            # What `torchopt check` skips (marked @generated, over `max-file-size`) shows nothing here.
            doc.broken, doc.checked_text, doc.diags, doc.rendered = False, text, [], None
            return True
        try:
            problem, diags, rendered = await self.check_text(doc, text, edits, settings)
        except Stale:
            return False  # a newer analysis is scheduled (or the document was closed)
        except LaneDied as exc:
            if self.docs.get(doc.uri) is doc and doc.lane is not None:
                self.log_line(f"{doc.path}: {exc}; starting another", lsp.MessageType.Warning)
                self.engine.submit(doc.lane.close)
                doc.lane = None
            return False
        except (RecursionError, MemoryError) as exc:  # deep nesting the pre-check did not see
            return self.unanalysable(doc, text, f"too deeply nested to analyse ({type(exc).__name__})")
        except ParseError as exc:
            if doc.text == text and not doc.broken:
                doc.broken = True
                self.log_line(f"{doc.path}: {exc}; keeping the last diagnostics until it parses")
            return False
        except Exception as exc:  # a rule's bug must not take the server down
            self.log_line(f"{doc.path}: internal error: {type(exc).__name__}: {exc}", lsp.MessageType.Error)
            return False
        if problem is not None:
            return self.unanalysable(doc, text, problem)
        if doc.text != text or doc.version != version:
            return False  # edited meanwhile; a newer analysis is scheduled
        doc.broken = False
        doc.checked_text, doc.diags, doc.rendered = text, diags, rendered
        return True

    def unanalysable(self, doc: Doc, text: str, problem: str) -> bool:
        """Show no diagnostics for a text the engine cannot take (and say why in the log once)."""
        if doc.text != text:
            return False  # edited meanwhile; a newer analysis is scheduled
        if doc.checked_text != text:
            self.log_line(f"{doc.path}: {problem}; no diagnostics for it", lsp.MessageType.Warning)
        doc.broken, doc.checked_text, doc.diags, doc.rendered = False, text, [], None
        return True

    async def analyse_and_publish(self, doc: Doc, delay: float = 0.0) -> None:
        try:
            if delay:
                await asyncio.sleep(delay)
            if await self.analyse(doc) and self.docs.get(doc.uri) is doc:
                self.publish(doc)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a background task must never die silently
            self.log_line(f"{doc.path}: internal error: {type(exc).__name__}: {exc}", lsp.MessageType.Error)

    def schedule(self, doc: Doc, delay: float) -> None:
        if doc.task is not None and not doc.task.done():
            doc.task.cancel()
        doc.task = asyncio.ensure_future(self.analyse_and_publish(doc, delay))

    def publish(self, doc: Doc) -> None:
        """Send the document's diagnostics: the JSON rendered with its check (one write, however
        many there are), or rendered here when the client settings changed since."""
        assert doc.checked_text is not None
        look = (self.encoding, self.options.rule_url)
        if doc.rendered is not None and doc.rendered[0] == look:
            array = doc.rendered[1]
        else:
            array = self.renderer.array(doc.diags, doc.checked_text, *look)
        protocol = self.protocol
        assert isinstance(protocol, TorchoptProtocol)
        protocol.send_bytes(publish_message(doc.uri, doc.version, array))

    def lsp_range(self, d: Diagnostic, lines: Lines) -> lsp.Range:
        return self.protocol._converter.structure(lsp_range(d, lines, self.encoding), lsp.Range)

    def to_lsp(self, d: Diagnostic, lines: Lines) -> lsp.Diagnostic:
        """The LSP form of ``d`` (for code actions: the diagnostics are published as JSON)."""
        data = lsp_json(d, lines, self.encoding, self.options.rule_url)
        return self.protocol._converter.structure(data, lsp.Diagnostic)

    async def current(self, doc: Doc) -> tuple[str, list[Diagnostic]] | None:
        """Diagnostics for the document's current text (None while it does not parse)."""
        if doc.task is not None and not doc.task.done():
            doc.task.cancel()
        if not await self.analyse(doc) or doc.checked_text is None:
            return None
        if doc.checked_text != doc.text:
            return None
        self.publish(doc)  # the pending debounced publish was cancelled above
        return doc.checked_text, doc.diags

    # edits ----------------------------------------------------------------------------------------

    def workspace_edit(self, doc: Doc, text: str, edits: list[Edit]) -> lsp.WorkspaceEdit:
        lines = doc.lines(text)
        enc = self.encoding
        text_edits = []
        for e in edits:
            sl, sc = lines.offset_to_client(e.start, enc)
            el, ec = lines.offset_to_client(e.end, enc)
            text_edits.append(
                lsp.TextEdit(range=lsp.Range(lsp.Position(sl, sc), lsp.Position(el, ec)), new_text=e.text)
            )
        caps = self.client_capabilities.workspace
        versioned = bool(caps and caps.workspace_edit and caps.workspace_edit.document_changes)
        if versioned:
            ident = lsp.OptionalVersionedTextDocumentIdentifier(uri=doc.uri, version=doc.version)
            return lsp.WorkspaceEdit(document_changes=[lsp.TextDocumentEdit(text_document=ident, edits=text_edits)])
        return lsp.WorkspaceEdit(changes={doc.uri: text_edits})

    async def edit_for(self, doc: Doc, text: str, data: dict) -> list[Edit] | None:
        """The edits of a fix action on ``text``; None when there is nothing to do or it failed."""
        settings = self.settings_for(doc.path)
        edits, error = await self.run(compute_edit, doc.path, text, data, settings)
        if error:
            self.log_line(f"{doc.path}: cannot fix: {error}", lsp.MessageType.Warning)
        return edits


def compute_edit(path: str, text: str, data: dict, settings: Settings) -> tuple[list[Edit] | None, str | None]:
    """Pure (runs in the engine thread): the minimal edits of one fix action, or an error."""
    op = data.get("op")
    try:
        if op == "fix":
            code, line, column = data["code"], data["line"], data["column"]
            hits: list[Diagnostic] = []

            def only(d: Diagnostic) -> bool:  # this one diagnostic, in the first pass only
                ok = not hits and d.code == code and d.line == line and d.column == column
                if ok:
                    hits.append(d)
                return ok

            new = fix_source(text, settings, path, unsafe=True, codes=[code], only=only).text
        elif op in ("fixAll", "fixAllUnsafe"):
            unsafe = True if op == "fixAllUnsafe" else settings.unsafe_fixes
            new = fix_source(text, settings, path, unsafe=unsafe).text
        else:
            return None, None
    except (ParseError, FixError) as exc:
        return None, str(exc)
    except Exception as exc:  # a rule's bug must not take the server down
        return None, f"internal error: {type(exc).__name__}: {exc}"
    return minimal_edits(text, new) or None, None


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


def create_server() -> TorchoptServer:
    server = TorchoptServer()

    @server.feature(lsp.INITIALIZE)
    def initialize(ls: TorchoptServer, params: lsp.InitializeParams) -> None:
        ls.options, problems = ClientOptions.parse(params.initialization_options)
        ls.report_option_problems(problems)
        folders = params.workspace_folders or []
        root_uri = folders[0].uri if folders else params.root_uri
        if root_uri:
            ls.root = uri_to_path(root_uri, os.getcwd())
        ls.reload_settings()

    @server.feature(lsp.INITIALIZED)
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

    @server.feature(lsp.TEXT_DOCUMENT_DID_OPEN)
    async def did_open(ls: TorchoptServer, params: lsp.DidOpenTextDocumentParams) -> None:
        td = params.text_document
        doc = Doc(uri=td.uri, path=uri_to_path(td.uri, ls.root), text=td.text, version=td.version)
        old = ls.docs.get(td.uri)
        if old is not None:
            ls.retire(old)
        ls.docs[td.uri] = doc
        ls.schedule(doc, 0.0)

    @server.feature(lsp.TEXT_DOCUMENT_DID_CHANGE)
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

    @server.feature(lsp.TEXT_DOCUMENT_DID_SAVE, lsp.SaveOptions(include_text=False))
    async def did_save(ls: TorchoptServer, params: lsp.DidSaveTextDocumentParams) -> None:
        uri = params.text_document.uri
        if os.path.basename(uri_to_path(uri, ls.root)) == "pyproject.toml":
            await _settings_changed(ls)
            return
        doc = ls.docs.get(uri)
        if doc is not None:
            ls.schedule(doc, 0.0)

    @server.feature(lsp.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: TorchoptServer, params: lsp.DidCloseTextDocumentParams) -> None:
        doc = ls.docs.pop(params.text_document.uri, None)
        if doc is not None:
            ls.retire(doc)
        ls.text_document_publish_diagnostics(lsp.PublishDiagnosticsParams(uri=params.text_document.uri, diagnostics=[]))

    async def _settings_changed(ls: TorchoptServer) -> None:
        ls.reload_settings()
        for doc in list(ls.docs.values()):
            doc.checked_text = None  # force a re-check under the new settings
            doc.broken = False
            ls.schedule(doc, 0.0)

    @server.feature(lsp.WORKSPACE_DID_CHANGE_CONFIGURATION)
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

    @server.feature(lsp.WORKSPACE_DID_CHANGE_WATCHED_FILES)
    async def did_change_watched(ls: TorchoptServer, params: lsp.DidChangeWatchedFilesParams) -> None:
        if any(c.uri.rstrip("/").endswith("pyproject.toml") for c in params.changes):
            ls.log_line("pyproject.toml changed; settings reloaded")
            await _settings_changed(ls)

    @server.feature(
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

    @server.feature(lsp.CODE_ACTION_RESOLVE)
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

    @server.feature(lsp.TEXT_DOCUMENT_HOVER)
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

    return server


def main() -> None:
    from torchopt.rewrite import speedups
    from torchopt.rewrite.runner import tune_gc

    logging.basicConfig(level=logging.WARNING, format="torchopt-lsp: %(levelname)s %(message)s")
    tune_gc()
    speedups.install()
    raise SystemExit(create_server().start_io())
