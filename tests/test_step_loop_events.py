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


ENGINE = dedent("""\
    import torch


    def make_step(model, optimizer, loss_fn):
        def step(x, y):
            optimizer.zero_grad()
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                loss = loss_fn(model(xs), ys)
                loss.backward()
            optimizer.step()
            return {"loss": float(loss.item())}

        return step


    def fit(model, optimizer, loader):
        for x, y in loader:
            loss = model(x).mean()
            loss.backward()
            optimizer.step()
        return loss.item()
""")

MAIN = dedent("""\
    from engine import make_step


    def main(model, optimizer, loss_fn, loader):
        step = make_step(model, optimizer, loss_fn)
        for x, y in loader:
            print(step(x.cuda(non_blocking=True), y.cuda(non_blocking=True)))
""")


def test_a_function_that_runs_an_optimizer_step_is_a_step_wherever_it_is_called_from(tmp_path: Path) -> None:
    """The step closure is called once per batch from another module: its read costs every step.
    `fit` runs its optimizer steps in its own loop: the read after that loop runs once per call."""
    (tmp_path / "engine.py").write_text(ENGINE)
    (tmp_path / "main.py").write_text(MAIN)
    res = CliRunner().invoke(app, ["check", str(tmp_path), "--select", "TOP601", "--no-cache", "--exit-zero"])
    found = [ln.split(": ")[0] for ln in res.output.splitlines() if "TOP601" in ln and ".py:" in ln]
    assert [f.rsplit("/", 1)[-1] for f in found] == ["engine.py:11:31"], res.output
    assert "in the training step `step` (each call runs an optimizer step)" in res.output


WRAPPER = dedent("""\
    import torch


    class Trainer:
        def __init__(self, net, optimizer):
            self.net = net
            self.optimizer = optimizer

        def optimize(self, x):
            loss = self.net(x).mean()
            loss.backward()
            self.optimizer.step()
            self.acc = (loss > 0).cpu().numpy()
""")


def test_a_method_that_runs_an_optimizer_step_is_not_a_step_unless_a_step_loop_calls_it(tmp_path: Path) -> None:
    """Whether another module ever calls the method is not known: its reads are not claimed per step."""
    assert _found(tmp_path, WRAPPER) == []
