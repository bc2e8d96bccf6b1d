"""The language server's incremental check (rewrite/incremental.py) must report exactly what
`torchopt check` reports, and after an edit inside one function re-analyse only that function's
group of linked statements."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import ParseError, check_source
from torchopt.rewrite.incremental import IncrementalChecker, groups, split
from torchopt.rewrite.registry import all_rules

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
RULES = all_rules()
EVERY_RULE = Settings(select=("ALL",) + tuple(c for c, r in RULES.items() if getattr(r, "opt_in", False)))


def _same(text: str, settings: Settings = EVERY_RULE) -> None:
    full = check_source(text, settings, "m.py").diagnostics
    inc = IncrementalChecker().check(text, settings, "m.py")
    a, b = collections.Counter(full), collections.Counter(inc)
    assert a == b, f"only in check: {list((a - b).elements())}\nonly incremental: {list((b - a).elements())}"
    assert inc == sorted(inc, key=lambda d: d.sort_key())


@pytest.mark.parametrize("name", sorted(p.parent.name for p in FIXTURES.glob("*/before.py")))
def test_fixture_gives_what_check_gives(name):
    _same((FIXTURES / name / "before.py").read_text(encoding="utf-8"))


def _multi_chunk_examples() -> list:
    out = []
    for code, rule in sorted(RULES.items()):
        for i, ex in enumerate(rule.examples):
            chunks = split(ex.src)
            if chunks and len(chunks) > 2 and groups(chunks)[1]:
                out.append(pytest.param(ex.src, id=f"{code}-{i}"))
    return out


@pytest.mark.parametrize("src", _multi_chunk_examples())
def test_rule_example_gives_what_check_gives(src):
    _same(src)


HEAD = """import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

device = "cuda" if torch.cuda.is_available() else "cpu"
"""

BLOCK = """

class Net{i}(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def train_{i}():
    model = Net{i}().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scratch = torch.zeros(8, 4).cuda()
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4)
    for x, y in loader:
        x = x.to(device)
        loss = ((model(x) - y.to(device)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return scratch
"""


def test_an_edit_in_one_function_reanalyses_only_its_group():
    text = HEAD + "".join(BLOCK.format(i=i) for i in range(4))
    checker = IncrementalChecker()
    first = checker.check(text, Settings(), "m.py")
    assert first == check_source(text, Settings(), "m.py").diagnostics
    assert checker.last_misses >= 4  # the header and one group per Net/train pair
    edited = text.replace("lr=0.05", "lr=0.07", 3).replace("lr=0.07", "lr=0.05", 2)  # the third block only
    assert edited != text
    again = checker.check(edited, Settings(), "m.py")
    assert checker.last_misses == 1
    assert again == check_source(edited, Settings(), "m.py").diagnostics
    # Lines added above a function move its diagnostics; nothing below is re-analysed but the header.
    moved = edited.replace("def train_0():", "def train_0():\n    pass\n\n\ndef train_0():", 1)
    shifted = checker.check(moved, Settings(), "m.py")
    assert shifted == check_source(moved, Settings(), "m.py").diagnostics
    assert [d.line for d in shifted if d.line > 40] and checker.last_misses <= 2


def test_messages_that_name_a_line_name_the_original_line():
    text = (
        HEAD
        + "".join(BLOCK.format(i=i) for i in range(2))
        + """

def report(model, loader):
    total = 0.0
    for x, y in loader:
        loss = model(x).sum()
        loss.backward()
        total += loss.item()
    return total
"""
    )
    diags = IncrementalChecker().check(text, Settings(), "m.py")
    assert diags == check_source(text, Settings(), "m.py").diagnostics
    assert any("line " in d.message for d in diags)


def test_split_cuts_top_level_statements_with_decorators_and_comments():
    text = "import torch\n\n# about f\n@torch.no_grad()\ndef f():\n    return 1\n# trailing\n\na = 1; b = f()\n"
    chunks = split(text)
    assert [(c.start, c.end, c.kind) for c in chunks] == [(1, 3, "import"), (4, 8, "def"), (9, 9, "stmt")]
    header, comps = groups(chunks)
    assert header == [0] and comps == [[1, 2]]  # `b = f()` uses f


@pytest.mark.parametrize("text", ["x = 1\r\ny = 2\r\n", "def f(:\n", "", "# only a comment\n"])
def test_texts_it_cannot_cut_are_checked_whole(text):
    assert split(text) is None or len(split(text)) < 2
    try:
        expected = check_source(text, Settings(), "m.py").diagnostics
    except ParseError:
        with pytest.raises(ParseError):
            IncrementalChecker().check(text, Settings(), "m.py")
        return
    assert IncrementalChecker().check(text, Settings(), "m.py") == expected


def _one_edit(text: str, rng) -> str:
    """An edit a user makes: type or delete characters, add or remove lines, at a random place."""
    snippets = [
        "x",
        "\n",
        "\n\n",
        "    pass\n",
        "def g():\n    return 1\n",
        "# note\n",
        ")",
        "(",
        "'",
        "@dec\n",
        "import os\n",
        "y = g()\n",
        "class K:\n    pass\n",
    ]
    i = rng.randrange(len(text) + 1)
    if rng.random() < 0.5:  # at the start of a line: more edits that still parse
        i = text.rfind("\n", 0, i) + 1
    if rng.random() < 0.3 and text:
        j = min(len(text), i + rng.randrange(1, 40))
        return text[:i] + text[j:]
    return text[:i] + rng.choice(snippets) + text[i:]


@pytest.mark.parametrize("seed", range(3))
def test_resplit_after_any_edit_equals_a_fresh_split(seed):
    import random

    from torchopt.rewrite.incremental import _lines, resplit

    rng = random.Random(seed)
    text = (
        HEAD
        + "".join(BLOCK.format(i=i) for i in range(3))
        + "\n\n# the end\nif __name__ == '__main__':\n    train_0()\n"
    )
    lines, chunks = _lines(text), split(text)
    checked = 0
    for _ in range(200):
        new = _one_edit(text, rng)
        got_lines, got = resplit(lines, chunks, new)
        assert got == split(new), f"after an edit to:\n{new}"
        if got is not None:  # the user goes on from text that parses
            text, lines, chunks = new, got_lines, got
            checked += 1
    assert checked > 40


@pytest.mark.slow  # over ~2.5 s on a quiet machine: CI runs it with the slow tests
def test_edits_keep_the_incremental_result_exact():
    import random

    rng = random.Random(7)
    text = HEAD + "".join(BLOCK.format(i=i) for i in range(2))
    checker = IncrementalChecker()
    settings = Settings()
    compared = 0
    for _ in range(40):
        new = _one_edit(text, rng)
        try:
            expected = check_source(new, settings, "m.py").diagnostics
        except ParseError:
            with pytest.raises(ParseError):
                checker.check(new, settings, "m.py")
            continue
        assert checker.check(new, settings, "m.py") == expected
        text = new
        compared += 1
    assert compared >= 6
