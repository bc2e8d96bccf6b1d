"""Reading source files: bytes -> text, keeping what is needed to write the exact same bytes back
(declared encoding, UTF-8 BOM) and what the file was when read (so a later write can tell whether
someone changed it meanwhile). Line endings stay inside the text untouched."""

from __future__ import annotations

import dataclasses
import io
import os
import stat
import tokenize
import warnings
from dataclasses import dataclass

try:  # what hashlib.blake2b is, without hashlib loading OpenSSL's bindings (part of a one-file start-up)
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - a Python built without it
    from hashlib import blake2b

GENERATED_MARKER = "@generated"
DEFAULT_MAX_BYTES = 2 * 1024 * 1024


class SourceError(Exception):
    """A file we cannot handle; the message is one line, for the user."""


@dataclass(frozen=True)
class FileState:
    """The identity and content of a file when it was read; a write is refused unless it still matches."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    digest: bytes

    @classmethod
    def of(cls, st: os.stat_result, data: bytes) -> "FileState":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, content_digest(data))

    def same_stat(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (self.device, self.inode, self.size, self.mtime_ns)


def content_digest(data: bytes) -> bytes:
    return blake2b(data, digest_size=32).digest()


@dataclass(frozen=True)
class SourceText:
    text: str
    encoding: str  # as Python's tokenize detects it ("utf-8-sig" when a BOM is present)
    state: FileState | None = dataclasses.field(default=None, compare=False)  # set when read from a file

    def encode(self, text: str) -> bytes:
        """The bytes for ``text``; raises SourceError when the codec would not give ``text`` back
        (a codec such as raw_unicode_escape can turn new text into an escape sequence)."""
        try:
            data = text.encode(self.encoding)
            same = data.decode(self.encoding) == text
        except UnicodeError as exc:
            raise SourceError(f"cannot encode the fixed text as {self.encoding}: {_one_line(exc)}") from None
        if not same:
            raise SourceError(f"the fixed text would not read back the same in {self.encoding}; left unchanged")
        return data


# Text a codec must map to itself byte for byte to be trusted with Python source: every printable ASCII
# character and the whitespace Python knows. utf-7, unicode_escape and EBCDIC codecs fail it.
_ASCII_PROBE = bytes(range(0x20, 0x7F)) + b"\t\n\r\x0c"


def _ascii_compatible(encoding: str) -> bool:
    if encoding == "utf-8-sig":  # UTF-8 behind a BOM, which the probe would otherwise gain
        encoding = "utf-8"
    try:
        with warnings.catch_warnings():  # escape codecs warn about the probe's backslash sequences
            warnings.simplefilter("ignore")
            return (
                _ASCII_PROBE.decode(encoding) == _ASCII_PROBE.decode("ascii")
                and _ASCII_PROBE.decode("ascii").encode(encoding) == _ASCII_PROBE
            )
    except (UnicodeError, LookupError, TypeError):
        return False


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
    if not _ascii_compatible(encoding):
        raise SourceError(f"declared encoding {encoding} is not an ASCII-compatible text encoding; left unchanged")
    try:
        text = data.decode(encoding)
    except (UnicodeDecodeError, LookupError) as exc:
        raise SourceError(f"cannot decode as {encoding}: {_one_line(exc)}") from None
    try:
        same = text.encode(encoding) == data
    except UnicodeError:
        same = False
    if not same:
        raise SourceError(
            f"declared encoding {encoding} does not give these bytes back when re-encoded; left unchanged"
        )
    return SourceText(text=text, encoding=encoding)


def file_kind(mode: int) -> str | None:
    """None for a regular file, else what it is: such files are never opened (a FIFO blocks forever)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "named pipe"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISLNK(mode):  # only seen where links are not followed: one put in place of the file
        return "symbolic link"
    return "special file"


def read(path: str, max_bytes: int = DEFAULT_MAX_BYTES, dir_fd: int | None = None) -> SourceText:
    """Read and decode ``path``; the result remembers what the file was (``state``). With ``dir_fd``,
    ``path`` is a name in that open folder and a symbolic link there is not followed."""
    nofollow = getattr(os, "O_NOFOLLOW", 0) if dir_fd is not None else 0
    try:
        kind = file_kind(os.stat(path, dir_fd=dir_fd, follow_symlinks=dir_fd is None).st_mode)
        if kind is not None:
            raise SourceError(f"not a regular file ({kind}); not opened")
        # O_NONBLOCK: if the path was swapped for a FIFO since the stat, opening it must not block.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | nofollow
        fd = os.open(path, flags, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            kind = file_kind(st.st_mode)
            if kind is not None:
                raise SourceError(f"not a regular file ({kind}); not read")
            if max_bytes and st.st_size > max_bytes:
                raise SourceError(
                    f"file is {st.st_size / 1e6:.1f} MB, over the {max_bytes / 1e6:.1f} MB limit "
                    "(raise `max-file-size` in [tool.torchopt] to process it)"
                )
            data = fh.read()
    except OSError as exc:
        raise SourceError(f"cannot read: {exc.strerror or exc}") from None
    return dataclasses.replace(decode(data), state=FileState.of(st, data))


def unkept_bytes(text: str) -> str | None:
    """Where LibCST would not reproduce ``text`` exactly (it drops a form feed at the start of a line
    and the last carriage return of a CR-only file): a one-line reason, or None when it round-trips.
    A fix written through LibCST would change those bytes too, so such files are refused."""
    import libcst

    try:
        again = libcst.parse_module(text).code
    except Exception:  # the engine reports files LibCST cannot parse; nothing to add here
        return None
    if again == text:
        return None
    at = next((i for i, (a, b) in enumerate(zip(text, again)) if a != b), min(len(text), len(again)))
    line = text.count("\n", 0, at) + text.count("\r", 0, at) - text.count("\r\n", 0, at) + 1
    near = text[at : at + 1]
    what = {"\x0c": "a form feed", "\r": "a carriage return", "": "the end of the file"}.get(near, repr(near))
    return f"LibCST would not keep {what} at line {line} byte for byte, so no fix is written (left unchanged)"


def shown(path: str) -> str:
    """``path`` as printable text: bytes of a file name that are not UTF-8 come out as ``\\xNN``
    instead of lone surrogates that a strict UTF-8 stream refuses to print."""
    try:
        return os.fsencode(path).decode("utf-8", "backslashreplace")
    except UnicodeError:
        return path.encode("utf-8", "backslashreplace").decode("utf-8")


def is_generated(text: str) -> bool:
    """Files that say they are generated (in their first lines) are not ours to edit."""
    return GENERATED_MARKER in text[:2000]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
