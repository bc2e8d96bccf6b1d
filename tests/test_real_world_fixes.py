"""Faults that re-measuring torchopt on public training scripts showed: a crash of the loader analysis
on a loop over a builtin's result, a Python-loop finding on a loop over a few `chunk()` pieces, and a
host-read finding on logging that already runs every N steps "or on the last batch". Each script is a
reduced copy of the pattern the real one has; every run goes through the command line on a tree under
tmp_path, whose files must stay byte-identical."""

from __future__ import annotations

import hashlib
from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

from torchopt.cli import app


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _run(tmp_path: Path, files: dict[str, str], *args: str) -> tuple[int, str]:
    """Run torchopt with ``args`` on a fresh tree under tmp_path; every file must come out unchanged."""
    root = tmp_path / "proj"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    before = _hashes(tmp_path)
    res = CliRunner().invoke(app, [*args, str(root), "--no-cache"])
    assert _hashes(tmp_path) == before
    for name, text in files.items():
        assert (root / name).read_bytes() == text.encode()
    return res.exit_code, res.output


# ------------------------------------------------------------------ a loop over a builtin's result

SAMPLER = dedent("""\
    import torch
    from torch.utils.data import DataLoader


    def sample(times):
        pairs = list(zip(times[:-1], times[1:]))
        for now, later in pairs:
            x = torch.full((2,), now).to("cuda")
            print(x)


    loader = DataLoader(list(range(8)), batch_size=4, pin_memory=True)
    model = torch.nn.Linear(1, 1).cuda()
    for batch in loader:
        batch = batch.to("cuda")
        model(batch[:, None].float()).sum().backward()
    """)


def test_loop_over_builtin_result_does_not_crash_the_loader_analysis(tmp_path):
    """`pairs = list(...)`: `list` is a builtin, not a local function returning a DataLoader. The
    file used to fail with an internal error (exit 2) and get no diagnostic at all."""
    code, out = _run(
        tmp_path,
        {"sampler.py": SAMPLER, "other.py": "import torch\n"},
        "check",
        "--select",
        "TOP104",
        "--output-format",
        "text",
    )
    assert "internal error" not in out
    assert code == 1
    assert "sampler.py:15:13: TOP104" in out  # the real loader loop is still reported
    assert "sampler.py:8:" not in out  # the loop over `pairs` is not a loader loop


def test_loop_over_builtin_result_rewrite_only_fixes_the_loader_copy(tmp_path):
    code, out = _run(tmp_path, {"sampler.py": SAMPLER}, "rewrite", "--diff", "--select", "TOP104")
    assert code == 1
    assert '+    batch = batch.to("cuda", non_blocking=True)' in out
    assert "internal error" not in out


# ------------------------------------------------------------------ a loop over chunk() pieces

CROPS_LOSS = dedent("""\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class CropLoss(nn.Module):
        def __init__(self, ncrops):
            super().__init__()
            self.ncrops = ncrops

        def forward(self, student_output, teacher_output):
            student_out = student_output / 0.1
            student_out = student_out.chunk(self.ncrops)
            teacher_out = F.softmax(teacher_output, dim=-1).detach().chunk(2)
            total = 0
            for iq, q in enumerate(teacher_out):
                for v in range(len(student_out)):
                    if v == iq:
                        continue
                    total += torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
            return total
    """)

ROW_LOSS = dedent("""\
    import torch
    import torch.nn as nn


    class RowLoss(nn.Module):
        def forward(self, scores):
            scores = scores * 2
            total = 0
            for i in range(len(scores)):
                total = total + scores[i].sum()
            return total
    """)


def test_loop_over_chunk_pieces_is_not_a_row_loop(tmp_path):
    """`student_out` is rebound to `ncrops` pieces, each a whole batch: the loop launches a handful of
    batched kernels, not one per row."""
    code, out = _run(
        tmp_path,
        {"crops.py": CROPS_LOSS, "rows.py": ROW_LOSS},
        "check",
        "--select",
        "TOP610",
        "--output-format",
        "text",
    )
    assert code == 1
    assert "crops.py" not in out
    assert "rows.py:9:9: TOP610" in out  # a loop over the rows of one tensor is still reported


# ------------------------------------------------------------------ logging every N steps or at the end

LOGGER = dedent("""\
    import torch


    def train(model, loader, optimizer, log_interval, last_idx):
        for batch_idx, (x, y) in enumerate(loader):
            x, y = x.cuda(), y.cuda()
            last_batch = batch_idx == last_idx
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if batch_idx % log_interval == 0 or last_batch:
                print(loss.item())
            if batch_idx % log_interval == 0 or args_verbose():
                print(loss.item())


    def args_verbose():
        return True
    """)


def test_periodic_or_last_batch_logging_is_not_a_per_step_read(tmp_path):
    """`i % n == 0 or last_batch` runs every n steps plus once: the read is already rare. A test
    joined with something that may hold on every step (`or args_verbose()`) is still reported."""
    code, out = _run(tmp_path, {"train.py": LOGGER}, "check", "--select", "TOP601", "--output-format", "text")
    assert code == 1
    assert "train.py:13:" not in out
    assert "train.py:15:19: TOP601" in out


# ------------------------------------------------------------------ a parameter that shadows the train function

PAIRS = dedent("""\
    import torch
    from torch.utils.data import Dataset


    class Pairs(Dataset):
        def __init__(self, root, train):
            self.items = load(root, train=train)


    def train(model, device, train_loader, optimizer):
        for batch_idx, (left, right, target) in enumerate(train_loader):
            left, right, target = left.to(device), right.to(device), target.to(device)
            optimizer.zero_grad()
            model(left, right, target).backward()
            optimizer.step()


    def main():
        device = torch.device("cuda")
        train_loader = torch.utils.data.DataLoader(Pairs("data", train=True), batch_size=8, pin_memory=True)
        model = Model().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, device, train_loader, optimizer)


    if __name__ == "__main__":
        main()
    """)


def test_parameter_named_like_the_train_function_does_not_hide_its_loader(tmp_path):
    """A dataset's `__init__(self, root, train)` uses its own `train`, not the `train()` function:
    every call of `train()` still passes a DataLoader, so its batch copies are followed and fixed."""
    code, out = _run(tmp_path, {"pairs.py": PAIRS}, "rewrite", "--diff", "--select", "TOP104")
    assert code == 1
    assert (
        "+        left, right, target = (\n"
        "+            left.to(device, non_blocking=True),\n"
        "+            right.to(device, non_blocking=True),\n"
        "+            target.to(device, non_blocking=True),\n"
        "+        )\n"
    ) in out
    assert "Would fix 3 issues in 1 file (TOP104 ×3)." in out


def test_scaler_made_in_main_and_passed_to_the_step_is_seen():
    """TOP203 said "float16 autocast without a GradScaler" on a step that receives the scaler main() made."""
    from torchopt.rewrite.config import Settings
    from torchopt.rewrite.engine import check_source

    src = (
        "import torch\n\n\n"
        "def train_one_epoch(model, loader, optimizer, scaler):\n"
        "    for x, y in loader:\n"
        "        with torch.cuda.amp.autocast(scaler is not None):\n"
        "            loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "        optimizer.zero_grad()\n"
        "        if scaler is None:\n"
        "            loss.backward()\n"
        "            optimizer.step()\n"
        "        else:\n"
        "            scaler.scale(loss).backward()\n"
        "            scaler.step(optimizer)\n"
        "            scaler.update()\n\n\n"
        "def main(use_fp16):\n"
        "    model = torch.nn.Linear(4, 1).cuda()\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    scaler = None\n"
        "    if use_fp16:\n"
        "        scaler = torch.cuda.amp.GradScaler()\n"
        "    train_one_epoch(model, [], optimizer, scaler)\n"
    )
    codes = [d.code for d in check_source(src, Settings(), "train.py").diagnostics]
    assert "TOP203" not in codes
    # Without the scaler anywhere, the same step is still reported.
    bare = src.replace("        scaler = torch.cuda.amp.GradScaler()\n", "        scaler = None\n")
    assert "TOP203" in [d.code for d in check_source(bare, Settings(), "train.py").diagnostics]


def test_amp_refusal_names_the_calls_it_cannot_tell_are_models():
    """A model built by `models.__dict__[arch]()` is not known to be a module: the reason says which calls
    feed the loss instead of claiming that no module does."""
    from torchopt.rewrite.config import Settings
    from torchopt.rewrite.engine import check_source

    src = (
        "import torch\nimport torchvision.models as models\n\n\n"
        "def train(loader, model, criterion, optimizer, device):\n"
        "    for images, target in loader:\n"
        "        images = images.to(device)\n"
        "        output = model(images)\n"
        "        loss = criterion(output, target)\n"
        "        optimizer.zero_grad()\n"
        "        loss.backward()\n"
        "        optimizer.step()\n\n\n"
        "def main(arch):\n"
        "    device = torch.device('cuda')\n"
        "    model = models.__dict__[arch]().to(device)\n"
        "    criterion = torch.nn.CrossEntropyLoss().to(device)\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    train([], model, criterion, optimizer, device)\n"
    )
    diags = [d for d in check_source(src, Settings(), "main.py").diagnostics if d.code == "TOP202"]
    assert diags and all("no call of a torch.nn.Module" not in d.message for d in diags)
    assert any("`model(...)`" in d.message for d in diags)
    assert all("images.to" not in d.message for d in diags)
