"""Reading source files: bytes -> text, keeping what is needed to write the exact same bytes back
(declared encoding, UTF-8 BOM). Line endings stay inside the text untouched: LibCST round-trips them."""
from __future__ import annotations

import io
import os
import tokenize
from dataclasses import dataclass

GENERATED_MARKER = "@generated"
DEFAULT_MAX_BYTES = 2 * 1024 * 1024


class SourceError(Exception):
    """A file we cannot handle; the message is one line, for the user."""


@dataclass(frozen=True)
class SourceText:
    text: str
    encoding: str  # as Python's tokenize detects it ("utf-8-sig" when a BOM is present)

    def encode(self, text: str) -> bytes:
        return text.encode(self.encoding)


def decode(data: bytes) -> SourceText:
    if b"\x00" in data:
        raise SourceError("contains NUL bytes: binary data, not Python source")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        msg = getattr(exc, "msg", None) or str(exc)
        if "invalid or missing" in msg:
            raise SourceError("cannot decode: not valid UTF-8 and no encoding declared (PEP 263)") from None
        raise SourceError(f"bad encoding declaration: {_one_line(exc)}") from None
    try:
        text = data.decode(encoding)
    except (UnicodeDecodeError, LookupError) as exc:
        raise SourceError(f"cannot decode as {encoding}: {_one_line(exc)}") from None
    return SourceText(text=text, encoding=encoding)


def read(path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> SourceText:
    try:
        size = os.stat(path).st_size
        if max_bytes and size > max_bytes:
            raise SourceError(
                f"file is {size / 1e6:.1f} MB, over the {max_bytes / 1e6:.1f} MB limit "
                "(raise `max-file-size` in [tool.torchopt] to process it)"
            )
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise SourceError(f"cannot read: {exc.strerror or exc}") from None
    return decode(data)


def is_generated(text: str) -> bool:
    """Files that say they are generated (in their first lines) are not ours to edit."""
    return GENERATED_MARKER in text[:2000]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
