"""Which other files of a project a run may read, and what it read: the ground the project index
(``torchopt/analysis/project.py``) stands on.

A rule that asks about another module (where a model class is defined, which function iterates the
loader) makes the run read that module's file. Which files may be read is decided here, per file
analysed, from the unit it belongs to:

- the *project folder*: the nearest folder above the file holding ``pyproject.toml``, ``setup.py``,
  ``setup.cfg`` or ``.git``; every file under it may be read, even one the run does not check;
- else the *folder given* to the run that holds the file (``torchopt check proj/``);
- else *the file alone* (a file named on the command line, stdin): a sibling module is then
  "not part of this run", and the facts it would give are unknown.

A :class:`ProjectScope` is made once per run (and travels to the worker processes without what
it learnt); it reads each file once per process, keeps what was derived from it, and records, for
the file being analysed, every file it read and every path it looked for and did not find. The
runner stores that record with the file's cache entry, and a cache hit is believed only while every
file recorded is unchanged (:func:`unchanged`). Facts derived from a file are also kept in the
result cache by the hash of the file's bytes (signed like every entry), so a later run does not parse
it again.
"""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence, TypeVar

from torchopt.rewrite import source

if TYPE_CHECKING:
    from torchopt.rewrite.cache import Cache

T = TypeVar("T")

MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")
# Files larger than this are not read for facts about other modules (generated tables, vendored blobs).
MAX_BYTES = 2_000_000

# A file read for the index (its hash) or looked for and not found (None).
Dependency = tuple[str, "str | None"]


def digest(data: bytes) -> str:
    return source.blake2b(data, digest_size=16).hexdigest()


class ProjectScope:
    """The files a run may read to learn about other modules, what it read, and what it derived."""

    def __init__(self, folders: Iterable[str] = (), files: Iterable[str] = (), cache: "Cache | None" = None) -> None:
        self.folders = tuple(sorted({os.path.realpath(f) for f in folders}, key=len, reverse=True))
        self.files = frozenset(os.path.realpath(f) for f in files)
        self.cache = cache
        self._reset()

    def _reset(self) -> None:
        self._roots: dict[str, str | None] = {}  # folder -> its project folder (None: none above it)
        self._texts: dict[str, tuple[str, str] | None] = {}  # real path -> (hash, text), None: unreadable
        self._derived: dict[tuple, Any] = {}
        self._record: dict[str, str | None] | None = None

    def __getstate__(self) -> dict:
        return {"folders": self.folders, "files": self.files, "cache": self.cache}

    def __setstate__(self, state: dict) -> None:
        self.folders, self.files, self.cache = state["folders"], state["files"], state["cache"]
        self._reset()

    # ------------------------------------------------------------------ which files belong
    def project_folder(self, folder: str) -> str | None:
        """The nearest folder at or above ``folder`` that holds a project marker."""
        folder = os.path.realpath(folder)
        seen = []
        found: str | None = None
        cur = folder
        while True:
            if cur in self._roots:
                found = self._roots[cur]
                break
            seen.append(cur)
            if any(os.path.lexists(os.path.join(cur, m)) for m in MARKERS):
                found = cur
                break
            up = os.path.dirname(cur)
            if up == cur:
                break
            cur = up
        for s in seen:
            self._roots[s] = found
        return found

    def unit(self, path: str) -> str:
        """The folder whose files the analysis of ``path`` may read, or ``path`` itself when it stands
        alone (then only it may be read)."""
        real = os.path.realpath(path)
        root = self.project_folder(os.path.dirname(real))
        if root is not None:
            return root
        for folder in self.folders:
            if real.startswith(folder + os.sep):
                return folder
        return real

    def may_read(self, path: str, unit: str) -> bool:
        real = os.path.realpath(path)
        return real == unit or real.startswith(unit.rstrip(os.sep) + os.sep) or real in self.files

    # ------------------------------------------------------------------ reading, recorded
    def exists(self, path: str) -> bool:
        """Whether ``path`` is a file (recorded: a file that appears later invalidates the result)."""
        real = os.path.realpath(path)
        if os.path.isfile(real):
            return True
        if self._record is not None:
            self._record.setdefault(real, None)
        return False

    def text(self, path: str) -> str | None:
        """The text of the Python file ``path`` (None when it cannot be read or decoded)."""
        real = os.path.realpath(path)
        if real not in self._texts:
            self._texts[real] = _read(real)
        got = self._texts[real]
        if self._record is not None:
            self._record[real] = got[0] if got is not None else None
        return None if got is None else got[1]

    def file_fact(
        self,
        path: str,
        what: str,
        make: Callable[[str], T],
        dump: Callable[[T], Any] | None = None,
        load: Callable[[Any], T] | None = None,
    ) -> T | None:
        """``make(text)`` for the file ``path``, computed once per process and file version; with
        ``dump``/``load`` (to and from JSON) it is kept in the result cache by the file's hash too.
        None when the file cannot be read."""
        text = self.text(path)
        if text is None:
            return None
        real = os.path.realpath(path)
        got = self._texts[real]
        assert got is not None
        key = (what, real, got[0])
        if key in self._derived:
            return self._derived[key]
        value: T | None = None
        if self.cache is not None and load is not None:
            stored = self.cache.get_fact(real, what, got[0])
            if stored is not None:
                try:
                    value = load(stored)
                except (KeyError, TypeError, ValueError):
                    value = None
        if value is None:
            value = make(text)
            if self.cache is not None and dump is not None:
                self.cache.put_fact(real, what, got[0], dump(value))
        self._derived[key] = value
        return value

    def derived(self, what: tuple, make: Callable[[], T]) -> T:
        """``make()`` once per process for ``what`` (a key that must name every file it depends on)."""
        if what not in self._derived:
            self._derived[what] = make()
        return self._derived[what]

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Dependency]]:
        """Record the files read (and looked for) until the block ends, into the list it yields."""
        outer, self._record = self._record, {}
        out: list[Dependency] = []
        try:
            yield out
        finally:
            record, self._record = self._record, outer
            out.extend(sorted(record.items()))
            if outer is not None:
                outer.update(record)


def _read(real: str) -> tuple[str, str] | None:
    try:
        with open(real, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_BYTES:
        return None
    try:
        return digest(data), source.decode(data).text
    except source.SourceError:
        return digest(data), ""


def unchanged(deps: Sequence[Sequence[Any]]) -> bool:
    """Every file in ``deps`` still has the recorded hash, and every path recorded missing is still missing."""
    for path, want in deps:
        if want is None:
            if os.path.isfile(path):
                return False
            continue
        try:
            with open(path, "rb") as fh:
                data = fh.read(MAX_BYTES + 1)
        except OSError:
            return False
        if digest(data) != want:
            return False
    return True


_SCOPE: ContextVar["ProjectScope | None"] = ContextVar("torchopt_project_scope", default=None)
current_scope: Callable[[], "ProjectScope | None"] = _SCOPE.get


@contextlib.contextmanager
def in_scope(scope: ProjectScope | None) -> Iterator[ProjectScope | None]:
    """Make ``scope`` the run's scope until the block ends (None: keep the one already set)."""
    if scope is None:
        yield _SCOPE.get()
        return
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def recorded() -> Iterator[list[Dependency]]:
    """Record what the run's scope reads until the block ends (a scope of its own when none is set)."""
    scope = _SCOPE.get()
    with in_scope(None if scope is not None else ProjectScope()) as active:
        assert active is not None
        with active.recording() as deps:
            yield deps
