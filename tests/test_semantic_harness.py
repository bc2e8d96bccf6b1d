"""The before/after harness of the CPU semantics tests (tests/semantic.py) compares what a program
computed even when the program sets up a process group and so runs in a process of its own."""

from __future__ import annotations

from semantic import compare_programs, run_program

PROGRAM = """\
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "init"), rank=0, world_size=1)
torch.manual_seed(0)
model = DDP(nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for _ in range(3):
    opt.zero_grad()
    loss = model(torch.randn(5, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    losses.append(loss.detach())
dist.destroy_process_group()
"""


def test_a_process_group_program_is_compared_from_its_own_process():
    ns = run_program(PROGRAM, "ddp")
    assert sorted(ns["model"]) == ["module.bias", "module.weight"]  # the module's state, by value
    assert len(ns["losses"]) == 3
    assert compare_programs(PROGRAM, PROGRAM) == []


def test_a_changed_value_in_a_process_group_program_is_seen():
    changed = PROGRAM.replace("lr=0.1", "lr=0.2")
    diffs = compare_programs(PROGRAM, changed)
    assert any(d.startswith("losses[1]") for d in diffs), diffs
    assert any(d.startswith("model.module.weight") for d in diffs), diffs
