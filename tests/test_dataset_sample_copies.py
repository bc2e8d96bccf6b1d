"""TOP104 reports, without a fix, a loader whose dataset copies every sample to the device in its
own `__getitem__`: each batch is as many small synchronous copies as it has samples."""

from __future__ import annotations

from textwrap import dedent

import pytest

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source

SRC = """\
import torch
from torch.utils.data import DataLoader, Dataset


def train(data, device, batch_size):
    class Windows(Dataset):
        def __init__(self, data, n):
            self.data, self.n = data, n

        def __getitem__(self, i):
            start = torch.randint(0, self.data.size(0) - self.n, (1,))
            window = self.data[start : start + self.n].long()
            return RETURN

        def __len__(self):
            return self.data.size(0) // self.n

    windows = Windows(data, 16)
    loader = DataLoader(windows, batch_size=batch_size, drop_last=True)
    for batch in loader:
        yield batch
"""


def _found(ret: str) -> list:
    return check_source(dedent(SRC.replace("RETURN", ret)), Settings(select=("TOP104",))).diagnostics


@pytest.mark.parametrize("ret", ["window.to(device)", "window.cuda()"])
def test_a_dataset_that_copies_each_sample_is_reported_at_its_loader(ret):
    [d] = _found(ret)
    assert d.fix is None and d.line == 19
    assert d.message.startswith(f"`Windows.__getitem__` copies every sample to the device (`{ret}`)")


@pytest.mark.parametrize("ret", ["window", "window.to('cpu')", "window.to(torch.float32)"])
def test_a_dataset_that_returns_host_tensors_is_not(ret):
    assert _found(ret) == []
