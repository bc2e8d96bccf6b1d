"""The inference rules ask the model lifecycle (torchopt/analysis/lifecycle.py): a fix never puts a
model's construction or weight loading under `no_grad`/`inference_mode` (under `inference_mode` the
parameters become inference tensors and a later `load_state_dict` raises), `model.eval()` set a few
lines above (in a chain, in a helper, in a factory) is not a missing `eval()`, and `eval()` on a part
of the model inside training (frozen BatchNorm) is not a misplaced one. Every rewritten program runs
on the CPU and prints what the original printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from layout_cases import check, rewrite


def _run(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    done = subprocess.run([sys.executable, str(path)], cwd=path.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _same_outputs(tmp_path: Path, before: str, after: str) -> None:
    assert after != before
    ran = tmp_path / "ran"
    ran.mkdir()
    assert _run(ran / "before.py", before) == _run(ran / "after.py", after)


BUILT_UNDER_NO_GRAD = """\
import torch
import torch.nn as nn

if __name__ == "__main__":
    torch.manual_seed(0)
    with torch.no_grad():
        model = nn.Linear(4, 2)
    model.load_state_dict({"weight": torch.ones(2, 4), "bias": torch.zeros(2)})
    model.eval()
    for i in range(3):  # evaluated more than once: a one-off block is not worth a finding
        with torch.no_grad():
            out = model(torch.full((1, 4), float(i)))
        print(out.tolist())
"""


# Under inference_mode the parameters would be inference tensors: the load_state_dict that follows,
# outside the block, would raise. Only the block that runs the model is converted.
BUILT_UNDER_NO_GRAD_AFTER = BUILT_UNDER_NO_GRAD.replace(
    "        with torch.no_grad():\n            out", "        with torch.inference_mode():\n            out"
)


def test_no_grad_around_construction_is_not_turned_into_inference_mode(tmp_path):
    res, text = rewrite(tmp_path, BUILT_UNDER_NO_GRAD, "--unsafe-fixes", "--select", "TOP802")
    assert res.exit_code == 0, res.output
    assert text == BUILT_UNDER_NO_GRAD_AFTER


MAIN_BUILDS_AND_LOADS = """\
import torch
import torch.nn as nn


def main():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model.load_state_dict({"weight": torch.ones(2, 4), "bias": torch.zeros(2)})
    model.eval()
    out = model(torch.ones(1, 4))
    print(out.tolist())


if __name__ == "__main__":
    main()
"""


MAIN_BUILDS_AND_LOADS_AFTER = MAIN_BUILDS_AND_LOADS.replace(
    "    out = model(torch.ones(1, 4))\n", "    with torch.no_grad():\n        out = model(torch.ones(1, 4))\n"
)


def test_an_inference_main_is_not_decorated_over_its_construction_and_loading(tmp_path):
    res, text = rewrite(tmp_path, MAIN_BUILDS_AND_LOADS, "--unsafe-fixes", "--select", "TOP801")
    assert res.exit_code == 0, res.output
    assert text == MAIN_BUILDS_AND_LOADS_AFTER


TWO_MODELS = """\
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Linear(4, 3)
model.load_state_dict({"weight": torch.ones(3, 4), "bias": torch.zeros(3)})
model.eval()
feats = model(torch.ones(1, 4))
head_model = nn.Linear(3, 2)
head_model.load_state_dict({"weight": torch.ones(2, 3), "bias": torch.zeros(2)})
head_model.eval()
out = head_model(feats)
print(out.tolist())
"""


TWO_MODELS_AFTER = TWO_MODELS.replace(
    "feats = model(torch.ones(1, 4))\n", "with torch.no_grad():\n    feats = model(torch.ones(1, 4))\n"
).replace("out = head_model(feats)\n", "with torch.no_grad():\n    out = head_model(feats)\n")


def test_a_script_block_stops_at_the_construction_of_the_next_model(tmp_path):
    res, text = rewrite(tmp_path, TWO_MODELS, "--unsafe-fixes", "--select", "TOP801")
    assert res.exit_code == 0, res.output
    assert text == TWO_MODELS_AFTER


TEST_FUNCTION = """\
import torch
import torch.nn as nn

test_loader = [(torch.ones(2, 4), torch.tensor([0, 1]))]


def test():
    model = nn.Linear(4, 2)
    model.load_state_dict({"weight": torch.eye(2, 4), "bias": torch.zeros(2)})
    model.eval()
    correct = 0
    for x, y in test_loader:
        correct += (model(x).argmax(1) == y).sum().item()
    return correct
"""


def test_an_evaluation_function_that_builds_its_model_wraps_its_loop(tmp_path):
    # `correct` holds only counts: the fix is safe, and applies without --unsafe-fixes
    res, text = rewrite(tmp_path, TEST_FUNCTION, "--select", "TOP801")
    assert res.exit_code == 0, res.output
    assert text == TEST_FUNCTION.replace(
        "    for x, y in test_loader:\n        correct += (model(x).argmax(1) == y).sum().item()\n",
        "    with torch.no_grad():\n"
        "        for x, y in test_loader:\n"
        "            correct += (model(x).argmax(1) == y).sum().item()\n",
    )


IMPORTED_BUILDER = """\
import models
import torch
from models import ModelRegistry, build_model

print(models.available_models())
registry = ModelRegistry({"small": 1})
model = build_model("small")
model.load_state_dict(torch.load("weights.pt"))
model.eval()
out = model(torch.ones(1, 4))
print(out.argmax(-1).tolist())
"""


def test_a_builder_imported_from_another_file_is_construction_not_a_model_call(tmp_path):
    # `build_model(...)`, `ModelRegistry(...)` and `models.available_models()` are named like models
    # but build or look up something: the block starts at the first call of the model itself.
    res, text = rewrite(tmp_path, IMPORTED_BUILDER, "--unsafe-fixes", "--select", "TOP801")
    assert res.exit_code == 0, res.output
    assert text == IMPORTED_BUILDER.replace(
        "out = model(torch.ones(1, 4))\n", "with torch.no_grad():\n    out = model(torch.ones(1, 4))\n"
    )


EVAL_SET_BEFORE = """\
import torch
import torch.nn as nn


def load_model(path):
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    net.eval()
    return net


model = load_model("w.pt")
other_model = nn.Sequential(nn.Linear(4, 2), nn.Dropout(0.5)).eval()
val_loader = [torch.ones(1, 4)]
with torch.no_grad():
    for x in val_loader:
        print(model(x).shape, other_model(x).shape)
"""


def test_eval_set_by_a_factory_or_a_chain_is_not_missing(tmp_path):
    res = check(tmp_path / "a", EVAL_SET_BEFORE, "--select", "TOP803")
    assert res.exit_code == 0, res.output
    assert "TOP803" not in res.output
    # a model never switched to eval is still reported
    src = EVAL_SET_BEFORE.replace("    net.eval()\n", "").replace(").eval()\n", ")\n")
    res = check(tmp_path / "b", src, "--select", "TOP803")
    assert res.exit_code == 1
    assert "TOP803" in res.output and "without `model.eval()`" in res.output


FROZEN_BN = """\
import torch
import torch.nn as nn


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.backbone(x))


def set_bn_eval(module):
    for m in module.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.eval()


def fit(model, opt, train_loader, epochs):
    for epoch in range(epochs):
        model.backbone.eval()
        set_bn_eval(model)
        for x, y in train_loader:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
"""


def test_freezing_batchnorm_inside_training_is_not_a_misplaced_eval(tmp_path):
    res = check(tmp_path / "a", FROZEN_BN, "--select", "TOP803")
    assert res.exit_code == 0, res.output
    assert "TOP803" not in res.output
    # switching the whole trained model to eval after the step is still reported: the next epoch
    # trains in eval mode
    res = check(tmp_path / "b", FROZEN_BN + "        model.eval()\n", "--select", "TOP803")
    assert res.exit_code == 1
    assert "switches the model to evaluation inside an epoch loop" in res.output


@pytest.mark.slow
@pytest.mark.parametrize(
    "src, code, after",
    [
        (BUILT_UNDER_NO_GRAD, "TOP802", BUILT_UNDER_NO_GRAD_AFTER),
        (MAIN_BUILDS_AND_LOADS, "TOP801", MAIN_BUILDS_AND_LOADS_AFTER),
        (TWO_MODELS, "TOP801", TWO_MODELS_AFTER),
    ],
    ids=["built-under-no-grad", "main-builds-and-loads", "two-models"],
)
def test_rewritten_programs_run_and_print_what_the_originals_print(tmp_path, src, code, after):
    res, text = rewrite(tmp_path, src, "--unsafe-fixes", "--select", code)
    assert res.exit_code == 0, res.output
    assert text == after
    _same_outputs(tmp_path, src, text)


LINEAR_PROBE = """\
import torch
import torch.nn as nn


def train(loader, model, opt):
    # linear classification on frozen features: BatchNorm statistics must not change
    model.eval()
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()


def main(model, opt, train_loader, val_loader, epochs):
    for epoch in range(epochs):
        train(train_loader, model, opt)
        model.eval()
        print(sum(model(x).sum().item() for x, y in val_loader))
"""


def test_a_training_routine_that_chooses_eval_mode_for_its_own_step_is_not_a_misplaced_eval(tmp_path):
    res = check(tmp_path, LINEAR_PROBE, "--select", "TOP803")
    assert res.exit_code == 0, res.output
    assert "TOP803" not in res.output
