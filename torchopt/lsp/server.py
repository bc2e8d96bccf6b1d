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
from concurrent.futures import ThreadPoolExecutor

from cattrs import transform_error
from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcInternalError, JsonRpcInvalidParams, JsonRpcInvalidRequest, JsonRpcParseError
from pygls.io_ import StdinAsyncReader, StdoutWriter
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol

from torchopt import __version__
from torchopt.lsp.document import Doc
from torchopt.lsp.frames import FrameError, read_frames
from torchopt.lsp.handlers import register
from torchopt.lsp.lanes import LARGE_DOC_CHARS, Checked, Lane, LaneDied, check_text
from torchopt.lsp.options import ClientOptions
from torchopt.lsp.render import Renderer, lsp_json, lsp_range, publish_message
from torchopt.lsp.text import UTF16, Edit, Lines, minimal_edits
from torchopt.rewrite.config import ConfigError, Resolver, Settings
from torchopt.rewrite.engine import Diagnostic, FixError, ParseError, fix_source
from torchopt.rewrite.incremental import Stale
from torchopt.rewrite.projectscope import LiveScope
from torchopt.rewrite.source import is_generated

log = logging.getLogger("torchopt.lsp")

# Documents analysed at the same time, each in its own thread (one slow document never holds up the
# others); more than this many busy documents queue for a thread.
ENGINE_THREADS = 32


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
        # The project index of every document: other modules are read from the editor's unsaved
        # text when they are open, and each module's summary is made again only when it changes.
        self.scope = LiveScope()
        self.changes = 0  # texts changed (text_changed), and the count when each file last changed
        self.changed_at: dict[str, int] = {}

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
        self.scope = LiveScope()  # project folders may have moved with the settings files
        for doc in self.docs.values():
            self.scope.set_text(doc.path, doc.text)

    def text_changed(self, doc: Doc, text: str | None) -> None:
        """The editor's text of ``doc`` is now ``text`` (None: closed, its file's text counts again):
        the other open documents whose diagnostics were read from it are checked again, after the
        debounce (a check under way when it changed is, when it read it: ``analyse``). Their results
        that did not read it, or read a summary of it that did not change, are kept."""
        if not doc.uri.startswith("file:") or not self.scope.set_text(doc.path, text):
            return
        real = os.path.realpath(doc.path)
        self.changes += 1
        self.changed_at[real] = self.changes
        for other in list(self.docs.values()):
            if other is not doc and real in other.reads:
                self.recheck(other)

    def recheck(self, doc: Doc) -> None:
        doc.checked_text = None
        self.schedule(doc, self.options.debounce_s)

    def others(self, doc: Doc) -> dict[str, str]:
        """The unsaved texts of the open documents other than ``doc``, by path."""
        return {d.path: d.text for d in self.docs.values() if d is not doc and d.uri.startswith("file:")}

    async def run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.engine, functools.partial(fn, *args, **kwargs))

    async def check_text(self, doc: Doc, text: str, edits: int, settings: Settings) -> Checked:
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
            doc.job = self.engine.submit(doc.lane.check, text, settings, doc.path, edits, look, self.others(doc))
        else:
            stale = lambda: doc.edits != edits  # noqa: E731
            doc.job = self.engine.submit(
                check_text, doc.checker, text, settings, doc.path, stale, look, self.renderer, self.scope
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
        text, version, edits, changes = doc.text, doc.version, doc.edits, self.changes
        if doc.checked_text == text and not doc.broken:
            return True
        settings = self.settings_for(doc.path)
        if is_generated(text) or (settings.max_file_size and len(text) > settings.max_file_size):
            # What `torchopt check` skips (marked @generated, over `max-file-size`) shows nothing here.
            doc.broken, doc.checked_text, doc.diags, doc.rendered = False, text, [], None
            return True
        try:
            problem, diags, rendered, reads = await self.check_text(doc, text, edits, settings)
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
        if changes != self.changes and any(self.changed_at.get(r, 0) > changes for r in reads):
            self.recheck(doc)  # a file it read changed while it was checked
            return False
        doc.broken = False
        doc.checked_text, doc.diags, doc.rendered, doc.reads = text, diags, rendered, reads
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


def create_server() -> TorchoptServer:
    server = TorchoptServer()
    register(server)
    return server


def main() -> None:
    from torchopt.rewrite import speedups
    from torchopt.rewrite.runner import tune_gc

    logging.basicConfig(level=logging.WARNING, format="torchopt-lsp: %(levelname)s %(message)s")
    tune_gc()
    speedups.install()
    raise SystemExit(create_server().start_io())
