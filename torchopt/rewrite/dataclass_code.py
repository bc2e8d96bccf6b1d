"""The methods ``dataclasses`` writes, compiled once and kept between processes.

For every dataclass, Python writes the source of ``__init__``, ``__repr__``, ``__eq__`` (and
``__setattr__``, ``__delattr__``, ``__hash__`` of a frozen one) and compiles it while the module is
imported: importing LibCST (about 170 dataclasses) and the modules of a one-file check (about 70)
spent a fifth of the command's instructions compiling them, every run, where the module's own code
comes compiled from its bytecode cache. :func:`install` gives ``dataclasses`` an ``exec`` that takes
the code object from a table read from one file beside this module's bytecode cache (the text is the
key: the same text compiled the same way gives the same code), compiles what is missing and writes
the table again at exit. What runs is the same code either way; only the compile is skipped.

Installed by the entry points' quick path before LibCST is imported, never on import; nothing is
written where Python would not write bytecode (``PYTHONDONTWRITEBYTECODE``, a folder that cannot be
written), and ``TORCHOPT_NO_SPEEDUPS=1`` leaves ``dataclasses`` as it is.
"""

from __future__ import annotations

import builtins
import marshal
import os
import sys
from typing import Any

# entries kept at most: the methods of LibCST's and torchopt's dataclasses are about a thousand
LIMIT = 5000


def _path() -> str | None:
    try:
        from importlib._bootstrap_external import cache_from_source  # (importlib.util imports more)

        pyc = cache_from_source(__file__)
    except (NotImplementedError, ValueError):  # no bytecode cache in this Python
        return None
    return pyc[: -len(".pyc")] + ".marshal"


def _header() -> bytes:
    from importlib._bootstrap_external import MAGIC_NUMBER

    return MAGIC_NUMBER + b"dataclass-code\n"


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return {}
    head = _header()
    if not data.startswith(head):
        return {}
    try:
        table = marshal.loads(data[len(head) :])
    except (EOFError, ValueError, TypeError):
        return {}
    return table if isinstance(table, dict) else {}


class CompiledMethods:
    """The table of one process: read from ``path`` when installed, written back at exit. Its
    state lives on the instance that ``dataclasses`` holds, so uninstalling forgets it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.table: dict[str, Any] = _load(path)
        self.new: list[str] = []  # texts compiled in this process
        self.used: set[str] = set()  # texts asked for in this process

    def exec(self, source: Any, globals: Any = None, locals: Any = None, /) -> None:
        """``exec`` as ``dataclasses`` calls it, with the compiled code of a text read from the table.
        ``dont_inherit``: the text is compiled with no ``__future__`` flag, as ``dataclasses`` (which
        imports none) compiles it."""
        if isinstance(source, str):
            code = self.table.get(source)
            if code is None:
                code = compile(source, "<string>", "exec", dont_inherit=True)
                self.table[source] = code
                self.new.append(source)
            self.used.add(source)
            source = code
        builtins.exec(source, globals, locals)

    def save(self) -> None:
        """Write the table again when this process compiled something (atomically: another process may
        read or write it at the same time); a table past :data:`LIMIT` keeps only what was used here."""
        if not self.new or sys.dont_write_bytecode:
            return
        table = self.table if len(self.table) <= LIMIT else {k: v for k, v in self.table.items() if k in self.used}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_header() + marshal.dumps(table))
            os.replace(tmp, self.path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def installed() -> CompiledMethods | None:
    """The table ``dataclasses`` compiles with in this process, if :func:`install` gave it one."""
    import dataclasses

    owner = getattr(getattr(dataclasses, "exec", None), "__self__", None)
    return owner if isinstance(owner, CompiledMethods) else None


def install(path: str | None = None) -> bool:
    """Give ``dataclasses`` the cached compile (idempotent), its table kept in ``path`` (default:
    beside this module's bytecode cache); False when it is not installed."""
    import atexit
    import dataclasses

    if installed() is not None:
        return True
    if os.environ.get("TORCHOPT_NO_SPEEDUPS") == "1":
        return False
    path = path or _path()
    if path is None:
        return False
    methods = CompiledMethods(path)
    dataclasses.exec = methods.exec  # type: ignore[attr-defined]  # a module global ahead of the builtin
    atexit.register(methods.save)
    return True


def uninstall() -> None:
    """``dataclasses`` as it was, the table forgotten (without writing it)."""
    import atexit
    import dataclasses

    methods = installed()
    if methods is not None:
        del dataclasses.exec  # type: ignore[attr-defined]  # the builtin again
        atexit.unregister(methods.save)
