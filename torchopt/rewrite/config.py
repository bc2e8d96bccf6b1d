"""Settings: ``[tool.torchopt]`` in the nearest pyproject.toml, with command-line flags on top.

Everything here is plain data so it can travel to worker processes.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from torchopt.rewrite.registry import all_rules, info_of
from torchopt.rewrite.selection import SelectorError, expand_all
from torchopt.rewrite.source import DEFAULT_MAX_BYTES
from torchopt.rewrite.style import Style, style_for

DEFAULT_DEVICE_NAMES = ("device", "dev", "*_device")


class ConfigError(Exception):
    """Bad configuration; the message names the file and the key."""


@dataclass(frozen=True)
class Settings:
    select: tuple[str, ...] = ("ALL",)
    extend_select: tuple[str, ...] = ()  # added to `select` (ruff's `extend-select`)
    ignore: tuple[str, ...] = ()
    unsafe_fixes: bool = False
    exclude: tuple[str, ...] = ()
    per_file_ignores: tuple[tuple[str, tuple[str, ...]], ...] = ()
    extend_safe_fixes: tuple[str, ...] = ()
    extend_unsafe_fixes: tuple[str, ...] = ()
    device_names: tuple[str, ...] = DEFAULT_DEVICE_NAMES
    max_file_size: int = DEFAULT_MAX_BYTES
    rule_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    root: str = "."  # directory patterns are relative to (the config file's)
    config_path: str | None = None
    # The oldest PyTorch the user supports: rules whose fix needs a newer API are not run.
    target_torch: tuple[int, int] | None = None
    # The formatter settings of the file (ruff, black, isort), which rewritten code follows.
    style: Style = Style()

    def enabled_codes(self, path: str | None = None) -> frozenset[str]:
        selected = self.select + self.extend_select
        codes = expand_all(selected) - expand_all(self.ignore)
        codes = _drop_unrequested_opt_in(codes, selected)
        if self.target_torch is not None:
            rules = all_rules()
            codes = {c for c in codes if (info_of(rules, c).min_torch or (0, 0)) <= self.target_torch}
        if path is not None and self.per_file_ignores:
            rel = relpath(path, self.root)
            for pattern, sels in self.per_file_ignores:
                if glob_match(rel, pattern):
                    codes -= expand_all(sels)
        return frozenset(codes)

    def options_for(self, code: str) -> dict[str, Any]:
        rule = all_rules()[code]
        given = dict(self.rule_options.get(code, {}))
        return {opt.name: given.get(opt.name, opt.default) for opt in rule.options}

    def fix_is_safe(self, code: str, safe: bool) -> bool:
        """Apply the user's promotions/demotions (`extend-safe-fixes`, `extend-unsafe-fixes`)."""
        if safe and _matches(code, self.extend_unsafe_fixes):
            return False
        if not safe and _matches(code, self.extend_safe_fixes):
            return True
        return safe


def _drop_unrequested_opt_in(codes: set[str], select: tuple[str, ...]) -> set[str]:
    """Opt-in rules (class attribute ``opt_in = True``) run only when selected by their full code or
    name, never through ``ALL``, a prefix or a family name."""
    rules = all_rules()
    named = {s.strip().upper() for s in select} | {s.strip() for s in select}
    return {c for c in codes if not info_of(rules, c).opt_in or c in named or info_of(rules, c).name in named}


def _matches(code: str, selectors: tuple[str, ...]) -> bool:
    return bool(selectors) and code in expand_all(selectors)


def relpath(path: str, root: str) -> str:
    try:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    except ValueError:
        rel = path
    return rel.replace(os.sep, "/")


def glob_match(rel: str, pattern: str) -> bool:
    """Ruff-like: a pattern matches the relative path, a parent folder, or the file name."""
    pat = pattern.rstrip("/")
    if fnmatch.fnmatchcase(rel, pat) or fnmatch.fnmatchcase(os.path.basename(rel), pat):
        return True
    parts = rel.split("/")
    return any(fnmatch.fnmatchcase("/".join(parts[:i]), pat) for i in range(1, len(parts)))


_KEYS = {
    "select",
    "extend-select",
    "ignore",
    "unsafe-fixes",
    "exclude",
    "per-file-ignores",
    "extend-safe-fixes",
    "extend-unsafe-fixes",
    "device-names",
    "max-file-size",
    "rules",
    "target-torch",
}


def _size(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb)?\s*", value, re.I)
        if m:
            mult = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9}[(m.group(2) or "b").lower()]
            try:
                return int(float(m.group(1)) * mult)
            except OverflowError:  # more digits than a float holds: no real limit was meant
                pass
    raise ConfigError(f'{where}: `max-file-size` must be a byte count or a size like "4MB", got {value!r}')


def _str_list(value: Any, key: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: `{key}` must be a list of strings, got {value!r}")
    return tuple(value)


def _selectors(value: Any, key: str, where: str) -> tuple[str, ...]:
    sels = _str_list(value, key, where)
    try:
        expand_all(sels)
    except SelectorError as exc:
        raise ConfigError(f"{where}: `{key}`: {exc}") from None
    return sels


def _rule_options(value: Any, where: str) -> dict[str, dict[str, Any]]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: `rules` must be a table of rule codes")
    rules = all_rules()
    out: dict[str, dict[str, Any]] = {}
    for code, opts in value.items():
        if code not in rules:
            raise ConfigError(f"{where}: [tool.torchopt.rules.{code}]: no rule has this code")
        if not isinstance(opts, dict):
            raise ConfigError(f"{where}: [tool.torchopt.rules.{code}] must be a table")
        known = {o.name: o for o in rules[code].options}
        for name, val in opts.items():
            opt = known.get(name)
            if opt is None:
                names = ", ".join(sorted(known)) or "none"
                raise ConfigError(f"{where}: {code} has no option {name!r} (options: {names})")
            ok = isinstance(val, opt.type) and not (opt.type is int and isinstance(val, bool))
            if not ok or (opt.choices and val not in opt.choices):
                want = f"one of {list(opt.choices)}" if opt.choices else opt.type.__name__
                raise ConfigError(f"{where}: {code}.{name} must be {want}, got {val!r}")
        out[code] = dict(opts)
    return out


def from_table(table: Mapping[str, Any], where: str, root: str) -> Settings:
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) in [tool.torchopt]: {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})"
        )
    kw: dict[str, Any] = {"root": root, "config_path": where}
    if "select" in table:
        kw["select"] = _selectors(table["select"], "select", where)
    if "extend-select" in table:
        kw["extend_select"] = _selectors(table["extend-select"], "extend-select", where)
    if "ignore" in table:
        kw["ignore"] = _selectors(table["ignore"], "ignore", where)
    for key, attr in (("extend-safe-fixes", "extend_safe_fixes"), ("extend-unsafe-fixes", "extend_unsafe_fixes")):
        if key in table:
            kw[attr] = _selectors(table[key], key, where)
    if "unsafe-fixes" in table:
        if not isinstance(table["unsafe-fixes"], bool):
            raise ConfigError(f"{where}: `unsafe-fixes` must be true or false")
        kw["unsafe_fixes"] = table["unsafe-fixes"]
    if "exclude" in table:
        kw["exclude"] = _str_list(table["exclude"], "exclude", where)
    if "device-names" in table:
        kw["device_names"] = _str_list(table["device-names"], "device-names", where)
    if "max-file-size" in table:
        kw["max_file_size"] = _size(table["max-file-size"], where)
    if "per-file-ignores" in table:
        pfi = table["per-file-ignores"]
        if not isinstance(pfi, dict):
            raise ConfigError(f"{where}: `per-file-ignores` must be a table of glob = [codes]")
        kw["per_file_ignores"] = tuple(
            (pat, _selectors(codes, f"per-file-ignores.{pat}", where)) for pat, codes in pfi.items()
        )
    if "rules" in table:
        kw["rule_options"] = _rule_options(table["rules"], where)
    if "target-torch" in table:
        kw["target_torch"] = parse_torch_version(table["target-torch"], where)
    return Settings(**kw)


class _TomlFloat(float):
    """A TOML float that remembers how it was written (``2.10`` is the float 2.1)."""

    text = ""


def _toml_float(text: str) -> float:
    value = _TomlFloat(text.replace("_", ""))
    value.text = text
    return value


def parse_torch_version(value: Any, where: str) -> tuple[int, int]:
    """``"2.1"`` (or ``"2.1.2"``) → ``(2, 1)``: the major and minor version that matter. A TOML
    number is refused: ``2.10`` would be read as the float 2.1."""
    if isinstance(value, float):
        written = getattr(value, "text", repr(value))
        raise ConfigError(
            f'{where}: `target-torch` = {written} is a number, not a version; write it as a string: "{written}"'
        )
    m = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)?\s*", value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f'{where}: `target-torch` must be a version such as "2.1", got {value!r}')
    return int(m.group(1)), int(m.group(2))


def load_file(path: str) -> Settings | None:
    """Settings from one pyproject.toml, or None when it has no [tool.torchopt] table."""
    try:
        data = tomllib.loads(_read_config(path).decode("utf-8"), parse_float=_toml_float)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: arrays or tables nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 (byte {exc.object[exc.start]:#04x} at offset {exc.start}); TOML files must be UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except (ValueError, MemoryError) as exc:  # a number too long to convert, say
        raise ConfigError(f"{path}: invalid TOML: {' '.join(str(exc).split())[:200]}") from None
    tool = data.get("tool", {})
    if not isinstance(tool, dict):
        raise ConfigError(f"{path}: [tool] must be a table, got {tool!r}")
    table = tool.get("torchopt")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.torchopt] must be a table, got {table!r}")
    return from_table(table, path, os.path.dirname(os.path.abspath(path)))


# A configuration file larger than this is not a configuration file.
MAX_CONFIG_BYTES = 16 << 20


def _read_config(path: str) -> bytes:
    """The bytes of a configuration file that is a regular file (checked before it is opened: a
    named pipe would block the open), of a sane size."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path}: not a regular file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {info.st_size} bytes; a configuration file is at most {MAX_CONFIG_BYTES >> 20} MB")
    # O_NONBLOCK: had it been swapped for a pipe since, the open still returns (and fstat says so)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path}: not a regular file")
        return fh.read(MAX_CONFIG_BYTES + 1)


@dataclass(frozen=True)
class Overrides:
    """Command-line flags; None means 'not given'."""

    select: tuple[str, ...] | None = None
    ignore: tuple[str, ...] = ()
    unsafe_fixes: bool | None = None
    extend_select: tuple[str, ...] = ()

    def apply(self, s: Settings) -> Settings:
        kw: dict[str, Any] = {}
        if self.select is not None:
            # as in ruff, --select starts the selection afresh: the file's `extend-select` goes too
            kw["select"] = self.select
            kw["extend_select"] = self.extend_select
        elif self.extend_select:
            kw["extend_select"] = s.extend_select + self.extend_select
        if self.ignore:
            kw["ignore"] = s.ignore + self.ignore
        if self.unsafe_fixes is not None:
            kw["unsafe_fixes"] = self.unsafe_fixes
        return replace(s, **kw) if kw else s


class Resolver:
    """Finds the settings for each file: the nearest pyproject.toml with [tool.torchopt] above it
    (or an explicit --config), then the command-line overrides. Results are cached per folder."""

    def __init__(self, overrides: Overrides = Overrides(), config: str | None = None) -> None:
        self.overrides = overrides
        self._cache: dict[str, Settings] = {}
        self._explicit: Settings | None = None
        self._styles: dict[str, Style] = {}
        if config is not None:
            loaded = load_file(config)
            base = loaded or Settings(root=os.path.dirname(os.path.abspath(config)), config_path=config)
            self._explicit = overrides.apply(base)

    def for_path(self, path: str) -> Settings:
        folder = os.path.dirname(os.path.abspath(path)) if not os.path.isdir(path) else os.path.abspath(path)
        settings = self._explicit if self._explicit is not None else self._for_dir(folder)
        style = style_for(folder, self._styles)  # the file's own formatter settings, whatever --config says
        return settings if settings.style == style else replace(settings, style=style)

    def _for_dir(self, folder: str) -> Settings:
        hit = self._cache.get(folder)
        if hit is not None:
            return hit
        candidate = os.path.join(folder, "pyproject.toml")
        found = load_file(candidate) if os.path.isfile(candidate) else None
        if found is not None:
            result = self.overrides.apply(found)
        else:
            parent = os.path.dirname(folder)
            if parent == folder:
                result = self.overrides.apply(Settings(root=os.getcwd()))
            else:
                result = self._for_dir(parent)
        self._cache[folder] = result
        return result
