"""A rule's cheap prefilter (``could_match``) must never hide a finding: run every rule without its
prefilter over every rule's examples and every fixture, and check that the prefilter lets through
each text the rule reports on. (The corpus version is benchmarks/prefilter_audit.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchopt.rewrite.audit import audit
from torchopt.rewrite.registry import all_rules

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _texts() -> list[tuple[str, str]]:
    out = []
    for code, rule in sorted(all_rules().items()):
        for i, ex in enumerate(rule.examples):
            out.append((f"{code} example {i}", ex.src))
    for p in sorted(FIXTURES.glob("*/before.py")):
        out.append((f"fixtures/{p.parent.name}/{p.name}", p.read_text(encoding="utf-8")))
    return out


@pytest.fixture(scope="module")
def result():
    return audit(_texts())


def test_the_audit_sees_findings(result):
    # The audit itself must work: most rules report on their own examples.
    assert sum(1 for a in result.values() if a.found) >= len(result) - 2


@pytest.mark.parametrize("code", sorted(all_rules()))
def test_prefilter_hides_no_finding(result, code):
    a = result[code]
    assert not a.hidden, f"{code}: could_match rejects texts the rule reports on: {a.hidden}"
