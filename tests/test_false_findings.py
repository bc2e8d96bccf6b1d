"""Findings that real training scripts showed to be false: the pattern is a reduced copy of what the
script does, and each test names what the user saw before (a report on code that has no problem)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

SYNC = Settings(select=("TOP601", "TOP602", "TOP603", "TOP605", "TOP606"))


def codes(text: str, settings: Settings = SYNC) -> list[tuple[str, int]]:
    return [(d.code, d.line) for d in check_source(text, settings).diagnostics]


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


LOG_INTERVAL = """\
import torch
import torch.nn.functional as F


def train(args, model, device, loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print(f"epoch {epoch} loss {loss.item():.6f}")
        if (batch_idx + 1) % 100 == 0 and args.verbose:
            print(float(loss))
"""


def test_item_already_under_a_log_interval_is_not_reported() -> None:
    assert codes(LOG_INTERVAL) == []


def test_item_on_every_step_is_still_reported() -> None:
    every = LOG_INTERVAL.replace("        if batch_idx % args.log_interval == 0:\n    ", "")
    assert ("TOP601", 13) in codes(every)


EXIT_ON_NAN = """\
import math
import sys
import torch


def train_one_epoch(model, loader, optimizer):
    for images, _ in loader:
        loss = model(images).mean()
        bad = torch.isfinite(loss).logical_not()
        if torch.any(bad):
            print("Loss is {}, stopping training".format(loss.item()))
            sys.exit(1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


def test_item_on_the_exit_path_is_not_reported() -> None:
    found = codes(EXIT_ON_NAN)
    assert ("TOP601", 11) not in found
    assert ("TOP605", 10) in found  # the branch itself still syncs on every step


AFTER_BATCH_LOOP = """\
import torch


def validate(model, loader):
    top1 = torch.zeros(())
    with torch.no_grad():
        model(torch.randn(1, 3))  # warm-up
        for images, target in loader:
            out = model(images)
            top1 += (out.argmax(1) == target).float().mean()
    result = top1.item()
    print(f"top1 {top1.item():.3f}")
    return result


def run(model, loader, batch_size):
    while batch_size:
        try:
            return validate(model, loader)
        except RuntimeError:
            torch.cuda.empty_cache()
            batch_size //= 2
"""


def test_reads_after_the_batch_loop_and_a_retry_empty_cache_are_not_reported() -> None:
    assert codes(AFTER_BATCH_LOOP) == []


def test_item_of_a_cpu_tensor_is_not_a_device_sync() -> None:
    text = (
        "import torch\n\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
        "        size = torch.randint(16, 128, ()).item()\n        loss = model(x[:size]).sum()\n"
        "        loss.backward()\n        opt.step()\n"
    )
    assert codes(text) == []
    on_gpu = text.replace("torch.randint(16, 128, ())", "torch.randint(16, 128, (), device='cuda')")
    assert ("TOP601", 6) in codes(on_gpu)


def test_python_numbers_are_not_tensors_for_prints_and_branches() -> None:
    text = """\
import itertools
import torch


def p_sample(model, x, t: int):
    noise = torch.randn_like(x) if t > 0 else 0.0
    return model(x) + noise


def sample(model, x, steps, times):
    times = torch.linspace(-1, steps - 1, steps + 1)
    times = list(reversed(times.int().tolist()))
    for t in reversed(range(0, steps)):
        x = p_sample(model, x, t)
    for time, time_next in zip(times[:-1], times[1:]):
        x = model(x)
        if time_next < 0:
            break
    return x


def train(model, env, opt):
    total_reward = 0.0
    for step in itertools.count():
        loss = model(torch.ones(2)).sum()
        loss.backward()
        opt.step()
        total_reward += loss.item()
        print(f"step {step} reward {total_reward}")
"""
    found = codes(text)
    assert not [c for c in found if c[0] in ("TOP602", "TOP605")], found


SCRIPT = """\
import torch

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
net = torch.nn.Linear(4, 2).to(device)
criterion = torch.nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
trainloader = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(6)]

for epoch in range(2):
    running_loss = 0.0
    for i, data in enumerate(trainloader, 0):
        inputs, labels = data[0].to(device), data[1].to(device)
        optimizer.zero_grad()
        loss = criterion(net(inputs), labels)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
        if i % 2000 == 1999:
            print(f"[{epoch + 1}, {i + 1:5d}] loss: {running_loss / 2000:.3f}")
            running_loss = 0.0
"""


def test_tutorial_script_running_loss_is_fixed_on_disk(tmp_path: Path) -> None:
    """The PyTorch tutorial's module-level `running_loss` is rewritten: a file whose training loop
    is at module level is a script, not a library another module imports."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    other = tmp_path / "notes.txt"
    other.write_text("untouched\n")
    before = _tree(tmp_path)
    res = CliRunner().invoke(app, ["rewrite", str(script), "--select", "TOP601", "--no-cache"])
    assert res.exit_code == 0, res.output
    after = script.read_text()
    assert "    running_loss = torch.zeros((), dtype=torch.float64, device=device)\n" in after
    assert "running_loss += loss.detach()\n" in after and "running_loss.item() / 2000" in after
    assert "            running_loss.zero_()\n" in after
    changed = {k for k, v in _tree(tmp_path).items() if before.get(k) != v}
    assert changed == {"train.py"}


def test_no_float64_accumulator_on_a_device_that_may_be_mps(tmp_path: Path) -> None:
    """A device picked through `torch.accelerator` may be MPS, which has no float64: reported,
    the file left byte-identical."""
    text = SCRIPT.replace(
        'torch.device("cuda" if torch.cuda.is_available() else "cpu")',
        'torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")',
    )
    script = tmp_path / "train.py"
    script.write_bytes(text.encode())
    res = CliRunner().invoke(app, ["rewrite", str(script), "--select", "TOP601", "--no-cache"])
    assert res.exit_code == 0, res.output
    assert script.read_bytes() == text.encode()
    (diag,) = check_source(text, Settings(select=("TOP601",))).diagnostics
    assert diag.fix is None and "may be Apple MPS" in diag.message
    named = SCRIPT.replace(
        '"cuda" if torch.cuda.is_available() else "cpu"', '"mps" if torch.backends.mps.is_available() else "cpu"'
    )
    assert fix_source(named, Settings(select=("TOP601",))).text == named


def test_copy_once_per_epoch_or_on_the_first_batch_is_not_reported() -> None:
    text = """\
import torch


def test(model, loader, device):
    with torch.no_grad():
        for i, (data, _) in enumerate(loader):
            recon = model(data.to(device))
            if i == 0:
                keep = recon[:8].cpu()


def train(model, loader, opt, device):
    for data, _ in loader:
        model(data.to(device)).sum().backward()
        opt.step()


def main(model, loader, opt, device):
    for epoch in range(3):
        train(model, loader, opt, device)
        test(model, loader, device)
        with torch.no_grad():
            sample = model(torch.randn(64, 20).to(device)).cpu()
"""
    assert [c for c in codes(text) if c[0] == "TOP603"] == []
    per_batch = text.replace("            if i == 0:\n                keep", "            keep")
    assert ("TOP603", 8) in codes(per_batch)


def test_opt_in_synchronize_switch_is_not_reported() -> None:
    text = (
        "import torch\n\n\ndef train(args, model, loader, opt):\n    for x, y in loader:\n"
        "        model(x).sum().backward()\n        opt.step()\n        if args.synchronize_step:\n"
        "            torch.cuda.synchronize()\n"
    )
    assert codes(text) == []
    assert ("TOP606", 8) in codes(text.replace("        if args.synchronize_step:\n    ", ""))
