"""Copies marked non_blocking that cannot overlap or are read too early (TOP106), and loader batch
copies found through a function parameter or a trainer's attribute (TOP104), from the command line."""

from __future__ import annotations

import hashlib
from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

import torchopt.cli

PAGEABLE = dedent("""\
    import torch

    def predict(model, features, device):
        x = torch.from_numpy(features)
        x = x.float()
        return model(x.to(device, non_blocking=True))
    """)
EARLY_READ = dedent("""\
    import torch

    class Evaluator:
        def scores(self, x):
            out = self.model(x).to("cpu", non_blocking=True)
            return out.tolist()
    """)
WAITS = dedent("""\
    import torch

    def fetch(t):
        y = t.to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        return y.numpy()
    """)
LAYOUT_B = dedent("""\
    import torch
    from torch.utils.data import DataLoader

    def train(model, device, train_loader):
        for i, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)

    def main(ds, model):
        loader = DataLoader(ds, batch_size=8, pin_memory=True)
        train(model, torch.device("cuda"), loader)
    """)
LAYOUT_C = dedent("""\
    from torch.utils.data import DataLoader


    class Trainer:
        def __init__(self, train_data, gpu_id: int):
            self.gpu_id = gpu_id
            self.train_data = train_data

        def run_epoch(self):
            for source, targets in self.train_data:
                source = source.to(self.gpu_id)


    def prepare(ds):
        return DataLoader(ds, batch_size=32, pin_memory=True)


    Trainer(prepare(ds), 0).run_epoch()
    """)


def _tree_hash(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name, text in files.items():
        (src / name).write_text(text)
    (tmp_path / "outside.py").write_text(PAGEABLE)
    return src


def _run(*args: str):
    return CliRunner().invoke(torchopt.cli.app, [*args, "--no-cache"], catch_exceptions=False)


def test_check_reports_pageable_source_and_early_host_read_and_writes_nothing(tmp_path):
    src = _tree(tmp_path, {"pageable.py": PAGEABLE, "early.py": EARLY_READ, "waits.py": WAITS})
    before = _tree_hash(tmp_path)
    r = _run("check", str(src), "--select", "TOP106")
    assert r.exit_code == 1, r.output
    lines = [line for line in r.output.splitlines() if "TOP106" in line and ".py:" in line]
    assert len(lines) == 2, r.output
    assert any(
        "pageable.py:6:" in line and "`x` is in pageable host memory (made by `torch.from_numpy`)" in line
        for line in lines
    ), r.output
    assert any(
        "early.py:5:" in line and "`out` is read on line 6 before anything waits for it" in line for line in lines
    ), r.output
    assert "waits.py" not in r.output
    assert _tree_hash(tmp_path) == before


def test_rewrite_makes_an_early_read_host_copy_synchronous_only(tmp_path):
    src = _tree(tmp_path, {"pageable.py": PAGEABLE, "early.py": EARLY_READ, "waits.py": WAITS})
    before = _tree_hash(tmp_path)
    r = _run("rewrite", str(src), "--select", "TOP106")
    assert r.exit_code == 0, r.output
    assert (src / "early.py").read_text() == EARLY_READ.replace('.to("cpu", non_blocking=True)', '.to("cpu")')
    after = _tree_hash(tmp_path)
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"src/early.py"} and set(after) == set(before)


def test_rewrite_adds_non_blocking_to_loader_batches_in_a_function_and_a_trainer_method(tmp_path):
    mixed = LAYOUT_B + "\ntrain(None, 'cuda', prefetcher)\n"  # one call passes something else
    src = _tree(tmp_path, {"layout_b.py": LAYOUT_B, "layout_c.py": LAYOUT_C, "mixed.py": mixed})
    before = _tree_hash(tmp_path)
    r = _run("rewrite", str(src), "--select", "TOP104")
    assert r.exit_code == 0, r.output
    assert (src / "layout_b.py").read_text() == LAYOUT_B.replace(  # past 88 columns: laid out as ruff format does
        "data, target = data.to(device), target.to(device)",
        "data, target = (\n            data.to(device, non_blocking=True),\n"
        "            target.to(device, non_blocking=True),\n        )",
    )
    assert (src / "layout_c.py").read_text() == LAYOUT_C.replace(
        "source.to(self.gpu_id)", "source.to(self.gpu_id, non_blocking=True)"
    )
    after = _tree_hash(tmp_path)
    assert {k for k in before if before[k] != after[k]} == {"src/layout_b.py", "src/layout_c.py"}
