"""TOP202/TOP203/TOP205: automatic mixed precision inserted into training and inference loops.

Golden fixtures (fixtures/amp_*), validation on the CPU within the AMP tolerances, the
float16 + GradScaler control flow exercised on the CPU, and the refusals and options.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchopt.rewrite.config import Settings
from cpu_support import skip_unless_bfloat16_lstm
from torchopt.rewrite.engine import check_source, fix_source

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
NAMES = sorted(p.name for p in FIXTURES.glob("amp_*") if (p / "before.py").is_file())
TOP2 = Settings(select=("TOP2",))
# Fixtures the AMP rules rewrite (the others, e.g. amp_already, may still get other families' fixes).
CHANGED = [
    n
    for n in NAMES
    if "autocast" in (FIXTURES / n / "after_unsafe.py").read_text()
    and (FIXTURES / n / "before.py").read_text().count("autocast")
    != (FIXTURES / n / "after_unsafe.py").read_text().count("autocast")
]


def _read(name: str, which: str) -> str:
    return (FIXTURES / name / f"{which}.py").read_text(encoding="utf-8")


def test_amp_fixtures_exist():
    assert {
        "amp_plain_loop",
        "amp_clipping",
        "amp_accumulation",
        "amp_gan",
        "amp_scheduler",
        "amp_checkpoint",
        "amp_eval",
        "amp_train_function",
        "amp_already",
        "amp_deprecated_api",
    } <= set(NAMES)
    for name in NAMES:
        for f in ("after_unsafe.py", "after_safe.py", "notes.md"):
            assert (FIXTURES / name / f).is_file(), f"{name}/{f} missing"


def _without_flag_lines(text: str) -> str:
    flags = ("torch.backends.cudnn.benchmark = True", 'torch.set_float32_matmul_precision("high")')
    lines = [ln for ln in text.splitlines() if ln.strip() not in flags]
    return "\n".join(ln for i, ln in enumerate(lines) if ln.strip() or i == 0 or lines[i - 1].strip())


@pytest.mark.parametrize("name", NAMES)
def test_golden(name):
    before, expected = _read(name, "before"), _read(name, "after_unsafe")
    got = fix_source(before, TOP2, unsafe=True)
    # The golden is the whole rule set's output: the AMP rewrite alone, then the other families'
    # fixes on top of it, reach it (up to where the flags family's switch lines land).
    full = fix_source(got.text, Settings(), unsafe=True).text
    assert _without_flag_lines(full) == _without_flag_lines(expected)
    compile(got.text, f"{name}/after_unsafe.py", "exec", dont_inherit=True)
    again = fix_source(got.text, TOP2, unsafe=True)
    assert again.text == got.text and not again.applied
    # Idempotence: the rewritten output is never flagged again by TOP202/203/205.
    assert not [d for d in check_source(got.text, TOP2).diagnostics if d.code in ("TOP202", "TOP203", "TOP205")]


@pytest.mark.parametrize("name", [n for n in NAMES if n != "amp_deprecated_api"])
def test_safe_rewrite_changes_nothing(name):
    before = _read(name, "before")
    assert fix_source(before, TOP2, unsafe=False).text == before


def test_already_amp_is_untouched_and_silent():
    before = _read("amp_already", "before")
    assert fix_source(before, TOP2, unsafe=True).text == before
    assert check_source(before, TOP2).diagnostics == []


def test_deprecated_api_only_top201():
    diags = check_source(_read("amp_deprecated_api", "before"), TOP2).diagnostics
    assert diags and {d.code for d in diags} == {"TOP201"}


@pytest.mark.parametrize("name", CHANGED)
def test_validates_on_cpu(name):
    from torchopt.validate.command import validate

    skip_unless_bfloat16_lstm((FIXTURES / name / "before.py").read_text(encoding="utf-8"))
    settings = Settings(select=("TOP2",), unsafe_fixes=True)
    out = validate(
        str(FIXTURES / name / "before.py"),
        None,
        settings,
        unsafe=True,
        steps=3,
        device="cpu",
        argv=(),
        entry=None,
        nproc=1,
        timeout=120,
    )
    assert out.exit_code == 0, out.text


_PROBE = r"""
import runpy, sys, warnings
import torch
torch.set_num_threads(1)
warnings.simplefilter("error", FutureWarning)
ns = runpy.run_path(sys.argv[1], run_name="__main__")
scalers = [v for v in ns.values() if isinstance(v, torch.amp.GradScaler)]
print("SCALERS", [s.is_enabled() for s in scalers])
print("DTYPE", ns.get("amp_dtype"))
"""


# A step that updates its parameters by hand gets bfloat16 and no scaler whatever the option: no float16 path.
@pytest.mark.slow  # runs the rewritten program in float16 on the CPU, seconds each: with the end-to-end runs
@pytest.mark.parametrize(
    "name", [n for n in CHANGED if "amp_dtype = torch.bfloat16\n" not in (FIXTURES / n / "after_unsafe.py").read_text()]
)
def test_fp16_control_flow_on_cpu(name, tmp_path):
    """The rewrite with its dtype choice forced to float16: float16 CPU autocast with an enabled
    GradScaler('cpu'); catches double unscale_, update() placement and closure errors."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    path = tmp_path / "after_unsafe.py"
    path.write_text(force_float16(_read(name, "after_unsafe")))
    r = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path)], cwd=path.parent, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RuntimeError" not in r.stderr and "AssertionError" not in r.stderr
    if name == "amp_deprecated_api":
        return  # not an AMP insertion: only TOP201 applies
    assert "DTYPE torch.float16" in r.stdout
    if "GradScaler(" in path.read_text():
        assert "SCALERS [True]" in r.stdout, r.stdout


def force_float16(text: str) -> str:
    """The inserted dtype choice made float16 everywhere (a CPU then runs the GradScaler path)."""
    forced = re.sub(
        r"""(amp_dtype\w*) = (\w+)\.float16 if \w+ == ["']cuda["'] else \w+\.bfloat16""", r"\1 = \2.float16", text
    )
    assert forced != text or "amp_dtype" not in text
    return forced


@pytest.mark.parametrize("name", CHANGED)
def test_inserted_code_has_no_switches_or_tool_names(name):
    """What is inserted reads as hand-written AMP: no environment switch, no tool-named comment or variable."""
    before = _read(name, "before")
    after = fix_source(before, TOP2, unsafe=True).text
    for word in ("TORCHOPT", "torchopt", "os.environ", "use_amp", "enabled=use"):
        assert after.count(word) == before.count(word), word


# ----------------------------------------------------------------------------- unit cases

_H = (
    "import torch\nimport torch.nn as nn\n\ndevice = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
    "model = nn.Linear(4, 2).to(device)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
)
_LOOP = (
    "for x, y in batches:\n    optimizer.zero_grad()\n    out = model(x)\n"
    "    loss = nn.functional.mse_loss(out, y)\n    loss.backward()\n    optimizer.step()\n"
)


def _fix(src: str, **opts) -> str:
    s = Settings(select=("TOP2",), rule_options={"TOP202": opts} if opts else {})
    return fix_source(src, s, unsafe=True).text


def _codes(src: str) -> list[tuple[str, str]]:
    return [(d.code, d.message) for d in check_source(src, TOP2).diagnostics]


def test_bfloat16_option_gives_autocast_only():
    out = _fix(_H + _LOOP, dtype="bfloat16")
    assert "amp_dtype = torch.bfloat16" in out and "GradScaler" not in out and "scaler" not in out
    assert "    loss.backward()\n    optimizer.step()\n" in out


def test_select_top202_alone_is_complete_fp16():
    out = fix_source(_H + _LOOP, Settings(select=("TOP202",)), unsafe=True).text
    assert "scaler.scale(loss).backward()" in out and "scaler.update()" in out


def test_reuses_torch_alias_and_avoids_taken_names():
    src = (
        (_H + "scaler = 3\namp_dtype = None\n" + _LOOP)
        .replace("torch.", "T.")
        .replace("import torch\nimport T.nn as nn\n", "import torch as T\nimport torch.nn as nn\n")
    )
    out = _fix(src)
    assert "scaler_1 = T.amp.GradScaler(amp_device_type" in out
    # the file writes its strings in single quotes, and so does the inserted line
    assert "amp_dtype_1 = T.float16 if amp_device_type == 'cuda' else T.bfloat16" in out
    assert "with T.autocast(device_type=amp_device_type, dtype=amp_dtype_1):" in out
    assert "scaler_1.scale(loss).backward()" in out


def test_backward_kwargs_and_step_result_kept():
    src = _H + (
        "for x, y in batches:\n    loss = nn.functional.mse_loss(model(x), y)\n"
        "    loss.backward(retain_graph=True)\n    r = optimizer.step()\n"
    )
    out = _fix(src)
    assert "scaler.scale(loss).backward(retain_graph=True)" in out
    assert "r = scaler.step(optimizer)\n    scaler.update()" in out


@pytest.mark.parametrize(
    "body,reason",
    [
        (
            "    loss = nn.functional.mse_loss(model(x), y)\n    loss.backward()\n    optimizer.step(lambda: loss)\n",
            "closure",
        ),
        (
            "    out = model(x)\n    g = torch.autograd.grad(out.sum(), x, create_graph=True)[0]\n"
            "    loss = out.mean() + g.pow(2).mean()\n    loss.backward()\n    optimizer.step()\n",
            "autograd.grad",
        ),
        (
            "    out = model(x)\n    print(out)\n    loss = out.mean()\n    loss.backward()\n    optimizer.step()\n",
            "cannot run under autocast",
        ),
    ],
)
def test_refusals_are_display_only(body, reason):
    src = _H + "for x, y in batches:\n" + body
    diags = [d for d in check_source(src, TOP2).diagnostics if d.code == "TOP202"]
    assert len(diags) == 1 and diags[0].fix is None and reason in diags[0].message, diags
    assert _fix(src) == src


def test_half_model_refused():
    src = _H.replace(".to(device)", ".to(device).half()") + _LOOP
    # Cast unconditionally: the program trains in half precision by hand (analysis/precision.py), so
    # TOP202 has no float32 step to rewrite; TOP204 is the finding that speaks about it.
    found = check_source(src, TOP2).diagnostics
    assert [d.code for d in found if d.code in ("TOP202", "TOP204")] == ["TOP204"], found
    assert _fix(src) == src


def test_cpu_only_model_not_rewritten():
    src = _H.replace(".to(device)", "") + _LOOP
    assert _fix(src) == src


def test_no_step_no_finding():
    src = _H + "for x, y in batches:\n    out = model(x)\n    loss = out.sum()\n"
    assert _codes(src) == []


def test_eval_loop_in_training_script_untouched():
    src = _H + _LOOP + "model.eval()\nwith torch.no_grad():\n    for x in batches:\n        pred = model(x)\n"
    out = _fix(src)
    assert out.endswith("with torch.no_grad():\n    for x in batches:\n        pred = model(x)\n")
    assert out.count("torch.autocast(") == 1


def test_fp16_autocast_without_scaler_flagged_by_top203():
    src = _H + (
        "for x, y in batches:\n    with torch.autocast('cuda'):\n        loss = model(x).sum()\n"
        "    loss.backward()\n    optimizer.step()\n"
    )
    assert [c for c, _ in _codes(src)] == ["TOP203"]
    assert _fix(src) == src


def test_step_in_function_uses_module_level_setup():
    out = fix_source(_read("amp_train_function", "before"), TOP2, unsafe=True).text
    assert out.index("scaler = torch.amp.GradScaler") > out.index("optimizer = torch.optim.SGD")
    assert "    scaler.step(opt)\n    scaler.update()\n    return loss.item(), out\n" in out


# ----------------------------------------------------------------------------- BCE, DataParallel, checkpoints,
# several losses, autograd.backward

_STEP = (
    "for x, y in batches:\n    optimizer.zero_grad()\n    out = model(x)\n    loss = {loss}\n"
    "    loss.backward()\n    optimizer.step()\n"
)
_HF = _H.replace("import torch.nn as nn\n", "import torch.nn as nn\nimport torch.nn.functional as F\n", 1)


def _refused(src: str, reason: str) -> None:
    diags = [d for d in check_source(src, TOP2).diagnostics if d.code == "TOP202"]
    assert len(diags) == 1 and diags[0].fix is None and reason in diags[0].message, diags
    assert _fix(src) == src


@pytest.mark.parametrize(
    "pre,loss",
    [
        ("", "F.binary_cross_entropy(torch.sigmoid(out), y)"),
        ("", "torch.nn.functional.binary_cross_entropy(out.sigmoid(), y)"),
        ("crit = nn.BCELoss()\n", "crit(torch.sigmoid(out), y)"),
        ("", "nn.BCELoss()(torch.sigmoid(out), y)"),
        ("def loss_fn(o, t):\n    return F.binary_cross_entropy(o.sigmoid(), t)\n", "loss_fn(out, y)"),
    ],
)
def test_bce_never_under_autocast(pre, loss):
    """CUDA autocast raises on binary cross-entropy: only the forward goes under it, and the loss
    reads its output upcast to float32."""
    out = _fix(_HF + pre + _STEP.format(loss=loss))
    assert f"        out = model(x)\n    out = out.float()\n    loss = {loss}\n    scaler.scale(loss).backward()" in out


def test_bce_outside_autocast_with_bfloat16_too():
    src = _HF + _STEP.format(loss="F.binary_cross_entropy(torch.sigmoid(out), y)")
    out = _fix(src, dtype="bfloat16")
    assert "        out = model(x)\n    out = out.float()\n    loss = F.binary_cross_entropy(" in out
    assert "scaler" not in out


def test_bce_with_logits_is_rewritten():
    out = _fix(_HF + _STEP.format(loss="F.binary_cross_entropy_with_logits(out, y)"))
    assert "        loss = F.binary_cross_entropy_with_logits(out, y)\n    scaler.scale(loss).backward()" in out


def test_bce_loss_passed_to_step_function_refused():
    src = _HF + (
        "crit = nn.BCELoss()\n\ndef train_step(m, opt, c, x, y):\n    opt.zero_grad()\n"
        "    loss = c(torch.sigmoid(m(x)), y)\n    loss.backward()\n    opt.step()\n\n"
        "for x, y in batches:\n    train_step(model, optimizer, crit, x, y)\n"
    )
    _refused(src, "same statement")


@pytest.mark.parametrize(
    "header",
    [
        _H.replace("model = nn.Linear(4, 2).to(device)", "model = nn.DataParallel(nn.Linear(4, 2)).to(device)"),
        _H.replace(".to(device)\n", ".to(device)\nmodel = torch.nn.DataParallel(model)\n", 1),
        _H.replace(".to(device)\n", ".to(device)\nmodel = torch.nn.parallel.DataParallel(model)\n", 1),
    ],
)
def test_data_parallel_gets_float16_autocast_and_bfloat16_is_refused(header):
    """DataParallel's replica threads enter autocast with the caller's on/off state and CUDA's default
    dtype, float16: the default float16 rewrite reaches them, a bfloat16 one would not."""
    src = header + _STEP.format(loss="out.sum()")
    out = _fix(src)
    assert "    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):\n        out = model(x)\n" in out
    assert "scaler.step(optimizer)" in out
    diags = [
        d
        for d in check_source(
            src, Settings(select=("TOP2",), rule_options={"TOP202": {"dtype": "bfloat16"}})
        ).diagnostics
        if d.code == "TOP202"
    ]
    assert len(diags) == 1 and diags[0].fix is None, diags
    assert "DataParallel" in diags[0].message and "float16" in diags[0].message and "TOP401" in diags[0].message


def test_checkpoint_through_named_dict():
    src = (
        _H
        + _LOOP
        + (
            '    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}\n'
            '    torch.save(ckpt, "f.pt")\n'
            'ckpt = torch.load("f.pt")\noptimizer.load_state_dict(ckpt["optimizer"])\n'
        )
    )
    out = _fix(src)
    assert (
        '    ckpt = {\n        "model": model.state_dict(),\n        "optimizer": optimizer.state_dict(),\n'
        '        "scaler": scaler.state_dict(),\n    }\n    torch.save(ckpt, "f.pt")\n'
    ) in out
    assert out.endswith(
        'optimizer.load_state_dict(ckpt["optimizer"])\n'
        'if "scaler" in ckpt:\n    scaler.load_state_dict(ckpt["scaler"])\n'
    )
    assert fix_source(out, TOP2, unsafe=True).text == out


def test_named_dict_without_optimizer_state_untouched():
    src = _H + _LOOP + '    ckpt = {"model": model.state_dict()}\n    torch.save(ckpt, "f.pt")\n'
    assert '    ckpt = {"model": model.state_dict()}\n' in _fix(src)


def test_named_dict_rebound_uses_last_binding():
    src = (
        _H
        + _LOOP
        + (
            '    ckpt = {"optimizer": optimizer.state_dict()}\n    ckpt = {"model": model.state_dict()}\n'
            '    torch.save(ckpt, "f.pt")\n'
        )
    )
    assert "scaler.state_dict()" not in _fix(src)


def test_two_losses_each_scaled_one_update():
    out = _fix(_read("amp_two_losses", "before"))
    assert (
        "    scaler.scale(loss_ce).backward(retain_graph=True)\n    scaler.scale(loss_reg).backward()\n"
        "    scaler.step(optimizer)\n    scaler.update()\n"
    ) in out
    assert out.count("scaler.update()") == 1 and out.count("torch.autocast(") == 1


def test_autograd_backward_scaled():
    src = _H + (
        "for x, y in batches:\n    optimizer.zero_grad()\n    loss = model(x).sum()\n"
        "    torch.autograd.backward(loss)\n    optimizer.step()\n"
    )
    out = _fix(src)
    assert "    torch.autograd.backward(scaler.scale(loss))\n    scaler.step(optimizer)\n    scaler.update()\n" in out
    assert fix_source(out, TOP2, unsafe=True).text == out


def test_autograd_backward_tensors_keyword_and_list():
    src = _H + (
        "for x, y in batches:\n    out = model(x)\n    l1 = out.sum()\n    l2 = out.pow(2).mean()\n"
        "    torch.autograd.backward(tensors=[l1, l2])\n    optimizer.step()\n"
    )
    assert "torch.autograd.backward(tensors=scaler.scale([l1, l2]))" in _fix(src)


def test_backward_with_gradient_argument_scaled():
    src = _H + (
        "for x, y in batches:\n    out = model(x)\n    out.backward(torch.ones_like(out))\n    optimizer.step()\n"
    )
    out = _fix(src)
    assert "    scaler.scale(out).backward(torch.ones_like(out))\n    scaler.step(optimizer)\n" in out


@pytest.mark.slow  # runs the rewritten program in float16 on the CPU, seconds each: with the end-to-end runs
def test_autograd_backward_fp16_runs_on_cpu():
    """The scaled torch.autograd.backward and out.backward(grad) forms run under fp16 + an enabled scaler."""
    src = (
        "import torch\nimport torch.nn as nn\n\ntorch.manual_seed(0)\ndevice = 'cpu'\n"
        "model = nn.Linear(4, 2).to(device)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]\n"
        "for x, y in batches:\n    optimizer.zero_grad()\n    out = model(x)\n    loss = (out - y).pow(2).mean()\n"
        "    torch.autograd.backward(loss, retain_graph=True)\n    out.backward(torch.ones_like(out))\n"
        "    optimizer.step()\n"
    )
    src = src.replace("device = 'cpu'", "device = 'cuda' if torch.cuda.is_available() else 'cpu'")
    out = _fix(src)
    assert "torch.autograd.backward(scaler.scale(loss), retain_graph=True)" in out
    assert "scaler.scale(out).backward(torch.ones_like(out))" in out
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", force_float16(out)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
