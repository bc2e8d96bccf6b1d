"""TOP601-TOP609 beyond their examples: where the accumulator rewrite must refuse, how it spells
torch, and that diagnostics stay inside hot loops."""

from __future__ import annotations

import pytest

from semantic import compare_programs
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

S = Settings(select=("TOP6",))

TRAIN = """\
import torch
import torch.nn.functional as F


def train(model, loader, opt, device):
    running = 0.0
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        running += loss.item()
        if i % 2 == 1:
            print(f"{running / 2:.6f}")
            running = 0.0
    return running
"""

RUN = """
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(5)]
left = train(model, data, opt, "cpu")
"""


def fixed(src: str) -> str:
    return fix_source(src, S).text


def top601(src: str):
    return [d for d in check_source(src, S).diagnostics if d.code == "TOP601"]


def test_accumulator_rewrite_and_its_result():
    out = fixed(TRAIN)
    assert "    running = torch.zeros((), dtype=torch.float64, device=device)\n" in out
    assert "        running += loss.detach()\n" in out
    assert '            print(f"{running.item() / 2:.6f}")\n' in out
    assert "            running.zero_()\n" in out
    assert "    return running.item()\n" in out
    assert fixed(out) == out
    assert compare_programs(TRAIN + RUN, out + RUN) == []


def test_torch_alias_is_reused():
    src = TRAIN.replace("import torch\n", "import torch as T\n")
    out = fixed(src)
    assert "running = T.zeros((), dtype=T.float64, device=device)" in out
    assert "import torch\n" not in out


@pytest.mark.parametrize(
    "edit,reason",
    [
        (
            ("        running += loss.item()\n", "        running += loss.item()\n        hist.append(running)\n"),
            "read on every step",
        ),
        (("device):\n    running = 0.0\n", "device):\n    running = 1.0\n"), "assigned something other than 0"),
        (("            running = 0.0\n", "            running = running * 0.5\n"), "other than 0"),
        (("        running += loss.item()\n", "        running += loss.item() ** 2\n"), "not a Python number"),
        (("    return running\n", "    return lambda: running\n"), "nested function"),
        (("    return running\n", "    return running.real\n"), "used as an object"),
        (("device):\n    running = 0.0\n", "device):\n    running = 0\n"), "read other than as `running / ...`"),
        (
            ("        loss = F.mse_loss(model(x), y)\n", "        loss = compute(model(x), y)\n"),
            "not provably a tensor",
        ),
        (
            ("        x, y = x.to(device), y.to(device)\n", "        x, y = x.to(device), y.to('cuda:1')\n"),
            "more than one device",
        ),
    ],
)
def test_refusals_keep_the_diagnostic_and_say_why(edit, reason):
    old, new = edit
    assert TRAIN.count(old) == 1
    src = TRAIN.replace(old, new)
    diags = top601(src)
    assert diags and all(d.fix is None for d in diags), diags
    assert any("not rewritten: " in d.message and reason in d.message for d in diags), [d.message for d in diags]
    assert fixed(src) == src


def test_int_counter_read_only_as_a_ratio_is_rewritten():
    src = (
        TRAIN.replace("device):\n    running = 0.0\n", "device):\n    running = 0\n")
        .replace(
            '            print(f"{running / 2:.6f}")\n            running = 0.0\n', "            print(running / 2)\n"
        )
        .replace("    return running\n", "    return running / 5\n")
    )
    out = fixed(src)
    assert "running = torch.zeros((), dtype=torch.float64, device=device)" in out
    assert "print(running.item() / 2)" in out
    assert compare_programs(src + RUN, out + RUN) == []


def test_module_level_accumulator_in_a_script_is_fixed():
    src = (
        "import torch\n\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "total = 0.0\nfor x in [torch.ones(1, 2)] * 3:\n    loss = torch.sum(model(x))\n    loss.backward()\n"
        "    opt.step()\n    total += loss.item()\nprint(total)\n"
    )
    d = top601(src)
    assert len(d) == 1 and d[0].fix is not None and d[0].fix.safety == "safe"
    assert "in the training loop at line 6" in d[0].message
    out = fix_source(src, S).text
    assert "total = torch.zeros((), dtype=torch.float64)\n" in out and "print(total.item())" in out


def test_no_device_in_file_means_cpu_accumulator():
    src = TRAIN.replace("        x, y = x.to(device), y.to(device)\n", "").replace(", device):", "):")
    out = fixed(src)
    assert "running = torch.zeros((), dtype=torch.float64)\n" in out


def test_outside_hot_loops_nothing_is_reported():
    src = (
        "import torch\n\ndef stats(xs):\n    out = []\n    for x in xs:\n        out.append(x.mean().item())\n"
        "        if (x > 0).all():\n            print(x)\n    return out\n"
    )
    assert check_source(src, S).diagnostics == []


def test_evaluation_loop_and_called_module_forward():
    src = (
        "import torch\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(2, 2)\n\n    def forward(self, x):\n        y = self.fc(x)\n"
        "        assert torch.isfinite(y).all()\n        return y\n\nnet = Net()\n\n"
        "def evaluate(loader):\n    preds = []\n    with torch.no_grad():\n        for x, _ in loader:\n"
        "            preds.append(net(x).argmax(1).tolist())\n    return preds\n"
    )
    diags = check_source(src, S).diagnostics
    codes = {(d.code, d.line) for d in diags}
    assert ("TOP605", 10) in codes and ("TOP601", 19) in codes, codes
    msg = {d.code: d.message for d in diags}
    assert "in `Net.forward`, called from the forward-pass loop at line 18" in msg["TOP605"]
    assert "in the forward-pass loop at line 18" in msg["TOP601"]


ALIASED = """\
import torch
from torch.nn import Linear{alias}

proj = {cls}(4, 2)
data = [torch.randn(3, 4) for _ in range(3)]
total = 0.0
with torch.no_grad():
    for x in data:
        out = proj(x)
        total += out.sum().item()
"""


@pytest.mark.parametrize("alias,cls", [("", "Linear"), (" as lin", "lin"), (" as Lin", "Lin")])
def test_a_module_class_imported_under_another_name_still_makes_a_hot_loop(alias, cls):
    """`from torch.nn import Linear as lin`: `proj = lin(...)` is a module like `Linear(...)`, so the
    loop calling it is a forward-pass loop (the cheap pre-checks used to look for a capital letter)."""
    diags = check_source(ALIASED.format(alias=alias, cls=cls), S).diagnostics
    assert [(d.code, d.line) for d in diags] == [("TOP601", 10)]
    assert "in the forward-pass loop at line 8" in diags[0].message
