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
it again. The language server keeps one :class:`LiveScope` while it runs: it reads the editor's
unsaved text of the open documents, and makes a module's facts again only when its text changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import Counter
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
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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


_NONE = object()
Key = tuple[str, str, str]  # (kind, real path, fact): one thing a live scope's analysis read


class LiveScope(ProjectScope):
    """The scope of a process that lives while files change (the language server): a file open in
    the editor is read from its unsaved text (:meth:`set_text`), a file on disk is read again when
    its size or modification time changes, and a module's derived facts (its summary) are computed
    again only for a text not seen before, the old one's dropped.

    What an analysis read is recorded as the facts it was given (``recording`` yields pairs of
    ``(kind, path, fact)`` and the value), not the texts they came from: :meth:`unchanged` says
    whether every one of them still holds, so an edit of another module that leaves its summary as
    it was keeps a result that read it. Safe to share between threads: each records its own reads."""

    def __init__(self, folders: Iterable[str] = (), files: Iterable[str] = ()) -> None:
        self._local = threading.local()
        # real path -> [hash, text] as the editor has it (the hash made when an analysis first reads
        # it, not on the event loop at each keystroke)
        self._open: dict[str, list] = {}
        self._disk: dict[str, tuple[tuple[int, int, int], tuple[str, str] | None]] = {}  # path -> (stat, read)
        self._makers: dict[str, Callable[[str], Any]] = {}
        self.built: Counter[str] = Counter()  # real path -> facts derived from its texts (tests, logs)
        self._lock = threading.Lock()
        super().__init__(folders, files, None)

    @property
    def _record(self) -> dict | None:
        return getattr(self._local, "record", None)

    @_record.setter
    def _record(self, value: dict | None) -> None:
        self._local.record = value

    def _note(self, key: Key, value: Any) -> None:
        record = self._record
        if record is not None:
            record[key] = value

    def set_text(self, path: str, text: str | None) -> bool:
        """The file ``path`` now has ``text`` (open in the editor, unsaved), or is read from disk
        again (None: it was closed). True when the text the analyses see changed."""
        real = os.path.realpath(path)
        old = self._open.pop(real, None)
        if text is None:
            if old is None:
                return False
            disk = self._current(real)
            return disk is None or disk[1] != old[1]
        if old is not None and old[1] == text:
            self._open[real] = old
            return False
        before = old[1] if old is not None else (self._current(real) or (None, None))[1]
        self._open[real] = [None, text]
        return before != text

    def open_paths(self) -> set[str]:
        """The files given a text of their own (:meth:`set_text`)."""
        return set(self._open)

    def _current(self, real: str) -> tuple[str, str] | None:
        got = self._open.get(real)
        if got is not None:
            if got[0] is None:
                data = got[1].encode("utf-8", "surrogatepass")
                got[0] = digest(data) if len(data) <= MAX_BYTES else ""  # too large, as on disk
            return (got[0], got[1]) if got[0] else None
        try:
            st = os.stat(real)
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        seen = self._disk.get(real)
        if seen is None or seen[0] != stamp:
            seen = self._disk[real] = (stamp, _read(real))
        return seen[1]

    def exists(self, path: str) -> bool:
        real = os.path.realpath(path)
        if real in self._open or os.path.isfile(real):
            return True
        self._note(("missing", real, ""), None)
        return False

    def text(self, path: str) -> str | None:
        real = os.path.realpath(path)
        got = self._current(real)
        self._note(("text", real, ""), got and got[0])
        return None if got is None else got[1]

    def file_fact(
        self,
        path: str,
        what: str,
        make: Callable[[str], T],
        dump: Callable[[T], Any] | None = None,
        load: Callable[[Any], T] | None = None,
    ) -> T | None:
        real = os.path.realpath(path)
        self._makers.setdefault(what, make)
        value = self._fact(real, what, make)
        self._note(("fact", real, what), value)
        return value

    def _fact(self, real: str, what: str, make: Callable[[str], T]) -> T | None:
        got = self._current(real)
        if got is None:
            return None
        key = (what, real, got[0])
        hit = self._derived.get(key, _NONE)
        if hit is not _NONE:
            return hit
        value = make(got[1])
        with self._lock:
            self.built[real] += 1
            for old in [k for k in self._derived if len(k) == 3 and k[:2] == (what, real)]:
                del self._derived[old]  # an older text's
            self._derived[key] = value
        return value

    def unchanged(self, deps: Sequence[Sequence[Any]]) -> bool:
        """Whether every read recorded in ``deps`` would read the same now."""
        for (kind, real, what), value in deps:
            if kind == "fact":
                make = self._makers.get(what)
                if make is None or self._fact(real, what, make) != value:
                    return False
            elif kind == "text":
                got = self._current(real)
                if (got and got[0]) != value:
                    return False
            elif real in self._open or os.path.isfile(real):  # "missing"
                return False
        return True

    @staticmethod
    def paths(deps: Sequence[Sequence[Any]]) -> set[str]:
        """The files ``deps`` read or looked for."""
        return {key[1] for key, _ in deps}


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
