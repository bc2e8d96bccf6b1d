"""The cheap prefilters of the SYNC (TOP601-TOP609), MEM (TOP711), INF (TOP803) and ZG (TOP832)
rules: texts the rules report on must pass (alias and import forms, the tricky cases), library-style
model code must be rejected. Soundness over every example and fixture is tests/test_prefilter_sound.py."""

from __future__ import annotations

import pytest

from torchopt.codemods.inference.eval_code import epoch_loop_possible
from torchopt.analysis.precheck.step_loops import UNPARSED, ast_hot
from torchopt.rewrite.audit import unfiltered_codes
from torchopt.rewrite.registry import all_rules

RULES = all_rules()


def passes(code: str, text: str) -> bool:
    return RULES[code].could_match(text)


def reports(code: str, text: str) -> bool:
    return code in unfiltered_codes(text, [RULES[code]])


# A transformers-style modeling file: loops over layers call modules (so HotMap finds "evaluation"
# step loops), but nothing in them syncs.
LIBRARY = """
import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.act = nn.GELU()

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        if attention_mask is not None:
            hidden_states = hidden_states + attention_mask
        out = self.act(self.proj(hidden_states))
        if output_attentions:
            return out, None
        return out


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([Layer(config) for _ in range(config.n)])
        self.norm = nn.LayerNorm(config.hidden)
        self.gradient_checkpointing = False

    def forward(self, hidden_states, output_hidden_states=False, use_cache=True):
        all_hidden = () if output_hidden_states else None
        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden = all_hidden + (hidden_states,)
            if self.gradient_checkpointing and self.training:
                hidden_states = self.norm(hidden_states)
            hidden_states = layer(hidden_states)
            hidden_states = self.norm(hidden_states.to(hidden_states.device))
        return hidden_states, all_hidden
"""

TRAIN = """
import torch
import torch.nn.functional as F


def train(model, loader, opt, device):
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
{extra}
"""


def train(extra: str) -> str:
    return TRAIN.format(extra="\n".join("        " + line for line in extra.splitlines()))


@pytest.mark.parametrize(
    "code", ["TOP601", "TOP602", "TOP603", "TOP604", "TOP605", "TOP606", "TOP607", "TOP608", "TOP609", "TOP711"]
)
def test_library_model_code_is_rejected(code):
    assert not passes(code, LIBRARY)
    assert not reports(code, LIBRARY)


def test_library_code_has_a_step_loop_but_rejects_triggers():
    hot = ast_hot(LIBRARY)
    assert hot is not None and hot is not UNPARSED and hot.step_loops  # the layer loop calls modules


@pytest.mark.parametrize(
    "code,extra",
    [
        ("TOP601", "print(loss.item())"),
        ("TOP601", "if float(loss) > 10:\n    break"),
        ("TOP602", "print(f'loss {loss:.3f}')"),
        ("TOP602", "logging.info('%s', loss)"),
        ("TOP603", "preds = model(x).argmax(1).cpu()"),
        ("TOP603", "preds = model(x).to('cpu')"),
        ("TOP604", "idx = y.nonzero()"),
        ("TOP604", "sel = loss[y > 0]"),
        ("TOP604", "idx = torch.where(y > 0)"),
        ("TOP605", "if loss > 10:\n    break"),
        ("TOP605", "if torch.isnan(loss):\n    break"),
        ("TOP606", "torch.cuda.synchronize()"),
        ("TOP607", "n = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\nprint(n.item())"),
    ],
)
def test_triggers_in_a_training_step_pass(code, extra):
    text = "import logging\n" + train(extra)
    assert reports(code, text), text
    assert passes(code, text)


def test_trigger_after_the_loop_is_rejected():
    text = train("") + "    print(loss.item())\n    idx = y.nonzero()\n"
    for code in ("TOP601", "TOP604"):
        assert not reports(code, text)
        assert not passes(code, text)


def test_module_found_through_an_import_alias():
    # `lin` is torch.nn.Linear under another name: calling it may make the loop a step loop (HotMap's
    # own pre-check reads only capitalised names today; the prefilter stays a superset either way).
    text = (
        "import torch\nfrom torch.nn import Linear as lin\n\nm = lin(4, 4)\n"
        "def run(data):\n    for x in data:\n        print(float(m(x).sum()))\n"
    )
    assert passes("TOP601", text)
    assert not passes("TOP601", text.replace("print(float(m(x).sum()))", "print(m(x))"))


def test_step_reached_through_a_method_and_a_local_class():
    text = """
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x):
        out = self.fc(x)
        return out[out > 0]


class Trainer:
    def __init__(self):
        self.net = Net()

    def step(self, x):
        return self.net(x).sum()

    def fit(self, data):
        for x in data:
            loss = self.step(x)
            loss.backward()
"""
    assert reports("TOP604", text)
    assert passes("TOP604", text)


def test_parameter_values_come_from_the_hot_callers():
    # `flag` is a parameter: a tensor only if a hot caller passes one.
    text = """
import torch


def check(model, x, flag):
    if flag:
        return model(x)
    return None


def run(model, data):
    for x in data:
        check(model, x, x.sum() > 0)
"""
    assert reports("TOP605", text)
    assert passes("TOP605", text)
    plain = text.replace("x.sum() > 0", "True")
    assert not reports("TOP605", plain)
    assert not passes("TOP605", plain)


def test_unparsable_text_passes():
    text = "for x in loader:\n    if model(x).cpu().to('cpu').item( > 0\n"
    assert ast_hot(text) is UNPARSED
    for code in ("TOP601", "TOP603", "TOP605", "TOP609"):
        assert passes(code, text)


def test_pageable_copy_of_the_batch():
    text = (
        "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
        "        x = x.cuda()\n        model(x).sum().backward()\n"
    )
    assert reports("TOP609", text)
    assert passes("TOP609", text)
    assert not passes("TOP609", text.replace("x.cuda()", "x.cuda(non_blocking=True)"))


def test_epoch_loop_precheck():
    fit = (
        "def fit(model, opt, train_loader, val_loader, epochs):\n    for epoch in range(epochs):\n"
        "        for x, y in train_loader:\n            model(x).sum().backward()\n            opt.step()\n"
        "        model.eval()\n"
    )
    assert epoch_loop_possible(fit)
    assert reports("TOP803", fit) and passes("TOP803", fit)
    # The eval switch lives in a helper the loop calls; the gradient comes from autograd.grad.
    helper = (
        "from torch.autograd import grad as g\n\ndef switch(m):\n    m.train(False)\n\n"
        "def fit(model, data):\n    for x in data:\n        g(model(x).sum(), model.parameters())\n"
        "        switch(model)\n"
    )
    assert epoch_loop_possible(helper)
    library = (
        "import torch\n\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
        "        for layer in self.layers:\n            x = layer(x)\n        return x\n\n"
        "def backward_hook(grad):\n    return grad * 2\n"
    )
    assert not epoch_loop_possible(library)
    assert not passes("TOP803", library)


def test_manual_grad_zeroing_precheck():
    text = (
        "import torch\n\nmodel = torch.nn.Linear(2, 2)\nfor p in model.parameters():\n"
        "    if p.grad is not None:\n        p.grad.zero_()\n"
    )
    assert reports("TOP832", text) and passes("TOP832", text)
    # Clipping code that mentions `.grad`, parameters and `zero_` elsewhere: no zeroing loop.
    library = (
        "import torch\n\ndef clip(model):\n    for p in model.parameters():\n"
        "        p.grad.mul_(0.5)\n\ndef reset(t):\n    t.zero_()\n"
    )
    assert not passes("TOP832", library)


LOADER = """
import torch
from torch.utils.data import DataLoader


def train(model, ds, opt):
    loader = DataLoader(ds, batch_size=8{extra})
    for epoch in range(3):
        for x, y in loader:
            model(x.cuda()).sum().backward()
            opt.step()
"""


def test_data_loader_prefilters():
    plain = LOADER.format(extra="")
    assert reports("TOP701", plain) and passes("TOP701", plain)
    workers = LOADER.format(extra=", num_workers=4")
    assert not passes("TOP701", workers)
    assert reports("TOP703", workers) and passes("TOP703", workers)
    assert not passes("TOP703", LOADER.format(extra=", num_workers=4, persistent_workers=True"))
    assert not passes("TOP702", LOADER.format(extra=", pin_memory=False"))
    # Another library's DataLoader, and a torch loader nothing iterates.
    other = plain.replace("from torch.utils.data import DataLoader", "from mylib import DataLoader")
    assert not any(passes(c, other) for c in ("TOP701", "TOP702", "TOP703"))
    alias = plain.replace(
        "from torch.utils.data import DataLoader", "from torch.utils.data import DataLoader as DL"
    ).replace("= DataLoader(", "= DL(")
    # LoaderRule._is_loader wants the callee spelled `DataLoader`: an alias is not a loader there either.
    assert not reports("TOP701", alias) and not passes("TOP701", alias)
    attr = plain.replace("from torch.utils.data import DataLoader", "import torch.utils.data as tud").replace(
        "= DataLoader(", "= tud.DataLoader("
    )
    assert reports("TOP701", attr) and passes("TOP701", attr)
    idle = "import torch\n\ndef make(ds):\n    return torch.utils.data.DataLoader(ds, num_workers=2)\n"
    assert not passes("TOP703", idle) and not passes("TOP702", idle)


def test_profiler_prefilter():
    text = (
        "import torch\nfrom torch import profiler as P\n\nwith P.profile():\n    for x, y in loader:\n"
        "        model(x).sum().backward()\n        opt.step()\n"
    )
    assert reports("TOP812", text) and passes("TOP812", text)
    words = (
        "import torch\n\nclass Args:\n    profile: bool = False\n\ndef f(args):\n"
        "    with open(args.profile_path) as fh:\n        return fh.read()\n"
    )
    assert not passes("TOP812", words)


def test_eval_function_methods_are_rejected():
    method = "import torch\n\nclass Seg(torch.nn.Module):\n    def predict(self, x):\n        return self.backbone(x)\n"
    # TOP801 and TOP803 now look at methods (a trainer's evaluate), so their pre-checks let them
    # through; the rules themselves still leave the methods of torch modules alone.
    assert not reports("TOP801", method) and not reports("TOP803", method)
    function = "import torch\n\ndef predict(model, x):\n    return model(x).softmax(-1)\n"
    assert reports("TOP801", function) and passes("TOP801", function)
    switched = "def evaluate(model, loader):\n    model.eval()\n    return [model(x) for x, y in loader]\n"
    assert not reports("TOP803", switched) and not passes("TOP803", switched)
    nested = (
        "def evaluate(model, loader):\n    def helper(m):\n        m.eval()\n    return [model(x) for x, y in loader]\n"
    )
    assert reports("TOP803", nested) and passes("TOP803", nested)


def test_manual_grad_zeroing_shapes():
    groups = (
        "import torch\n\nopt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)\n"
        "for g in opt.param_groups:\n    for p in g['params']:\n        if p.grad is not None:\n"
        "            p.grad.detach_()\n            p.grad.zero_()\n"
    )
    assert reports("TOP832", groups) and passes("TOP832", groups)
    freeze = (
        "import torch\n\nmodel = torch.nn.Linear(2, 2)\nfor p in model.parameters():\n"
        "    p.requires_grad_(False)\n    p.grad.zero_()\n"
    )
    assert not reports("TOP832", freeze) and not passes("TOP832", freeze)
    other = groups.replace("g['params']", "params")
    assert not passes("TOP832", other)
