"""Reading LSP's `Content-Length` frames from a byte stream, resynchronising after a bad one.

pygls's own loop waits forever for a body when a header block has no `Content-Length`, and a body
without a trailing newline then swallows the next frame's header: the server goes deaf. Here a
malformed frame is reported (the server answers it with a JSON-RPC parse error) and everything up
to the next `Content-Length` header is dropped, so the next well-formed message is served.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Protocol

# Searched, not matched: after an unframed body (which has no newline of its own) the next frame's
# header starts in the middle of a line.
_CONTENT_LENGTH = re.compile(rb"content-length[ \t]*:[ \t]*([^\r\n]*?)[ \t]*\r?\n?$", re.IGNORECASE)
_HEADER = re.compile(rb"[A-Za-z0-9-]+[ \t]*:")
# A larger body is refused rather than allocated: stdin's read(n) reserves n bytes up front.
MAX_BODY = 1 << 30


class AsyncReader(Protocol):
    def readline(self) -> Awaitable[bytes]: ...

    def readexactly(self, n: int) -> Awaitable[bytes]: ...


@dataclass(frozen=True)
class FrameError:
    """A frame that cannot be read as a message; ``reason`` says why."""

    reason: str


async def read_frames(reader: AsyncReader) -> AsyncIterator[bytes | FrameError]:
    """Each message body, or a FrameError for each malformed frame, until the end of input."""
    length: int | None = None
    bad_length: str | None = None
    in_headers = False
    skipping = False  # after an error: drop everything up to the next Content-Length header
    while True:
        line = await reader.readline()
        if not line:
            return
        found = _CONTENT_LENGTH.search(line)
        if found:
            if line[: found.start()].strip() and not skipping:
                yield FrameError("data outside a message (no Content-Length header before it)")
            skipping, in_headers = False, True
            value = found.group(1)
            length, bad_length = None, None
            if not value.isdigit():
                bad_length = f"invalid Content-Length {value.decode('latin-1')!r}"
            elif int(value) > MAX_BODY:
                bad_length = f"Content-Length {int(value)} is over the {MAX_BODY}-byte limit"
            else:
                length = int(value)
            continue
        if not line.strip():
            if not in_headers:
                continue  # blank lines between messages, or the tail of skipped data
            in_headers = False
            if bad_length is not None or length is None:
                yield FrameError(bad_length or "message without a Content-Length header")
                skipping, length, bad_length = True, None, None
                continue
            body = await reader.readexactly(length) if length else b""
            if len(body) < length:
                return  # the input ended inside the body
            length = None
            yield body
            continue
        if skipping:
            continue
        if _HEADER.match(line):
            in_headers = True  # another header (Content-Type); only Content-Length matters
            continue
        yield FrameError("data outside a message (no Content-Length header before it)")
        skipping, in_headers, length, bad_length = True, False, None, None
