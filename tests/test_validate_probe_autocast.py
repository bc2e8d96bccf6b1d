"""The probe batch of a model whose input was computed under autocast (an RNN's carried hidden
state) is replayed under that autocast region, so a correct AMP rewrite keeps its outputs probed.

Replayed outside it, the rewritten run's LSTM got a bfloat16 hidden state with float32 weights and
refused it; its outputs went missing and the validator called the correct rewrite DIVERGED.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from cpu_support import skip_unless_bfloat16_lstm

import pytest

LM = """\
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.rnn = nn.LSTM(8, 8)
        self.out = nn.Linear(8, 20)

    def forward(self, x, hidden):
        y, hidden = self.rnn(self.emb(x), hidden)
        return self.out(y), hidden


model = LM().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
tokens = torch.randint(0, 20, (6, 9, 2))
hidden = (torch.zeros(1, 2, 8, device=device), torch.zeros(1, 2, 8, device=device))
for batch in tokens:
    x, y = batch[:-1].to(device), batch[1:].to(device)
    hidden = tuple(h.detach() for h in hidden)
    optimizer.zero_grad()
    logits, hidden = model(x, hidden)
    loss = F.cross_entropy(logits.reshape(-1, 20), y.reshape(-1))
    loss.backward()
    optimizer.step()
"""


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_amp_rnn_with_carried_hidden_state_keeps_its_outputs(tmp_path: Path) -> None:
    skip_unless_bfloat16_lstm(LM)
    prog = tmp_path / "prog"
    prog.mkdir()
    (prog / "lm.py").write_text(LM)
    before = _tree(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchopt",
            "validate",
            str(prog / "lm.py"),
            "--unsafe-fixes",
            "--select",
            "TOP202",
            "--steps",
            "3",
            "--device",
            "cpu",
            "--json",
            "--jobs",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    out = json.loads(proc.stdout)
    assert [f["code"] for f in out["applied"]] == ["TOP202"]
    assert proc.returncode == 0, (out["headline"], out["first_divergence"], out["notes"])
    assert out["headline"].startswith("EQUIVALENT")
    outputs = {r["name"]: r for r in out["rows"] if r["name"].startswith("output/model")}
    assert set(outputs) == {"output/model[0]", "output/model[1][0]", "output/model[1][1]"}
    assert all(r["verdict"] == "ok" and "bfloat16" in r["detail"] for r in outputs.values())
    assert not any("probe batch" in n for n in out["notes"])
    assert _tree(tmp_path) == before
