"""What `torchopt validate` runs is what `torchopt rewrite` writes, and fixes are listed at their
place in the file the user has open. These tests run no program (fast); the end-to-end runs are in
test_validate_exact_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source
from torchopt.rewrite.registry import all_rules
from torchopt.rewrite.rule import Invalid
from torchopt.validate import replay
from torchopt.validate.command import plan_rewrite, replayable

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = sorted((ROOT / "fixtures").glob("*/before.py"))
CNN = ROOT / "tests" / "data" / "validate" / "cnn_train.py"
# Every rule, opt-in ones included (channels-last, compile, fused optimizers, DDP conversion...).
EVERY_RULE = Settings(select=("ALL", *sorted(c for c, r in all_rules().items() if getattr(r, "opt_in", False))))
# Examples of random-stream fixes are instrumented: quick. The others only check that nothing is
# instrumented; the whole set runs with the slow tests.
EXAMPLES = [
    pytest.param(code, ex.src, id=f"{code}-{i}", marks=() if "rng" in ex.unsafe_tags else (pytest.mark.slow,))
    for code, rule in all_rules().items()
    for i, ex in enumerate(rule.examples)
    if isinstance(ex, Invalid)
]


def _assert_validated_is_written(text: str, path: str, settings: Settings, unsafe: bool) -> None:
    written = fix_source(text, settings, path, unsafe=unsafe)
    plan = plan_rewrite(text, path, settings, unsafe)
    assert plan.before == text  # the original runs as it is
    assert replay.strip(plan.after) == written.text
    assert [(d.code, d.line, d.column) for d in plan.applied] == [(d.code, d.line, d.column) for d in written.applied]
    # every random-stream fix is replayed or listed as not validated, with a reason
    # (padding fixes are aligned by the weight transplant, compiled random ops by the harness)
    rng = [d for d in written.applied if replayable(d)]
    assert len(plan.sites) + len(plan.unvalidated) <= len(rng)
    assert all(why for _, why in plan.unvalidated)
    if not plan.unvalidated and rng:
        assert plan.sites, "a random-stream fix was neither replayed nor listed as not validated"


@pytest.mark.slow  # three rewrites of each of 50 real-looking programs
@pytest.mark.parametrize("before", [*FIXTURES, CNN], ids=lambda p: p.parent.name if p != CNN else "cnn_train")
@pytest.mark.parametrize(
    "settings,unsafe",
    [(Settings(), False), (Settings(), True), (EVERY_RULE, True)],
    ids=["safe", "unsafe", "opt-in-unsafe"],
)
def test_run_text_is_the_written_text_on_every_fixture(before: Path, settings: Settings, unsafe: bool) -> None:
    _assert_validated_is_written(before.read_text(encoding="utf-8"), str(before), settings, unsafe)


@pytest.mark.parametrize("unsafe", [False, True], ids=["safe", "unsafe"])
@pytest.mark.parametrize("code,src", EXAMPLES)
def test_run_text_is_the_written_text_on_every_rule_example(code: str, src: str, unsafe: bool) -> None:
    # the rule alone, as its examples are checked (an opt-in rule fires only when selected), and
    # every rule at once, as `rewrite` runs by default
    _assert_validated_is_written(src, "example.py", Settings(select=(code,)), unsafe)
    _assert_validated_is_written(src, "example.py", Settings(), unsafe)


@pytest.mark.slow  # over ~2.5 s on a quiet machine: CI runs it with the slow tests
def test_every_fix_rewrite_writes_is_in_the_program_run() -> None:
    """The CNN script: rewrite writes fixes of six rules; before, the random-stream sites were
    wrapped first and the rules no longer matched the wrapped code, so validate ran 6 of 12."""
    text = CNN.read_text(encoding="utf-8")
    written = fix_source(text, Settings(), str(CNN), unsafe=True)
    plan = plan_rewrite(text, str(CNN), Settings(), True)
    assert len(written.applied) >= 10
    assert sorted(d.code for d in plan.applied) == sorted(d.code for d in written.applied)
    assert plan.sites  # the random draw moved to the device is replayed ...
    assert replay.strip(plan.after) == written.text  # ... on the very text rewrite writes


def test_strip_inverts_the_instrumentation_of_awkward_expressions() -> None:
    text = "import torch\nx = (torch.rand(4)).double()\ny = [torch.rand(\n    2\n).double()]\n"
    written = fix_source(text, Settings(), "a.py", unsafe=True)
    plan = plan_rewrite(text, "a.py", Settings(), True)
    assert len(plan.sites) + len(plan.unvalidated) == 2 and plan.sites
    assert replay.strip(plan.after) == written.text
    compile(plan.after, "a.py", "exec")


def test_a_random_stream_fix_in_a_class_body_is_listed_with_its_reason() -> None:
    """A lambda in a class body cannot see the class's names, so the site is not wrapped: the fix
    is named with the reason instead of being silently compared without replay."""
    text = "import torch\n\n\nclass C:\n    n = 4\n    w = torch.rand(n).double()\n"
    plan = plan_rewrite(text, "c.py", Settings(), True)
    assert [d.code for d, _ in plan.unvalidated] == ["TOP102"]
    assert "class body" in plan.unvalidated[0][1]


# --------------------------------------------------------------------------- positions


def _cli(*args: object):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.slow  # over ~2.5 s on a quiet machine: CI runs it with the slow tests
def test_fix_listings_name_positions_in_the_original_text(tmp_path: Path) -> None:
    """TOP202 and TOP502 insert lines in the first pass; TOP101's fix, found in a later pass, must
    still be listed where the user sees `torch.randn(8).to(device)`, in every listing."""
    text = CNN.read_text(encoding="utf-8")
    want = {(d.code, d.line, d.column) for d in check_source(text, Settings(), str(CNN)).diagnostics}
    top101 = next((line, col) for code, line, col in want if code == "TOP101")
    assert text.splitlines()[top101[0] - 1][top101[1] - 1 :].startswith("torch.randn(8).to(device)")

    written = fix_source(text, Settings(), "t.py", unsafe=True)
    assert written.passes > 1
    for d in written.applied:
        assert (d.code, d.line, d.column) in want, d

    for fmt in ("json", "sarif"):
        target = tmp_path / f"{fmt}.py"
        target.write_text(text, encoding="utf-8")
        res = _cli("rewrite", target, "--unsafe-fixes", "--no-cache", "--output-format", fmt)
        data = json.loads(res.stdout)
        rows = data if fmt == "json" else data["runs"][0]["results"]
        assert rows
        for r in rows:
            if fmt == "json" and r.get("fixed"):
                assert (r["code"], r["line"], r["column"]) in want, r
            elif fmt == "sarif" and r["ruleId"] == "TOP101":
                region = r["locations"][0]["physicalLocation"]["region"]
                assert (region["startLine"], region["startColumn"]) == top101
    target = tmp_path / "text.py"
    target.write_text(text, encoding="utf-8")
    res = _cli("rewrite", target, "--unsafe-fixes", "--no-cache")
    assert f"{target}:{top101[0]}:{top101[1]}: TOP101 unsafe fix" in res.stderr
