"""A module-level switch set to False (`profile = False` at the top of a script that a config file or
the command line may turn on) is off by default, like an option: a step loop that runs only under it
is not the program's default run, so its per-step host reads are not reported."""

from __future__ import annotations

from textwrap import dedent

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source

SCRIPT = dedent("""\
    import torch

    profile = {value}
    device = "cuda"
    model = torch.nn.Linear(8, 8).to(device)
    optimizer = torch.optim.AdamW(model.parameters())

    if profile:
        with torch.profiler.profile() as prof:
            for k in range(15):
                loss = model(torch.randn(4, 8, device=device)).square().mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                print(f"{k}: {loss.item():.4f}")
                prof.step()
""")


def _lines(value: str) -> list[int]:
    text = SCRIPT.replace("{value}", value)
    return [d.line for d in check_source(text, Settings(), "bench.py", codes=["TOP601"]).diagnostics]


def test_a_loop_under_a_switch_set_to_false_is_not_the_default_run() -> None:
    assert _lines("False") == []


def test_the_same_loop_under_a_switch_set_to_true_is_reported() -> None:
    assert _lines("True") == [15]
