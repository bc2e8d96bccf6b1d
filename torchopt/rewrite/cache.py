"""A content-hash cache of per-file results, like ruff's: a file whose text, path, settings, torchopt
(version, source and rule set) and LibCST are unchanged is not analysed again.

Layout: ``<dir>/<fingerprint>/<xx>/<entry>.json`` where ``dir`` is ``--cache-dir``, else
``$TORCHOPT_CACHE_DIR``, else ``.torchopt_cache`` in the project root (next to the pyproject.toml with
``[tool.torchopt]``), else ``~/.cache/torchopt``; it holds a CACHEDIR.TAG and a ``.gitignore`` of ``*``. ``fingerprint`` hashes everything that changes what the engine computes for
any file (torchopt version and the bytes of its package source, the registered rule classes, the
LibCST and Python versions); a run prunes the folders of other fingerprints. ``entry`` hashes the
file's absolute path and the kind of result (check, fix, fix with unsafe fixes), so there is at most
one entry per file and kind and the cache cannot grow without bound; the entry stores the rest of the
key (text hash, settings hash, the path as given) and is a miss when any of it differs.

Writes go through a temp file and an atomic rename, so a reader (another worker, another run) sees a
whole entry or none; anything unreadable or malformed is a miss. The cache never raises: when its
folder cannot be written, caching is silently off.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Mapping

import torchopt
from torchopt.rewrite.engine import Diagnostic, FixInfo

CACHE_DIR_NAME = ".torchopt_cache"
ENV_VAR = "TORCHOPT_CACHE_DIR"
FORMAT = 1  # bump when the entry layout changes
CACHEDIR_TAG = ("Signature: 8a477f597d28d172789f06886806bc55\n"
                "# This file is a cache directory tag created by torchopt.\n"
                "# For information about cache directory tags see https://bford.info/cachedir/\n")
MAX_ENTRIES = 200_000  # a fingerprint folder with more entries than this is wiped


def _h(*parts: bytes | str) -> str:
    m = hashlib.blake2b(digest_size=16)
    for p in parts:
        m.update(p.encode("utf-8", "surrogatepass") if isinstance(p, str) else p)
        m.update(b"\x00")
    return m.hexdigest()


def canonical(value: Any) -> Any:
    """A JSON-able, order-independent form of settings: dataclasses by their fields (so a field added
    later is part of the key without anyone touching this file), mappings sorted, sets sorted."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__dc__": type(value).__qualname__,
                **{f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, enum.Enum):
        return canonical(value.value)
    if isinstance(value, Mapping):
        return {"__map__": sorted(([canonical(k), canonical(v)] for k, v in value.items()), key=repr)}
    if isinstance(value, (set, frozenset)):
        return {"__set__": sorted((canonical(v) for v in value), key=repr)}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"__repr__": f"{type(value).__qualname__}:{value!r}"}


def settings_hash(settings: Any) -> str:
    return _h(json.dumps(canonical(settings), sort_keys=True, separators=(",", ":")))


def _package_source_hash() -> str:
    """Hash of every .py file of the installed torchopt package: a dev edit invalidates the cache."""
    root = os.path.dirname(os.path.abspath(torchopt.__file__))
    m = hashlib.blake2b(digest_size=16)
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            m.update(os.path.relpath(path, root).encode() + b"\x00")
            try:
                with open(path, "rb") as fh:
                    m.update(fh.read())
            except OSError:
                m.update(b"?")
            m.update(b"\x00")
    return m.hexdigest()


def fingerprint(rules: Mapping[str, type] | None = None) -> str:
    """Everything besides the file and its settings that decides what the engine computes."""
    import libcst

    if rules is None:
        from torchopt.rewrite.registry import all_rules

        rules = all_rules()
    rule_ids = ";".join(f"{code}={cls.__module__}.{cls.__qualname__}" for code, cls in sorted(rules.items()))
    libcst_version = getattr(libcst, "__version__", "") or _dist_version("libcst")
    return _h(str(FORMAT), torchopt.__version__, _package_source_hash(), rule_ids, libcst_version,
              sys.version)[:20]


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # pragma: no cover
        return "?"


def default_dir(project_root: str | None, override: str | None = None) -> str:
    """``override`` (``--cache-dir``), else ``$TORCHOPT_CACHE_DIR``, else ``.torchopt_cache`` in the
    project root (the folder of the pyproject.toml that configures torchopt), else, for files no
    configuration covers, the user's cache folder (``$XDG_CACHE_HOME/torchopt``, ``~/.cache/torchopt``):
    torchopt does not litter folders it was merely pointed at."""
    chosen = override or os.environ.get(ENV_VAR)
    if chosen:
        return os.path.abspath(chosen)
    if project_root:
        return os.path.abspath(os.path.join(project_root, CACHE_DIR_NAME))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "torchopt"))


# Diagnostics <-> JSON ---------------------------------------------------------------------------


def _diag_out(d: Diagnostic) -> list:
    fix = None if d.fix is None else [d.fix.title, d.fix.safety, list(d.fix.tags), d.fix.note]
    return [d.code, d.name, d.message, d.line, d.column, d.end_line, d.end_column, fix]


def _diag_in(row: list, path: str) -> Diagnostic:
    code, name, message, line, col, end_line, end_col, fix = row
    info = None if fix is None else FixInfo(title=fix[0], safety=fix[1], tags=tuple(fix[2]), note=fix[3])
    return Diagnostic(code=code, name=name, message=message, path=path, line=line, column=col,
                      end_line=end_line, end_column=end_col, fix=info)


@dataclasses.dataclass
class Entry:
    """What one analysis produced for one file: enough to answer check, rewrite, --diff and --check."""

    status: str = "ok"  # ok | failed (a parse or fix error, deterministic for the text)
    reason: str = ""
    diagnostics: list[Diagnostic] = dataclasses.field(default_factory=list)
    applied: list[Diagnostic] = dataclasses.field(default_factory=list)
    remaining: list[Diagnostic] = dataclasses.field(default_factory=list)
    new_text: str | None = None  # None: the fix changes nothing


@dataclasses.dataclass
class Cache:
    """Picklable (it travels to the worker processes): a folder and the fingerprint of this run."""

    root: str
    fp: str

    @classmethod
    def open(cls, root: str, rules: Mapping[str, type] | None = None) -> "Cache | None":
        """The cache in ``root`` (created with its tag files), or None when it cannot be written."""
        c = cls(root=os.path.abspath(root), fp=fingerprint(rules))
        try:
            fresh = not os.path.isdir(c.root)
            os.makedirs(c.folder, exist_ok=True)
            if fresh or not os.path.exists(os.path.join(c.root, "CACHEDIR.TAG")):
                _write_small(os.path.join(c.root, "CACHEDIR.TAG"), CACHEDIR_TAG)
                _write_small(os.path.join(c.root, ".gitignore"), "# Created by torchopt automatically.\n*\n")
        except OSError:
            return None
        return c

    @property
    def folder(self) -> str:
        return os.path.join(self.root, self.fp)

    def _entry_path(self, path: str, kind: str) -> str:
        name = _h(os.path.abspath(path), kind)
        return os.path.join(self.folder, name[:2], name[2:] + ".json")

    @staticmethod
    def key(text: str, path: str, settings: Any, kind: str) -> str:
        return _h(kind, path, _h(text), settings_hash(settings))

    def get(self, text: str, path: str, settings: Any, kind: str) -> Entry | None:
        try:
            with open(self._entry_path(path, kind), "rb") as fh:
                data = json.loads(fh.read())
            if data["key"] != self.key(text, path, settings, kind):
                return None
            return Entry(status=data["status"], reason=data["reason"],
                         diagnostics=[_diag_in(r, path) for r in data["diagnostics"]],
                         applied=[_diag_in(r, path) for r in data["applied"]],
                         remaining=[_diag_in(r, path) for r in data["remaining"]],
                         new_text=data["new_text"])
        except Exception:  # missing, truncated, corrupt, an older layout: all just a miss
            return None

    def put(self, text: str, path: str, settings: Any, kind: str, entry: Entry) -> None:
        data = {"key": self.key(text, path, settings, kind), "status": entry.status, "reason": entry.reason,
                "diagnostics": [_diag_out(d) for d in entry.diagnostics],
                "applied": [_diag_out(d) for d in entry.applied],
                "remaining": [_diag_out(d) for d in entry.remaining],
                "new_text": entry.new_text}
        target = self._entry_path(path, kind)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            _atomic(target, json.dumps(data, separators=(",", ":")).encode("utf-8", "surrogatepass"))
        except (OSError, ValueError):
            pass

    def prune(self) -> None:
        """Remove the folders of other fingerprints (older torchopt, edited source, other rule set), and
        this fingerprint's folder when it has grown past MAX_ENTRIES."""
        try:
            for entry in os.scandir(self.root):
                if entry.is_dir(follow_symlinks=False) and entry.name != self.fp:
                    shutil.rmtree(entry.path, ignore_errors=True)
            count = 0
            for sub in os.scandir(self.folder):
                if sub.is_dir(follow_symlinks=False):
                    count += sum(1 for _ in os.scandir(sub.path))
            if count > MAX_ENTRIES:
                shutil.rmtree(self.folder, ignore_errors=True)
        except OSError:
            pass


def _write_small(path: str, text: str) -> None:
    _atomic(path, text.encode())


def _atomic(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
