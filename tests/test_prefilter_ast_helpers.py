"""Prefilters (``could_match``) of the P1 rules: device, deprecated, conv_bias, pad, flags, ddp,
compile, channels_last, env. Each must let through the texts its rule can report on (alias and
import forms included) and should reject library-style texts. Pure text tests: nothing runs."""

from __future__ import annotations

import pytest

import ast

from torchopt.analysis.precheck.scopes import ast_loop_calls, ast_reaching_values
from torchopt.analysis.precheck.torch_imports import may_call_torch, torch_calls_to
from torchopt.analysis.precheck.tree import ast_tree
from torchopt.rewrite.registry import all_rules

RULES = all_rules()

# (code, text the rule reports on: must pass)
MUST_PASS = [
    # TOP105
    ("TOP105", "import torch\n\ndef f(t):\n    return t.type(torch.cuda.FloatTensor)\n"),
    ("TOP105", "from torch.cuda import HalfTensor as H\n\ndef f(t):\n    return t.type(H)\n"),
    ("TOP105", "def f(t):\n    return t.type('torch.cuda.HalfTensor')\n"),
    ("TOP105", "from torch import tensor as T\n\ndef f(a: 'Tensor'):\n    return T(a)\n"),
    ("TOP105", "import torch as th\n\na = th.zeros(3)\nb = th.tensor(a)\n"),
    ("TOP105", "import torch\n\nfor s in range(3):\n    t = torch.tensor([1.0, 2.0]).cuda()\n"),
    (
        "TOP105",
        "import torch\n\ndef f(rows, device):\n    for r in rows:\n        t = torch.tensor(r, device=device)\n",
    ),
    ("TOP105", "import torch\n\ndef run(xs):\n    w = torch.randn(4)\n    for x in xs:\n        y = x @ w.cuda()\n"),
    (
        "TOP105",
        "import torch\n\ndef run(xs, dev):\n    w = torch.randn(4)\n    for x in xs:\n        y = x @ w.to(dev)\n",
    ),
    ("TOP105", "import torch\n\ndef run(xs, w):\n    while xs:\n        y = w.to('cuda:1')\n"),
    ("TOP105", "import torch\n\ndef run(xs, w):\n    for x in xs:\n        y = [w.to(self.gpu) for _ in x]\n"),
    # TOP101 / TOP102
    ("TOP101", "from torch import zeros as z\n\nx = z(3).cuda()\n"),
    ("TOP101", "import torch\n\nx = torch.cuda.FloatTensor(2, 3)\n"),
    ("TOP101", "import torch\nimport numpy as np\nx = torch.from_numpy(np.ones(3)).to('cuda')\n"),
    ("TOP101", "import torch\n\ndef f(d):\n    return torch.empty(3).to(d)\n"),
    ("TOP102", "import torch as T\n\nx = T.zeros(3).double()\n"),
    ("TOP102", "import torch\n\nx = torch.arange(3).to(torch.float16)\n"),
    ("TOP101", "import torch\n\ndef f(dtype):\n    return torch.arange(3).to(dtype)\n"),
    ("TOP101", "import torch\n\nx = torch.zeros(3).to('cuda', torch.float16)\n"),
    ("TOP102", "import torch\n\ndef f(d):\n    return torch.arange(3).to(d)\n"),
    ("TOP302", "import torch.nn as nn\n\nH = 50\nnet = nn.Sequential(nn.Linear(32, H), nn.Linear(H, 8))\n"),
    (
        "TOP302",
        "import torch.nn as nn\n\nclass M(nn.Module):\n    def __init__(self):\n        d = 3 * 33\n"
        "        self.fc = nn.Linear(d, 64)\n",
    ),
    ("TOP302", "from torch import nn\n\nattn = nn.MultiheadAttention(96, 8)\n"),
    # deprecated
    ("TOP820", "from torch import norm\n\ndef f(x):\n    return norm(x)\n"),
    ("TOP820", "import torch as T\n\ndef f(A, b):\n    return T.solve(b, A)\n"),
    ("TOP820", "from torch import *\n\ndef f(x):\n    return qr(x)\n"),
    ("TOP826", "from torch import range as r\n\nx = r(0, 3)\n"),
    ("TOP827", "import torch.utils.checkpoint as cp\n\ndef f(b, x):\n    return cp.checkpoint_sequential(b, 2, x)\n"),
    ("TOP827", "from torch.utils.checkpoint import checkpoint as ckpt\n\ndef f(m, x):\n    return ckpt(m, x)\n"),
    ("TOP828", "from torch import LongTensor as LT\n\nidx = LT(4, 2)\n"),
    ("TOP828", "import torch\n\nh = torch.Tensor(8, 16).cuda(1)\n"),
    ("TOP829", "from torch.autograd import Variable as V\n\nw = V(x)\n"),
    ("TOP823", "import torch\n\ntorch.set_default_tensor_type(torch.cuda.FloatTensor)\n"),
    ("TOP825", "from torch import testing\n\ntesting.assert_allclose(a, b)\n"),
    # conv_bias
    ("TOP841", "import torch.nn as nn\n\nblock = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))\n"),
    ("TOP841", "from torch.nn import Conv1d as C, GroupNorm\n\nb = Seq(C(3, 8, 3, bias=True), GroupNorm(8, 8))\n"),
    (
        "TOP841",
        "import torch.nn as nn\n\nclass B(nn.Module):\n    def __init__(self, c):\n        super().__init__()\n        self.conv = nn.Conv2d(3, c, 3)\n        self.bn = nn.BatchNorm2d(c)\n\n    def forward(self, x):\n"
        "        return self.bn(self.conv(x))\n",
    ),
    (
        "TOP841",
        "import torch.nn as nn\n\nclass B(nn.Module):\n    def __init__(self, c):\n        super().__init__()\n        self.conv = nn.Conv2d(3, c, 3)\n        self.bn = nn.BatchNorm2d(c)\n\n    def forward(self, x):\n"
        "        y = self.conv(x)\n        y = self.bn(y)\n        return y\n",
    ),
    # pad
    ("TOP303", "from torch.nn.utils.rnn import pad_sequence as ps\n\ndef c(b):\n    return ps(b)\n"),
    ("TOP303", "from transformers import DataCollatorWithPadding as D\n\nc = D(tok)\n"),
    ("TOP302", "import torch.nn as nn\n\nlayer = nn.Linear(32, 100)\n"),
    # flags
    (
        "TOP501",
        "import torch\nimport torch.nn as nn\n\nm = nn.Conv2d(3, 8, 3).cuda()\n\nif __name__ == '__main__':\n    pass\n",
    ),
    ("TOP502", "import torch\n\ndef main():\n    m = torch.nn.Linear(4, 4).cuda()\n\n\nmain()\n"),
    ("TOP502", "import torch\nm = torch.nn.Linear(4, 4).cuda()\nfor x in data:\n    m(x).sum().backward()\n"),
    ("TOP503", "import torch\n\ntorch.backends.cudnn.deterministic = True\n"),
    ("TOP503", "from torch import use_deterministic_algorithms as uda\n\nuda(True)\n"),
    ("TOP503", "import torch\n\ntorch.use_deterministic_algorithms(warn_only=True)\n"),
    ("TOP503", "import os\n\nos.environ['CUBLAS_WORKSPACE_CONFIG'] = ':4096:8'\n"),
    # ddp
    (
        "TOP403",
        "import torch\nfrom torch.utils.data import DataLoader\nfrom torch.utils.data.distributed import "
        "DistributedSampler as DS\nloader = DataLoader(ds, sampler=DS(ds))\n",
    ),
    (
        "TOP104",
        "import torch\nfrom torch.utils.data import DataLoader as DL\n\nloader = DL(ds)\n"
        "for x, y in loader:\n    x = x.cuda()\n",
    ),
    ("TOP401", "from torch.nn import DataParallel as DP\n\nmodel = DP(model)\n"),
    (
        "TOP407",
        "from torch.nn.parallel import DistributedDataParallel as DDP\n\nm = DDP(m, find_unused_parameters=True)\n",
    ),
    (
        "TOP408",
        "import torch\nfrom torch.nn.utils.rnn import pad_sequence\nm = torch.nn.DataParallel(m)\nb = pad_sequence(s)\n",
    ),
    # compile / channels_last / env
    ("TOP911", "import torch\n\nmodel = Net()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\ny = model(x)\n"),
    ("TOP911", "import torch\n\nnet = make()\nnet.eval()\ny = net(x)\n"),
    (
        "TOP921",
        "import torch\n\nnet = torch.compile(make_net())\nopt = torch.optim.SGD(net.parameters())\ny = net(x)\n",
    ),
    ("TOP922", "from torch.cuda import CUDAGraph as G\n\ng = G()\n"),
    ("TOP901", "import torch\nimport torch.nn as nn\n\nmodel = nn.Conv2d(3, 8, 3)\nmodel.eval()\ny = model(x)\n"),
    ("TOP951", "import torch\n\ndef main():\n    pass\n\n\nif __name__ == '__main__':\n    main()\n"),
]

# Library-style texts the rule finds nothing in: should be rejected.
MUST_REJECT = [
    (
        "TOP105",
        "import torch\n\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
        "        for layer in self.layers:\n            x = layer(x.to(self.dtype))\n"
        "        mask = torch.tensor([1, 2], device=x.device)\n        return x.to(dtype=torch.float16)\n",
    ),
    ("TOP105", "import torch\n\ndef f(xs, w):\n    for x in xs:\n        w = w.to('cuda')\n"),
    ("TOP105", "import torch\n\ndef f(xs, w):\n    for x in xs:\n        w.add_(1)\n        v = w.cuda()\n"),
    (
        "TOP105",
        "import torch\n\ndef f(xs, w):\n    for x in xs:\n        v = w.to(torch.float16)\n        u = w.to('cpu')\n",
    ),
    ("TOP105", "import mylib\n\nx = mylib.tensor(a)\n"),
    ("TOP101", "import torch\n\nx = torch.zeros(3).to(self.device)\n".replace("torch.zeros", "mylib.zeros")),
    ("TOP101", "import torch\n\nx = torch.Tensor(data).cuda()\n"),
    ("TOP101", "import torch\n\nx = torch.from_numpy(a).to(torch.float32)\ny = torch.arange(3).to(dtype=torch.long)\n"),
    (
        "TOP102",
        "import torch\n\nx = torch.arange(3).to(q.device)\ny = torch.zeros(2).to(device=d)\nz = torch.ones(1).to('cuda')\n",
    ),
    (
        "TOP302",
        "import torch.nn as nn\n\nclass M(nn.Module):\n    def __init__(self, hidden):\n"
        "        self.fc = nn.Linear(hidden, 64)\n        self.fc2 = nn.Linear(self.h, 128)\n",
    ),
    ("TOP302", "import torch.nn as nn\n\nH = 50\nH = 64\nnet = nn.Linear(64, H)\n"),
    ("TOP105", "import torch\n\ndef f(xs):\n    d = []\n    d = torch.tensor(d)\n"),
    ("TOP105", "import torch\n\ndef f(t: 'int'):\n    return torch.tensor(t)\n"),
    ("TOP841", "import torch.nn as nn\n\nb = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(16))\n"),
    ("TOP102", "import torch\n\nx = torch.randn(3).to(device=d, dtype=torch.float16)\n"),
    ("TOP403", "class DistributedSampler:\n    pass\n"),
    ("TOP104", "import torch\nfrom torch.utils.data import DataLoader\n\nloader = DataLoader(ds)\n"),
    ("TOP820", "import numpy as np\nimport torch\n\nn = np.linalg.norm(x)\ny = x.norm()\n"),
    ("TOP828", "import torch\n\nt = torch.Tensor([3])\nu = torch.LongTensor(n)\n"),
    (
        "TOP827",
        "from torch.utils.checkpoint import checkpoint\n\ndef f(m, x):\n    return checkpoint(m, x, use_reentrant=False)\n",
    ),
    ("TOP841", "import torch.nn as nn\n\nb = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8))\n"),
    ("TOP841", "import torch.nn as nn\n\nb = nn.Sequential(nn.Conv1d(3, 8, 3), nn.BatchNorm2d(8))\n"),
    (
        "TOP841",
        "import torch.nn as nn\n\nclass B(nn.Module):\n    def __init__(self, c):\n        super().__init__()\n        self.conv = nn.Conv2d(3, c, 3)\n        self.bn = nn.BatchNorm2d(c)\n\n    def forward(self, x):\n"
        "        return self.bn(self.conv(x)) + self.conv(x)\n",
    ),
    (
        "TOP841",
        "import torch.nn as nn\n\nclass B(nn.Module):\n    def __init__(self, c):\n        super().__init__()\n        self.conv = nn.Conv2d(3, c, 3)\n        self.bn = nn.BatchNorm2d(c)\n\n    def forward(self, x):\n"
        "        return self.conv(self.bn(x))\n",
    ),
    ("TOP303", "from .data import DataCollatorWithPadding\n\nc = DataCollatorWithPadding(tok)\n"),
    (
        "TOP501",
        "import torch\nimport torch.nn as nn\n\nclass M(nn.Module):\n    def f(self):\n        return nn.Conv2d(3, 8, 3).cuda()\n",
    ),
    (
        "TOP502",
        "import torch\n\nclass M(torch.nn.Module):\n    def f(self):\n        return torch.nn.Linear(4, 4).cuda()\n",
    ),
    (
        "TOP503",
        "import torch\n\ndef f(previous):\n    torch.use_deterministic_algorithms(previous)\n    cfg.deterministic = False\n",
    ),
    ("TOP401", "import torch\n\n# DataParallel is not used here\n"),
    (
        "TOP911",
        "import torch\n\nclass M(torch.nn.Module):\n    def f(self):\n        self.eval()\n        return self.parameters()\n",
    ),
    ("TOP921", "import torch\n\nfast_gelu = torch.compile(gelu)\n"),
    ("TOP922", "import networkx\nimport torch\n\ng = networkx.graph(x)\ny = x.cuda()\n"),
    ("TOP951", "import torch\n\nif __name__ == '__main__':\n    x = torch.ones(2, device='cuda')\n"),
]


@pytest.mark.parametrize("code,text", MUST_PASS, ids=[f"{c}-{i}" for i, (c, _) in enumerate(MUST_PASS)])
def test_prefilter_lets_through(code: str, text: str) -> None:
    assert RULES[code].could_match(text)


@pytest.mark.parametrize("code,text", MUST_REJECT, ids=[f"{c}-{i}" for i, (c, _) in enumerate(MUST_REJECT)])
def test_prefilter_rejects(code: str, text: str) -> None:
    assert not RULES[code].could_match(text)


@pytest.mark.parametrize("code,text", MUST_PASS, ids=[f"{c}-{i}" for i, (c, _) in enumerate(MUST_PASS)])
def test_unparsable_text_passes(code: str, text: str) -> None:
    # The engine reports the syntax error: the AST part of a prefilter must not hide the file.
    assert RULES[code].could_match(text + "\ndef broken(:\n")


def test_helpers() -> None:
    text = "import torch.nn as nn\nfrom torch import zeros as z\n\nnn.Linear(1, 2)\nz(3)\nmylib.zeros(3)\n"
    assert may_call_torch(text, ("torch.zeros",)) and may_call_torch(text, ("torch.nn.Linear",))
    assert not may_call_torch(text, ("torch.ones",))
    assert len(torch_calls_to(text, ("torch.zeros",)) or []) == 1
    assert torch_calls_to("def (", ("torch.zeros",)) is None
    loops = ast_loop_calls(
        "def f(xs):\n    for x in xs:\n        a()\n        def g():\n            b()\n"
        "    else:\n        c()\n    while d():\n        e()\n"
    )
    assert sorted(c.func.id for c, _ in loops or []) == ["a", "e"]


def test_ast_reaching_values() -> None:
    text = (
        "H = 50\nK: int = 3\ndef f(a, b=H):\n    c = a + 1\n    d = [H for H in range(H)]\n    g(a, c, H, K)\n"
        "class C:\n    H = 2\n    def g(self):\n        return H\n    x = H\n"
        "def h():\n    global H\n    return H\n"
    )
    got = {}
    for n in ast.walk(ast_tree(text)):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in ("H", "K", "a", "c"):
            v = ast_reaching_values(text, n)
            got.setdefault((n.lineno, n.id), []).append(
                None if v is None else [None if x is None else ast.unparse(x) for x in v]
            )
    assert got[(3, "H")] == [["50"]]  # a default: evaluated in the module
    assert got[(4, "a")] == [[None]]  # a parameter
    assert got[(6, "c")] == [["a + 1"]]
    assert got[(6, "K")] == [["3"]]
    assert sorted(map(str, got[(5, "H")])) == sorted(map(str, [[None], ["50"]]))  # target; first iterable
    assert got[(10, "H")] == [["50"]]  # a method skips the class body
    assert got[(11, "H")] == [["2"]]
    assert got[(14, "H")] == [["50"]]  # global: the module's
