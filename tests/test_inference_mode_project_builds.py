"""TOP802 does not turn `no_grad` into `inference_mode` around code that builds the model: parameters
made in inference mode are inference tensors. Construction through a class of another file of the
project (`trainer = Trainer(cfg)`, whose `__init__` builds the layers) and a checkpoint restored through
a method (`trainer.checkpointer.load(step=...)`) count, as a `nn.Linear(...)` in the block does."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

from torchopt.cli import app

TRAINER = dedent("""\
    import torch.nn as nn


    class Trainer:
        def __init__(self, width):
            self.model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))
""")

INFER = dedent("""\
    import torch

    from trainer import Trainer


    @torch.no_grad()
    def inference(width, model=None):
    {body}
        for _ in range(100):
            print(model(torch.randn(8, width)).argmax(-1))


    if __name__ == "__main__":
        inference(16{model})
""")


def _check(tmp_path: Path, body: str, model: str) -> str:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "pyproject.toml").write_text("[project]\nname = 'proj'\n", encoding="utf-8")
    (root / "trainer.py").write_text(TRAINER, encoding="utf-8")
    (root / "infer.py").write_text(INFER.replace("{body}", body).replace("{model}", model), encoding="utf-8")
    res = CliRunner().invoke(app, ["check", str(root / "infer.py"), "--select", "TOP802", "--no-cache"])
    return res.output


def test_no_finding_when_the_block_builds_the_model_through_a_project_class(tmp_path: Path) -> None:
    body = "    trainer = Trainer(width)\n    model = trainer.model"
    assert "TOP802" not in _check(tmp_path, body, "")


def test_no_finding_when_the_block_restores_a_checkpoint_through_a_method(tmp_path: Path) -> None:
    body = "    model.checkpointer.load(step=10)"
    assert "TOP802" not in _check(tmp_path, body, ", model=torch.nn.Linear(16, 2)")


def test_reported_when_the_block_only_runs_a_model_built_elsewhere(tmp_path: Path) -> None:
    assert "TOP802" in _check(tmp_path, "    pass", ", model=torch.nn.Linear(16, 2)")
