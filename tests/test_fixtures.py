"""Golden fixtures: whole realistic programs (fixtures/<name>/before.py) rewritten by every rule.

For each fixture folder:
  (a) the safe rewrite is exactly after_safe.py, the unsafe one exactly after_unsafe.py;
  (b) both outputs compile and a second pass changes nothing;
  (c) before.py and after_safe.py compute bitwise the same thing on the CPU (tensors, module
      states, RNG state);
  (d) after_unsafe.py runs on the CPU.
Plus the command line on one fixture (--diff writes nothing; --unsafe-fixes says what changes).
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest
from typer.testing import CliRunner

import torchopt.cli
from semantic import compare_programs, run_program
from cpu_support import skip_unless_bfloat16_lstm
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import fix_source

pytestmark = pytest.mark.filterwarnings(
    # aliases_chains keeps `T.tensor(template).to(device)` on purpose (a display-only case).
    "ignore:To copy construct from a tensor:UserWarning"
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "before.py").is_file())


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The programs are tiny; intra-op threads only add overhead (seconds per run on a loaded
    2-CPU box) and make reductions depend on the thread count. Restored afterwards."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _read(name: str, which: str) -> str:
    return (FIXTURES / name / f"{which}.py").read_text(encoding="utf-8")


def _diff(expected: str, got: str, name: str) -> str:
    return "".join(
        difflib.unified_diff(
            expected.splitlines(True), got.splitlines(True), f"{name} (expected)", f"{name} (torchopt)"
        )
    )


def test_fixtures_exist():
    assert set(NAMES) >= {"cnn_train", "transformer_lm", "data_pipeline", "aliases_chains", "inference"}
    for name in NAMES:
        for f in ("after_safe.py", "after_unsafe.py", "notes.md"):
            assert (FIXTURES / name / f).is_file(), f"fixtures/{name}/{f} is missing"


@pytest.mark.parametrize("name", NAMES)
# the unsafe rewrite of every fixture takes seconds each: with the slow tests (CI runs them)
@pytest.mark.parametrize("unsafe", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["safe", "unsafe"])
def test_rewrite_matches_golden(name, unsafe):
    before = _read(name, "before")
    expected = _read(name, "after_unsafe" if unsafe else "after_safe")
    got = fix_source(before, Settings(), unsafe=unsafe).text
    assert got == expected, "\n" + _diff(expected, got, name)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("unsafe", [False, True], ids=["safe", "unsafe"])
def test_golden_compiles_and_is_a_fix_point(name, unsafe):
    which = "after_unsafe" if unsafe else "after_safe"
    text = _read(name, which)
    compile(text, f"{name}/{which}.py", "exec", dont_inherit=True)
    again = fix_source(text, Settings(), unsafe=unsafe)
    assert again.text == text, "a second pass changed the output:\n" + _diff(text, again.text, name)
    assert not again.applied


@pytest.mark.parametrize("name", NAMES)
def test_before_itself_is_deterministic(name):
    """Guards the fixture, not the tool: otherwise (c) would be meaningless."""
    before = _read(name, "before")
    assert compare_programs(before, before) == []


@pytest.mark.parametrize("name", NAMES)
def test_safe_rewrite_is_bitwise_the_same_on_cpu(name):
    assert compare_programs(_read(name, "before"), _read(name, "after_safe")) == []


@pytest.mark.parametrize("name", NAMES)
def test_unsafe_rewrite_runs_on_cpu(name):
    src = _read(name, "after_unsafe")
    skip_unless_bfloat16_lstm(src)
    ns = run_program(src, f"{name}_after_unsafe")  # (a process group's program runs in its own process)
    assert ns  # it ran to the end and left its globals


# ----------------------------------------------------------------------------- command line


def _cli(*args):
    return CliRunner().invoke(torchopt.cli.app, list(args), catch_exceptions=False)


def _changed_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    minus, plus = [], []
    for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0):
        if line.startswith("---") or line.startswith("+++") or line.startswith("@@"):
            continue
        (minus if line.startswith("-") else plus).append(line)
    return minus, plus


def test_cli_diff_on_fixture_prints_safe_fixes_and_writes_nothing():
    path = FIXTURES / "cnn_train" / "before.py"
    before_bytes = path.read_bytes()
    r = _cli("rewrite", str(path), "--diff", "-j", "1")
    assert r.exit_code == 1, r.output
    assert path.read_bytes() == before_bytes, "--diff wrote to the file"
    minus, plus = _changed_lines(_read("cnn_train", "before"), _read("cnn_train", "after_safe"))
    assert minus and plus
    out = r.stdout.splitlines()
    for line in minus + plus:
        assert line in out, f"diff lacks {line!r}:\n{r.stdout}"
    # Unsafe changes are not in the safe diff.
    _, unsafe_plus = _changed_lines(_read("cnn_train", "after_safe"), _read("cnn_train", "after_unsafe"))
    for line in unsafe_plus:
        assert line not in out, f"safe diff shows an unsafe change {line!r}"
    assert "Would fix" in r.stderr and "TOP101" in r.stderr
    assert "--unsafe-fixes" in r.stderr  # hidden unsafe fixes are announced


@pytest.mark.slow  # over ~2.5 s on a quiet machine: CI runs it with the slow tests
def test_cli_unsafe_diff_on_fixture_names_what_changes():
    path = FIXTURES / "cnn_train" / "before.py"
    before_bytes = path.read_bytes()
    r = _cli("rewrite", str(path), "--diff", "--unsafe-fixes", "-j", "1")
    assert r.exit_code == 1, r.output
    assert path.read_bytes() == before_bytes
    minus, plus = _changed_lines(_read("cnn_train", "before"), _read("cnn_train", "after_unsafe"))
    out = r.stdout.splitlines()
    for line in minus + plus:
        assert line in out, f"diff lacks {line!r}:\n{r.stdout}"
    applied = fix_source(_read("cnn_train", "before"), Settings(), unsafe=True).applied
    unsafe = [d for d in applied if d.fix is not None and d.fix.safety == "unsafe"]
    assert unsafe, "cnn_train is meant to exercise unsafe fixes"
    lines = [ln for ln in r.stderr.splitlines() if ": TOP" in ln and " unsafe fix: " in ln]
    assert len(lines) == len(unsafe), r.stderr
    remaining = list(lines)
    for d in unsafe:  # positions in the original text, whichever pass applied the fix
        match = [ln for ln in remaining if f":{d.line}:{d.column}: {d.code} unsafe fix: " in ln]
        assert match, f"stderr does not name the unsafe fix {d.code} at {d.line}:{d.column}:\n{r.stderr}"
        ln = match[0]
        remaining.remove(ln)
        assert " — changes " in ln and all(f"{t}: " in ln for t in d.fix.tags), ln
    tags = {t for d in unsafe for t in d.fix.tags}
    assert {"rng", "semantics"} <= tags, tags


def test_cli_summary_spells_plural_of_fix():
    """`3 unsafe fixs not applied` is a typo in the summary (reported as a discrepancy)."""
    r = _cli("rewrite", str(FIXTURES / "cnn_train" / "before.py"), "--diff", "-j", "1")
    assert "unsafe fixes not applied" in r.stderr and "fixs" not in r.stderr, r.stderr


@pytest.mark.parametrize("name", NAMES)
def test_each_problem_is_reported_once(name):
    """Two display-only diagnostics on the same span are one problem reported twice (reported as a
    discrepancy: `.type(T.cuda.FloatTensor)` is flagged by both TOP101 and TOP105)."""
    from torchopt.rewrite.engine import check_source

    diags = check_source(_read(name, "before"), Settings()).diagnostics
    seen = {}
    for d in diags:
        if d.fix is not None:
            continue
        key = (d.line, d.column, d.end_line, d.end_column)
        assert key not in seen, (
            f"{seen[key].code} and {d.code} both report {key}: {seen[key].message!r} / {d.message!r}"
        )
        seen[key] = d
