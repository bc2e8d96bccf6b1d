"""Rule selectors: a full code (TOP101), a prefix (TOP1), a family name (device), a rule name, or ALL."""

from __future__ import annotations

from typing import Iterable

from torchopt.rewrite.registry import all_rules, info_of


class SelectorError(ValueError):
    pass


def expand(selector: str) -> set[str]:
    rules = all_rules()
    sel = selector.strip()
    if not sel:
        # An empty entry is a typo (a stray comma, an unset variable), never a request for nothing.
        raise SelectorError(
            f"empty rule selector {selector!r} (expected a code such as TOP101, a prefix such "
            "as TOP1, a family name, a rule name, or ALL)"
        )
    if sel.upper() == "ALL":
        return set(rules)
    up = sel.upper()
    if up.startswith("TOP"):
        codes = {c for c in rules if c.startswith(up)}
        if codes or up == "TOP":
            return codes
        raise SelectorError(f"unknown rule selector {selector!r}: no rule code starts with {up}")
    codes = {c for c in rules if info_of(rules, c).family == sel or info_of(rules, c).name == sel}
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


def split_arg(values: Iterable[str] | None, flag: str = "a selector option") -> list[str]:
    """CLI values may be repeated or comma-separated: `--select TOP1,TOP2 --select TOP5`. An empty
    part (`--select ""`, `--select TOP1,`) is an error: dropping it would silently change the selection."""
    out: list[str] = []
    for v in values or ():
        parts = [p.strip() for p in v.split(",")]
        if not all(parts):
            raise SelectorError(
                f"empty rule selector in {flag} {v!r} (expected codes separated by commas, such as TOP101,TOP2)"
            )
        out.extend(parts)
    return out
