"""fixtures/sync_item_logging end to end: the rewrite validates bitwise, prints the same bytes, and
its training step synchronises less (counted on the CPU by instrumenting the Tensor methods that
read device values on the host)."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from semantic import run_program
from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures" / "sync_item_logging"

# Tensor methods that read a value on the host (each one is a synchronisation on CUDA).
SYNC_METHODS = ("item", "cpu", "tolist", "numpy", "__bool__", "__format__", "__float__", "__int__")


def count_syncs(src: str) -> collections.Counter:
    """Run ``src`` with every SYNC_METHODS call counted by (method, calling function)."""
    counts: collections.Counter = collections.Counter()
    saved = {m: getattr(torch.Tensor, m) for m in SYNC_METHODS}

    def wrap(name, fn):
        def inner(self, *args, **kwargs):
            counts[(name, sys._getframe(1).f_code.co_name)] += 1
            return fn(self, *args, **kwargs)

        return inner

    for m, fn in saved.items():
        setattr(torch.Tensor, m, wrap(m, fn))
    try:
        run_program(src, "counted")
    finally:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, fn)
    return counts


@pytest.fixture(scope="module")
def texts():
    before = (FIX / "before.py").read_text()
    return before, fix_source(before, Settings()).text


def test_rewritten_training_step_synchronises_less(texts, capsys):
    torch.set_num_threads(1)
    before, after = (count_syncs(t) for t in texts)
    capsys.readouterr()
    # train(): 12 `loss.item()` + 3 `grad_norm.item()` before; only the 3 logging reads + 3 after.
    assert before[("item", "train")] == 15
    assert after[("item", "train")] == 6
    # evaluate(): 3 `val_loss` reads + 3 `correct` reads before; 1 + 3 after.
    assert before[("item", "evaluate")] == 6
    assert after[("item", "evaluate")] == 4
    # The Python branches are reported, not rewritten: the same number of `__bool__` calls.
    assert before[("__bool__", "forward")] == after[("__bool__", "forward")] == 15
    assert before[("__bool__", "focal_loss")] == after[("__bool__", "focal_loss")] == 12
    assert sum(after.values()) < sum(before.values())


def test_logged_output_is_byte_for_byte_the_same(texts):
    torch.set_num_threads(1)
    outs = []
    for text in texts:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            run_program(text, "printed")
        outs.append(buf.getvalue())
    assert outs[0] == outs[1]
    assert outs[0].count("loss") == 4  # three logging points and the validation line


def test_validate_reports_bitwise_equivalence():
    res = CliRunner().invoke(
        app, ["validate", str(FIX / "before.py"), "--steps", "12", "--device", "cpu", "--json"], catch_exceptions=False
    )
    out = json.loads(res.stdout)
    assert res.exit_code == 0, out
    assert out["headline"] == "EQUIVALENT (bitwise)"
    assert {f["code"] for f in out["applied"]} == {"TOP601"}
    assert all(f["safety"] == "safe" for f in out["applied"])
    assert out["rows"] and all(r["verdict"] == "ok" for r in out["rows"])


def test_every_sync_diagnostic_names_its_loop():
    diags = [d for d in check_source((FIX / "before.py").read_text(), Settings(select=("TOP6",))).diagnostics]
    assert {d.code for d in diags} >= {"TOP601", "TOP603", "TOP604", "TOP605", "TOP609"}
    # the gradient norm is read only at the logging points, every LOG_EVERY steps: not a per-step sync
    assert not [d for d in diags if d.code == "TOP607"]
    for d in diags:
        assert (
            "in the training loop at line 53" in d.message
            or "in the forward-pass loop at line 77" in d.message
            or "called from the training loop at line 53" in d.message
        ), d.message
    by_line = {(d.line, d.code): d for d in diags}
    assert "in `focal_loss`, called from the training loop at line 53" in by_line[(37, "TOP605")].message
    assert "in `MLP.forward`, called from the training loop at line 53" in by_line[(27, "TOP605")].message
    assert "not provably a tensor" in by_line[(81, "TOP601")].message
    assert by_line[(61, "TOP601")].fix is not None and by_line[(61, "TOP601")].fix.safety == "safe"
