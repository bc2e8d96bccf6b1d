"""Which loops are step loops: an optimizer step run directly in a loop makes it a training step
loop even when the backward passes run in a nested loop (sub-divided batches, gradient
accumulation); an epoch loop whose optimizer steps run in a nested loop is not one."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

from torchopt.cli import app

SUBDIVIDED = dedent("""\
    import torch


    def train(model, optimizer, loss_func, train_loader, chunks):
        model.train()
        for data, targets in train_loader:
            data = data.cuda(non_blocking=True)
            targets = targets.cuda(non_blocking=True)
            optimizer.zero_grad()
            losses = []
            for d, t in zip(data.chunk(chunks), targets.chunk(chunks)):
                loss = loss_func(model(d), t)
                losses.append(loss.detach())
                loss.backward()
            optimizer.step()
            total = torch.stack(losses).sum()
            print(total.item())
            torch.cuda.synchronize()
""")

ACCUMULATED = dedent("""\
    import torch


    def fit(net, g_optim, scaler, batches, steps, accum):
        for step in range(steps):
            for _ in range(accum):
                x = next(batches).cuda(non_blocking=True)
                with torch.autocast("cuda"):
                    loss = net(x).mean()
                scaler.scale(loss).backward()
            scaler.step(g_optim)
            scaler.update()
            g_optim.zero_grad()
            print(loss.item())
""")

EPOCHS = dedent("""\
    import torch


    def fit(net, optimizer, loader, epochs):
        for epoch in range(epochs):
            for x in loader:
                x = x.cuda(non_blocking=True)
                loss = net(x).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(loss.item())
            torch.cuda.synchronize()
""")


def _found(tmp_path: Path, text: str) -> list[tuple[int, str]]:
    f = tmp_path / "train.py"
    f.write_text(text)
    res = CliRunner().invoke(app, ["check", str(f), "--select", "TOP601,TOP606", "--no-cache", "--exit-zero"])
    assert res.exit_code == 0, res.output
    out = []
    for ln in res.output.splitlines():
        parts = ln.split(":")
        if len(parts) > 3 and parts[0].endswith("train.py"):
            out.append((int(parts[1]), parts[3].split()[0]))
    return sorted(out)


def test_an_optimizer_step_makes_the_loop_around_subdivided_batches_a_training_step(tmp_path: Path) -> None:
    found = _found(tmp_path, SUBDIVIDED)
    assert found == [(17, "TOP601"), (18, "TOP606")]


def test_a_scaler_step_of_an_optimizer_makes_an_accumulation_loop_a_training_step(tmp_path: Path) -> None:
    assert _found(tmp_path, ACCUMULATED) == [(14, "TOP601")]


def test_an_epoch_loop_whose_steps_run_in_a_nested_loop_is_not_a_step_loop(tmp_path: Path) -> None:
    assert _found(tmp_path, EPOCHS) == []
