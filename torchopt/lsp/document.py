"""A document open in the editor, as the language server keeps it."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

from torchopt.lsp.lanes import Lane
from torchopt.lsp.text import Lines
from torchopt.rewrite.engine import Diagnostic
from torchopt.rewrite.incremental import IncrementalChecker


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
    # The other files its diagnostics were read from (the project index): when one of them changes,
    # open in the editor or not, the document is checked again.
    reads: frozenset[str] = frozenset()
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
