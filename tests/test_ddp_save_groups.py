"""A rank-0 guard covers the group of side effects that belong to one save: the folder creation, the
path, the write, the copy and the log line for that file, in one `if` (TOP405 and the DDP
conversions share the guard). Unguarded, every process creates the folder at once and all but one
fail with FileExistsError."""

from __future__ import annotations

import subprocess
import sys

import pytest
from layout_cases import rewrite

HEAD = """\
import os
import shutil

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(nn.Linear(4, 2))
for epoch in range(2):
    loss = model(torch.randn(3, 4)).mean()
    loss.backward()
"""

SAVE = """\
    ckpt_dir = os.path.join("runs", f"epoch{epoch}")
    if not os.path.exists(ckpt_dir):
        os.mkdir(ckpt_dir)
    path = os.path.join(ckpt_dir, "model.pt")
    torch.save(model.module.state_dict(), path)
    shutil.copyfile(path, "runs/last.pt")
    print(f"saved {path}")
"""


def test_the_folder_creation_joins_the_guard_of_its_save(tmp_path):
    res, text = rewrite(tmp_path / "a", HEAD + SAVE, "--unsafe-fixes", "--select", "TOP405")
    assert res.exit_code == 0, res.output
    assert text == HEAD + (
        '    ckpt_dir = os.path.join("runs", f"epoch{epoch}")\n'
        "    if dist.get_rank() == 0:\n"
        "        if not os.path.exists(ckpt_dir):\n"
        "            os.mkdir(ckpt_dir)\n"
        '        path = os.path.join(ckpt_dir, "model.pt")\n'
        "        torch.save(model.module.state_dict(), path)\n"
        '        shutil.copyfile(path, "runs/last.pt")\n'
        '        print(f"saved {path}")\n'
    )


def test_a_path_read_after_the_group_is_computed_above_the_guard(tmp_path):
    src = (
        HEAD
        + SAVE.replace(
            '    ckpt_dir = os.path.join("runs", f"epoch{epoch}")\n    if not os.path.exists(ckpt_dir):\n        os.mkdir(ckpt_dir)\n',
            '    os.makedirs("runs", exist_ok=True)\n',
        ).replace('os.path.join(ckpt_dir, "model.pt")', 'os.path.join("runs", f"{epoch}.pt")')
        + "    last = path\n"
    )
    res, text = rewrite(tmp_path, src, "--unsafe-fixes", "--select", "TOP405")
    assert res.exit_code == 0, res.output
    assert text == HEAD + (
        '    path = os.path.join("runs", f"{epoch}.pt")\n'
        "    if dist.get_rank() == 0:\n"
        '        os.makedirs("runs", exist_ok=True)\n'
        "        torch.save(model.module.state_dict(), path)\n"
        '        shutil.copyfile(path, "runs/last.pt")\n'
        '        print(f"saved {path}")\n'
        "    dist.barrier()  # the file is written by rank 0 only\n"
        "    last = path\n"
    )
    # a folder the save does not write to is no part of its group
    src = HEAD + '    os.makedirs("logs", exist_ok=True)\n    torch.save(model.module.state_dict(), "ckpt.pt")\n'
    res, text = rewrite(tmp_path / "b", src, "--unsafe-fixes", "--select", "TOP405")
    assert res.exit_code == 0, res.output
    assert text == HEAD + (
        '    os.makedirs("logs", exist_ok=True)\n'
        "    if dist.get_rank() == 0:\n"
        '        torch.save(model.module.state_dict(), "ckpt.pt")\n'
    )


SINGLE_PROCESS = """\
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
dataset = TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
loader = DataLoader(dataset, batch_size=4, shuffle=True)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    out_dir = os.path.join("runs", str(epoch))
    os.makedirs(out_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out_dir, "model.pt"))
    print(f"epoch {epoch} saved to {out_dir}")
"""


def test_the_ddp_conversion_guards_the_folder_with_its_checkpoint(tmp_path):
    res, text = rewrite(tmp_path, SINGLE_PROCESS, "--unsafe-fixes", "--select", "TOP402")
    assert res.exit_code == 0, res.output
    assert text.endswith(
        '    out_dir = os.path.join("runs", str(epoch))\n'
        "    if rank == 0:\n"
        "        os.makedirs(out_dir, exist_ok=True)\n"
        '        torch.save(model.module.state_dict(), os.path.join(out_dir, "model.pt"))\n'
        '        print(f"epoch {epoch} saved to {out_dir}")\n'
        "\n"
        "dist.destroy_process_group()\n"
    )


@pytest.mark.slow
def test_the_converted_program_runs_as_one_process_and_writes_the_same_checkpoints(tmp_path):
    res, text = rewrite(tmp_path, SINGLE_PROCESS, "--unsafe-fixes", "--select", "TOP402")
    assert res.exit_code == 0, res.output
    assert "    if rank == 0:\n        os.makedirs(out_dir, exist_ok=True)\n" in text
    outputs = []
    for name, program in (("before", SINGLE_PROCESS), ("after", text)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "train.py").write_text(program, encoding="utf-8")
        done = subprocess.run([sys.executable, "train.py"], cwd=run_dir, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outputs.append((done.stdout, sorted(str(p.relative_to(run_dir)) for p in (run_dir / "runs").rglob("*"))))
    assert outputs[0] == outputs[1]


DATA_PARALLEL = """\
import os
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

if not os.path.isdir("results"):
    os.mkdir("results")
figures = Path("figures")
if not figures.exists():
    figures.mkdir(parents=True)
os.mkdir("run")
net = nn.DataParallel(nn.Linear(4, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
dataset = TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
loader = DataLoader(dataset, batch_size=4, shuffle=True)


def checkpoint(epoch):
    state = {"net": net.state_dict(), "epoch": epoch}
    if not os.path.isdir("checkpoint"):
        os.mkdir("checkpoint")
    torch.save(state, "./checkpoint/ckpt_" + str(epoch) + ".pt")


for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    checkpoint(epoch)
"""


def test_the_conversion_leaves_no_folder_creation_that_processes_race_on(tmp_path):
    # the checkpoint folder, named by the literal its save path starts with, joins the save's guard;
    # a checked creation elsewhere becomes one that tolerates the folder existing; a bare `os.mkdir`
    # (which fails when the folder exists) runs on rank 0 only
    res, text = rewrite(tmp_path, DATA_PARALLEL, "--unsafe-fixes", "--select", "TOP401")
    assert res.exit_code == 0, res.output
    assert 'os.makedirs("results", exist_ok=True)\nfigures = Path("figures")\n' in text
    assert "figures.mkdir(parents=True, exist_ok=True)\n" in text
    assert 'if rank == 0:\n    os.mkdir("run")\n' in text
    assert (
        "    if rank == 0:\n"
        '        if not os.path.isdir("checkpoint"):\n'
        '            os.mkdir("checkpoint")\n'
        '        torch.save(state, "./checkpoint/ckpt_" + str(epoch) + ".pt")\n'
    ) in text
    assert text.count("isdir") == 1 and "figures.exists()" not in text


@pytest.mark.slow
def test_the_converted_data_parallel_program_creates_the_same_folders(tmp_path):
    res, text = rewrite(tmp_path, DATA_PARALLEL, "--unsafe-fixes", "--select", "TOP401")
    assert res.exit_code == 0, res.output
    outputs = []
    for name, program in (("before", DATA_PARALLEL), ("after", text)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "train.py").write_text(program, encoding="utf-8")
        done = subprocess.run([sys.executable, "train.py"], cwd=run_dir, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outputs.append(sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.name != "train.py"))
    assert outputs[0] == outputs[1]


def test_a_log_line_inside_a_guarded_group_gets_no_second_guard(tmp_path):
    """The `try` after a save names the save's path and joins its guard; the prints inside it are
    side effects too, but the outer guard already decides whether they run: one `if`, not three."""
    src = HEAD + (
        '    torch.save(model.module.state_dict(), f"{epoch}.pt")\n'
        "    try:\n"
        '        print(f"saved {epoch}.pt at lr {optimizer.lr}")\n'
        "    except NameError:\n"
        '        print(f"saved {epoch}.pt")\n'
    )
    res, text = rewrite(tmp_path / "a", src, "--unsafe-fixes", "--select", "TOP405")
    assert res.exit_code == 0, res.output
    assert text == HEAD + (
        "    if dist.get_rank() == 0:\n"
        '        torch.save(model.module.state_dict(), f"{epoch}.pt")\n'
        "        try:\n"
        '            print(f"saved {epoch}.pt at lr {optimizer.lr}")\n'
        "        except NameError:\n"
        '            print(f"saved {epoch}.pt")\n'
    )
