"""The language server's incremental check after a sequence of random edits gives what a full
check of each text gives (property test): on a training script cut into independent parts, the
same script as one program, and the fixtures."""

from __future__ import annotations

import collections
import importlib.util
import random
from pathlib import Path

import pytest
from test_incremental import EVERY_RULE, _one_edit

from torchopt.rewrite.engine import ParseError, check_source
from torchopt.rewrite.incremental import IncrementalChecker, groups, split

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("lsp_script", ROOT / "benchmarks" / "lsp_script.py")
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
PROGRAM: str = _module.TRAINING_SCRIPT
# Without main() (and the lines that call it) the functions no longer reach each other: several
# groups, each analysed on its own, whose results are reused across edits.
PARTS = PROGRAM[: PROGRAM.index("def main(")] + PROGRAM[PROGRAM.index("def smoke_test(") : PROGRAM.index("if __name__")]
NUMBER_EDITS = ["0.5", "3", "True", "x.item()", "torch.zeros(2).cuda()"]


def _edit(text: str, rng: random.Random) -> str:
    """A user's edit: _one_edit's insertions and deletions, or a new value typed over a number."""
    if rng.random() < 0.4:
        spots = [i for i, c in enumerate(text) if c.isdigit() and text[i - 1] in "=(, "]
        if spots:
            i = rng.choice(spots)
            j = i
            while j < len(text) and (text[j].isdigit() or text[j] == "."):
                j += 1
            return text[:i] + rng.choice(NUMBER_EDITS) + text[j:]
    return _one_edit(text, rng)


def _walk(text: str, seed: int, steps: int) -> int:
    """Random edits from ``text``; after each one the incremental result must equal a full check.
    Returns how many texts were compared (edits that do not parse are checked to fail alike)."""
    rng = random.Random(seed)
    checker = IncrementalChecker()
    checker.check(text, EVERY_RULE, "train.py")
    compared = 0
    for _ in range(steps):
        new = _edit(text, rng)
        try:
            expected = check_source(new, EVERY_RULE, "train.py").diagnostics
        except ParseError:
            with pytest.raises(ParseError):
                checker.check(new, EVERY_RULE, "train.py")
            continue
        got = checker.check(new, EVERY_RULE, "train.py")
        a, b = collections.Counter(expected), collections.Counter(got)
        assert a == b, (
            f"after an edit to:\n{new}\nonly full: {list((a - b).elements())}\nonly inc: {list((b - a).elements())}"
        )
        assert got == sorted(got, key=lambda d: d.sort_key())
        text = new
        compared += 1
    return compared


def test_the_scripts_have_what_the_test_is_about():
    assert len(groups(split(PARTS))[1]) >= 5  # independent parts, whose results are reused
    assert max(len(g) for g in groups(split(PROGRAM))[1]) >= 15  # one program: main() reaches the rest
    assert len(check_source(PARTS, EVERY_RULE, "train.py").diagnostics) >= 10


@pytest.mark.slow
def test_random_edits_of_a_script_in_parts_give_a_full_checks_result():
    assert _walk(PARTS, seed=1, steps=6) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("which", ["parts", "program"])
def test_long_random_edit_sequences_give_a_full_checks_result(which, seed):
    assert _walk(PARTS if which == "parts" else PROGRAM, seed=seed, steps=20) >= 6


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.parent.name for p in (ROOT / "fixtures").glob("*/before.py")))
def test_random_edits_of_a_fixture_give_a_full_checks_result(name):
    text = (ROOT / "fixtures" / name / "before.py").read_text(encoding="utf-8")
    assert _walk(text, seed=len(name), steps=8) >= 2
