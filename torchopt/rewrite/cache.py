"""A content-hash cache of per-file results, like ruff's: a file whose text, path, settings, torchopt
(version, source and rule set) and LibCST are unchanged is not analysed again.

Layout: ``<dir>/<fingerprint>/<xx>/<entry>.json`` where ``dir`` is ``--cache-dir``, else
``$TORCHOPT_CACHE_DIR``, else ``.torchopt_cache`` in the project root (next to the pyproject.toml with
``[tool.torchopt]``), else ``~/.cache/torchopt``; it holds a CACHEDIR.TAG and a ``.gitignore`` of ``*``. ``fingerprint`` hashes everything that changes what the engine computes for
any file (torchopt version and the bytes of its package source, the registered rule classes, the
LibCST and Python versions); a run prunes the folders of other fingerprints. ``entry`` hashes the
file's absolute path and the kind of result (check, fix, fix with unsafe fixes), so there is at most
one entry per file and kind and the cache cannot grow without bound; the entry stores the rest of the
key (text hash, settings hash, the path as given) and is a miss when any of it differs. An entry also
lists the other files of the project its analysis read (with their hashes) and looked for in vain
(``Entry.depends``, see projectscope.py): the runner believes it only while they are unchanged. What
the project index derives from one module is kept the same way (``get_fact``/``put_fact``: one entry
per file and kind of fact, checked against the hash of the file's bytes).

The cache folder may be any path a user typed, so it only ever touches what it made: it refuses a
folder that already holds files but not torchopt's CACHEDIR.TAG, and a folder that is a symbolic link;
each fingerprint folder carries its own marker file, and pruning removes only fingerprint-named folders
with that marker, and inside them only shard folders and entry files, never following a link.

Writes go through a temp file and an atomic rename, so a reader (another worker, another run) sees a
whole entry or none; a missing entry is a miss. When its folder cannot be written, caching is silently
off; a folder it refuses raises :class:`CacheRefused` so the caller can say so.

Trust: an entry decides what is written into a user's file, and a cache folder can come from anywhere
(committed to a repository, shared, copied), so nothing in it is believed unless this user's torchopt
wrote it. Each entry starts with an HMAC-SHA256 over its fingerprint, its name and its body, keyed with
32 random bytes kept in the user's own cache folder (``$XDG_CACHE_HOME/torchopt/key``, 0600 in a
folder only the user may write, never in a project). An entry whose MAC does not match is ignored,
recomputed and overwritten (:class:`Untrusted` tells the caller, who warns once per run). A cache folder
owned by another user, or writable by group or others, is refused as a whole. The body holds the hash of
the exact text the result was computed from, so a hit is always the result for the bytes on disk.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import os
import re
import stat
import sys
import tempfile
from typing import Any, Mapping

import torchopt
from torchopt.rewrite.engine import Diagnostic, FixInfo

CACHE_DIR_NAME = ".torchopt_cache"
ENV_VAR = "TORCHOPT_CACHE_DIR"
FORMAT = 2  # bump when the entry layout changes
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by torchopt.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)
TAG_NAME = "CACHEDIR.TAG"
GITIGNORE_TEXT = "# Created by torchopt automatically.\n*\n"
FOLDER_MARKER = "TORCHOPT-CACHE-FOLDER"
FOLDER_MARKER_TEXT = "torchopt result cache entries for one fingerprint; torchopt deletes this folder when stale\n"
FINGERPRINT_SHAPE = re.compile(r"[0-9a-f]{20}")
SHARD_SHAPE = re.compile(r"[0-9a-f]{2}")
MAX_ENTRIES = 200_000  # a fingerprint folder with more entries than this is wiped
KEY_NAME = "key"
KEY_BYTES = 32
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class CacheRefused(Exception):
    """The cache folder is not one torchopt made (or may adopt), or not this user's alone: the run goes
    on without a cache rather than write into, prune, or believe a folder that is not its own."""


class Untrusted(Exception):
    """An entry exists but this user's torchopt did not write it (planted, copied, committed, altered):
    it is not used; the caller computes the result again and says so once."""


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
        return {
            "__dc__": type(value).__qualname__,
            **{f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
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

    from torchopt.rewrite.registry import all_rules, info_of

    if rules is None:
        rules = all_rules()
    infos = [info_of(rules, code) for code in sorted(rules)]  # the index answers without importing the rules
    rule_ids = ";".join(f"{i.code}={i.module}.{i.qualname}" for i in infos)
    libcst_version = getattr(libcst, "__version__", "") or _dist_version("libcst")
    return _h(str(FORMAT), torchopt.__version__, _package_source_hash(), rule_ids, libcst_version, sys.version)[:20]


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # pragma: no cover
        return "?"


def user_cache_home() -> str:
    """The user's own torchopt cache folder: ``$XDG_CACHE_HOME/torchopt``, else ``~/.cache/torchopt``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "torchopt"))


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
    return user_cache_home()


def _check_private(path: str, st: os.stat_result, what: str = "") -> None:
    """Refuse a cache folder or file that another user owns or may write (``what`` also refuses one
    that others may read: the key)."""
    if not hasattr(os, "geteuid"):  # no owners or modes to go by (Windows)
        return
    if st.st_uid != os.geteuid():
        raise CacheRefused(f"{path} is owned by another user (uid {st.st_uid})")
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheRefused(f"{path} is writable by others (mode {mode:04o}; chmod go-w it to use it)")
    if what and mode & 0o077:
        raise CacheRefused(f"{what} {path} is readable by others (mode {mode:04o}; chmod 600 it to use it)")


def load_key(home: str | None = None) -> bytes:
    """This user's cache key, made on first use: 32 random bytes in ``home/key`` (mode 0600), in a
    folder made 0700 and tagged as a torchopt cache. Raises CacheRefused when the folder or the key is
    not the user's alone, OSError when it cannot be made."""
    home = os.path.abspath(home or user_cache_home())
    os.makedirs(os.path.dirname(home), exist_ok=True)
    _claim(home)
    path = os.path.join(home, KEY_NAME)
    if not os.path.lexists(path):
        # Written whole under another name, then linked into place: a run starting at the same time
        # reads either no key or the whole key (the first link wins, the other key is dropped).
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=home)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(os.urandom(KEY_BYTES).hex().encode())
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    with os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0)), "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CacheRefused(f"{path} is not a regular file")
        _check_private(path, st, what="the cache key")
        text = fh.read(KEY_BYTES * 2 + 1)
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise CacheRefused(f"{path} is not a torchopt cache key (delete it to make a new one)")
    return key


def _claim(root: str) -> None:
    """Create ``root`` (0700), or adopt it when empty, or accept it when it carries torchopt's tag;
    in every case it must be a real folder of this user's that no one else may write."""
    try:
        os.mkdir(root, 0o700)
        created = True
    except FileExistsError:
        created = False
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise CacheRefused(f"{root} is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise CacheRefused(f"{root} is not a folder")
    _check_private(root, st)
    if not _has_torchopt_tag(root):
        if not created and os.listdir(root):
            raise CacheRefused(f"{root} is not empty and has no CACHEDIR.TAG from torchopt")
        _create_new(os.path.join(root, TAG_NAME), CACHEDIR_TAG)
    _create_new(os.path.join(root, ".gitignore"), GITIGNORE_TEXT)


# Diagnostics <-> JSON ---------------------------------------------------------------------------


def _diag_out(d: Diagnostic) -> list:
    fix = None if d.fix is None else [d.fix.title, d.fix.safety, list(d.fix.tags), d.fix.note]
    return [d.code, d.name, d.message, d.line, d.column, d.end_line, d.end_column, fix]


def _diag_in(row: list, path: str) -> Diagnostic:
    code, name, message, line, col, end_line, end_col, fix = row
    info = None if fix is None else FixInfo(title=fix[0], safety=fix[1], tags=tuple(fix[2]), note=fix[3])
    return Diagnostic(
        code=code,
        name=name,
        message=message,
        path=path,
        line=line,
        column=col,
        end_line=end_line,
        end_column=end_col,
        fix=info,
    )


@dataclasses.dataclass
class Entry:
    """What one analysis produced for one file: enough to answer check, rewrite, --diff and --check."""

    status: str = "ok"  # ok | failed (a parse or fix error, deterministic for the text)
    reason: str = ""
    diagnostics: list[Diagnostic] = dataclasses.field(default_factory=list)
    applied: list[Diagnostic] = dataclasses.field(default_factory=list)
    remaining: list[Diagnostic] = dataclasses.field(default_factory=list)
    new_text: str | None = None  # None: the fix changes nothing
    # Other files of the project the analysis read (path, hash) or looked for (path, None): the entry
    # holds only while they are unchanged (see rewrite/projectscope.py).
    depends: list[tuple[str, str | None]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Cache:
    """Picklable (it travels to the worker processes): a folder, the fingerprint of this run and the
    user's key that authenticates its entries."""

    root: str
    fp: str
    secret: bytes = dataclasses.field(default=b"", repr=False)

    @classmethod
    def open(cls, root: str, rules: Mapping[str, type] | None = None, key_home: str | None = None) -> "Cache | None":
        """The cache in ``root`` (created with its tag files), or None when it cannot be written.
        Raises CacheRefused for a symbolic link, a non-empty folder without torchopt's tag, or a
        folder (or key) another user owns or may write."""
        try:
            root = os.path.abspath(root)
            os.makedirs(os.path.dirname(root), exist_ok=True)
            _claim(root)
            c = cls(root=root, fp=fingerprint(rules), secret=load_key(key_home))
            if not c._ensure_folder():
                raise CacheRefused(f"{c.folder} is not a folder torchopt made")
        except OSError:
            return None
        return c

    def _ensure_folder(self) -> bool:
        """This fingerprint's folder exists as a real folder (made, with its marker, if missing)."""
        if not _real_dir(self.root):
            return False
        try:
            os.mkdir(self.folder, 0o700)
        except FileExistsError:
            pass
        if not _real_dir(self.folder):
            return False
        _create_new(os.path.join(self.folder, FOLDER_MARKER), FOLDER_MARKER_TEXT)
        return True

    @property
    def folder(self) -> str:
        return os.path.join(self.root, self.fp)

    def _entry_path(self, path: str, kind: str) -> str:
        name = _h(os.path.abspath(path), kind)
        return os.path.join(self.folder, name[:2], name[2:] + ".json")

    def seal(self, target: str, body: bytes) -> bytes:
        """The bytes of an entry file: the MAC of (fingerprint, entry name, body), a newline, the body."""
        mac = hmac.new(self.secret, b"\x00".join([self.fp.encode(), os.path.basename(target).encode(), body]), "sha256")
        return mac.hexdigest().encode() + b"\n" + body

    def _unseal(self, target: str, data: bytes) -> bytes:
        body = data.partition(b"\n")[2]
        if not (self.secret and hmac.compare_digest(self.seal(target, body), data)):
            raise Untrusted(target)
        return body

    @staticmethod
    def key(text: str, path: str, settings: Any, kind: str) -> str:
        return _h(kind, path, _h(text), settings_hash(settings))

    def get(self, text: str, path: str, settings: Any, kind: str) -> Entry | None:
        """The entry for exactly this text, path, settings and kind, or None. Raises Untrusted for an
        entry this user's torchopt did not write (bad MAC, malformed, another owner's file)."""
        body = self._read(self._entry_path(path, kind))
        if body is None:  # missing (the usual miss), or unreadable
            return None
        try:
            entry = json.loads(body)
            if entry["key"] != self.key(text, path, settings, kind):
                return None  # the file or its settings changed since: an ordinary miss
            return Entry(
                status=entry["status"],
                reason=entry["reason"],
                diagnostics=[_diag_in(r, path) for r in entry["diagnostics"]],
                applied=[_diag_in(r, path) for r in entry["applied"]],
                remaining=[_diag_in(r, path) for r in entry["remaining"]],
                new_text=entry["new_text"],
                depends=[(p, h) for p, h in entry.get("depends", ())],
            )
        except Exception:  # authentic but unusable (cannot happen unless torchopt changed): a miss
            return None

    def put(self, text: str, path: str, settings: Any, kind: str, entry: Entry) -> None:
        data = {
            "key": self.key(text, path, settings, kind),
            "status": entry.status,
            "reason": entry.reason,
            "diagnostics": [_diag_out(d) for d in entry.diagnostics],
            "applied": [_diag_out(d) for d in entry.applied],
            "remaining": [_diag_out(d) for d in entry.remaining],
            "new_text": entry.new_text,
            "depends": entry.depends,
        }
        self._write(self._entry_path(path, kind), data)

    def get_fact(self, path: str, what: str, content: str) -> Any:
        """What was derived (``what``) from the file ``path`` whose bytes hash to ``content``, or None;
        signed and checked like every entry (an untrusted one is a miss, and is replaced)."""
        target = self._entry_path(path, "fact:" + what)
        try:
            body = self._read(target)
        except Untrusted:
            return None
        try:
            data = json.loads(body) if body is not None else None
            return data["value"] if data is not None and data["content"] == content else None
        except Exception:  # authentic but unusable: a miss
            return None

    def put_fact(self, path: str, what: str, content: str, value: Any) -> None:
        self._write(self._entry_path(path, "fact:" + what), {"content": content, "value": value})

    def _read(self, target: str) -> bytes | None:
        try:
            if not (_real_dir(self.folder) and _real_dir(os.path.dirname(target))):
                return None
            with os.fdopen(os.open(target, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0)), "rb") as fh:
                st = os.fstat(fh.fileno())
                if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
                    raise Untrusted(target)
                data = fh.read()
        except OSError:
            return None
        return self._unseal(target, data)

    def _write(self, target: str, data: dict) -> None:
        shard = os.path.dirname(target)
        try:
            if not self._ensure_folder():
                return
            try:
                os.mkdir(shard, 0o700)
            except FileExistsError:
                pass
            if not _real_dir(shard):
                return
            body = json.dumps(data, separators=(",", ":")).encode("utf-8", "surrogatepass")
            _atomic(target, self.seal(target, body))
        except (OSError, ValueError):
            pass

    def prune(self) -> None:
        """Remove the folders of other fingerprints (older torchopt, edited source, other rule set), and
        this fingerprint's folder when it has grown past MAX_ENTRIES. Only folders with a fingerprint's
        name and torchopt's marker are touched, and in them only what the cache writes."""
        try:
            if not (_real_dir(self.root) and _has_torchopt_tag(self.root)):
                return
            for entry in os.scandir(self.root):
                if (
                    entry.name != self.fp
                    and FINGERPRINT_SHAPE.fullmatch(entry.name)
                    and entry.is_dir(follow_symlinks=False)
                    and _is_marked(entry.path)
                ):
                    _remove_folder(entry.path)
            if not _real_dir(self.folder):
                return
            count = 0
            for sub in os.scandir(self.folder):
                if SHARD_SHAPE.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False):
                    count += sum(1 for _ in os.scandir(sub.path))
            if count > MAX_ENTRIES:
                _remove_folder(self.folder)
        except OSError:
            pass


def _real_dir(path: str) -> bool:
    """A folder itself, not a symbolic link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _read_own_file(path: str, limit: int = 4096) -> str:
    """The start of a regular file, never through a symbolic link; "" when there is none."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return ""
        with os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb") as fh:
            return fh.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _has_torchopt_tag(root: str) -> bool:
    text = _read_own_file(os.path.join(root, TAG_NAME))
    return text.startswith(CACHEDIR_TAG.splitlines()[0]) and CACHEDIR_TAG.splitlines()[1] in text


def _is_marked(folder: str) -> bool:
    return _read_own_file(os.path.join(folder, FOLDER_MARKER)) == FOLDER_MARKER_TEXT


def _is_cache_file(entry: os.DirEntry) -> bool:
    return entry.is_file(follow_symlinks=False) and (entry.name.endswith(".json") or entry.name.startswith(".tmp-"))


def _remove_folder(folder: str) -> None:
    """Delete a fingerprint folder's shards and entries; anything else keeps the folder, and its marker
    so that a later run can finish the job once that is gone."""
    for shard in os.scandir(folder):
        if not (SHARD_SHAPE.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False)):
            continue
        for item in os.scandir(shard.path):
            if _is_cache_file(item):
                _unlink_quietly(item.path)
        _rmdir_quietly(shard.path)
    if os.listdir(folder) == [FOLDER_MARKER]:
        _unlink_quietly(os.path.join(folder, FOLDER_MARKER))
        _rmdir_quietly(folder)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _rmdir_quietly(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _create_new(path: str, text: str) -> None:
    """Write a small file only when nothing (not even a link) has that name: never overwrite."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as fh:
        fh.write(text.encode())


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
