"""Inference rules on real layouts: evaluation in a trainer's method, a plain inference script,
model calls already under `no_grad` inside the loop, and training scripts whose training routine
lives in another file."""

from __future__ import annotations

from layout_cases import check, rewrite

TRAINER = """\
import torch


class Trainer:
    def __init__(self, model, val_data):
        self.model = model
        self.val_data = val_data

    def evaluate(self):
        correct = 0
        for x, y in self.val_data:
            correct += (self.model(x).argmax(1) == y).sum().item()
        return correct
"""


def test_trainer_evaluate_method_gets_no_grad(tmp_path):
    res, text = rewrite(tmp_path, TRAINER, "--select", "TOP801")
    assert res.exit_code == 0
    assert text == TRAINER.replace("    def evaluate(self):\n", "    @torch.no_grad()\n    def evaluate(self):\n")


SCRIPT = """\
import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
model.load_state_dict(torch.load("weights.pt"))
model.eval()
logits = model(torch.load("inputs.pt"))
torch.save(logits.argmax(-1), "labels.pt")
"""


def test_plain_inference_script_gets_no_grad(tmp_path):
    res, text = rewrite(tmp_path, SCRIPT, "--unsafe-fixes", "--select", "TOP801")
    assert res.exit_code == 0
    assert text == SCRIPT.replace(
        'logits = model(torch.load("inputs.pt"))\n',
        'with torch.no_grad():\n    logits = model(torch.load("inputs.pt"))\n',
    )


def test_model_call_already_under_no_grad_in_the_loop_is_left_alone(tmp_path):
    src = (
        "import torch\n\n\ndef training_function(model, eval_dataloader, metric):\n    model.eval()\n"
        "    for step, batch in enumerate(eval_dataloader):\n        with torch.no_grad():\n"
        "            outputs = model(**batch)\n        metric.add_batch(predictions=outputs.logits.argmax(-1))\n"
    )
    res, text = rewrite(tmp_path, src, "--unsafe-fixes", "--select", "TOP801")
    assert res.exit_code == 0 and text == src


def test_script_calling_a_training_routine_is_not_inference_only(tmp_path):
    src = (
        "import torch\nfrom engine import evaluate, train_one_epoch\n\n\ndef main(model, loaders, optimizer):\n"
        "    for epoch in range(10):\n        train_one_epoch(model, loaders[0], optimizer)\n"
        "        with torch.no_grad():\n            stats = evaluate(model, loaders[1])\n\n\n"
        'if __name__ == "__main__":\n    main(*build())\n'
    )
    res, text = rewrite(tmp_path, src, "--unsafe-fixes", "--select", "TOP802")
    assert res.exit_code == 0 and text == src
    res = check(tmp_path / "c", src, "--select", "TOP802")
    assert res.exit_code == 0 and "inference-only" not in res.stdout
