"""TOP701 adds workers to a loader built in a helper module only when every script of the project that
imports the helper and builds the loader has a main guard: a script that runs at import time would be
run again by every worker a `spawn`/`forkserver` start method starts."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

from torchopt.cli import app

UTILS = dedent("""\
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    def get_data(batch_size=128):
        train_set = TensorDataset(torch.randn(512, 3), torch.arange(512))
        return DataLoader(train_set, batch_size=batch_size, shuffle=True)
""")

TRAIN = dedent("""\
    import torch

    from utils import *

    model = torch.nn.Linear(3, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = get_data()
    for epoch in range(10):
        for x, y in train_loader:
            loss = model(x.cuda()).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
""")


def _project(tmp_path: Path, train: str) -> Path:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "pyproject.toml").write_text("[project]\nname = 'proj'\n", encoding="utf-8")
    (root / "utils.py").write_text(UTILS, encoding="utf-8")
    (root / "train.py").write_text(train, encoding="utf-8")
    return root


def _run(root: Path, *args: str) -> str:
    return CliRunner().invoke(app, [*args, str(root / "utils.py"), "--select", "TOP701", "--no-cache"]).output


def test_no_workers_added_when_the_importing_script_runs_at_import_time(tmp_path: Path) -> None:
    root = _project(tmp_path, TRAIN)
    assert "`train.py` imports this module and runs at import time" in _run(root, "check")
    assert "num_workers" not in _run(root, "rewrite", "--diff", "--unsafe-fixes")


def test_workers_added_when_the_importing_script_has_a_main_guard(tmp_path: Path) -> None:
    body = "".join(
        "    " + line if line.strip() else line for line in TRAIN.split("from utils import *\n")[1].splitlines(True)
    )
    guarded = 'import torch\n\nfrom utils import *\n\nif __name__ == "__main__":\n' + body
    root = _project(tmp_path, guarded)
    assert "num_workers" in _run(root, "rewrite", "--diff", "--unsafe-fixes")
