"""TOP301 pads a model's vocabulary and slices the logits back where the class calls its head; a call
of the head outside the class (`model.ff(out)` in a greedy decoder, in the same file or in another file
of the project) would see the padded columns, unsliced: the finding then comes without a fix."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

from torchopt.cli import app

MODEL = dedent("""\
    import torch.nn as nn


    class Translator(nn.Module):
        def __init__(self, vocab_size, d_model):
            super().__init__()
            self.emb = nn.Embedding(vocab_size, d_model)
            self.ff = nn.Linear(d_model, vocab_size)

        def forward(self, idx):
            return self.ff(self.emb(idx))
""")

DECODE = dedent("""\
    import torch

    from model import Translator


    def greedy_decode(model, idx):
        out = model.emb(idx)
        return model.ff(out).argmax(-1)


    if __name__ == "__main__":
        model = Translator(10001, 64)
        print(greedy_decode(model, torch.zeros(1, 5, dtype=torch.long)))
""")


def _rewrite_diff(root: Path) -> str:
    res = CliRunner().invoke(
        app, ["rewrite", str(root), "--select", "TOP301", "--unsafe-fixes", "--diff", "--no-cache"]
    )
    return res.output


def _project(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "pyproject.toml").write_text("[project]\nname = 'proj'\n", encoding="utf-8")
    for name, text in files.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


def test_the_padding_is_offered_when_only_the_class_calls_its_head(tmp_path: Path) -> None:
    root = _project(tmp_path, {"model.py": MODEL, "main.py": DECODE.replace("model.ff(out)", "model(idx)")})
    assert "+        self.ff = nn.Linear(d_model, " in _rewrite_diff(root)


def test_no_fix_when_another_file_of_the_project_calls_the_head(tmp_path: Path) -> None:
    root = _project(tmp_path, {"model.py": MODEL, "main.py": DECODE})
    out = CliRunner().invoke(app, ["check", str(root), "--select", "TOP301", "--no-cache"]).output
    assert "`.ff` is used in main.py, where the logits would not be sliced" in out
    assert "+        self.ff" not in _rewrite_diff(root)


def test_no_fix_when_the_same_file_calls_the_head_outside_the_class(tmp_path: Path) -> None:
    one = MODEL + "\n\n" + DECODE.replace("from model import Translator\n", "")
    root = _project(tmp_path, {"model.py": one})
    out = CliRunner().invoke(app, ["check", str(root), "--select", "TOP301", "--no-cache"]).output
    assert "`model.ff` is used outside the class" in out
    assert "+        self.ff" not in _rewrite_diff(root)
