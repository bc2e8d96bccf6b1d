"""Faster LibCST internals for torchopt's own processes, installed on request only.

Each fast path replaces a piece of LibCST with code that gives the same answers for less time
(``tests/test_libcst_fast_paths.py`` compares them with LibCST's own; ``benchmarks/speedups.py``
measures what each buys). They change LibCST for the whole process, so importing torchopt installs
nothing: the entry points (``torchopt.cli.main``, the language server's ``main``) call
:func:`install`, and a program that only imports torchopt keeps LibCST exactly as it was.

The fast paths rely on LibCST internals (``_visit_and_replace_children``, ``PositionProvider._gen``,
the code generation state), so they are installed only on the LibCST versions they were tested
with (:data:`TESTED_LIBCST`); elsewhere LibCST's own code runs, just slower.
``TORCHOPT_NO_SPEEDUPS=1`` also keeps LibCST's own code, for a comparison or to rule them out.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Callable, Iterable

import libcst as cst
from libcst.metadata import PositionProvider

from torchopt.rewrite import fastvisit, positions


def _debug(msg: str, *args: object) -> None:
    import logging  # (imported only to say why nothing was installed)

    logging.getLogger(__name__).debug(msg, *args)


# [first, last) LibCST versions the fast paths were run against (equivalence tests, the test suite).
TESTED_LIBCST = ((1, 1), (1, 10))

# Undo actions of the fast paths installed in this process, by name.
_UNDO: dict[str, Callable[[], None]] = {}


def _replace(owner: type, attr: str, new: object) -> Callable[[], None]:
    """Set ``owner.attr`` to ``new``; returns what puts LibCST's own back (deletes it again where
    ``owner`` inherited it)."""
    missing = object()
    old = owner.__dict__.get(attr, missing)
    setattr(owner, attr, new)

    def undo() -> None:
        if old is missing:
            delattr(owner, attr)
        else:
            setattr(owner, attr, old)

    return undo


def _visit() -> Callable[[], None]:
    # LibCST's walk copies every node even for a visitor that can change nothing
    return _replace(cst.CSTNode, "visit", fastvisit.fast_visit)


def _positions() -> Callable[[], None]:
    # LibCST builds three frozen dataclasses per node; positions are needed for a few nodes only
    return _replace(PositionProvider, "_gen", positions.fast_gen)


def _isinstance() -> Callable[[], None]:
    # an ABC instance check is a Python frame per class tested; node classes register no virtual subclasses
    return fastvisit.plain_isinstance()


def _visitors() -> Callable[[], None]:
    # LibCST reads thousands of no-op stubs per visitor instance to find its few visitor methods
    return _replace(cst.BatchableCSTVisitor, "get_visitors", fastvisit.fast_get_visitors)


# Every fast path, by name: each saved more than 5% of a cold check (benchmarks/speedups.py).
FAST_PATHS: dict[str, Callable[[], Callable[[], None]]] = {
    "visit": _visit,
    "positions": _positions,
    "isinstance": _isinstance,
    "visitors": _visitors,
}
DEFAULT = tuple(FAST_PATHS)


def libcst_version() -> tuple[int, ...] | None:
    try:  # the version LibCST's build wrote (importlib.metadata takes longer to import than a parse)
        from libcst._version import __version__ as text
    except ImportError:
        from importlib import metadata as dist_metadata

        try:
            text = dist_metadata.version("libcst")
        except dist_metadata.PackageNotFoundError:
            return None
    parts = re.match(r"(\d+)\.(\d+)", text)
    return (int(parts.group(1)), int(parts.group(2))) if parts else None


def supported(version: tuple[int, ...] | None) -> bool:
    low, high = TESTED_LIBCST
    return version is not None and low <= version[:2] < high


def install(names: Iterable[str] = DEFAULT) -> tuple[str, ...]:
    """Install the fast paths ``names`` (idempotent); returns the names installed now in this process.
    Does nothing, and says why at debug level, with ``TORCHOPT_NO_SPEEDUPS=1`` or on a LibCST version
    outside :data:`TESTED_LIBCST`."""
    names = tuple(names)
    unknown = sorted(set(names) - set(FAST_PATHS))
    if unknown:
        raise ValueError(f"unknown fast path(s): {', '.join(unknown)}")
    if os.environ.get("TORCHOPT_NO_SPEEDUPS") == "1":
        _debug("LibCST speed-ups not installed: TORCHOPT_NO_SPEEDUPS=1")
        return installed()
    version = libcst_version()
    if not supported(version):
        shown = ".".join(map(str, version)) if version else "unknown"
        low, high = (".".join(map(str, v)) for v in TESTED_LIBCST)
        _debug("LibCST speed-ups not installed: LibCST %s is outside the tested range >=%s,<%s", shown, low, high)
        return installed()
    for name in names:
        if name not in _UNDO:
            _UNDO[name] = FAST_PATHS[name]()
    return installed()


def uninstall() -> None:
    """Put LibCST's own code back (tests and benchmarks compare both in one process)."""
    for name in reversed(list(_UNDO)):
        _UNDO.pop(name)()


def installed() -> tuple[str, ...]:
    return tuple(_UNDO)


def worker_initializer() -> Callable[[], object] | None:
    """For a process pool: what gives its workers the fast paths this process has (a worker started
    by spawn or forkserver does not inherit them); None when there are none."""
    return functools.partial(install, installed()) if _UNDO else None
