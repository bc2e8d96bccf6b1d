"""What this machine's CPU build of torch can run: some tests run rewritten programs in bfloat16 on the
CPU, and oneDNN has no bfloat16 LSTM on processors without AVX-512 (it raises "could not create a
primitive descriptor for the LSTM forward propagation primitive"). Such a test is skipped there with
that reason instead of failing on the hardware."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def bfloat16_lstm_missing() -> str | None:
    """Why this CPU cannot run an LSTM under bfloat16 autocast, or None when it can."""
    import torch

    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.LSTM(4, 4)(torch.randn(2, 1, 4))
    except RuntimeError as e:
        return f"this CPU cannot run an LSTM in bfloat16 (oneDNN: {str(e).splitlines()[0]})"
    return None


def skip_unless_bfloat16_lstm(source: str) -> None:
    """Skip the calling test when ``source`` builds an LSTM and this CPU cannot run one in bfloat16."""
    why = bfloat16_lstm_missing() if "LSTM" in source else None
    if why is not None:
        pytest.skip(why)
