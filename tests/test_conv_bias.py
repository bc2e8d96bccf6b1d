"""CBN rule (TOP841, `bias=False` on a conv a norm follows): detection, what blocks the fix, the
eval-mode caveat, the checkpoint migration documented on the rule page (executed here), the
validator's treatment of the probes the fix changes by design, and the fixture's validation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.codemods.conv_bias.conv_bias_before_norm import ConvBiasBeforeNorm
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source
from torchopt.validate.compare import compare
from torchopt.validate.tolerance import tolerance_for

ROOT = Path(__file__).resolve().parents[1]
CBN = Settings(select=("TOP84",))


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def fix(src: str) -> str:
    return fix_source(src, CBN, unsafe=True).text


def diags(src: str):
    return check_source(src, CBN).diagnostics


SEQ = "import torch.nn as nn\n\nblock = nn.Sequential({conv}, nn.BatchNorm2d(8))\n"


@pytest.mark.parametrize(
    "conv,after",
    [
        ("nn.Conv2d(3, 8, 3)", "nn.Conv2d(3, 8, 3, bias=False)"),
        ("nn.Conv2d(3, 8, 3, bias=True)", "nn.Conv2d(3, 8, 3, bias=False)"),
        # past 88 columns once `bias=False` is added: laid out as ruff format would
        ("nn.Conv2d(3, out_channels=8, kernel_size=3)", "wrapped"),
        ("nn.Conv2d(3, 8, 3, 1, 1, 1, 1, True)", None),  # positional bias: left alone
        ("nn.Conv2d(3, 8, 3, bias=use_bias)", None),
        ("nn.Conv2d(\n    3, 8, 3,  # stem\n)", "blocked"),
        ("nn.Conv1d(3, 8, 3)", None),  # BatchNorm2d after Conv1d: not the same dims
    ],
)
def test_sequential_forms(conv, after):
    src = SEQ.format(conv=conv)
    out = fix(src)
    if after is None:
        assert out == src
    elif after == "blocked":
        [d] = diags(src)
        assert d.fix is None and "comment" in d.message
    elif after == "wrapped":
        assert out == (
            "import torch.nn as nn\n\nblock = nn.Sequential(\n"
            "    nn.Conv2d(3, out_channels=8, kernel_size=3, bias=False), nn.BatchNorm2d(8)\n)\n"
        )
        assert fix(out) == out
    else:
        assert out == SEQ.format(conv=after)
        assert fix(out) == out


def test_unguarded_bias_init_blocks_but_guarded_does_not():
    base = (
        "import torch.nn as nn\n\nnet = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))\n"
        "for m in net.modules():\n    if isinstance(m, nn.Conv2d):\n{init}"
    )
    blocked = base.format(init="        nn.init.zeros_(m.bias)\n")
    [d] = diags(blocked)
    assert d.fix is None and "m.bias" in d.message
    guarded = base.format(init="        if m.bias is not None:\n            nn.init.zeros_(m.bias)\n")
    [d] = diags(guarded)
    assert d.fix is not None and set(d.fix.tags) == {"semantics", "tolerance", "rng"}


def test_module_pair_used_elsewhere_is_left_alone():
    src = (
        "import torch.nn as nn\nimport torch.nn.functional as F\n\n\nclass Net(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.conv = nn.Conv2d(3, 8, 3)\n        self.bn = nn.BatchNorm2d(8)\n\n"
        "    def forward(self, x):\n        return self.bn(self.conv(x))\n\n"
        "    def features(self, x):\n        return self.conv(x)\n"
    )
    assert diags(src) == []


def test_existing_cnn_train_fixture():
    """TOP841 fires on fixtures/cnn_train: `self.bn1(self.conv1(x))` (conv1 -> bn1) gets
    `bias=False`; conv2 (followed by ReLU) keeps its bias."""
    before = (ROOT / "fixtures" / "cnn_train" / "before.py").read_text(encoding="utf-8")
    after = fix(before)
    assert "self.conv1 = nn.Conv2d(3, 8, kernel_size=3, padding=1, bias=False)" in after
    assert "self.conv2 = nn.Conv2d(8, 16, kernel_size=3, padding=1)\n" in after
    assert len([d for d in diags(before)]) == 1


# --------------------------------------------------------------------------- numerics and checkpoints


def _doc_function(name: str) -> str:
    """The code block on the rule page that defines ``name``."""
    blocks = re.findall(r"```python\n(.*?)```", ConvBiasBeforeNorm.__doc__ or "", re.S)
    for b in blocks:
        if f"def {name}(" in b:
            lines = b.splitlines()
            indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
            return "\n".join(line[indent:] for line in lines) + "\n"
    raise AssertionError(f"no code block defines {name}")


def _pair(bias: bool):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, bias=bias), torch.nn.BatchNorm2d(8))


def test_train_close_eval_differs_and_old_checkpoints_load_with_the_documented_fold():
    old = _pair(True)
    with torch.no_grad():
        old[0].bias.uniform_(-0.5, 0.5)
    x = torch.randn(4, 3, 10, 10)
    old.train()
    old(x)  # one training-mode forward: running_mean now includes the bias
    new = _pair(False)
    new[0].weight.data.copy_(old[0].weight.data)
    # train mode: the norm cancels the bias, up to rounding
    new.train()
    torch.testing.assert_close(new(x), old(x), rtol=1e-5, atol=1e-5)
    # an old checkpoint does not load strictly
    ckpt = {k: v.clone() for k, v in old.state_dict().items()}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "0.bias"'):
        _pair(False).load_state_dict(ckpt)
    # strict=False loads but drops the bias: eval outputs change
    dropped = _pair(False)
    dropped.load_state_dict(ckpt, strict=False)
    old.eval()
    dropped.eval()
    assert (dropped(x) - old(x)).abs().max() > 1e-2
    # the fold on the rule page keeps eval outputs (exactly up to rounding), once or as a load hook
    ns: dict = {}
    exec(compile(_doc_function("fold_conv_bias"), "<rule page>", "exec"), ns)
    folded = _pair(False)
    folded.load_state_dict(ns["fold_conv_bias"](dict(ckpt), "0", "1"))
    folded.eval()
    torch.testing.assert_close(folded(x), old(x), rtol=1e-5, atol=1e-5)
    hooked = _pair(False)
    hooked.register_load_state_dict_pre_hook(
        lambda module, state_dict, prefix, *args: ns["fold_conv_bias"](state_dict, prefix + "0", prefix + "1")
    )
    hooked.load_state_dict(dict(ckpt))
    hooked.eval()
    torch.testing.assert_close(hooked(x), old(x), rtol=1e-5, atol=1e-5)


def test_validator_reports_documented_changes_only_for_top841():
    t = torch.ones(3)
    before = {
        "losses": [t[0]],
        "loss_steps": [1],
        "steps_done": 1,
        "tensors": {"param/net.0.bias": t, "param/net.0.weight": t, "param/net.1.running_mean": t, "output/net": t},
    }
    after = {
        "losses": [t[0]],
        "loss_steps": [1],
        "steps_done": 1,
        "tensors": {"param/net.0.weight": t + 1e-7, "param/net.1.running_mean": t + 0.5, "output/net": t + 0.9},
    }
    tol = tolerance_for(["semantics", "tolerance"])
    fixes = [{"code": "TOP841", "tags": ["semantics", "tolerance"], "safety": "unsafe"}]
    ok = compare(before, after, tol, fixes)
    assert ok.verdict == "equivalent", ok.rows
    assert {r.name: r.verdict for r in ok.rows}["param/net.0.bias"] == "skipped"
    other = compare(before, after, tol, [{"code": "TOP101", "tags": ["semantics"], "safety": "unsafe"}])
    assert other.verdict == "diverged"
    # a weight outside the tolerance still fails under TOP841
    after["tensors"]["param/net.0.weight"] = t + 1e-2
    assert compare(before, after, tol, fixes).verdict == "diverged"


def test_fixture_second_run_changes_nothing():
    before = (ROOT / "fixtures" / "cbn_resnet" / "before.py").read_text(encoding="utf-8")
    first = fix_source(before, CBN, unsafe=True)
    assert len(first.applied) == 4 and first.text.count("bias=False") == 4
    assert "self.mix = nn.Conv2d(32, 32, 1)\n" in first.text  # GroupNorm(4, 32): bias kept
    again = fix_source(first.text, CBN, unsafe=True)
    assert again.text == first.text and not again.applied


def test_fixture_validates_within_tolerance(tmp_path):
    """Dropping a bias moves the random stream (tag rng). The second file is torchopt's own rewrite,
    so it is validated as that rewrite, with replay: each bias-free Conv2d the rewrite builds runs,
    started from the original's weight (the original's construction drew the random numbers, so
    later draws line up), and the training it feeds is compared within the fp32 tolerance."""
    before = ROOT / "fixtures" / "cbn_resnet" / "before.py"
    after = tmp_path / "after.py"
    after.write_text(fix(before.read_text(encoding="utf-8")), encoding="utf-8")
    res = CliRunner().invoke(
        app,
        [
            "validate",
            str(before),
            str(after),
            "--select",
            "TOP84",
            "--unsafe-fixes",
            "--device",
            "cpu",
            "--steps",
            "3",
            "--json",
        ],
        catch_exceptions=False,
    )
    out = json.loads(res.stdout)
    assert res.exit_code == 0, out
    assert not out["unvalidated"] and [f["code"] for f in out["applied"]] == ["TOP841"] * 4
    assert any("4 module(s)" in n for n in out["notes"])
    assert out["verdict"] == "equivalent"
    assert all(r["verdict"] == "ok" for r in out["rows"] if r["name"].startswith("loss["))
