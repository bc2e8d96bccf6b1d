"""TOP101/TOP102 on tensors a training program makes once, when it starts (a rollout buffer before the
loop), and on `*_like` factories that follow a tensor already moved to the same device: no finding,
since nothing is copied per step (or at all); the same code inside the loop is still reported."""

from __future__ import annotations

from textwrap import dedent

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source

PROGRAM = dedent("""\
    import torch

    if __name__ == "__main__":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        policy = torch.nn.Linear(64, 4).to(device)
        opt = torch.optim.Adam(policy.parameters())
    {start}
        for update in range(1000):
    {step}
            loss = policy(obs).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
""")


def _codes(start: str, step: str, select: str = "TOP101") -> list[str]:
    text = PROGRAM.replace("{start}", start).replace("{step}", step)
    return [d.code for d in check_source(text, Settings(), "rl.py", codes=[select]).diagnostics]


def test_a_buffer_made_before_the_loop_is_not_reported_one_made_every_step_is() -> None:
    buffer = "    obs = torch.zeros((256, 64)).to(device)"
    assert _codes(buffer, "") == []
    assert _codes("", "    " + buffer) == ["TOP101"]


def test_a_cast_made_once_at_start_is_not_reported() -> None:
    start = "    obs = torch.randn(256, 64, device=device).double()"
    assert _codes(start, "", "TOP102") == []
    assert _codes("", "    " + start, "TOP102") == ["TOP102"]


def test_a_like_factory_of_a_tensor_moved_to_the_same_device_builds_nothing_on_the_host() -> None:
    start = "    rewards = torch.zeros((256, 64)).to(device)\n    obs = torch.zeros((256, 64), device=device)"
    assert _codes(start, "        advantages = torch.zeros_like(rewards).to(device)") == []
    host = "    rewards = torch.zeros((256, 64))\n    obs = torch.zeros((256, 64), device=device)"
    assert _codes(host, "        advantages = torch.zeros_like(rewards).to(device)") == ["TOP101"]
