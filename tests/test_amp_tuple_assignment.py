"""A model moved in a tuple assignment (`model, data = Net().to(device), data.to(device)`) is a model
on that device: TOP202 rewrites its step instead of refusing because "no `.to(device)` is on it"."""

from __future__ import annotations

from textwrap import dedent

import torch

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

TOP2 = Settings(select=("TOP2",))

PROGRAM = dedent("""\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 2)

        def forward(self, x):
            return self.fc(x)


    torch.manual_seed(0)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        device = torch.device("cpu")
    tiny = False
    device = torch.device("cpu") if tiny else device
    data = torch.randn(16, 8)
    target = torch.randint(0, 2, (16,))
    model, data, target = Net().to(device), data.to(device), target.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)


    def train():
        model.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        return float(loss)


    losses = []
    for epoch in range(5):
        losses.append(train())
""")


def test_a_model_moved_in_a_tuple_assignment_gets_mixed_precision() -> None:
    [message] = [d.message for d in check_source(PROGRAM, TOP2, "t.py").diagnostics if d.code == "TOP202"]
    assert "cannot tell which device" not in message
    after = fix_source(PROGRAM, TOP2, unsafe=True).text
    assert after.count("with torch.autocast(") == 1
    assert "scaler.scale(loss).backward()" in after and "scaler.step(optimizer)" in after
    before_ns: dict = {}
    exec(compile(PROGRAM, "before.py", "exec"), before_ns)
    after_ns: dict = {}
    exec(compile(after, "after.py", "exec"), after_ns)
    # bfloat16 autocast on the CPU: the losses stay close, and they fall as the float32 run's do
    assert torch.allclose(torch.tensor(after_ns["losses"]), torch.tensor(before_ns["losses"]), atol=0.05)
