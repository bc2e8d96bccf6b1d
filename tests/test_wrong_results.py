"""Fixes that used to change what a program computes: `torch.range` rewritten with one element too
many, a conv-bias removal that did not say it moves the random stream, and a float64 tensor put on
a device that may be MPS."""

from __future__ import annotations

import hashlib
import random
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

torch = pytest.importorskip("torch")

RANGE = Settings(select=("TOP826",))


def _evaluate(text: str) -> "torch.Tensor | None":
    """The value of `r` after running ``text``; None when the program raises."""
    scope: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            exec(compile(text, "<range>", "exec"), scope)
        except RuntimeError:
            return None
    return scope["r"]  # type: ignore[return-value]


def _draw_calls(rng: random.Random, count: int) -> list[tuple[str, bool]]:
    calls = []
    for _ in range(count):
        if rng.random() < 0.5:
            start, end = rng.randint(-40, 40), rng.randint(-40, 40)
            step = rng.choice([s for s in range(-9, 10) if s])
            form = rng.choice(["{a}, {b}, {c}", "{a}, {b}", "{a}, {b}, {c}, dtype=torch.int64"])
            floats = False
        else:
            start, end = round(rng.uniform(-5, 5), rng.choice([1, 2])), round(rng.uniform(-5, 5), 2)
            step = rng.choice([0.1, 0.25, 0.3, -0.1, -0.7, 1.5, 0.05])
            form = rng.choice(["{a}, {b}, {c}", "{a}, {b}"])
            floats = True
        calls.append(("torch.range(" + form.format(a=start, b=end, c=step) + ")", floats))
    return calls


@pytest.mark.slow  # over ~2.5 s on a quiet machine: CI runs it with the slow tests
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_safe_range_fix_keeps_dtype_and_values(seed: int) -> None:
    """Random bounds and steps, ints and floats, negative steps: whenever the rewrite is declared
    safe, the new call yields the same dtype and the same values on the CPU, and a call that raised
    still raises."""
    safe_fixes = 0
    for call, floats in _draw_calls(random.Random(seed), 100):
        text = f"import torch\n\nr = {call}\n"
        fixed = fix_source(text, RANGE, unsafe=False).text
        diags = check_source(text, RANGE).diagnostics
        assert [d.code for d in diags] == ["TOP826"], call
        if floats:
            assert fixed == text, f"a float range was fixed as safe: {call} -> {fixed}"
            assert diags[0].fix is None or diags[0].fix.safety == "unsafe", call
            _assert_unsafe_float_fix_keeps_the_length(text)
        if fixed == text:
            continue
        safe_fixes += 1
        before, after = _evaluate(text), _evaluate(fixed)
        if before is None:
            pytest.fail(f"{call} raises, but its rewrite {fixed!r} was declared safe")
        assert after is not None, fixed
        assert after.dtype == before.dtype, (call, fixed)
        assert torch.equal(after, before), (call, fixed, before, after)
    assert safe_fixes > 20


def _assert_unsafe_float_fix_keeps_the_length(text: str) -> None:
    fixed = fix_source(text, RANGE, unsafe=True).text
    before, after = _evaluate(text), _evaluate(fixed)
    if fixed == text or before is None:
        assert fixed == text, f"a call that raises was rewritten: {fixed}"
        return
    assert after is not None and after.shape == before.shape, fixed
    assert torch.allclose(after, before, rtol=0, atol=1e-5), fixed


def test_range_with_a_step_that_does_not_divide_the_span_keeps_its_elements(tmp_path: Path) -> None:
    """The reported case: `torch.range(1, 10, 2)` is 1, 3, 5, 7, 9, and so is its rewrite."""
    script = tmp_path / "grid.py"
    script.write_text("import torch\n\nr = torch.range(1, 10, 2)\n")
    res = CliRunner().invoke(app, ["rewrite", str(script), "--select", "TOP826", "--no-cache"])
    assert res.exit_code == 0, res.output
    after = script.read_text()
    assert after == "import torch\n\nr = torch.arange(1, 11, 2, dtype=torch.get_default_dtype())\n"
    assert _evaluate(after).tolist() == [1.0, 3.0, 5.0, 7.0, 9.0]


def test_a_range_that_raises_is_reported_but_not_turned_into_an_empty_tensor(tmp_path: Path) -> None:
    text = "import torch\n\nr = torch.range(5, 4, 1)\nz = torch.range(0, 5, 0)\n"
    assert [d.code for d in check_source(text, RANGE).diagnostics] == ["TOP826", "TOP826"]
    assert fix_source(text, RANGE, unsafe=True).text == text


def test_non_literal_bounds_are_unsafe_and_say_the_count_may_change() -> None:
    text = "import torch\n\n\ndef grid(lo, hi, h):\n    return torch.range(lo, hi if hi else 1, h)\n"
    (diag,) = check_source(text, RANGE).diagnostics
    assert diag.fix is not None and diag.fix.safety == "unsafe"
    assert "semantics" in diag.fix.changes()
    assert fix_source(text, RANGE, unsafe=False).text == text
    out = fix_source(text, RANGE, unsafe=True).text
    assert "torch.arange(lo, (hi if hi else 1) + h, h," in out


def _tree_hash(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_dropping_a_conv_bias_says_it_moves_the_random_stream(tmp_path: Path) -> None:
    """Without the bias the conv draws fewer random numbers, so every later initialisation and
    shuffle changes: the unsafe fix must say `rng`, on the command line and on its page."""
    script = tmp_path / "net.py"
    script.write_text("import torch.nn as nn\n\nblock = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))\n")
    before = _tree_hash(tmp_path)
    res = CliRunner().invoke(app, ["rewrite", str(script), "--select", "TOP841", "--no-cache"])
    assert res.exit_code == 0, res.output
    assert "rng" in res.output
    assert _tree_hash(tmp_path) == before
    (diag,) = check_source(script.read_text(), Settings(select=("TOP841",))).diagnostics
    assert diag.fix is not None and "rng" in diag.fix.tags
    page = CliRunner().invoke(app, ["rule", "TOP841"])
    assert "rng" in page.output
