"""Under `torch.set_default_device(device)` a factory given no device builds its tensor on that
device: `torch.tensor(r).to(device)` copies nothing from the host, and an index built by
`torch.arange(n)` is already where the tensor it indexes is. TOP101 said both were built on the
host (cleanrl's PPO scripts set the default device when CUDA is on). `torch.from_numpy` ignores the
default device: its copy is still reported."""

from __future__ import annotations

from textwrap import dedent

import torch

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source

PROGRAM = dedent("""\
    import numpy as np
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_default_device(device)
    logits = torch.randn(4, 3, device=device)
    picked = logits[torch.arange(4), torch.tensor([0, 1, 2, 0])]
    reward = torch.tensor([1.0, 0.5]).to(device)
    obs = torch.from_numpy(np.ones(3, dtype=np.float32)).to(device)
""")


def _top101_lines(text: str) -> list[int]:
    return sorted(d.line for d in check_source(text, Settings(select=("TOP101",)), "ppo.py").diagnostics)


def test_factories_under_a_default_device_are_not_reported():
    assert _top101_lines(PROGRAM) == [9]  # only the NumPy copy


def test_without_the_default_device_the_same_factories_are_reported():
    plain = PROGRAM.replace("torch.set_default_device(device)\n", "")
    assert _top101_lines(plain) == [6, 6, 7, 8]


def test_the_default_device_really_places_the_factories():
    """What the silence rests on, on the CPU: the default device reaches factories without a device."""
    meta = torch.device("meta")
    torch.set_default_device(meta)
    try:
        made = [torch.tensor([1.0, 0.5]), torch.arange(4), torch.zeros(2)]
    finally:
        torch.set_default_device(None)
    assert all(t.device == meta for t in made)
