"""DDP rules on the layouts of real training programs: a `state_dict()` read before the wrap, a
checkpoint copied after it is written, rank conditions already in place, the DataParallel forms
tutorials use, and DataParallel used only for inference (one report, not two)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layout_cases import check, rewrite
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import fix_source

ROOT = Path(__file__).resolve().parent.parent

FINETUNE = """\
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def main(args):
    model = nn.Linear(4, 2)
    if args.finetune:
        checkpoint_model = torch.load(args.finetune)
        state_dict = model.state_dict()
        for k in ["weight", "bias"]:
            if checkpoint_model[k].shape != state_dict[k].shape:
                del checkpoint_model[k]
        model.load_state_dict(checkpoint_model, strict=False)
    model_without_ddp = model
    if args.distributed:
        model = DistributedDataParallel(model)
        model_without_ddp = model.module
    torch.save(model.state_dict(), "last.pt")
"""


def test_state_dict_read_before_the_wrap_is_left_alone(tmp_path):
    res, text = rewrite(tmp_path, FINETUNE, "--unsafe-fixes", "--select", "TOP406")
    assert res.exit_code == 0
    assert text == FINETUNE  # before the wrap, and after a wrap that only happens under a condition
    res = check(tmp_path / "c", FINETUNE, "--select", "TOP406")
    assert res.exit_code == 0 and "TOP406" not in res.stdout


def test_state_dict_after_an_unconditional_wrap_is_still_fixed(tmp_path):
    src = FINETUNE.replace(
        "    if args.distributed:\n        model = DistributedDataParallel(model)\n"
        "        model_without_ddp = model.module\n",
        "    model = DistributedDataParallel(model)\n",
    )
    res, text = rewrite(tmp_path, src, "--unsafe-fixes", "--select", "TOP406")
    assert res.exit_code == 0
    assert text == src.replace(
        'torch.save(model.state_dict(), "last.pt")', 'torch.save(model.module.state_dict(), "last.pt")'
    )


SAVE_CHECKPOINT = """\
import shutil

import torch
import torch.distributed as dist


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")


def main(args):
    dist.init_process_group("gloo")
    for epoch in range(args.epochs):
        save_checkpoint({"epoch": epoch}, epoch == 0)
"""


def test_guard_covers_the_copy_of_the_written_checkpoint(tmp_path):
    res, text = rewrite(tmp_path, SAVE_CHECKPOINT, "--unsafe-fixes", "--select", "TOP405")
    assert res.exit_code == 0
    assert text == SAVE_CHECKPOINT.replace(
        '    torch.save(state, filename)\n    if is_best:\n        shutil.copyfile(filename, "model_best.pth.tar")\n',
        "    if not dist.is_initialized() or dist.get_rank() == 0:\n        torch.save(state, filename)\n"
        '        if is_best:\n            shutil.copyfile(filename, "model_best.pth.tar")\n',
    )


def test_function_called_only_under_a_rank_condition_is_not_guarded_again(tmp_path):
    src = SAVE_CHECKPOINT.replace(
        '        save_checkpoint({"epoch": epoch}, epoch == 0)\n',
        '        if args.rank % args.gpus_per_node == 0:\n            save_checkpoint({"epoch": epoch}, epoch == 0)\n',
    )
    res, text = rewrite(tmp_path, src, "--unsafe-fixes", "--select", "TOP405")
    assert res.exit_code == 0 and text == src


def test_master_process_condition_is_a_rank_condition(tmp_path):
    src = (
        'import torch\nimport torch.distributed as dist\n\ndist.init_process_group("gloo")\n'
        'master_process = dist.get_rank() == 0\nif master_process:\n    print("training")\n'
        '    torch.save({}, "ckpt.pt")\n'
    )
    res, text = rewrite(tmp_path, src, "--unsafe-fixes", "--select", "TOP405")
    assert res.exit_code == 0 and text == src


def test_every_rank_reads_the_checkpoint_after_a_barrier(tmp_path):
    src = (
        'import torch\nimport torch.distributed as dist\n\ndist.init_process_group("gloo")\n'
        'torch.save({"w": 1}, "ckpt.pt")\nstate = torch.load("ckpt.pt")\n'
    )
    res, text = rewrite(tmp_path, src, "--unsafe-fixes", "--select", "TOP405")
    assert res.exit_code == 0
    assert text == src.replace(
        'torch.save({"w": 1}, "ckpt.pt")\n',
        'if dist.get_rank() == 0:\n    torch.save({"w": 1}, "ckpt.pt")\n'
        "dist.barrier()  # the file is written by rank 0 only\n",
    )


DP_HEAD = (
    "import torch\nimport torch.nn as nn\nfrom torch.utils.data import DataLoader, TensorDataset\n\n"
    "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
    "train_ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))\n"
    "loader = DataLoader(train_ds, batch_size=8, shuffle=True)\n"
)
DP_LOOP = (
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "for epoch in range(2):\n    for x, y in loader:\n"
    "        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))\n"
    "        optimizer.zero_grad()\n        loss.backward()\n        optimizer.step()\n"
)


@pytest.mark.parametrize(
    "wrap,moved",
    [
        ("model = nn.DataParallel(nn.Linear(4, 2)).cuda()\n", "model = nn.Linear(4, 2).cuda()\n"),
        ("model = nn.DataParallel(nn.Linear(4, 2)).to(device)\n", "model = nn.Linear(4, 2).to(device)\n"),
        (
            "model = nn.Linear(4, 2).to(device)\nif torch.cuda.device_count() > 1:\n    model = nn.DataParallel(model)\n",
            "model = nn.Linear(4, 2).to(device)\n",
        ),
    ],
)
def test_tutorial_data_parallel_forms_are_converted(tmp_path, wrap, moved):
    res, text = rewrite(tmp_path, DP_HEAD + wrap + DP_LOOP, "--unsafe-fixes", "--select", "TOP401")
    assert res.exit_code == 0
    assert moved + "model = DistributedDataParallel(\n    model, device_ids=" in text
    assert "DataParallel(" not in text.replace("DistributedDataParallel(", "")
    assert "device_count" not in text  # the wrap no longer depends on the GPUs one process sees
    compile(text, "main.py", "exec")


def test_move_after_the_wrap_is_refused(tmp_path):
    src = DP_HEAD + "model = nn.DataParallel(nn.Linear(4, 2))\nmodel.cuda()\n" + DP_LOOP
    res, text = rewrite(tmp_path, src, "--unsafe-fixes", "--select", "TOP401")
    assert res.exit_code == 0 and text == src
    res = check(tmp_path / "c", src, "--select", "TOP401")
    assert res.exit_code == 1
    assert "`model.cuda(...)` moves the model after it is wrapped" in res.stdout


def test_functional_data_parallel_is_reported(tmp_path):
    src = (
        "import torch.nn as nn\n\n\nclass Generator(nn.Module):\n    def forward(self, x):\n"
        "        if x.is_cuda and self.ngpu > 1:\n"
        "            return nn.parallel.data_parallel(self.main, x, range(self.ngpu))\n"
        "        return self.main(x)\n"
    )
    res = check(tmp_path, src, "--select", "TOP401")
    assert res.exit_code == 1
    assert "main.py:7:" in res.stdout and "nn.parallel.data_parallel(module, inputs)" in res.stdout


INFERENCE_DP = (
    "import torch\nfrom torch import nn\n\nnet = nn.Linear(16, 4)\n"
    "opt = torch.optim.SGD(net.parameters(), lr=0.1)\nfor x in data:\n"
    "    net(x).sum().backward()\n    opt.step()\nevaluator = nn.DataParallel(net)\n"
    "with torch.no_grad():\n    score = evaluator(val_x)\n"
)


def test_each_data_parallel_problem_is_reported_once(tmp_path):
    """Inference only: TOP411's advice alone; training: TOP401's conversion alone."""
    res = check(tmp_path / "inference", INFERENCE_DP, "--select", "TOP4")
    codes = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith(str(tmp_path))]
    assert codes == ["TOP411"], res.stdout
    res = check(
        tmp_path / "training",
        DP_HEAD + "model = nn.DataParallel(nn.Linear(4, 2).to(device))\n" + DP_LOOP,
        "--select",
        "TOP4",
    )
    codes = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith(str(tmp_path))]
    assert codes == ["TOP401"], res.stdout


@pytest.mark.slow
def test_converted_tutorial_script_runs_on_two_gloo_ranks(tmp_path):
    """fixtures/ddp_dp_forms converted: both ranks train the same parameters, only rank 0 writes
    the checkpoint and its copy."""
    before = (ROOT / "fixtures" / "ddp_dp_forms" / "before.py").read_text(encoding="utf-8")
    script = tmp_path / "train.py"
    script.write_text(fix_source(before, Settings(select=("TOP4",)), unsafe=True).text, encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / "ddp_support.py"),
            str(script),
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["params"] and all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    assert r1["writes"] == []
    assert sorted(Path(w).name for w in r0["writes"]) == ["checkpoint.pt", "model_best.pt"]
