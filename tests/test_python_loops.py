"""Python loops over a tensor's rows in custom losses and modules (TOP610): what the user sees from
`torchopt check` on a small project, and that neither check nor rewrite touches a file."""

from __future__ import annotations

import hashlib
from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

from torchopt.cli import app

LOSSES = dedent("""\
    import torch
    from torch import nn as N


    class PairLoss(N.Module):
        def forward(self, a, b):
            total = 0
            for i in range(a.size(0)):
                total = total + (a[i] - b[i]).pow(2).sum()
            return total


    def contrastive_loss(emb):
        return sum((emb[i] * emb[i]).sum(-1) for i in range(emb.shape[0]))


    class Trainer:
        def criterion(self, logits, target):
            total = 0.0
            for i in range(len(target)):
                if target[i] > 0:
                    total += logits[i].softmax(-1).max()
                w = target[i].item()
            return total / target.size(0)


    class RobustLoss(N.Module):
        def forward(self, pred, target):
            err = (pred - target).abs()
            if err.max() > 1.0:
                return (err ** 2).mean()
            return err.mean()
    """)

LIBRARY = dedent("""\
    from typing import List

    import torch
    import torch.nn as tnn


    class Backbone(tnn.Module):
        def forward(self, x, feats: List[torch.Tensor]):
            for blk in self.blocks:
                x = blk(x)
            outs = []
            for i in range(len(feats)):
                outs.append(self.lateral[i](feats[i]))
            heads = [self.heads[i](x) for i in range(x.size(0))]
            return outs, heads


    class FocalLoss(tnn.Module):
        def forward(self, logits, target, reduction: str = "mean", gamma=2.0):
            if reduction == "mean" and gamma > 0:
                return logits.mean()
            if target.dim() == 1 or target is None:
                target = target[:, None]
            return logits.sum()
    """)


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "lib").mkdir(parents=True)
    (root / "losses.py").write_text(LOSSES, encoding="utf-8")
    (root / "lib" / "backbone.py").write_text(LIBRARY, encoding="utf-8")
    return root


def _findings(output: str) -> list[tuple[str, int, str]]:
    out = []
    for line in output.splitlines():
        if " TOP610 " in line:
            path, row, _col, rest = line.split(":", 3)
            out.append((Path(path).name, int(row), rest.split(" TOP610 ", 1)[1]))
    return out


def test_row_loops_in_losses_and_modules_are_reported_with_the_batched_form(tmp_path: Path) -> None:
    root = _project(tmp_path)
    before = _hashes(tmp_path)
    res = CliRunner().invoke(app, ["check", str(root), "--select", "TOP610", "--no-cache"])
    assert res.exit_code == 1, res.output
    assert _hashes(tmp_path) == before
    found = _findings(res.output)
    assert [(f, line) for f, line, _ in found] == [
        ("losses.py", 8),
        ("losses.py", 14),
        ("losses.py", 20),
        ("losses.py", 21),
        ("losses.py", 23),
        ("losses.py", 30),
    ], res.output
    msg = {line: text for _, line, text in found}
    assert msg[8].startswith("`for i in range(a.size(0))` runs Python once per row of `a` in `PairLoss.forward`")
    assert msg[8].endswith("one batched reduction over dim 0: `total = total + (a - b).pow(2).sum()`")
    assert "in the loss function `contrastive_loss`" in msg[14]
    assert msg[14].endswith("`(emb * emb).sum(-1).sum(0)`")
    assert "`for i in range(len(target))`" in msg[20] and "`torch.vmap`" in msg[20]  # no mechanical form
    assert msg[21].startswith(
        "`target[i] > 0` branches on a tensor value once per row of `target` in the loss function `Trainer.criterion`"
    )
    assert msg[23].startswith("`target[i].item()` reads a tensor value once per row")
    assert msg[30].startswith("`err.max() > 1.0` branches on a tensor value in `RobustLoss.forward`")


def test_rewrite_changes_nothing(tmp_path: Path) -> None:
    """Display-only: even with unsafe fixes, no file is written."""
    root = _project(tmp_path)
    before = _hashes(tmp_path)
    res = CliRunner().invoke(app, ["rewrite", str(root), "--select", "TOP610", "--unsafe-fixes", "--no-cache"])
    assert res.exit_code == 0, res.output
    assert _hashes(tmp_path) == before


def test_a_loss_module_called_by_a_step_is_reported_once_per_line(tmp_path: Path) -> None:
    """In a module a training loop of the file calls, the step rule reports the branches; this rule
    adds only the row loop, so no line gets two findings."""
    script = dedent("""\
        import torch
        import torch.nn as nn


        class RobustLoss(nn.Module):
            def forward(self, pred, target):
                err = (pred - target).abs()
                if err.max() > 1.0:
                    return (err ** 2).mean()
                for i in range(err.size(0)):
                    if err[i] > 0:
                        err = err + err[i]
                return err.mean()


        def train(model, loader, opt):
            crit = RobustLoss()
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
        """)
    root = tmp_path / "proj"
    root.mkdir()
    (root / "train.py").write_text(script, encoding="utf-8")
    before = _hashes(tmp_path)
    res = CliRunner().invoke(app, ["check", str(root), "--select", "TOP605,TOP610", "--no-cache"])
    assert res.exit_code == 1, res.output
    assert _hashes(tmp_path) == before
    found = sorted(
        (int(ln.split(":")[1]), code)
        for ln in res.output.splitlines()
        for code in ("TOP605", "TOP610")
        if ln.startswith(str(root)) and f" {code} " in ln
    )
    assert found == [(8, "TOP605"), (10, "TOP610"), (11, "TOP605")], res.output
