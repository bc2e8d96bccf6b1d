"""TOP711: the inserted warm-up runs the largest batch first and leaves training
bitwise unchanged, where a naive warm-up does not; and the cases it must refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from semantic import compare_programs, run_program
from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures" / "mem_varlen_nlp"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def after() -> str:
    return fix_source((FIX / "before.py").read_text(), Settings(), codes=("TOP711",)).text


def test_warmup_runs_the_longest_batch_first(after, monkeypatch):
    import torch.nn.utils.rnn as rnn

    shapes = []
    real = rnn.pad_sequence

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(rnn, "pad_sequence", recording)
    run_program(after, "mem_after")
    assert len(shapes) == 1 + 2 * 8  # the warm-up, then 2 epochs of 8 batches
    assert shapes[0] == (4, 16)  # BATCH longest samples, padded to the dataset's maximum length
    assert all(s[0] <= 4 and s[1] <= 16 for s in shapes[1:])
    assert len({s[1] for s in shapes[1:]}) > 1  # the lengths really vary


def test_safe_warmup_keeps_training_bitwise(after):
    assert "preallocate_for_longest_batch(" in after
    assert compare_programs((FIX / "before.py").read_text(), after) == []


def test_naive_warmup_would_change_training(after):
    """The comparison is sensitive: without fork/restore training changes."""
    start = after.index("    py_state = random.getstate()")
    end = after.index("def warmup_loss")
    naive = (
        after[:start]
        + ("    for m in modules:\n        m.train()\n    forward_loss(*make_batch()).backward()\n\n\n")
        + after[end:]
    )
    compile(naive, "naive", "exec")
    diffs = compare_programs((FIX / "before.py").read_text(), naive)
    assert diffs, "a warm-up without fork_rng/buffer restore should have changed training"
    assert any("norm.running_mean" in d or "num_batches_tracked" in d or "losses" in d for d in diffs), diffs


def test_validate_compares_every_training_value_bitwise(tmp_path, after):
    """`torchopt validate` on the fixture: every loss, parameter, buffer, optimizer state, global,
    the model-output probe and the RNG state are bitwise equal. (The probe evaluates each model on
    its first input after the first optimizer step, so the inserted warm-up's longest batch is not
    what the rewritten version is probed with.)"""
    b = tmp_path / "before.py"
    a = tmp_path / "after.py"
    b.write_text((FIX / "before.py").read_text())
    a.write_text(after)
    res = CliRunner().invoke(
        app, ["validate", str(b), str(a), "--steps", "16", "--device", "cpu", "--json"], catch_exceptions=False
    )
    out = json.loads(res.stdout)
    rows = {r["name"]: r for r in out["rows"]}
    assert sum(n.startswith("loss[") for n in rows) == 16
    assert any(n.startswith("param/model.norm.running_mean") for n in rows)
    assert any(n.startswith("output/model") for n in rows)
    bad = sorted(n for n, r in rows.items() if r["verdict"] != "ok")
    assert bad == [], bad
    assert out["verdict"] == "equivalent"
    assert all(r["max_abs"] == 0 for r in rows.values() if r.get("max_abs") is not None)


def _variant(old: str, new: str) -> str:
    src = (FIX / "before.py").read_text()
    assert src.count(old) == 1, old
    return src.replace(old, new)


def _top711(src: str):
    diags = [d for d in check_source(src, Settings(select=("TOP711",))).diagnostics]
    assert len(diags) == 1, diags
    assert fix_source(src, Settings(select=("TOP711",))).text == src or diags[0].fix is not None
    return diags[0]


@pytest.mark.parametrize(
    "old,new,reason",
    [
        (
            "        out, _ = self.rnn(self.drop(h))\n",
            "        self.last_len = tokens.shape[1]\n        out, _ = self.rnn(self.drop(h))\n",
            "sets `self.last_len`",
        ),
        (
            "model = Classifier().to(device)\n",
            "model = torch.nn.DataParallel(Classifier().to(device))\n",
            "data parallelism",
        ),
        (
            "        logits = model(tokens)\n",
            "        logits = model(tokens)\n        print(logits.shape)\n",
            "in the step has side effects",
        ),
        (
            "        loss = criterion(logits, labels)\n",
            "        loss = criterion(logits, labels) * scale\n",
            "`scale` is bound after",
        ),
    ],
)
def test_refusals_are_reported_with_the_reason(old, new, reason):
    src = _variant(old, new)
    if "scale" in new:
        src = src.replace(
            "    for tokens, labels in loader:\n", "    scale = 1.0 / (epoch + 1)\n    for tokens, labels in loader:\n"
        )
    d = _top711(src)
    assert d.fix is None
    assert reason in d.message, d.message
    assert "in the training loop" not in d.message or "The training loop at line" in d.message
    assert fix_source(src, Settings(select=("TOP711",))).text == src


def test_inside_a_function_the_helper_goes_to_module_level():
    src = (FIX / "before.py").read_text()
    head, loop = src.split("losses = []\n")
    body = "".join("    " + ln + "\n" if ln else "\n" for ln in ("losses = []\n" + loop).splitlines())
    src = head + "def train():\n" + body + "    return losses\n\n\nlosses = train()\n"
    out = fix_source(src, Settings(), codes=("TOP711",)).text
    assert "\ndef preallocate_for_longest_batch(" in out  # module level
    assert "    def warmup_loss(tokens, labels):" in out  # in train(), before the epoch loop
    assert out.index("    preallocate_for_longest_batch(") < out.index("    for epoch in range(EPOCHS):")
    assert fix_source(out, Settings(), codes=("TOP711",)).text == out
    assert compare_programs(src, out) == []


def test_no_padding_no_finding():
    src = _variant(
        "    tokens = pad_sequence(seqs, batch_first=True, padding_value=PAD)\n",
        "    tokens = torch.stack([s[:3] for s in seqs])\n",
    )
    assert not check_source(src, Settings(select=("TOP711",))).diagnostics
