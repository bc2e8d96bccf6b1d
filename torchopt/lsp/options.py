"""The client's settings for `torchopt lsp`: `initializationOptions` and the settings of
`workspace/didChangeConfiguration`, checked (a value the server cannot use is reported and its
default kept)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchopt.rewrite.config import Overrides
from torchopt.rewrite.selection import SelectorError, expand_all

# Where `codeDescription.href` points: the generated rule pages (docs/rules/CODE.md) of the
# repository. Clients may override it with the initialization option `ruleUrl` ("...{code}...").
RULE_URL = "https://github.com/torchopt/torchopt/blob/main/docs/rules/{code}.md"
DEBOUNCE_S = 0.05
# Longer than this is a mistake (a debounce of minutes looks like a server that publishes nothing).
MAX_DEBOUNCE_MS = 10_000


OPTION_KEYS = ("select", "ignore", "unsafeFixes", "unsafe-fixes", "unsafe_fixes", "unsafe", "debounceMs", "ruleUrl")


@dataclass
class ClientOptions:
    """`initializationOptions` (and `workspace/didChangeConfiguration` settings): select / ignore /
    unsafeFixes like the CLI flags, plus debounceMs and ruleUrl."""

    select: tuple[str, ...] | None = None
    ignore: tuple[str, ...] = ()
    unsafe_fixes: bool | None = None
    debounce_s: float = DEBOUNCE_S
    rule_url: str = RULE_URL

    @classmethod
    def parse(cls, raw: Any) -> tuple["ClientOptions", list[str]]:
        opts = cls()
        problems: list[str] = []
        if not isinstance(raw, dict):
            return opts, problems
        raw = raw.get("torchopt", raw) if isinstance(raw.get("torchopt"), dict) else raw

        def selectors(key: str) -> tuple[str, ...] | None:
            val = raw.get(key)
            if val is None:
                return None
            if isinstance(val, str):
                val = [v for v in val.split(",") if v.strip()]
            try:
                if not isinstance(val, list) or not all(isinstance(v, str) for v in val):
                    raise SelectorError(f"must be a list of rule selectors, got {val!r}")
                expand_all(val)
            except SelectorError as exc:
                problems.append(f"initializationOptions.{key}: {exc}")
                return None
            return tuple(v.strip() for v in val)

        opts.select = selectors("select")
        opts.ignore = selectors("ignore") or ()
        for key in ("unsafeFixes", "unsafe-fixes", "unsafe_fixes", "unsafe"):
            if raw.get(key) is None:
                continue
            if isinstance(raw[key], bool):
                opts.unsafe_fixes = raw[key]
            else:
                problems.append(f"initializationOptions.{key}: must be true or false, got {raw[key]!r}")
        debounce = raw.get("debounceMs")
        if debounce is not None:
            ok = isinstance(debounce, (int, float)) and not isinstance(debounce, bool)
            if ok and math.isfinite(debounce) and 0 <= debounce <= MAX_DEBOUNCE_MS:
                opts.debounce_s = debounce / 1000
            else:
                problems.append(
                    f"initializationOptions.debounceMs: must be a number of milliseconds from 0 to "
                    f"{MAX_DEBOUNCE_MS}, got {debounce!r}; using {DEBOUNCE_S * 1000:g}"
                )
        url = raw.get("ruleUrl")
        if url is not None:
            why = _rule_url_problem(url)
            if why is None:
                opts.rule_url = url
            else:
                problems.append(f"initializationOptions.ruleUrl: {why}; using {RULE_URL}")
        return opts, problems

    def overrides(self) -> Overrides:
        return Overrides(select=self.select, ignore=self.ignore, unsafe_fixes=self.unsafe_fixes)


def _rule_url_problem(url: Any) -> str | None:
    """Why ``url`` cannot be a rule link template (None when it can): a string with ``{code}``
    that formats with the code alone."""
    if not isinstance(url, str):
        return f"must be a string with {{code}} in it, got {url!r}"
    if "{code}" not in url:
        return f"{url!r} has no {{code}} in it (where the rule's code goes)"
    try:
        url.format(code="TOP101")
    except (ValueError, KeyError, IndexError, AttributeError) as exc:
        return f"{url!r} is not a valid template ({type(exc).__name__}: {exc}); write a literal brace as {{{{ or }}}}"
    return None
