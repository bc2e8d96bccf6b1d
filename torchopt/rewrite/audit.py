"""Prefilter audit: does a rule's cheap ``could_match`` ever hide a finding, and how much does it let
through that the rule then finds nothing in? Used by tests (over the rules' examples and the
fixtures) and by ``benchmarks/prefilter_audit.py`` (over a corpus).

The rules run here *without* their prefilters (all of them in one batched traversal), so the
answer is what the engine would report if every file were parsed for every rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import ParseError, _run_rules, could_match, parse
from torchopt.rewrite.facts import analysing
from torchopt.rewrite.registry import all_rules
from torchopt.rewrite.rule import Rule


@dataclass
class RuleAudit:
    code: str
    passed: int = 0  # texts could_match let through
    passed_lines: int = 0
    found: int = 0  # texts the rule reports on (run without its prefilter)
    hidden: list[str] = field(default_factory=list)  # texts it reports on that could_match rejects

    @property
    def wasted(self) -> int:
        """Texts let through in which the rule reports nothing."""
        return self.passed - (self.found - len(self.hidden))


def unfiltered_codes(
    text: str, rules: Iterable[type[Rule]], settings: Settings | None = None, path: str = "<audit>"
) -> set[str]:
    """The codes of ``rules`` that report something in ``text`` when run on it regardless of their
    prefilters (suppression comments still apply). Raises ParseError for text that does not parse."""
    settings = settings or Settings()
    p = _run_rules(parse(text), list(rules), settings, path, text)
    return {f.rule.code for f, _ in p.findings}


def audit(
    texts: Iterable[tuple[str, str]], codes: Iterable[str] | None = None, settings: Settings | None = None
) -> dict[str, RuleAudit]:
    """Audit ``codes`` (default: every rule) over ``(name, text)`` pairs; unparsable texts are skipped."""
    rules = all_rules()
    chosen = [rules[c] for c in (sorted(codes) if codes is not None else sorted(rules))]
    out = {r.code: RuleAudit(r.code) for r in chosen}
    for name, text in texts:
        with analysing(text):  # the rules and their prefilters share the text's SourceFacts
            try:
                found = unfiltered_codes(text, chosen, settings, name)
            except ParseError:
                continue
            lines = text.count("\n")
            for r in chosen:
                rule_audit = out[r.code]
                ok = could_match(rules, r.code, text)  # the engine's test: the index's substrings, then the rule's
                if ok:
                    rule_audit.passed += 1
                    rule_audit.passed_lines += lines
                if r.code in found:
                    rule_audit.found += 1
                    if not ok:
                        rule_audit.hidden.append(name)
    return out
