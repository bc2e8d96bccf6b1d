"""Rule selectors: a full code (TOP101), a prefix (TOP1), a family name (device), a rule name, or ALL."""
from __future__ import annotations

from typing import Iterable

from torchopt.rewrite.registry import all_rules


class SelectorError(ValueError):
    pass


def expand(selector: str) -> set[str]:
    rules = all_rules()
    sel = selector.strip()
    if not sel:
        return set()
    if sel.upper() == "ALL":
        return set(rules)
    up = sel.upper()
    if up.startswith("TOP"):
        codes = {c for c in rules if c.startswith(up)}
        if codes or up == "TOP":
            return codes
        raise SelectorError(f"unknown rule selector {selector!r}: no rule code starts with {up}")
    codes = {c for c, r in rules.items() if r.family == sel or r.name == sel}
    if not codes:
        raise SelectorError(
            f"unknown rule selector {selector!r} (expected a code such as TOP101, a prefix such as "
            "TOP1, a family name, a rule name, or ALL)"
        )
    return codes


def expand_all(selectors: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for s in selectors:
        out |= expand(s)
    return out


def split_arg(values: Iterable[str] | None) -> list[str]:
    """CLI values may be repeated or comma-separated: `--select TOP1,TOP2 --select TOP5`."""
    out: list[str] = []
    for v in values or ():
        out.extend(p.strip() for p in v.split(",") if p.strip())
    return out
