"""TOP202 on the layouts of single-GPU training scripts that it used to refuse or get wrong: module
globals built in `__main__` below the step function that reads them, an optimizer held by a small
wrapper class with its own stepping method, a step imported from another module of the project,
`optimizer.zero_grad()` between the forward and the loss, and values unpacked from a model call
that may not be tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TOP202 = Settings(select=("TOP202",))


def _fix(src: str) -> str:
    return fix_source(src, TOP202, unsafe=True).text


def _top202(src: str) -> list:
    return [d for d in check_source(src, TOP202, "t.py").diagnostics if d.code == "TOP202"]


def _before(name: str) -> str:
    return (FIXTURES / name / "before.py").read_text()


# ----------------------------------------------------------------------------- globals built in __main__


def test_globals_built_in_main_guard_below_the_step_function():
    after = _fix(_before("amp_globals_main"))
    train = after.split("def train(epoch):")[1].split("def test(")[0]
    assert "        with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):\n" in train
    assert "        scaler.step(optimizer)\n        scaler.update()\n" in train
    main = after.split('if __name__ == "__main__":')[1]
    assert (
        main.index("optimizer = optim.SGD(")
        < main.index("    scaler = torch.amp.GradScaler(")
        < main.index("        train(epoch)")
    )


_GLOBALS = """import torch
import torch.nn as nn


def train():
    for x, y in batches:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()


device = "cuda" if torch.cuda.is_available() else "cpu"
batches = [(torch.randn(8, 4), torch.randn(8, 2))]
{early}model = nn.Linear(4, 2).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    train()
"""


def test_globals_at_module_level_after_argparse_style_setup():
    after = _fix(_GLOBALS.format(early=""))
    assert after.index("optimizer = torch.optim.SGD(") < after.index("scaler = torch.amp.GradScaler(")
    assert after.index("scaler = torch.amp.GradScaler(") < after.index("for epoch in range(2):")
    assert "    scaler.scale(loss).backward()\n" in after
    # A call of the step function before the optimizer exists: the scaler would not exist either.
    [d] = _top202(_GLOBALS.format(early="train()\n"))
    assert d.fix is None and "must follow `optimizer = torch.optim.SGD(" in d.message
    assert "not every call of `train` is known to run after it" in d.message


# ----------------------------------------------------------------------------- statements in the region

_STEP = """import torch
import torch.nn as nn
{imports}
device = "cuda" if torch.cuda.is_available() else "cpu"
{classes}model = {model}.to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in [(torch.randn(8, 4), torch.randn(8, 2))]:
{body}
"""


def test_zero_grad_between_forward_and_loss_stays_in_the_block():
    """`optimizer.zero_grad()` only clears gradients, so it may sit between the forward and the loss
    (a GAN that clears the discriminator's gradients after running the generator)."""
    body = (
        "    out = model(x)\n    optimizer.zero_grad()\n    loss = nn.functional.mse_loss(out, y)\n"
        "    loss.backward()\n    optimizer.step()"
    )
    after = _fix(_STEP.format(imports="", classes="", model="nn.Linear(4, 2)", body=body))
    assert (
        "    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):\n        out = model(x)\n"
        "        optimizer.zero_grad()\n        loss = nn.functional.mse_loss(out, y)\n"
        "    scaler.scale(loss).backward()\n"
    ) in after


_UNPACK = (
    "    optimizer.zero_grad()\n    scores, feats = model(x)\n    loss = nn.functional.mse_loss(scores, y)\n"
    "    loss.backward()\n    optimizer.step()\n    print(feats)"
)


def test_unpacked_items_of_an_imported_model_are_not_upcast():
    """What an imported model returns is not visible: `feats` may be a list, and `feats.float()` raises."""
    src = _STEP.format(imports="from models import Discriminator\n", classes="", model="Discriminator()", body=_UNPACK)
    [d] = _top202(src)
    assert d.fix is None
    assert "`feats` is unpacked from `model(...)`" in d.message
    assert "its class is not defined in this file" in d.message


_CLASS = """class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        {ret}


"""


def test_unpacked_list_of_a_file_model_is_not_upcast_and_tensors_are():
    classes = _CLASS.format(ret="feats = [h, h * 2]\n        return h, feats")
    [d] = _top202(_STEP.format(imports="", classes=classes, model="Net()", body=_UNPACK))
    assert d.fix is None and "`Net.forward` returns a container there" in d.message
    classes = _CLASS.format(ret="return h, h * 2")
    after = _fix(_STEP.format(imports="", classes=classes, model="Net()", body=_UNPACK))
    assert "        loss = nn.functional.mse_loss(scores, y)\n    feats = feats.float()\n" in after


def test_a_name_only_rebound_later_is_not_upcast():
    """`feats` is assigned again by a later unpacking, never read: nothing to upcast."""
    body = _UNPACK.replace("    print(feats)", "    scores, feats = None, None")
    after = _fix(
        _STEP.format(imports="from models import Discriminator\n", classes="", model="Discriminator()", body=body)
    )
    assert "feats.float()" not in after and "scaler.step(optimizer)" in after


# ----------------------------------------------------------------------------- optimizer wrappers


def test_wrapper_method_takes_the_scaler_and_steps_the_inner_optimizer():
    after = _fix(_before("amp_optimizer_wrapper"))
    assert "    def step_and_update_lr(self, scaler):\n" in after
    assert "        self._update_learning_rate()\n        scaler.step(self._optimizer)\n" in after
    assert "        optimizer.step_and_update_lr(scaler)\n        scaler.update()\n" in after
    assert "scaler.step(optimizer)" not in after  # a GradScaler cannot step the wrapper itself
    assert "    def zero_grad(self):\n        self._optimizer.zero_grad()\n" in after


_NOAM = """import torch
import torch.nn as nn


class NoamOpt:
    def __init__(self, warmup, optimizer):
        self.optimizer = optimizer
        self.warmup = warmup
        self._step = 0

    def step(self{params}):
        self._step += 1
        for p in self.optimizer.param_groups:
            p["lr"] = min(1.0, self._step / self.warmup)
        self.optimizer.step()


device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Linear(4, 2).to(device)
opt = NoamOpt(4, torch.optim.SGD(model.parameters(), lr=0.0))
for x, y in [(torch.randn(8, 4), torch.randn(8, 2))]:
    opt.optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward(){between}
    opt.step()
{after}"""


def test_wrapper_whose_method_is_called_step():
    after = _fix(_NOAM.format(params="", between="", after=""))
    assert "    def step(self, scaler):\n" in after and "        scaler.step(self.optimizer)\n" in after
    assert "    opt.step(scaler)\n    scaler.update()\n" in after
    assert "scaler.step(opt)" not in after


@pytest.mark.parametrize(
    "params,between,after,reason",
    [
        ("", "", "opt.step()\n", "also called at line 26, where no scaler exists"),
        (", closure=None", "", "", "default or variadic parameters"),
        ("", "\n    nn.utils.clip_grad_norm_(model.parameters(), 1.0)", "", "gradients are read before `opt.step()`"),
    ],
    ids=["called-elsewhere", "defaults", "clipping"],
)
def test_wrapper_refusals_say_why(params, between, after, reason):
    src = _NOAM.format(params=params, between=between, after=after)
    [d] = _top202(src)
    assert d.fix is None and reason in d.message, d.message
    assert _fix(src) == src


@pytest.mark.slow  # runs both programs: seconds each on a loaded 2-CPU box
def test_wrapper_schedule_runs_as_before_with_the_scaler_enabled(tmp_path):
    """float16 forced on the CPU so the scaler is enabled: the wrapper's schedule sets the same
    learning rates, once per call, and the inner optimizer steps through the scaler."""
    import re

    after = _fix(_before("amp_optimizer_wrapper"))
    forced = re.sub(r"amp_dtype = torch\.float16 if [^\n]* else torch\.bfloat16", "amp_dtype = torch.float16", after)
    assert forced != after
    out = {}
    for name, src in (("before", _before("amp_optimizer_wrapper")), ("after", forced)):
        path = tmp_path / f"{name}.py"
        path.write_text(
            src + "\nprint(repr([round(x, 12) for x in lrs]))\nprint(scaler.get_scale() if 'scaler' in dir() else '')\n"
        )
        r = subprocess.run(
            [sys.executable, str(path)],
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        out[name] = r.stdout.splitlines()
    assert out["after"][0] == out["before"][0]  # the same schedule, step for step
    assert float(out["after"][1]) > 0  # the scaler ran


# ----------------------------------------------------------------------------- steps of another module


def test_step_imported_from_another_module_says_where_it_is():
    src = (
        "import torch\nimport torch.nn as nn\nfrom engine import train_one_epoch\nfrom models import resnet18\n\n"
        "device = 'cuda' if torch.cuda.is_available() else 'cpu'\nmodel = resnet18().to(device)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\nfor epoch in range(10):\n"
        "    train_one_epoch(model, loader, optimizer, device, epoch)\n"
    )
    [d] = _top202(src)
    assert d.fix is None and d.line == 10
    assert "the step (`train_one_epoch`) is defined in `engine.py`, another file of the project" in d.message
    # An imported function that is not handed an optimizer of this file is no step.
    assert _top202(src.replace("loader, optimizer, device", "loader, device")) == []


def test_half_where_the_model_is_created_refuses_the_function_it_is_passed_to():
    """`model.half()` under a flag in `main()` reaches `train(model, ...)`: autocast on a half model
    would be pure float16 training under autocast; the flag is opt-in, and the reason says so."""
    src = (
        "import torch\nimport torch.nn as nn\n\n\ndef train(loader, model, criterion, optimizer):\n"
        "    for x, y in loader:\n        x, y = x.cuda(), y.cuda()\n        out = model(x)\n"
        "        loss = criterion(out, y)\n        optimizer.zero_grad()\n        loss.backward()\n"
        "        optimizer.step()\n\n\ndef main(half):\n    model = nn.Linear(4, 2)\n    model.cuda()\n"
        "    criterion = nn.MSELoss()\n    if half:\n        model.half()\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n    for epoch in range(2):\n"
        "        train(loader, model, criterion, optimizer)\n"
    )
    [d] = _top202(src)
    assert d.fix is None and "`model` is cast to float16/bfloat16 only `if half:` (an opt-in switch" in d.message
    assert "pure low-precision" not in d.message
    # Cast unconditionally where it is created: the program trains in half precision by hand, no float32 step.
    assert _top202(src.replace("    if half:\n        model.half()\n", "    model.half()\n")) == []


# ----------------------------------------------------------------------------- devices and parameter-free modules

_GPU_ARG = (
    "import torch\nimport torch.nn as nn\n{imports}\n\ndef train(loader, model, criterion, optimizer, args):\n"
    "    for images, target in loader:\n        images = images.cuda(args.gpu, non_blocking=True)\n"
    "        target = target.cuda(args.gpu, non_blocking=True)\n        output = model(images)\n"
    "        loss = criterion(output, target){reduce}\n        optimizer.zero_grad()\n        loss.backward()\n"
    "        optimizer.step()\n\n\ndef main_worker(args):\n    model = {model}\n    model.cuda(args.gpu)\n"
    "    criterion = {criterion}.cuda(args.gpu)\n    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "    for epoch in range(2):\n        train(loader, model, criterion, optimizer, args)\n"
)


def test_a_cuda_device_index_is_not_taken_for_a_device():
    """`x.cuda(args.gpu)` takes a device index that may be None (the current device);
    `torch.device(args.gpu)` would raise on None: the device type is "cuda"."""
    src = _GPU_ARG.format(imports="", model="nn.Linear(4, 2)", criterion="nn.CrossEntropyLoss()", reduce="")
    after = _fix(src)
    assert "torch.device(args.gpu)" not in after
    assert after.count("amp_device_type = 'cuda'\n") + after.count('amp_device_type = "cuda"\n') == 2
    assert "            output = model(images)\n" in after  # the forward is under autocast


def test_a_parameter_free_module_is_not_the_model():
    """A SimSiam-style step: the model is imported, the criterion is `nn.CosineSimilarity`, which
    holds no parameters; autocast around the criterion alone would leave the forward in float32."""
    src = _GPU_ARG.format(
        imports="from builder import SimSiam",
        model="SimSiam()",
        criterion="nn.CosineSimilarity(dim=1)",
        reduce=".mean()",
    )
    [d] = _top202(src)
    assert d.fix is None and "none of which is known to be a torch.nn.Module" in d.message


# ----------------------------------------------------------------------------- validation on the CPU


@pytest.mark.slow  # runs both programs several times: tens of seconds on a loaded 2-CPU box
@pytest.mark.parametrize("name", ["amp_globals_main", "amp_optimizer_wrapper"])
def test_fixture_validates_on_the_cpu(name, tmp_path):
    src = tmp_path / "before.py"
    src.write_bytes((FIXTURES / name / "before.py").read_bytes())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchopt",
            "validate",
            "--unsafe-fixes",
            "--device",
            "cpu",
            "--select",
            "TOP202",
            str(src),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "TOP202" in r.stdout + r.stderr
    assert src.read_bytes() == (FIXTURES / name / "before.py").read_bytes()
