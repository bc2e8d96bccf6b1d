"""The formatter settings that govern a file: how long a line may be, which quote strings use, and
how imports are grouped, read from the project's ruff, black and isort configuration.

Rewritten code follows them (torchopt/rewrite/layout.py): a statement a fix made too long is wrapped
the way the formatter would wrap it, inserted strings take the project's quotes, and new imports go
into their isort section. The settings are found like ruff finds its own: the nearest folder above
the file with a ``.ruff.toml``, a ``ruff.toml`` or a ``pyproject.toml`` that has ``[tool.ruff]``;
without one, the nearest ``pyproject.toml`` with ``[tool.black]`` or ``[tool.isort]``. Without any,
the formatters' defaults: 88 columns, double quotes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

DEFAULT_LINE_LENGTH = 88


@dataclass(frozen=True)
class Style:
    line_length: int = DEFAULT_LINE_LENGTH
    # "double" or "single"; "preserve" (ruff's quote-style, black's skip-string-normalization) and
    # no setting at all both mean: the quote most strings of the file already use.
    quote: str = "preserve"
    # A trailing comma keeps a call exploded one argument per line (ruff's and black's default).
    magic_trailing_comma: bool = True
    indent_width: int = 4
    known_first_party: tuple[str, ...] = ()
    known_third_party: tuple[str, ...] = ()
    config_path: str | None = None


def _table(data: Mapping[str, Any], *keys: str) -> Mapping[str, Any]:
    for key in keys:
        value = data.get(key) if isinstance(data, Mapping) else None
        if not isinstance(value, Mapping):
            return {}
        data = value
    return data


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _names(value: Any) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


def _from_ruff(ruff: Mapping[str, Any], path: str) -> Style:
    fmt = _table(ruff, "format")
    isort = _table(ruff, "lint", "isort") or _table(ruff, "isort")
    quote = fmt.get("quote-style")
    return Style(
        line_length=_int(ruff.get("line-length"), DEFAULT_LINE_LENGTH),
        quote=quote if quote in ("double", "single") else "preserve",
        magic_trailing_comma=fmt.get("skip-magic-trailing-comma") is not True,
        indent_width=_int(ruff.get("indent-width"), 4),
        known_first_party=_names(isort.get("known-first-party")),
        known_third_party=_names(isort.get("known-third-party")),
        config_path=path,
    )


def _from_black_isort(black: Mapping[str, Any], isort: Mapping[str, Any], path: str) -> Style:
    length = black.get("line-length", black.get("line_length", isort.get("line_length")))
    return Style(
        line_length=_int(length, DEFAULT_LINE_LENGTH),
        quote="preserve" if black.get("skip-string-normalization") is True else "double",
        magic_trailing_comma=black.get("skip-magic-trailing-comma") is not True,
        known_first_party=_names(isort.get("known_first_party")),
        known_third_party=_names(isort.get("known_third_party")),
        config_path=path,
    )


def _load(path: str) -> Mapping[str, Any] | None:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None  # a file the formatter could not read either: its settings do not apply


def _in_folder(folder: str) -> Style | None:
    for name in (".ruff.toml", "ruff.toml"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            data = _load(path)
            if data is not None:
                return _from_ruff(data, path)
    path = os.path.join(folder, "pyproject.toml")
    if not os.path.isfile(path):
        return None
    data = _load(path)
    if data is None:
        return None
    tool = _table(data, "tool")
    if "ruff" in tool:
        return _from_ruff(_table(tool, "ruff"), path)
    if "black" in tool or "isort" in tool:
        return _from_black_isort(_table(tool, "black"), _table(tool, "isort"), path)
    return None


def style_for(folder: str, cache: dict[str, Style]) -> Style:
    """The style of the files in ``folder``; ``cache`` (one per resolver) remembers each folder."""
    folder = os.path.abspath(folder)
    hit = cache.get(folder)
    if hit is not None:
        return hit
    found = _in_folder(folder)
    if found is None:
        parent = os.path.dirname(folder)
        found = Style() if parent == folder else style_for(parent, cache)
    cache[folder] = found
    return found
