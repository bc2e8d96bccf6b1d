"""Padding rules (TOP301-TOP303) and the validator's weight transplant, in process (fast).

The golden fixtures (fixtures/pad_gpt_vocab, fixtures/pad_mlp_hidden) are in test_fixtures.py and
the end-to-end `torchopt validate` runs in test_pad_validate.py. Here: the rewrites executed with
the original weights transplanted (what the validator does, without subprocesses), the corner
cases of each rule, and the comparison of padded tensors.
"""

from __future__ import annotations

import os
import re
import runpy
import tempfile
from pathlib import Path

import pytest
import torch
from semantic import describe_diff

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source
from torchopt.validate.compare import compare
from torchopt.validate.tolerance import tolerance_for
from torchopt.validate.transplant import Transplant, grown, leading

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _fix(src: str, code: str, **opts) -> str:
    settings = Settings(select=(code,), rule_options={code: opts} if opts else {})
    return fix_source(src, settings, unsafe=True).text


def _run(src: str, mode: str, record: str) -> dict:
    """Run ``src`` as a script under the transplant (record: the original, apply: the rewrite)."""
    notes: list[str] = []
    tp = Transplant(torch, mode, record, notes)
    tp.install()
    torch.manual_seed(0)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "prog.py")
            Path(path).write_text(src, encoding="utf-8")
            ns = runpy.run_path(path, run_name="__main__")
        tp.finish()
    finally:
        tp.uninstall()
    ns["__notes__"] = notes
    ns["__rng__"] = torch.get_rng_state()
    return ns


def _pair(before: str, after: str) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "record.pt")
        a = _run(before, "record", record)
        b = _run(after, "apply", record)
    return a, b


def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return describe_diff(x, y, "t") is None


# --------------------------------------------------------------------------- TOP301 on the GPT fixture


def test_gpt_vocab_padded_is_bitwise_with_transplanted_weights():
    before = (FIXTURES / "pad_gpt_vocab" / "before.py").read_text(encoding="utf-8")
    after = _fix(before, "TOP301")
    assert "padded_vocab = ((vocab_size + 7) // 8) * 8" in after
    a, b = _pair(before, after)
    copied = [int(m.group(1)) for n in b["__notes__"] for m in [re.search(r"(\d+) tensor\(s\) into", n)] if m]
    assert copied and copied[0] >= 2, b["__notes__"]  # the embedding (and the tied head) were padded
    assert not any("stopped" in n for n in b["__notes__"]), b["__notes__"]
    # losses of every step, the eval logits and loss, metrics, one-hot, the sample: bitwise
    assert a["losses"] == b["losses"]
    for name in ("logits", "val_loss", "accuracy", "expected_prob", "targets_onehot", "sample", "pred"):
        assert _bits_equal(a[name], b[name]), name
    assert b["logits"].shape[-1] == 101  # callers see the unpadded vocabulary
    assert torch.equal(a["__rng__"], b["__rng__"])
    # the padded model: 104 rows, the tie kept, pad rows still exactly zero after AdamW steps
    m = b["model"]
    assert m.tok_emb.weight.shape == (104, 32)
    assert m.head.weight is m.tok_emb.weight
    assert torch.count_nonzero(m.tok_emb.weight[101:]) == 0
    assert torch.equal(m.tok_emb.weight[:101], a["model"].tok_emb.weight)


def test_gpt_vocab_without_the_slice_is_caught():
    """The slice is what makes the fix exact: padded logits entering the loss change it."""
    before = (FIXTURES / "pad_gpt_vocab" / "before.py").read_text(encoding="utf-8")
    before = before[: before.index("# Evaluation")]  # the evaluation would fail outright (104 vs 101 columns)
    after = _fix(before, "TOP301").replace("[..., : self.vocab_size]", "")
    a, b = _pair(before, after)
    assert a["losses"][0] != b["losses"][0]


def test_vocab_multiple_64_option():
    before = (FIXTURES / "pad_gpt_vocab" / "before.py").read_text(encoding="utf-8")
    after = _fix(before, "TOP301", multiple=64)
    assert "padded_vocab = ((vocab_size + 63) // 64) * 64" in after
    assert (
        fix_source(after, Settings(select=("TOP301",), rule_options={"TOP301": {"multiple": 64}}), unsafe=True).text
        == after
    )


_LM = """import torch as T
from torch import nn
from torch.nn import functional as F

V = 1001


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, 16)
        self.lm_head = nn.Linear(16, V)

    def forward(self, idx):
        return self.lm_head(self.wte(idx))

    def loss(self, idx, y):
        logits = self.forward(idx)
        flat = logits.view(-1, V)
        return F.cross_entropy(flat, y.view(-1)) + F.one_hot(y, V).sum() * 0, logits.view(T.float32)
"""


def test_vocab_aliases_views_and_dtype_views():
    after = _fix(_LM, "TOP301")
    assert "padded_vocab = ((V + 7) // 8) * 8" in after
    assert "self.lm_head(self.wte(idx))[..., : self.vocab_size]" in after
    assert "flat = logits.reshape(-1, V)" in after  # self.forward(...) output is the sliced logits
    assert "logits.view(T.float32)" in after  # a dtype view is not a shape view: left alone
    assert "F.one_hot(y, V)" in after  # other uses keep the unpadded size
    assert fix_source(after, Settings(select=("TOP301",)), unsafe=True).text == after


def test_vocab_views_on_the_models_output_in_the_same_file():
    from torchopt.codemods.pad.unpadded_vocabulary import PadVocabulary

    _GPT = PadVocabulary.examples[0].src  # the rule's small GPT, whose head is Linear(..., 37)

    src = _GPT + (
        "flat = logits.view(-1, 37)\nother = idx.view(-1)\nraw = model.forward(idx, idx)[0].view(10, 37)\n"
        "bits = logits.view(torch.int32)\n"
    )
    after = _fix(src, "TOP301")
    assert after.endswith(
        "flat = logits.reshape(-1, 37)\nother = idx.view(-1)\n"
        "raw = model.forward(idx, idx)[0].reshape(10, 37)\nbits = logits.view(torch.int32)\n"
    )
    ns = runpy.run_path  # the rewritten program runs (a `.view` left on the slice would raise)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p.py")
        Path(path).write_text(after.replace("bits = logits.view(torch.int32)\n", ""), encoding="utf-8")
        assert ns(path)["flat"].shape == (10, 37)


@pytest.mark.parametrize(
    "extra, why",
    [
        ("\n    def size(self):\n        return self.lm_head.out_features\n", "out_features"),
        ("\n    def raw(self, h):\n        return F.linear(h, self.wte.weight)\n", "used directly"),
        ("\n    def head(self):\n        return self.lm_head\n", "other than by calling"),
    ],
)
def test_vocab_no_fix_when_unsafe_to_slice(extra, why):
    src = _LM.replace("\n    def loss", extra + "\n    def loss")
    diags = [d for d in check_source(src, Settings(select=("TOP301",))).diagnostics]
    assert len(diags) == 1 and diags[0].fix is None and why in diags[0].message, diags
    assert _fix(src, "TOP301") == src


def test_vocab_not_reported_when_padded_or_multiple():
    assert not check_source(_LM.replace("V = 1001", "V = 1024"), Settings(select=("TOP301",))).diagnostics


# --------------------------------------------------------------------------- TOP302


def test_mlp_hidden_padded_matches_within_fp32_tolerance_and_pad_units_stay_zero():
    before = (FIXTURES / "pad_mlp_hidden" / "before.py").read_text(encoding="utf-8")
    after = _fix(before, "TOP302")
    assert "nn.Linear(((HIDDEN + 7) // 8) * 8, 56)" in after
    assert "nn.Linear(N_FEATURES, 30), nn.LayerNorm(30)" in after  # a norm reduces over 30: untouched
    a, b = _pair(before, after)
    for x, y in zip(a["losses"], b["losses"]):
        assert abs(x - y) <= 1e-5 * abs(x)
    torch.testing.assert_close(b["test_logits"], a["test_logits"], rtol=1.3e-6, atol=1e-5)
    c = b["classifier"]
    assert c[0].weight.shape == (104, 24) and c[2].weight.shape == (56, 104) and c[4].weight.shape == (10, 56)
    # zero in, zero out, f(0) = 0: the pad units never learn
    assert torch.count_nonzero(c[0].weight[100:]) == 0 and torch.count_nonzero(c[0].bias[100:]) == 0
    assert torch.count_nonzero(c[2].weight[:, 100:]) == 0 and torch.count_nonzero(c[2].weight[50:]) == 0
    assert torch.count_nonzero(c[4].weight[:, 50:]) == 0


@pytest.mark.parametrize(
    "mid, fixed",
    [
        ("nn.ReLU(), nn.Dropout(0.2)", True),
        ("nn.Tanh(), nn.SiLU()", True),
        ("nn.Hardtanh()", True),
        ("nn.Hardtanh(0.5, 2.0)", False),
        ("nn.Sigmoid()", False),
        ("nn.Softplus()", False),
        ("nn.PReLU(30)", False),
        ("nn.BatchNorm1d(30)", False),
        ("nn.Softmax(dim=-1)", False),
        ("", True),
    ],
)
def test_sequential_fix_only_through_zero_preserving_elementwise(mid, fixed):
    src = f"import torch.nn as nn\n\nnet = nn.Sequential(nn.Linear(16, 30), {mid + ', ' if mid else ''}nn.Linear(30, 16))\n"
    after = _fix(src, "TOP302")
    assert (after != src) is fixed, after
    if fixed:
        assert "nn.Linear(16, 32)" in after and "nn.Linear(32, 16)" in after
        compile(after, "<after>", "exec")


def test_two_layers_of_one_module_padded_with_transplant():
    from torchopt.codemods.pad.unpadded_gemm_size import PadGemmDims

    _FFN = PadGemmDims.examples[2].src  # the rule's feed-forward block of two Linear layers

    after = _fix(_FFN, "TOP302")
    assert "nn.Linear(32, 104)" in after and "nn.Linear(104, 32)" in after
    a, b = _pair(_FFN, after)
    torch.testing.assert_close(b["out"], a["out"], rtol=1.3e-6, atol=1e-5)
    assert not any("stopped" in n for n in b["__notes__"]), b["__notes__"]


def test_sequential_inline_or_without_assignment_is_not_fixed():
    src = "import torch.nn as nn\n\n\ndef build():\n    return nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 16))\n"
    assert _fix(src, "TOP302") == src
    assert check_source(src, Settings(select=("TOP302",))).diagnostics


def test_dropout_between_layers_tags_rng():
    src = "import torch.nn as nn\n\nnet = nn.Sequential(nn.Linear(16, 30), nn.Dropout(0.1), nn.Linear(30, 16))\n"
    diag = check_source(src, Settings(select=("TOP302",))).diagnostics[0]
    assert set(diag.fix.tags) == {"semantics", "rng", "tolerance"} and "dropout" in diag.fix.note


def test_gemm_reports_attention_head_dim_and_skips_vocabulary():
    src = (
        "import torch.nn as nn\n\nV = 101\nattn = nn.MultiheadAttention(96, 8)\nemb = nn.Embedding(V, 32)\n"
        "head = nn.Linear(32, V)\n"
    )
    msgs = [d.message for d in check_source(src, Settings(select=("TOP302",))).diagnostics]
    assert msgs == ["`nn.MultiheadAttention(96, 8)`: head_dim=12 is not a multiple of 8 (nearest padded: head_dim=16)"]


# --------------------------------------------------------------------------- TOP303


def test_sequence_padding_advice_is_display_only():
    src = "import torch\nfrom torch.nn.utils.rnn import pad_sequence as ps\n\nx = ps([torch.ones(3), torch.ones(5)])\n"
    diags = check_source(src, Settings(select=("TOP303",))).diagnostics
    assert len(diags) == 1 and diags[0].fix is None
    assert fix_source(src, Settings(select=("TOP303",)), unsafe=True).text == src


# --------------------------------------------------------------------------- comparison of padded tensors


def test_grown_and_leading():
    assert grown((101, 32), (104, 32)) and grown((50,), (56,))
    assert not grown((101, 32), (101, 32)) and not grown((101, 32), (96, 40)) and not grown((4,), (4, 1))
    t = torch.arange(12).reshape(3, 4)
    assert torch.equal(leading(t, (2, 3)), t[:2, :3])


def _probes(t: torch.Tensor) -> dict:
    return {"losses": [], "loss_steps": [], "steps_done": 0, "tensors": {"param/m.w": t}, "status": "ok"}


def test_compare_reads_the_leading_slice_only_under_transplant():
    w = torch.randn(5, 3)
    padded = torch.zeros(8, 3)
    padded[:5] = w
    tol = tolerance_for(["semantics", "rng"], replayed=True)
    assert compare(_probes(w), _probes(padded), tol).verdict == "diverged"  # shape, without transplant
    from dataclasses import replace

    ttol = replace(tol, transplant=True)
    ok = compare(_probes(w), _probes(padded), ttol)
    assert ok.verdict == "equivalent" and any("leading slice" in n for n in ok.notes)
    padded[0, 0] += 1e-7
    assert compare(_probes(w), _probes(padded), ttol).verdict == "diverged"  # still bitwise
    assert compare(_probes(w), _probes(torch.zeros(4, 3)), ttol).verdict == "diverged"  # shrunk: shape
