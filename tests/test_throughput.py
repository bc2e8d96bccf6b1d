"""What keeps the engine fast, counted rather than timed: a file no selected rule could match is never
parsed by LibCST; rules declare their cheap test per rule (``prefilter``, ``requires``, or an override
of ``could_match``); name resolution runs only when a rule asks about a candidate; the parent map
agrees with LibCST's."""

from __future__ import annotations

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, ParentNodeProvider, ScopeProvider

from torchopt.rewrite import config as config_mod
from torchopt.rewrite import engine, selection
from torchopt.rewrite.config import Settings
from torchopt.rewrite.metadata import ParentProvider, qualified_names, unordered_children
from torchopt.rewrite.rule import Rule


class AnyZeros(Rule):
    """Flags calls to torch.zeros (resolved through scope analysis)."""

    code, name, family, message = "TOP980", "any-zeros", "test", "zeros"
    prefilter = ("zeros",)
    requires = ("torch",)

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Attribute) and node.func.attr.value == "zeros":
            if any(q.name == "torch.zeros" for q in qualified_names(self, node.func)):
                self.report(node)


class Sharp(Rule):
    """A rule with its own negative test: only files that call `.half(` on something."""

    code, name, family, message = "TOP981", "sharp", "test", "half"

    @classmethod
    def could_match(cls, text: str) -> bool:
        return ".half()" in text

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Attribute) and node.func.attr.value == "half":
            self.report(node)


class Plain(Rule):
    """No prefilter at all: every file is parsed for it (the old behaviour, unchanged)."""

    code, name, family, message = "TOP982", "plain", "test", "pass"

    def visit_Pass(self, node: cst.Pass) -> None:
        self.report(node)


TEST_RULES = {r.code: r for r in (AnyZeros, Sharp, Plain)}


@pytest.fixture(autouse=True)
def fake_registry(monkeypatch):
    monkeypatch.setattr(engine, "all_rules", lambda: TEST_RULES)
    monkeypatch.setattr(config_mod, "all_rules", lambda: TEST_RULES)
    monkeypatch.setattr(selection, "all_rules", lambda: TEST_RULES)


@pytest.fixture
def counts(monkeypatch):
    """How often LibCST parses and how often scope analysis runs."""
    seen = {"parse": 0, "scope": 0}
    real_parse, real_resolve = engine.parse, MetadataWrapper.resolve

    def parse(text):
        seen["parse"] += 1
        return real_parse(text)

    def resolve(self, key):
        if key is ScopeProvider:
            seen["scope"] += 1
        return real_resolve(self, key)

    monkeypatch.setattr(engine, "parse", parse)
    monkeypatch.setattr(MetadataWrapper, "resolve", resolve)
    return seen


def check(text, codes):
    return [d.code for d in engine.check_source(text, Settings(select=()), codes=codes).diagnostics]


def test_requires_keeps_files_without_torch_unparsed(counts):
    # "zeros" occurs, but "torch" does not: the file cannot import torch, AnyZeros is not run.
    assert check("import numpy as np\nx = np.zeros(3)\n", {"TOP980"}) == []
    assert counts == {"parse": 0, "scope": 0}
    assert check("import torch\nx = torch.zeros(3)\n", {"TOP980"}) == ["TOP980"]
    assert counts == {"parse": 1, "scope": 1}


def test_broken_file_is_still_reported_when_nothing_is_parsed(counts):
    with pytest.raises(engine.ParseError, match="line 1"):
        check("def f(:\n", {"TOP980"})
    assert counts["parse"] == 0


def test_could_match_override_is_the_per_rule_test(counts):
    assert check("x = y.half\n", {"TOP981"}) == []
    assert counts["parse"] == 0
    assert check("x = y.half()\n", {"TOP981"}) == ["TOP981"]
    assert counts["parse"] == 1
    assert AnyZeros.could_match("torch.zeros") and not AnyZeros.could_match("torch.ones")
    assert not AnyZeros.could_match("zeros")  # requires: every token must occur


def test_one_rule_that_could_match_is_enough_to_parse(counts):
    text = "import torch\nx = torch.ones(3)\npass\n"
    assert engine.active_rules({"TOP980", "TOP981", "TOP982"}, text) == [Plain]
    assert check(text, {"TOP980", "TOP981", "TOP982"}) == ["TOP982"]
    assert counts == {"parse": 1, "scope": 0}  # parsed for Plain; no rule asked for names


def test_name_resolution_only_for_candidates(counts):
    # The file passes AnyZeros's text test (both tokens in a comment) but has no call to `.zeros`:
    # it is parsed and visited, yet scope analysis never runs.
    text = "import torch  # zeros\nx = torch.ones(3)\n"
    assert check(text, {"TOP980"}) == []
    assert counts == {"parse": 1, "scope": 0}


def test_fix_passes_only_when_a_fix_exists(counts):
    r = engine.fix_source("import torch\nx = torch.zeros(3)\n", Settings(select=()), codes={"TOP980"})
    assert r.passes == 0 and r.text == "import torch\nx = torch.zeros(3)\n"
    assert counts["parse"] == 1  # one analysis; no re-parse, no verify pass for a display-only finding


def test_parent_map_equals_libcst():
    src = (
        "import torch\n@dec(a, *b, **c)\nclass A(B, metaclass=M):\n    x: int = 1\n"
        "    def f(self, /, a, *, b=2) -> None:\n        with open(p) as (f, g):\n"
        "            return [i async for i in y if i] or {k: v for k, v in z.items()}\n"
        "lambda q=1: (yield)\nmatch p:\n    case [1, *rest] | {'k': v} if v:\n        pass\n"
        "x = f'{a!r:>{w}}' + b'x' b'y'\ntry:\n    pass\nexcept* E as e:\n    del x[1:2, ::3]\n"
    )
    module = cst.parse_module(src)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    ours, theirs = wrapper.resolve(ParentProvider), wrapper.resolve(ParentNodeProvider)
    assert len(ours) == len(theirs) > 100
    assert all(ours[node] is parent for node, parent in theirs.items())
    for node in list(theirs)[:300]:
        assert sorted(map(id, unordered_children(node))) == sorted(map(id, node.children))


TRICKY = (
    "import torch as T, os.path\nfrom . import (a as b,)\n@dec(a, *b, **c)\nclass A(B, metaclass=M):\n"
    "    x: int = 1\n    def f(self, /, a, *, b=2) -> None:\n        global g\n"
    "        with open(p) as (f, g), q:\n            return [i async for i in y if i] or {**z}\n"
    "lambda q=1: (yield)\nmatch p:\n    case [1, *rest] | {'k': v, **kw} if v:\n        pass\n"
    "    case Point(x=0) as pt:\n        del a[1:2, ::3], b.c\nx = f'{a!r:>{w}}' 'y' + (a @ b) ** -c\n"
    "try:\n    assert x, 'm'\nexcept* E as e:\n    raise X from e\nelse:\n    pass\nfinally:\n"
    "    while (n := n - 1) > 0 if k else j:\n        print(*s, sep='', end='')\n"
    "async def g():\n    async with a as b:\n        await c\n    async for i in d:\n        continue\n"
    "type(x)[0].y = not -x < y <= z is not w in v\n"
)


def test_fast_children_are_libcst_children_in_order():
    from torchopt.rewrite.facts import analysing
    from torchopt.rewrite.metadata import _SLOW_CHILDREN, ordered_children

    module = cst.parse_module(TRICKY)
    stack, seen = [module], 0
    with analysing(TRICKY, module):
        while stack:
            node = stack.pop()
            slow = list(_SLOW_CHILDREN(node))
            for _ in range(2):  # the second time from the memo
                fast = ordered_children(node)
                assert len(fast) == len(slow) and all(a is b for a, b in zip(fast, slow)), type(node).__name__
            stack.extend(slow)
            seen += 1
    assert seen > 300
    # Edited trees (rule replacements reuse nodes, leave fields empty) go through the same checks.
    edited = module.visit(_Rename())
    stack = [edited]
    while stack:
        node = stack.pop()
        slow = list(_SLOW_CHILDREN(node))
        assert [id(c) for c in ordered_children(node)] == [id(c) for c in slow]
        stack.extend(slow)


class _Rename(cst.CSTTransformer):
    def leave_Name(self, original_node, updated_node):
        return updated_node.with_changes(value=updated_node.value + "_")

    def leave_Call(self, original_node, updated_node):
        shared = cst.Name("shared")
        return updated_node.with_changes(args=(cst.Arg(shared), cst.Arg(shared)) if updated_node.args else ())


def test_children_memo_never_answers_for_another_node_with_the_same_id():
    """The memo is keyed by id: a node freed during a pass (a rule's discarded replacement) may leave
    its id to a new node, which must get its own children."""
    from torchopt.rewrite import metadata
    from torchopt.rewrite.facts import analysing

    old = cst.parse_expression("f(a, b)")
    new = cst.parse_expression("g(c)")
    with analysing("f(a, b)\n", cst.parse_module("f(a, b)\n")) as facts:
        facts.children[id(new)] = (old, tuple(old.children))  # what a reused id would look like
        assert [type(c).__name__ for c in metadata.children_of(new)] == [
            type(c).__name__ for c in metadata._SLOW_CHILDREN(new)
        ]
        assert all(a is b for a, b in zip(metadata.children_of(new), metadata._SLOW_CHILDREN(new)))


def test_module_walks_are_shared_during_an_analysis_and_equal_the_plain_walk():
    from torchopt.analysis.syntax import _walk, walk
    from torchopt.rewrite.facts import analysing

    module = cst.parse_module(TRICKY)
    for cross in (True, False):
        plain = list(_walk(module, cross))
        assert [id(n) for n in walk(module, cross)] == [id(n) for n in plain]  # outside: computed
        with analysing(TRICKY, module) as facts:
            first = list(walk(module, cross))
            assert [id(n) for n in first] == [id(n) for n in plain]
            assert [id(n) for n in walk(module, cross)] == [id(n) for n in plain]  # from the memo
            other = cst.parse_module("x = 1\n")
            facts._by_node[("walk", cross, id(other))] = (module, plain)  # a reused id
            assert [type(n).__name__ for n in walk(other, cross)] == [type(n).__name__ for n in _walk(other, cross)]
    assert len(plain) > 10 and len(list(_walk(module, True))) > len(plain)  # scopes are skipped when asked
