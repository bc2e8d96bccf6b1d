"""TOP202 on more layouts of single-GPU float32 training steps: a forward computed in the branches of
an `if`/`else`, and the reasons given on steps it leaves alone."""

from __future__ import annotations

import os
import subprocess
import sys
from textwrap import dedent

import pytest

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

TOP202 = Settings(select=("TOP202",))


def _fix(src: str) -> str:
    return fix_source(src, TOP202, unsafe=True).text


def _top202(src: str) -> list:
    return [d for d in check_source(src, TOP202, "t.py").diagnostics if d.code == "TOP202"]


def _run(src: str, tmp_path, name: str) -> list[float]:
    path = tmp_path / f"{name}.py"
    path.write_text(src)
    r = subprocess.run(
        [sys.executable, str(path)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return [float(x) for line in r.stdout.splitlines() for x in line.split() if x[0].isdigit() or x[0] == "-"]


# ----------------------------------------------------------------------------- forward in an if/else

_BRANCHES = dedent("""\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(6, 8), torch.randint(0, 4, (6,))) for _ in range(3)]
    wide = True


    def train(epoch):
        total = 0.0
        for x, y in batches:
            optimizer.zero_grad()
            if wide:
                if epoch == 1:
                    print("switching")
                out = model(x.to(device))[:4]
            else:
                out = model(x.to(device))
            target = y[: out.shape[0]].to(device).to(torch.long)
            loss = F.cross_entropy(out, target)
            loss.backward()
            optimizer.step()
            total += float(loss)
            seen = torch.bincount(target, minlength=4)
        return total + float(seen.sum())


    for epoch in range(2):
        print(train(epoch))
    """)


def test_forward_in_both_branches_of_an_if_is_the_forward_region():
    after = _fix(_BRANCHES)
    assert (
        "        with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):\n"
        "            if wide:\n"
        "                if epoch == 1:\n"
        '                    print("switching")\n'
    ) in after
    assert "            loss = F.cross_entropy(" in after
    # The labels, read after the block, are cast to an integer dtype: no `.float()` for them.
    assert "target = target.float()" not in after
    assert "        scaler.scale(loss).backward()\n        scaler.step(optimizer)\n        scaler.update()\n" in after
    assert _fix(after) == after


def test_a_branch_printing_a_computed_value_stays_refused():
    src = _BRANCHES.replace('print("switching")', "print(x.sum())")
    [d] = _top202(src)
    assert d.fix is None and "cannot run under autocast" in d.message


@pytest.mark.slow  # runs both programs: seconds each on a loaded 2-CPU box
def test_forward_in_branches_trains_the_same_within_bfloat16(tmp_path):
    before = _run(_BRANCHES, tmp_path, "before")
    after = _run(_fix(_BRANCHES), tmp_path, "after")
    assert len(before) == len(after) == 2
    assert after == pytest.approx(before, rel=0.05)


# ----------------------------------------------------------------------------- a step in another module

_IMPORTED = dedent("""\
    import torch
    import engine
    from models import Net

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = Net().to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    for epoch in range(3):
        last = engine.train_one_epoch(model, loader, optimizer, device)
    """)


def test_assigned_result_of_an_imported_step_says_why_the_scaler_cannot_cross_files():
    [d] = _top202(_IMPORTED)
    assert d.fix is None and d.line == 9
    assert "the step (`engine.train_one_epoch`) is defined in `engine.py`" in d.message
    assert "GradScaler created here next to `optimizer` and passed to `engine.train_one_epoch`" in d.message
    assert "a fix edits only the file it was found in" in d.message


def test_imported_step_with_bfloat16_says_what_the_other_file_cannot_see():
    settings = Settings(select=("TOP202",), rule_options={"TOP202": {"dtype": "bfloat16"}})
    [d] = [x for x in check_source(_IMPORTED, settings, "t.py").diagnostics if x.code == "TOP202"]
    assert "autocast alone (bfloat16) would go there" in d.message and "GradScaler" not in d.message


# ----------------------------------------------------------------------------- an optimizer wrapper of another module

_TRAINER = dedent("""\
    import torch
    from {module} import Clipped


    class Trainer:
        def __init__(self, model):
            self.model = model
            self.optimizer = Clipped(torch.optim.Adam(model.parameters()), 5.0)

        def train_batch(self, x, y):
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
    """)

_WRAPPER = dedent("""\
    import torch


    class Clipped:
        def __init__(self, optimizer, max_norm):
            self.optimizer = optimizer
            self.max_norm = max_norm

        def step(self):
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.max_norm)
            self.optimizer.step()
    """)


def _project_check(tmp_path, module: str):
    from typer.testing import CliRunner

    import torchopt.cli

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "pyproject.toml").write_text('[project]\nname = "p"\nversion = "0"\n')
    (proj / "trainer.py").write_text(_TRAINER.format(module=module))
    (proj / "wrappers.py").write_text(_WRAPPER)
    r = CliRunner().invoke(
        torchopt.cli.app, ["check", str(proj), "--no-cache", "-j", "1", "--select", "TOP202"], catch_exceptions=False
    )
    return [ln for ln in r.stdout.splitlines() if "TOP202" in ln and ".py:" in ln]


def test_optimizer_wrapped_by_a_class_of_another_module_is_reported_with_the_reason(tmp_path):
    [line] = _project_check(tmp_path, "wrappers")
    assert "trainer.py:12:9: TOP202 training step not rewritten" in line
    assert "`Clipped` is a class of another file of the project (wrappers.py)" in line


def test_optimizer_wrapped_by_a_library_class_is_not_reported(tmp_path):
    assert _project_check(tmp_path, "somelib.optim") == []


# ----------------------------------------------------------------------------- a model class of another module

_MODELS = dedent("""\
    import torch.nn as nn


    class Critic(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
            self.out = nn.Linear(8, 1)

        def forward(self, x):
            fmaps = []
            for block in self.blocks:
                x = block(x).relu()
                fmaps.append(x)
            return self.out(x), fmaps


    class Scorer(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.out = nn.Linear(8, 1)

        def forward(self, x):
            h = self.body(x).relu()
            return self.out(h), h
    """)

_UNPACKING = dedent("""\
    import torch
    import torch.nn.functional as F

    from models import {cls}

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = {cls}().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(6, 8), torch.randn(6, 1)) for _ in range(3)]
    for x, y in batches:
        optimizer.zero_grad()
        scores, feats = model(x.to(device))
        loss = F.mse_loss(scores, y.to(device))
        loss.backward()
        optimizer.step()
        print(float(loss), float({read}.mean()))
    """)


def _models_project(tmp_path, cls: str, read: str, rewrite: bool = False):
    from typer.testing import CliRunner

    import torchopt.cli

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "pyproject.toml").write_text('[project]\nname = "p"\nversion = "0"\n')
    (proj / "models.py").write_text(_MODELS)
    (proj / "train.py").write_text(_UNPACKING.format(cls=cls, read=read))
    cmd = ["rewrite", "--unsafe-fixes"] if rewrite else ["check"]
    r = CliRunner().invoke(
        torchopt.cli.app, [*cmd, str(proj), "--no-cache", "-j", "1", "--select", "TOP202"], catch_exceptions=False
    )
    return proj, [ln for ln in r.stdout.splitlines() if "TOP202" in ln and ".py:" in ln]


def test_unpacked_list_of_a_model_class_of_another_module_names_its_forward(tmp_path):
    _, [line] = _models_project(tmp_path, "Critic", "feats[-1]")
    assert "`Critic.forward` (in models.py) returns a container there (a list of tensors), not a tensor" in line


def test_unpacked_tensor_of_a_model_class_of_another_module_is_upcast(tmp_path):
    proj, _ = _models_project(tmp_path, "Scorer", "feats", rewrite=True)
    after = (proj / "train.py").read_text()
    assert "    feats = feats.float()\n" in after and "scaler.scale(loss).backward()" in after


@pytest.mark.slow  # runs both programs: seconds each on a loaded 2-CPU box
def test_unpacked_tensor_of_another_module_trains_the_same_within_bfloat16(tmp_path):
    before_dir = tmp_path / "b"
    before_dir.mkdir()
    (before_dir / "models.py").write_text(_MODELS)
    (before_dir / "train.py").write_text(_UNPACKING.format(cls="Scorer", read="feats"))
    proj, _ = _models_project(tmp_path, "Scorer", "feats", rewrite=True)
    out = {}
    for name, folder in (("before", before_dir), ("after", proj)):
        r = subprocess.run(
            [sys.executable, "train.py"],
            cwd=folder,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        out[name] = [float(x) for line in r.stdout.splitlines() for x in line.split()]
    assert len(out["after"]) == len(out["before"]) == 6
    assert out["after"] == pytest.approx(out["before"], rel=0.05, abs=0.02)
