"""Tests generated from every rule's own examples (Fixit style): flagged or not, exact output,
output compiles, a second pass changes nothing, unsafe fixes wait for --unsafe-fixes, and runnable
examples compute bitwise the same thing before and after on the CPU."""

from __future__ import annotations

import pytest

from semantic import compare_programs, torch_globals_restored
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source
from torchopt.rewrite.registry import all_rules
from torchopt.rewrite.rule import Invalid, Valid

RULES = all_rules()
CASES = [
    pytest.param(rule, ex, id=f"{code}-{i}-{'valid' if isinstance(ex, Valid) else 'invalid'}")
    for code, rule in RULES.items()
    for i, ex in enumerate(rule.examples)
]


def test_rules_exist():
    assert RULES, "no rule was discovered in torchopt.codemods"


@pytest.mark.parametrize("code", sorted(RULES))
def test_rule_declares_examples_and_docs(code):
    rule = RULES[code]
    assert any(isinstance(e, Valid) for e in rule.examples), f"{code} has no Valid example"
    assert any(isinstance(e, Invalid) for e in rule.examples), f"{code} has no Invalid example"
    doc = rule.__doc__ or ""
    for section in ("## What it does", "## Why is this slow", "## Example", "## Use instead", "## Fix safety"):
        assert section in doc, f"{code}: docstring lacks {section!r}"


@pytest.mark.parametrize("rule,ex", CASES)
def test_example(rule, ex):
    settings = Settings(select=(rule.code,))
    found = [d for d in check_source(ex.src, settings).diagnostics if d.code == rule.code]
    if isinstance(ex, Valid):
        assert not found, f"{rule.code} flagged a Valid example: {found}"
        assert fix_source(ex.src, settings, unsafe=True).text == ex.src
        if ex.runnable:
            with torch_globals_restored():
                exec(compile(ex.src, "<valid>", "exec"), {})
        return

    assert found, f"{rule.code} did not flag:\n{ex.src}"
    safe = fix_source(ex.src, settings, unsafe=False)
    full = fix_source(ex.src, settings, unsafe=True)
    if ex.after is None:
        assert full.text == ex.src, f"{rule.code} changed an example that gives no `after`:\n{full.text}"
        return
    if ex.unsafe_tags:
        assert safe.text == ex.src, "an unsafe fix was applied without --unsafe-fixes"
        assert full.text == ex.after
        applied = [d for d in full.applied if d.code == rule.code]
        assert applied and all(d.fix.safety == "unsafe" for d in applied)
        tags = {t for d in applied for t in d.fix.tags}
        assert set(ex.unsafe_tags) <= tags, f"fix tags {tags} lack {ex.unsafe_tags}"
    else:
        assert safe.text == ex.after
        assert all(d.fix.safety == "safe" for d in safe.applied if d.code == rule.code)
    compile(ex.after, "<after>", "exec")
    again = fix_source(ex.after, settings, unsafe=True)
    assert again.text == ex.after, "a second pass changed the output"
    if ex.runnable:
        diffs = compare_programs(ex.src, ex.after)
        if not ex.unsafe_tags:
            assert not diffs, diffs
