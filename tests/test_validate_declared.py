"""Hand-made performance changes judged with the tolerance of their class (`--expect`, or the class
inferred from the edit), held to the program's own noise floor: the mistakes people make when they
add mixed precision by hand are DIVERGED, the right edits EQUIVALENT.

Each pair is a tiny MLP (or CNN) trained for a few SGD steps on the CPU; the "before" program is
float32, the "after" one the edit. bfloat16 autocast runs on the CPU, and so does the GradScaler.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchopt.cli import app

BASE = """\
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
data = torch.randn(6, 32, 16)
labels = torch.randint(0, 4, (6, 32))
for x, y in zip(data, labels):
    opt.zero_grad()
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    opt.step()
"""
FORWARD = """\
    out = model(x)
    loss = F.cross_entropy(out, y)
"""
AUTOCAST = """\
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        loss = F.cross_entropy(out, y)
"""
STEP = "    loss.backward()\n    opt.step()\n"
SCALER = 'scaler = torch.amp.GradScaler("cpu")\nopt = torch'
AMP_OK = BASE.replace(FORWARD, AUTOCAST)

# With gradient clipping: the gradients must be unscaled before they are clipped.
CLIPPED = BASE.replace(
    STEP, "    loss.backward()\n    nn.utils.clip_grad_norm_(model.parameters(), 0.5)\n    opt.step()\n"
)

# Two models, two optimizers (a GAN's shape without the game): each has its own loss.
TWO = """\
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
a = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
b = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt_a = torch.optim.SGD(a.parameters(), lr=0.05)
opt_b = torch.optim.SGD(b.parameters(), lr=0.05)
data = torch.randn(6, 32, 16)
targets = torch.randn(6, 32, 1)
for x, t in zip(data, targets):
    opt_a.zero_grad()
    opt_b.zero_grad()
    loss_a = F.mse_loss(a(x), t)
    loss_b = F.mse_loss(b(x), t)
    loss_a.backward()
    opt_a.step()
    loss_b.backward()
    opt_b.step()
"""

CNN = """\
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
images = torch.randn(4, 8, 3, 12, 12)
labels = torch.randint(0, 4, (4, 8))
for x, y in zip(images, labels):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
"""

MISTAKES = {
    # Weights kept in bfloat16 instead of autocast: updates below bfloat16's precision vanish.
    "weights_bf16": BASE.replace("opt = torch", "model = model.to(torch.bfloat16)\nopt = torch").replace(
        "    out = model(x)\n", "    out = model(x.to(torch.bfloat16)).float()\n"
    ),
    "scaled_twice": BASE.replace("opt = torch", SCALER)
    .replace(FORWARD, AUTOCAST)
    .replace(STEP, "    scaler.scale(scaler.scale(loss)).backward()\n    scaler.step(opt)\n    scaler.update()\n"),
    "step_skipped": BASE.replace("opt = torch", SCALER)
    .replace(FORWARD, AUTOCAST)
    .replace(STEP, "    scaler.scale(loss).backward()\n    scaler.update()\n"),
    # The backward inside autocast, after a cast that changes the loss's dtype.
    "cast_loss": BASE.replace(
        FORWARD + "    loss.backward()\n",
        AUTOCAST.replace("F.cross_entropy(out, y)", "F.cross_entropy(out, y).to(torch.bfloat16)")
        + "        loss.backward()\n",
    ),
    "step_only": BASE.replace(
        "    opt.step()\n", '    with torch.autocast("cpu", dtype=torch.bfloat16):\n        opt.step()\n'
    ),
    "lr_changed": AMP_OK.replace("lr=0.1", "lr=0.12"),
}


def cli(*args: object):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def judge(tmp_path: Path, before: str, after: str, *expect: str, steps: int = 5) -> tuple[int, dict]:
    (tmp_path / "before.py").write_text(before)
    (tmp_path / "after.py").write_text(after)
    flags = [f"--expect={e}" for e in expect]
    res = cli(
        "validate", tmp_path / "before.py", tmp_path / "after.py", "--device", "cpu", "--steps", steps, *flags, "--json"
    )
    assert res.stdout.lstrip().startswith("{"), res.output
    return res.exit_code, json.loads(res.stdout)


def first(out: dict) -> str:
    return (out.get("first_divergence") or {}).get("name", "")


# --------------------------------------------------------------------------- mistakes


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_amp_mistakes_diverge_under_their_declared_class(tmp_path: Path, name: str) -> None:
    code, out = judge(tmp_path, BASE, MISTAKES[name], "numerics=bf16")
    assert "numerics" in out["tolerance"]["tags"] and "noise floor" in out["tolerance"]["criterion"]
    assert (code, out["verdict"]) == (1, "diverged"), (name, out["headline"])
    if name == "step_only":  # bitwise the float32 program: the autocast region covers no forward pass
        assert first(out) == "precision"
    if name in ("weights_bf16", "cast_loss"):  # a dtype the original at reduced precision does not have
        assert any(r["verdict"] == "dtype" for r in out["rows"]), out["first_divergence"]


@pytest.mark.slow
def test_a_learning_rate_change_within_the_flat_band_is_caught_by_the_noise_floor(tmp_path: Path) -> None:
    code, out = judge(tmp_path, BASE, MISTAKES["lr_changed"], "numerics=bf16")
    assert code == 1 and first(out).startswith("loss[")
    band = next(n for n in out["notes"] if n.startswith("flat band"))
    # The 5 % band of earlier releases would have passed it; it stays in the report as a figure.
    worst = max(r["band"] for r in out["rows"] if r.get("band") is not None)
    assert worst < 0.05, band


@pytest.mark.slow
def test_gradients_not_unscaled_before_clipping_diverge(tmp_path: Path) -> None:
    after = (
        CLIPPED.replace("opt = torch", SCALER)
        .replace(FORWARD, AUTOCAST)
        .replace("    loss.backward()\n", "    scaler.scale(loss).backward()\n")
        .replace("    opt.step()\n", "    scaler.step(opt)\n    scaler.update()\n")
    )
    code, out = judge(tmp_path, CLIPPED, after, "numerics=bf16")
    assert code == 1, out["headline"]
    right = after.replace("    nn.utils.clip", "    scaler.unscale_(opt)\n    nn.utils.clip")
    code, out = judge(tmp_path, CLIPPED, right, "numerics=bf16")
    assert code == 0, (out["headline"], out["first_divergence"])


@pytest.mark.slow
def test_a_scaler_stepping_an_optimizer_whose_gradients_it_did_not_scale_diverges(tmp_path: Path) -> None:
    amp = (
        TWO.replace("opt_a = torch", 'scaler = torch.amp.GradScaler("cpu")\nopt_a = torch')
        .replace("    loss_a = F", '    with torch.autocast("cpu", dtype=torch.bfloat16):\n        loss_a = F')
        .replace("    loss_b = F", "        loss_b = F")
        .replace(
            "    loss_a.backward()\n    opt_a.step()\n", "    scaler.scale(loss_a).backward()\n    scaler.step(opt_a)\n"
        )
    )
    wrong = amp.replace(
        "    loss_b.backward()\n    opt_b.step()\n",
        "    loss_b.backward()\n    scaler.step(opt_b)\n    scaler.update()\n",
    )
    code, out = judge(tmp_path, TWO, wrong, "numerics=bf16")
    assert code == 1, out["headline"]
    right = amp.replace(
        "    loss_b.backward()\n    opt_b.step()\n",
        "    scaler.scale(loss_b).backward()\n    scaler.step(opt_b)\n    scaler.update()\n",
    )
    code, out = judge(tmp_path, TWO, right, "numerics=bf16")
    assert code == 0, (out["headline"], out["first_divergence"])


# --------------------------------------------------------------------------- right edits


@pytest.mark.slow
def test_a_hand_written_amp_edit_is_equivalent_declared_or_inferred(tmp_path: Path) -> None:
    code, out = judge(tmp_path, BASE, AMP_OK, "numerics=bf16")
    assert (code, out["verdict"]) == (0, "equivalent"), out["first_divergence"]
    code, out = judge(tmp_path, BASE, AMP_OK)
    assert code == 0, out["first_divergence"]
    assert any(n.startswith("inferred --expect numerics=bf16: AFTER adds 1 autocast region") for n in out["notes"])


@pytest.mark.slow
def test_an_unrecognised_change_is_bitwise_and_says_how_to_declare_one(tmp_path: Path) -> None:
    code, out = judge(tmp_path, BASE, BASE.replace("lr=0.1", "lr=0.1000001"))
    assert code == 1 and out["tolerance"]["bitwise"]
    assert any("--expect numerics[=bf16|fp16|tf32]" in n for n in out["notes"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edit", "expect"),
    [("tf32", "numerics=tf32"), ("foreach", "tolerance"), ("fused", "tolerance"), ("channels_last", "tolerance")],
)
def test_tf32_fused_and_channels_last_edits_are_equivalent(tmp_path: Path, edit: str, expect: str) -> None:
    before = CNN if edit == "channels_last" else BASE
    after = {
        "tf32": BASE.replace(
            "torch.manual_seed(0)\n", "torch.backends.cuda.matmul.allow_tf32 = True\ntorch.manual_seed(0)\n"
        ),
        "foreach": BASE.replace("momentum=0.9)", "momentum=0.9, foreach=True)"),
        "fused": BASE.replace("momentum=0.9)", "momentum=0.9, fused=True)"),
        "channels_last": CNN.replace(
            "opt = torch", "model = model.to(memory_format=torch.channels_last)\nopt = torch"
        ).replace("model(x)", "model(x.to(memory_format=torch.channels_last))"),
    }[edit]
    code, out = judge(tmp_path, before, after, expect)
    assert (code, out["verdict"]) == (0, "equivalent"), (out["headline"], out["first_divergence"])
    code, out = judge(tmp_path, before, after)  # the same class, inferred from the edit
    assert code == 0 and any(n.startswith(f"inferred --expect {expect}") for n in out["notes"]), out["notes"]


@pytest.mark.slow
@pytest.mark.parametrize("program", ["mlp", "cnn"])
def test_torchopts_own_amp_rewrite_is_within_the_noise_floor(tmp_path: Path, program: str) -> None:
    # TOP202 rewrites a training step whose model is placed on a device (the usual script's shape).
    text = (BASE if program == "mlp" else CNN).replace(
        "torch.manual_seed(0)\n", 'torch.manual_seed(0)\ndevice = "cuda" if torch.cuda.is_available() else "cpu"\n'
    )
    (tmp_path / "train.py").write_text(text.replace("opt = torch", "model = model.to(device)\nopt = torch"))
    res = cli(
        "validate",
        tmp_path / "train.py",
        "--unsafe-fixes",
        "--select",
        "TOP202",
        "--device",
        "cpu",
        "--steps",
        4,
        "--json",
    )
    out = json.loads(res.stdout)
    assert [f["code"] for f in out["applied"]] == ["TOP202"]
    assert res.exit_code == 0, (out["headline"], out["first_divergence"])
    assert "noise floor" in out["tolerance"]["criterion"]
    assert any(r["tolerance"].startswith("4×ref") for r in out["rows"] if r["name"].startswith("param/"))
