"""The claim behind TOP601's fix, checked empirically on the CPU: summing float32 `loss.item()`
values in a Python float gives exactly the bits of summing the same tensors into a float64 tensor
(in the same order), and so does every logged read (`acc / n`), while a float32 accumulator does not.
Python floats are IEEE doubles; `float64 += float32` converts the float32 value exactly and adds in
double precision with the same rounding, one addition per step, in the same order."""

from __future__ import annotations

import struct

import pytest
import torch


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _losses(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Losses of very different magnitudes (1e-4 ... 1e3), so the running sum rounds often.
    base = torch.rand(n, generator=g, dtype=torch.float64) * 3.0
    scale = torch.pow(10.0, torch.randint(-4, 4, (n,), generator=g).double())
    return (base * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float64_device_accumulator_matches_python_floats_bitwise(dtype):
    torch.set_num_threads(1)
    n, every = 100_000 if dtype == torch.float32 else 20_000, 100
    losses = list(_losses(n, dtype).unbind())
    py = 0.0
    dev = torch.zeros((), dtype=torch.float64)
    logged_py, logged_dev = [], []
    for i, loss in enumerate(losses):
        py += loss.item()
        dev += loss.detach()
        if i % every == every - 1:
            logged_py.append(py / every)
            logged_dev.append(dev.item() / every)
            py = 0.0
            dev.zero_()
    assert [_bits(v) for v in logged_py] == [_bits(v) for v in logged_dev]
    # and without resets: the final total of all steps
    total_py = 0.0
    total_dev = torch.zeros((), dtype=torch.float64)
    for loss in losses:
        total_py += loss.item()
        total_dev += loss.detach()
    assert _bits(total_py) == _bits(total_dev.item())


def test_weighted_sum_matches_with_double_summand():
    """`total += loss.item() * x.size(0)` -> `total += loss.detach().double() * x.size(0)`."""
    losses = list(_losses(50_000, torch.float32, seed=1).unbind())
    g = torch.Generator().manual_seed(2)
    sizes = torch.randint(1, 513, (len(losses),), generator=g).tolist()
    py = 0.0
    dev = torch.zeros((), dtype=torch.float64)
    for loss, n in zip(losses, sizes):
        py += loss.item() * n
        dev += loss.detach().double() * n
    assert _bits(py) == _bits(dev.item())
    assert _bits(py / sum(sizes)) == _bits(dev.item() / sum(sizes))


def test_float32_accumulator_would_not_reproduce_the_log():
    """Why the fix uses float64: a float32 running sum rounds differently."""
    losses = list(_losses(100_000, torch.float32).unbind())
    py = 0.0
    dev32 = torch.zeros((), dtype=torch.float32)
    for loss in losses:
        py += loss.item()
        dev32 += loss.detach()
    assert dev32.item() != py


def test_integer_counts_through_a_float64_accumulator():
    """`correct = 0; correct += (...).sum().item(); correct / total`: the int-started form is only
    rewritten when every read is a true division, where int and float64 give the same quotient."""
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 4096, (20_000,), generator=g)
    py = 0
    dev = torch.zeros((), dtype=torch.float64)
    for c in counts.unbind():
        py += c.item()
        dev += c
    total = 20_000 * 4096
    assert _bits(py / total) == _bits(dev.item() / total)
