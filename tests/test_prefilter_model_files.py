"""Library model files (layers, loss helpers, `from_pretrained`) are not parsed for the row-loop
and no-grad rules: their text tests look for the loops and scripts those rules report, so a
package of model definitions costs a CPython parse per file, not a LibCST analysis."""

from __future__ import annotations

from textwrap import dedent

import pytest

from torchopt.codemods.inference.eval_without_no_grad import EvalWithoutNoGrad
from torchopt.codemods.sync.python_loop_over_tensor import PythonLoopOverTensor
from torchopt.rewrite import engine
from torchopt.rewrite.config import Settings

MODEL_FILE = dedent("""\
    import torch
    from torch import nn


    class EncoderLayer(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.proj = nn.Linear(dim, dim)

        def forward(self, hidden_states, attention_mask=None):
            if attention_mask is not None:
                hidden_states = hidden_states * attention_mask
            return self.proj(hidden_states)


    class Encoder(nn.Module):
        def __init__(self, dim, layers):
            super().__init__()
            self.layers = nn.ModuleList(EncoderLayer(dim) for _ in range(layers))

        def forward(self, hidden_states, output_hidden_states=False):
            all_hidden_states = []
            for layer in self.layers:
                hidden_states = layer(hidden_states)
                all_hidden_states.append(hidden_states)
            for i in range(len(all_hidden_states)):
                print(i)
            return hidden_states, all_hidden_states


    class PreTrained(nn.Module):
        @classmethod
        def from_pretrained(cls, path, eval_mode=True):
            model = cls(8, 2)
            model.load_state_dict(torch.load(path))
            return model


    def compute_loss(logits, labels):
        return nn.functional.cross_entropy(logits, labels)
    """)


def test_model_definitions_are_not_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not PythonLoopOverTensor.could_match(MODEL_FILE)
    assert not EvalWithoutNoGrad.could_match(MODEL_FILE)

    def parse(text: str) -> None:
        raise AssertionError("a file no rule can report on was parsed by LibCST")

    monkeypatch.setattr(engine, "parse", parse)
    assert engine.check_source(MODEL_FILE, Settings(), "modeling.py").diagnostics == []


# Texts the sharper tests must still let through, with what the rule reports on each.
REPORTED = [
    (
        "TOP610",
        dedent("""\
        import torch


        def pair_loss(a, b):
            n = a.size(1)
            total = 0
            for i in range(len(a)):
                total = total + (a[i] - b[i]).pow(2).sum()
            return total / n
        """),
    ),
    (
        "TOP610",
        dedent("""\
        import torch


        def margin_loss(emb: torch.Tensor):
            return sum((emb[i] * emb[i]).sum(-1) for i in range(emb.shape[0]))
        """),
    ),
    (
        "TOP801",
        dedent("""\
        import torch

        model = torch.nn.Linear(4, 2)

        if __name__ == "__main__":
            model.load_state_dict(torch.load("w.pt"))
            model.eval()
            out = model(torch.load("inputs.pt"))
            torch.save(out, "out.pt")
        """),
    ),
]


@pytest.mark.parametrize("code,text", REPORTED)
def test_reported_files_still_pass(code: str, text: str) -> None:
    rule = engine.all_rules()[code]
    assert rule.could_match(text)
    found = engine.check_source(text, Settings(), "x.py", codes=[code]).diagnostics
    assert [d.code for d in found] and {d.code for d in found} == {code}
