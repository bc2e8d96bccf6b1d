"""The AMP rules' cheap prefilters (TOP201-TOP207, torchopt/codemods/amp/prechecks.py) and the
shared ast name resolver they use (_torch.torch_import_map / ast_torch_names / torch_callees).

Every "reports" text is checked both ways: the rule (run without its prefilter) reports on it, and
``could_match`` lets it through. Every "rejected" text is one the rule reports nothing on and the
prefilter turns away (what keeps LibCST off library code)."""

from __future__ import annotations

import ast

import pytest

from torchopt.analysis.precheck.torch_imports import ast_torch_names, torch_callees, torch_import_map
from torchopt.rewrite.audit import unfiltered_codes
from torchopt.rewrite.registry import all_rules

RULES = all_rules()

_H = "import torch\nimport torch.nn as nn\n\nmodel = nn.Linear(4, 2).cuda()\n"
_OPT = "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
_STEP = (
    "for x, y in batches:\n    optimizer.zero_grad()\n    loss = model(x).sum()\n"
    "    loss.backward()\n    optimizer.step()\n"
)

REPORTS: dict[str, list[str]] = {
    "TOP201": [
        "import torch\nwith torch.cuda.amp.autocast():\n    pass\n",
        "import torch as T\ns = T.cuda.amp.GradScaler()\n",
        "from torch.cuda import amp\nwith amp.autocast():\n    pass\n",
        "from torch import cuda\nwith cuda.amp.autocast():\n    pass\n",
        "from torch.cuda import nccl, amp\nwith amp.autocast():\n    pass\n",
        "from torch.cpu import (\n    amp,\n)\ns = amp.GradScaler()\n",
        "from torch.cuda.amp import autocast as ac\nwith ac():\n    pass\n",
        "def f():\n    from torch.cpu.amp import autocast\n    with autocast():\n        pass\n",
    ],
    "TOP202": [
        _H + _OPT + _STEP,
        # `mylib.optim.SGD` is not torch's: refused, saying GradScaler needs a torch.optim.Optimizer
        _H + "import mylib\noptimizer = mylib.optim.SGD(model.parameters())\n" + _STEP,
        # aliases: `from torch import optim`, `from torch.optim import AdamW as A`, `import torch.optim as O`
        _H + "from torch import optim\noptimizer = optim.Adam(model.parameters())\n" + _STEP,
        _H + "from torch.optim import AdamW as A\noptimizer = A(model.parameters())\n" + _STEP,
        _H + "import torch.optim as O\noptimizer = O.SGD(model.parameters(), lr=1)\n" + _STEP,
        # the step in a function called by name from a loop, the optimizer a parameter there
        _H + _OPT + "def train_step(m, opt, x):\n    out = m(x)\n    loss = out.sum()\n    loss.backward()\n"
        "    opt.step()\n\nfor x in batches:\n    train_step(model, optimizer, x)\n",
        # accumulation: the step under an `if`
        _H + _OPT + "for i, x in enumerate(batches):\n    loss = model(x).sum()\n    loss.backward()\n"
        "    if (i + 1) % 4 == 0:\n        optimizer.step()\n",
        # a refusal is a report too (closure step)
        _H
        + _OPT
        + "for x in batches:\n    loss = model(x).sum()\n    loss.backward()\n    optimizer.step(lambda: loss)\n",
        # the optimizer moved along a chain, the import inside a function
        "import torch.nn as nn\nmodel = nn.Linear(4, 2).cuda()\n\ndef main():\n    import torch\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n    while True:\n        loss = model(x).sum()\n"
        "        loss.backward()\n        opt.step()\n",
    ],
    "TOP203": [
        _H + _OPT + "for x in batches:\n    with torch.autocast('cuda', dtype=torch.float16):\n"
        "        loss = model(x).sum()\n    loss.backward()\n    optimizer.step()\n",
        _H + _OPT + "from torch.cuda.amp import autocast\nfor x in batches:\n    with autocast():\n"
        "        loss = model(x).sum()\n    loss.backward()\n    optimizer.step()\n",
        _H + "from torch import optim, autocast as ac\noptimizer = optim.SGD(model.parameters(), lr=0.1)\n"
        "for x in batches:\n    with ac('cuda'):\n        loss = model(x).sum()\n    loss.backward()\n",
    ],
    "TOP204": [
        _H.replace(".cuda()", ".half()") + _OPT,
        "import torch\nfrom torch import nn\nclass Net(nn.Module):\n    pass\nnet = Net()\nnet = net.to(torch.float16)\n"
        "net(x).sum().backward()\n",
        "import torch\nfrom torch import nn\nimport torch.optim as optim\nclass Net(nn.Module):\n    pass\n"
        "class Wrap:\n    def __init__(self):\n        self.m = Net()\n        self.opt = optim.SGD(self.m.parameters(), 0.1)\n"
        "        self.m.half()\n",
        "import torch\nfrom torch.autograd import grad\nm = torch.nn.Conv2d(3, 3, 3).half()\ng = grad(y, x)\n",
        # a parameter given to the optimizer, no assignment in sight
        "import torch\n\ndef train(model):\n    opt = torch.optim.Adam(model.parameters())\n    model.to(torch.float16)\n",
        # through names: net -> m -> Net()
        "import torch\nclass Net(torch.nn.Module):\n    pass\nm = Net()\nnet = m\nnet.half()\nloss.backward()\n",
    ],
    "TOP205": [
        "import torch\nimport torch.nn as nn\nmodel = nn.Linear(4, 2).cuda()\nwith torch.no_grad():\n"
        "    for x in batches:\n        out = model(x)\n",
        "import torch\nfrom torch import nn\nclass Net(nn.Module):\n    pass\nmodel = Net().to('cuda')\n\n"
        "@torch.inference_mode()\ndef run(batches):\n    for x in batches:\n        y = model(x)\n",
        "from torch import no_grad\nimport torch.nn as nn\nmodel = nn.Linear(4, 2).cuda()\nfor x in batches:\n"
        "    with no_grad():\n        out = model(x)\n",
        # a refusal (metric code in the forward's statement) is a report too
        "import torch\nimport torch.nn as nn\nmodel = nn.Linear(4, 2).cuda()\nwith torch.no_grad():\n"
        "    for x in batches:\n        preds.append(model(x).cpu())\n",
    ],
    "TOP206": [
        "import torch\nscaler = torch.amp.GradScaler('cuda')\ng = torch.autograd.grad(loss, params, create_graph=True)\n",
        "from torch import autograd\nfrom torch.cuda.amp import autocast\nwith autocast():\n    pass\n"
        "g = autograd.grad(loss, params, None, True, True)\n",
    ],
    "TOP207": [
        "import torch\n\nclass Op(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n"
        "        return x\n\nwith torch.autocast('cuda'):\n    pass\n",
        "from torch.autograd import Function\nfrom torch import autocast\n\nclass Base(Function):\n    pass\n\n"
        "class Op(Base):\n    @staticmethod\n    def forward(ctx, x):\n        return x\n\nac = autocast\n",
    ],
}

# Library-style code the rules find nothing in: the prefilter must turn it away.
_MODELING = (
    "import torch\nfrom torch import nn\n\n\nclass Rotary(nn.Module):\n    def __init__(self, dim):\n"
    "        super().__init__()\n        self.proj = nn.Linear(dim, dim)\n\n    @torch.no_grad()\n"
    "    def forward(self, x, position_ids):\n        with torch.autocast(device_type='cuda', enabled=False):\n"
    "            freqs = x.float() @ position_ids.float()\n        for layer in range(3):\n"
    "            x = x + freqs\n        return x.to(torch.float16).half()\n\n\n"
    "class Fn(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n        return x\n\n"
    "    @staticmethod\n    def backward(ctx, g):\n        return g\n"
)
REJECTED: dict[str, list[str]] = {
    "TOP201": [
        "import torch\n# torch.cuda.amp.autocast is deprecated\nx = 1\n",
        "from torch.cuda.amp import autocast\n",  # imported, never used here (re-exported)
        "import mylib\nwith mylib.cuda.amp.autocast():\n    pass\n",
    ],
    "TOP202": [
        # a trainer whose optimizer is not a torch.optim class
        "import torch\n\nclass Trainer:\n    def train(self):\n        for batch in self.loader:\n"
        "            loss = self.model(batch).loss\n            self.accelerator.backward(loss)\n"
        "            self.optimizer.step()\n",
        # docs mention the optimizer: strings only
        "import torch\n'''optimizer = torch.optim.SGD(...); loss.backward(); optimizer.step()'''\n",
        # already scaled
        _H + _OPT + "scaler = torch.amp.GradScaler()\nfor x in batches:\n    loss = model(x).sum()\n"
        "    scaler.scale(loss).backward()\n    scaler.step(optimizer)\n    scaler.update()\n",
        # backward and step in different loops
        _H + _OPT + "for x in batches:\n    model(x).sum().backward()\nfor _ in range(3):\n    optimizer.step()\n",
        # a name stepped but never zeroed, of a class that is not torch's: no optimizer-like object
        _H
        + "import mylib\noptimizer = mylib.optim.SGD(model.parameters())\n"
        + _STEP.replace("optimizer.zero_grad()", "pass"),
        _MODELING,
    ],
    "TOP203": [
        _MODELING,
        _H + _OPT + "for x in batches:\n    with torch.autocast('cuda', enabled=False):\n"
        "        loss = model(x).sum()\n    loss.backward()\n    optimizer.step()\n",
        # no optimizer
        _H
        + "for x in batches:\n    with torch.autocast('cuda'):\n        loss = model(x).sum()\n    loss.backward()\n",
    ],
    "TOP204": [
        _MODELING,
        # tensors cast in a training file
        "import torch\nopt = torch.optim.SGD(params, lr=0.1)\nx = batch['x'].to(torch.float16)\nself.w.half()\n",
        # names cast in a training file that are never bound to a module
        "import torch\n\ndef f(beam_idx, device, mask):\n    mask = mask.to(torch.bool)[0]\n    x = beam_idx.to(device)\n"
        "    mask.half()\n    y.backward()\n",
        # a module cast in an inference-only file
        "import torch\nm = torch.nn.Linear(2, 2).half()\nwith torch.no_grad():\n    y = m(x)\n",
    ],
    "TOP205": [
        _MODELING,
        # a loop under no_grad in a file that trains
        _H + "with torch.no_grad():\n    for x in batches:\n        out = model(x)\nloss.backward()\n",
        # no model call in the loop
        _H + "with torch.no_grad():\n    for p in params:\n        p.zero_()\n",
        # a `with` of something else
        _H + "import contextlib\nwith contextlib.nullcontext():\n    for x in batches:\n        out = model(x)\n",
        # a lookalike no_grad
        _H + "import mylib\nwith mylib.no_grad():\n    for x in batches:\n        out = model(x)\n",
    ],
    "TOP206": [
        "import torch\ng = torch.autograd.grad(y, x, create_graph=True)\n",  # no AMP in the file
        "import torch\nscaler = torch.amp.GradScaler()\ng = torch.autograd.grad(y, x, create_graph=False)\n",
        "import torch\nscaler = torch.amp.GradScaler()\ng = torch.autograd.grad(scaler.scale(y), x, create_graph=True)\n",
    ],
    "TOP207": [
        _MODELING,  # autocast only as `enabled=False` in another class: still an autocast use...
        "import torch\n\nclass Op(torch.autograd.Function):\n    @staticmethod\n    def setup_context(ctx, i, o):\n"
        "        pass\n\n    @staticmethod\n    def forward(x):\n        return x\n\nwith torch.autocast('cuda'):\n    pass\n",
        "import torch\n\nclass Op(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n"
        "        return x\n# no autocast here\n",
    ],
}
# _MODELING holds an autograd.Function (no custom_fwd) and uses autocast: TOP207 does report there.
REJECTED["TOP207"] = REJECTED["TOP207"][1:]


def _cases(table: dict[str, list[str]]) -> list:
    return [pytest.param(code, text, id=f"{code}-{i}") for code, texts in table.items() for i, text in enumerate(texts)]


@pytest.mark.parametrize("code,text", _cases(REPORTS))
def test_prefilter_lets_through_what_the_rule_reports(code: str, text: str) -> None:
    assert code in unfiltered_codes(text, [RULES[code]]), "the test text should be a finding"
    assert RULES[code].could_match(text)


@pytest.mark.parametrize("code,text", _cases(REJECTED))
def test_prefilter_rejects_what_the_rule_ignores(code: str, text: str) -> None:
    assert code not in unfiltered_codes(text, [RULES[code]]), "the test text should not be a finding"
    assert not RULES[code].could_match(text)


def test_modeling_text_is_a_custom_function_finding() -> None:
    assert "TOP207" in unfiltered_codes(_MODELING, [RULES["TOP207"]])
    assert RULES["TOP207"].could_match(_MODELING)


@pytest.mark.parametrize("code", sorted(REPORTS))
def test_unparsable_or_star_import_says_true(code: str) -> None:
    rule = RULES[code]
    words = " ".join(rule.prefilter + rule.requires + ("autocast", "GradScaler", "optim", "step", "backward"))
    assert rule.could_match(f"# {words}\ndef broken(:\n")
    assert rule.could_match(f"# {words}\nfrom torch.cuda.amp import *\nfrom torch import *\n")


def test_torch_import_map() -> None:
    text = (
        "import torch\nimport torch.nn as nn\nimport numpy as np\nfrom torch import optim as O, autocast\n"
        "from torch.optim import SGD\nfrom . import torch as local\n"
        "def f():\n    import torch.distributed as dist\n"
    )
    m = torch_import_map(text)
    assert m == {
        "torch": {"torch"},
        "nn": {"torch.nn"},
        "O": {"torch.optim"},
        "autocast": {"torch.autocast"},
        "SGD": {"torch.optim.SGD"},
        "dist": {"torch.distributed"},
    }
    assert torch_import_map("from torch.nn import *\n") is None
    assert torch_import_map("def (:\n") is None
    assert torch_import_map("import numpy\n") == {}


def test_ast_torch_names_and_callees() -> None:
    m = {"nn": frozenset({"torch.nn"}), "T": frozenset({"torch"})}
    expr = ast.parse("nn.functional.relu", mode="eval").body
    assert ast_torch_names(m, expr) == {"torch.nn.functional.relu"}
    assert ast_torch_names(m, ast.parse("x.nn.Linear", mode="eval").body) == frozenset()
    assert ast_torch_names(m, ast.parse("f().nn", mode="eval").body) == frozenset()
    text = "import torch as T\nfrom torch import nn\ny = T.zeros(3)\nl = nn.Linear(2, 2)\nz = np.zeros(2)\nw = l(y)\n"
    assert torch_callees(text) == {"torch.zeros", "torch.nn.Linear"}
    assert torch_callees("from torch import *\nzeros(3)\n") is None
