"""A device check that selects the accelerator path does not make an explicit sync harmless: on
that path the sync runs every step (TOP606). Only the host path of the check is quiet."""

from __future__ import annotations

from textwrap import dedent

import pytest

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source

SRC = """\
import time

import torch


def clock(use_gpu):
    if GUARD:
        torch.cuda.synchronize()
    return time.time()


def train(model, loader, opt, use_gpu, device):
    for x, y in loader:
        t0 = clock(use_gpu)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t1 = clock(use_gpu)
"""


@pytest.mark.parametrize("guard", ["use_gpu", "torch.cuda.is_available()", "device != 'cpu'"])
def test_a_sync_in_a_timing_helper_on_the_gpu_path_is_reported(guard):
    found = check_source(dedent(SRC.replace("GUARD", guard)), Settings(select=("TOP606",))).diagnostics
    assert [(d.line, d.code) for d in found] == [(8, "TOP606")]
    assert "in `clock`, called from the training loop at line 13" in found[0].message, found[0].message


@pytest.mark.parametrize("guard", ["not use_gpu", "device == 'cpu'"])
def test_a_sync_on_the_host_path_is_not(guard):
    assert check_source(dedent(SRC.replace("GUARD", guard)), Settings(select=("TOP606",))).diagnostics == []
