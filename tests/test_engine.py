"""Engine behaviour independent of any shipped rule, using small rules defined here: overlapping
fixes wait for the next pass, the fix-point is capped, broken output is rolled back and reported,
suppressions and safety promotion apply."""

from __future__ import annotations

import libcst as cst
import pytest

from torchopt.rewrite import config as config_mod
from torchopt.rewrite import engine, selection
from torchopt.rewrite.config import Settings
from torchopt.rewrite.rule import Later, Rule, Safety, Tag


class Unwrap(Rule):
    """`f(x)` -> `x` for calls to `f`: nested calls overlap and need several passes."""

    code, name, family, message, fix_title = "TOP990", "unwrap", "test", "call to f", "drop f"

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name) and node.func.value == "f" and len(node.args) == 1:
            self.report(node, replacement=node.args[0].value)


class Breaker(Rule):
    """Rewrites `x = 1` into code that does not parse."""

    code, name, family, message, fix_title = "TOP991", "breaker", "test", "breaks", "break"

    def visit_Name(self, node: cst.Name) -> None:
        if node.value == "x":
            self.report(node, replacement=cst.Name("lambda"))


class Risky(Rule):
    """An unsafe fix: `g()` -> `h()`."""

    code, name, family, message, fix_title = "TOP992", "risky", "test", "g is slow", "use h"
    safety = Safety.UNSAFE
    tags = (Tag.RNG,)

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name) and node.func.value == "g":
            self.report(node, replacement=node.with_changes(func=cst.Name("h")), note="h draws elsewhere")


class Forever(Rule):
    """Never reaches a fix-point: appends `+ 0` every pass."""

    code, name, family, message, fix_title = "TOP993", "forever", "test", "again", "again"

    def visit_Assign(self, node: cst.Assign) -> None:
        self.report(node.value, replacement=cst.BinaryOperation(node.value, cst.Add(), cst.Integer("0")))


MADE: list[str] = []  # what LaterUnwrap's replacements were made for


class LaterUnwrap(Rule):
    """`k(x)` -> `x`, the replacement made only when the fix is applied."""

    code, name, family, message, fix_title = "TOP994", "later-unwrap", "test", "call to k", "drop k"

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name) and node.func.value == "k" and len(node.args) == 1:
            arg = node.args[0].value
            self.report(node, replacement=Later(lambda: MADE.append(cst.Module([]).code_for_node(arg)) or arg))


TEST_RULES = {r.code: r for r in (Unwrap, Breaker, Risky, Forever, LaterUnwrap)}


@pytest.fixture(autouse=True)
def fake_registry(monkeypatch):
    monkeypatch.setattr(engine, "all_rules", lambda: TEST_RULES)
    monkeypatch.setattr(config_mod, "all_rules", lambda: TEST_RULES)
    monkeypatch.setattr(selection, "all_rules", lambda: TEST_RULES)


def fix(text, codes, unsafe=False, settings=None):
    return engine.fix_source(text, settings or Settings(select=()), codes=codes, unsafe=unsafe)


def test_nested_fixes_reach_fix_point():
    r = fix("y = f(f(f(1)))\n", {"TOP990"})
    assert r.text == "y = 1\n"
    assert len(r.applied) == 3 and r.passes == 3


def test_broken_output_is_rolled_back_and_reported():
    with pytest.raises(engine.FixError, match="TOP991"):
        fix("x = 1\n", {"TOP991"})


def test_unsafe_only_on_request_and_promotion():
    assert fix("g()\n", {"TOP992"}).text == "g()\n"
    r = fix("g()\n", {"TOP992"}, unsafe=True)
    assert r.text == "h()\n" and r.applied[0].fix.tags == ("rng",)
    assert "h draws elsewhere" in r.applied[0].fix.changes()
    promoted = Settings(select=(), extend_safe_fixes=("TOP992",))
    assert fix("g()\n", {"TOP992"}, settings=promoted).text == "h()\n"


def test_hidden_unsafe_fixes_are_counted():
    r = fix("g()\ng()\n", {"TOP992"})
    assert len(r.unsafe_hidden) == 2


def test_suppression_blocks_fix_and_diagnostic():
    src = "y = f(1)  # noqa: TOP990\nz = f(2)\n"
    assert fix(src, {"TOP990"}).text == "y = f(1)  # noqa: TOP990\nz = 2\n"
    diags = engine.check_source(src, Settings(select=()), codes={"TOP990"}).diagnostics
    assert [(d.line, d.column) for d in diags] == [(2, 5)]


def test_fix_point_is_capped():
    r = fix("y = 1\n", {"TOP993"})
    assert r.text == "y = 1" + " + 0" * engine.MAX_PASSES + "\n"


def test_parse_error_names_position():
    with pytest.raises(engine.ParseError, match="line 2"):
        engine.check_source("x = 1\ndef (:\n", Settings(select=()), codes={"TOP990"})


def test_prefilter_skips_parsing(monkeypatch):
    """A file none of whose rules' prefilter strings occur is never parsed by LibCST."""
    Unwrap.prefilter = ("f(",)
    try:
        calls = []
        real = engine.parse
        monkeypatch.setattr(engine, "parse", lambda text: calls.append(text) or real(text))
        assert fix("y = g(1)\n", {"TOP990"}).text == "y = g(1)\n"
        assert calls == []
        assert fix("y = f(1)\n", {"TOP990"}).text == "y = 1\n"
        assert calls
        with pytest.raises(engine.ParseError):  # broken files are still reported
            fix("def (:\n", {"TOP990"})
    finally:
        Unwrap.prefilter = ()


def test_a_replacement_left_for_later_is_made_only_by_a_fix():
    MADE.clear()
    diags = engine.check_source("y = k(1) + k(2)\n", Settings(select=()), codes={"TOP994"}).diagnostics
    assert [(d.column, d.fix is not None and d.fix.safety) for d in diags] == [(5, "safe"), (12, "safe")]
    assert MADE == []  # diagnostics only: nothing rebuilt
    r = fix("y = k(1) + k(2)\n", {"TOP994"})
    assert r.text == "y = 1 + 2\n" and len(r.applied) == 2
    assert sorted(MADE) == ["1", "2"]
