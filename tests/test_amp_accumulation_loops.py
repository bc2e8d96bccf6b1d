"""TOP202 on gradient accumulation written as an inner loop (`for _ in range(k): loss = model(...);
(loss / k).backward()`, the optimizer stepped once after it): autocast wraps each micro-batch's
forward, every backward is scaled, `unscale_` comes before the clipping and one `update()` after the
step. A step whose optimizer is built by a library class other than torch.optim is refused, saying
that GradScaler needs a torch.optim.Optimizer and that the class is not known to be one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

TOP202 = Settings(select=("TOP202",))

ACCUMULATE = """\
import torch
from torch import nn

ACCUMULATE = 4


def batches():
    while True:
        yield torch.randn(8, 16), torch.randn(8, 1)


if __name__ == "__main__":
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = batches()
    for step in range(25):
        model.train()
        for _ in range(ACCUMULATE):
            x, y = next(data)
            out = model(x.to(device))
            loss = (out - y.to(device)).pow(2).mean()
            (loss / ACCUMULATE).backward()
        print(f"{loss.item():.4f}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
"""

AFTER_LOOP = """\
        for _ in range(ACCUMULATE):
            x, y = next(data)
            with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                out = model(x.to(device))
                loss = (out - y.to(device)).pow(2).mean()
            scaler.scale(loss / ACCUMULATE).backward()
        print(f"{loss.item():.4f}")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
"""

LIBRARY_OPTIMIZER = """\
import torch
from lion_pytorch import Lion
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x).mean()


model = Net().cuda()
opt = Lion(model.parameters(), lr=1e-4)
for step in range(100):
    loss = model(next(loader))
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def _top202(src: str) -> list[str]:
    return [d.message for d in check_source(src, TOP202, "t.py").diagnostics if d.code == "TOP202"]


def _run(src: str, tmp_path: Path) -> list[float]:
    path = tmp_path / "prog.py"
    path.write_text(src)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return [float(x) for x in r.stdout.split()]


def test_an_inner_accumulation_loop_is_rewritten_and_runs_on_the_cpu(tmp_path):
    [message] = _top202(ACCUMULATE)
    assert "wrap forward and loss in `torch.autocast`" in message
    after = fix_source(ACCUMULATE, TOP202, unsafe=True).text
    compile(after, "prog.py", "exec")
    assert AFTER_LOOP in after
    assert (
        "    opt = torch.optim.SGD(model.parameters(), lr=0.05)\n    amp_device_type = torch.device(device).type\n"
        in after
    )
    assert fix_source(after, TOP202, unsafe=True).text == after  # idempotent
    assert _top202(after) == []
    before_losses, after_losses = _run(ACCUMULATE, tmp_path), _run(after, tmp_path)
    assert len(before_losses) == len(after_losses) == 25
    assert all(abs(a - b) <= 0.05 * max(1.0, abs(b)) for a, b in zip(after_losses, before_losses))


def test_a_step_before_the_inner_loop_is_not_one_accumulation_step():
    src = ACCUMULATE.replace("        model.train()\n", "        opt.step()\n")
    assert _top202(src) == []


def test_an_inner_loop_that_breaks_is_left_alone():
    src = ACCUMULATE.replace(
        "            (loss / ACCUMULATE).backward()\n",
        "            (loss / ACCUMULATE).backward()\n            if loss < 0:\n                break\n",
    )
    assert _top202(src) == []


def test_an_optimizer_of_another_library_is_refused_with_what_is_not_known():
    [message] = _top202(LIBRARY_OPTIMIZER)
    assert "not rewritten to mixed precision" in message
    assert "`opt` is built by `Lion(...)`, which is not a torch.optim class" in message
    assert "needs a torch.optim.Optimizer" in message and "whether `Lion` is one is not known" in message


def test_an_optimizer_of_another_library_in_an_accumulation_loop_is_refused_too():
    src = ACCUMULATE.replace("torch.optim.SGD(", "Lion(").replace(
        "from torch import nn\n", "from torch import nn\nfrom lion_pytorch import Lion\n"
    )
    [message] = _top202(src)
    assert "`opt` is built by `Lion(...)`" in message


def test_a_library_optimizer_stepped_on_a_loss_no_model_computes_is_not_reported():
    src = LIBRARY_OPTIMIZER.replace("loss = model(next(loader))", "loss = compute(next(loader))")
    assert _top202(src) == []
