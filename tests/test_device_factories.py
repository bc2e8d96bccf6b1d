"""TOP101 factory-then-move / TOP102 cast-after-factory: what the per-rule examples cannot express
(both rules together, imports, whole files, line endings, the fold-safety helper)."""

from __future__ import annotations

import pytest

from torchopt.codemods.device.dtype_folding import Data, exact_in, fold_verdict
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source
from torchopt.rewrite.rule import Tag

BOTH = Settings(select=("TOP101", "TOP102"))


def fix(text: str, unsafe: bool = True) -> str:
    return fix_source(text, BOTH, unsafe=unsafe).text


def diags(text: str):
    return check_source(text, BOTH).diagnostics


@pytest.mark.parametrize(
    "src,out",
    [
        (
            "import torch\nx = torch.zeros(3).cuda().half()\n",
            'import torch\nx = torch.zeros(3, device="cuda", dtype=torch.half)\n',
        ),
        (
            "import torch\nx = torch.zeros(3).float().cuda()\n",
            'import torch\nx = torch.zeros(3, dtype=torch.float32, device="cuda")\n',
        ),
        (
            "import torch\nx = torch.arange(4).cuda().to(torch.float64)\n",
            'import torch\nx = torch.arange(4, device="cuda", dtype=torch.float64)\n',
        ),
    ],
)
def test_chain_composes_through_the_fix_point(src, out):
    res = fix_source(src, BOTH, unsafe=False)
    assert res.text == out
    assert res.passes == 2


def test_torch_alias_is_reused_in_generated_device_call():
    src = "import torch as T\n\ndef f(rank: int):\n    return T.zeros(3).cuda(rank)\n"
    assert fix(src) == 'import torch as T\n\ndef f(rank: int):\n    return T.zeros(3, device=T.device("cuda", rank))\n'


def test_from_import_only_adds_import_torch():
    src = "from torch import zeros\n\ndef f(rank: int):\n    return zeros(3).cuda(rank)\n"
    out = fix(src)
    assert "import torch\n" in out and 'zeros(3, device=torch.device("cuda", rank))' in out
    compile(out, "<out>", "exec")


@pytest.mark.parametrize(
    "src",
    [
        "from torch import zeros\ntorch = object()\n\ndef f(rank: int):\n    return zeros(3).cuda(rank)\n",
        "from torch import zeros\n\ndef f(torch, rank: int):\n    return zeros(3).cuda(rank)\n",
        "from torch import from_numpy\ntorch = None\nx = from_numpy(a).cuda()\n",
        "from torch import zeros\ntorch = None\nx = zeros(3).half()\n",
    ],
)
def test_no_generated_torch_reference_when_torch_is_bound_to_something_else(src):
    assert fix(src) == src
    found = [d for d in diags(src) if d.code in ("TOP101", "TOP102")]
    assert found and all(d.fix is None for d in found)


def test_unsafe_fix_waits_for_unsafe_and_says_what_changes():
    src = "import torch\nx = torch.rand(3).cuda()\n"
    assert fix(src, unsafe=False) == src
    (d,) = diags(src)
    assert d.fix is not None and d.fix.safety == "unsafe" and d.fix.tags == ("rng",)
    assert "generator" in d.fix.note


def test_requires_grad_is_a_semantics_change():
    (d,) = diags("import torch\nx = torch.ones(2, requires_grad=True).cuda()\n")
    assert d.fix.tags == ("semantics",) and "leaf" in d.fix.note


def test_convention_message_states_the_assumption():
    (d,) = diags("import torch\n\ndef f(device):\n    return torch.zeros(3).to(device)\n")
    assert "assuming `device` is a torch.device" in d.message
    assert d.fix is not None and d.fix.safety == "safe"


def test_unknown_to_argument_is_display_only():
    (d,) = diags("import torch\n\ndef f(x):\n    return torch.zeros(3).to(x)\n")
    assert d.code == "TOP101" and d.fix is None
    assert "device, a dtype or a tensor" in d.message


def test_not_equivalent_upcast_is_explained():
    (d,) = diags("import torch\nx = torch.arange(0, 1, 0.1).double()\n")
    assert d.code == "TOP102" and d.fix is None and "not equivalent" in d.message


WHOLE_FILE = """\
import numpy as np
import torch
import torch as T
from torch import zeros, rand as R


def setup(model, device, loader, rank: int, args, x):
    a = torch.zeros(3, 4).cuda()
    b = T.ones(2).cuda(1)
    c = zeros(5, dtype=torch.long).to("cuda:0", non_blocking=True)
    d = torch.full((2,), 7.0).to(device=device, dtype=torch.float16)
    e = torch.arange(10).to(device)
    f = torch.zeros(3, pin_memory=True).cuda(non_blocking=True)
    g = torch.ones(4).cuda(rank)
    h = R(5).cuda()
    i = torch.zeros(3, requires_grad=True).cuda()
    j = torch.empty(3).to(x)
    k = torch.from_numpy(np.zeros(3)).cuda()
    m = torch.Tensor(2, 3).cuda()
    n = torch.cuda.FloatTensor(2, 3)
    o = torch.zeros(3).cuda().half()
    p = torch.zeros(3).float().cuda()
    q = torch.linspace(0, 1, 7).double()
    r = torch.zeros(
        3,
        4,
    ).to(
        device,
    )
    s = torch.zeros(3).cuda(args.local_rank)
    t = torch.randn(100).half()
    return a, b, c, d, e, f, g, h, i, j, k, m, n, o, p, q, r, s, t
"""


@pytest.mark.parametrize("unsafe", [False, True])
def test_whole_file_is_idempotent_and_compiles(unsafe):
    once = fix_source(WHOLE_FILE, BOTH, unsafe=unsafe)
    compile(once.text, "<once>", "exec")
    twice = fix_source(once.text, BOTH, unsafe=unsafe)
    assert twice.text == once.text
    assert not twice.applied
    assert 'torch.zeros(3, device="cuda", dtype=torch.half)' in once.text
    assert 'torch.zeros(3, dtype=torch.float32, device="cuda")' in once.text
    assert 'torch.empty(2, 3, dtype=torch.float32, device="cuda")' in once.text
    assert "torch.empty(3).to(x)" in once.text
    assert "torch.linspace(0, 1, 7).double()" in once.text
    assert ('R(5, device="cuda")' in once.text) is unsafe


def test_crlf_input_stays_crlf():
    src = "import torch\r\nx = torch.zeros(\r\n    3,\r\n).cuda()\r\ny = torch.ones(2).half()\r\n"
    out = fix(src)
    assert (
        out
        == 'import torch\r\nx = torch.zeros(\r\n    3,\r\n    device="cuda",\r\n)\r\ny = torch.ones(2, dtype=torch.half)\r\n'
    )
    assert "\n" not in out.replace("\r\n", "")


def test_multiline_to_with_trailing_comma():
    src = "import torch\n\ndef f(device):\n    return torch.zeros(\n        3,\n        4,\n    ).to(\n        device,\n    )\n"
    assert (
        fix(src)
        == "import torch\n\ndef f(device):\n    return torch.zeros(\n        3,\n        4,\n        device=device,\n    )\n"
    )


@pytest.mark.parametrize(
    "v,dt,ok",
    [
        (7.0, "float16", True),
        (0.1, "float32", False),
        (0.5, "bfloat16", True),
        (1 + 2**-8, "bfloat16", False),
        (1 + 2**-8, "float16", True),
        (2**24 + 1, "float32", False),
        (2**24, "float32", True),
        (65504, "float16", True),
        (70000, "float16", False),
        (300, "uint8", False),
        (-1, "int8", True),
        (True, "float32", True),
        (2, "bool", False),
        (1e300, "float32", False),
    ],
)
def test_exact_in(v, dt, ok):
    assert exact_in(v, dt) is ok


def test_fold_verdict_table():
    assert fold_verdict(Data("const", "float32"), "float16").ok
    assert fold_verdict(Data("values", "float32", (0.1,)), "float64").ok is False
    v = fold_verdict(Data("values", "float32", (0.1,)), "float16")
    assert v.ok and v.tags == (Tag.TOLERANCE,)
    assert fold_verdict(Data("random", "float32"), "float64").tags == (Tag.RNG,)
    assert fold_verdict(Data("random", "float32"), "float32").tags == ()
    assert not fold_verdict(Data("random", "float32"), "int64").ok
    assert fold_verdict(Data("intspan", "int64", lo=0, hi=2048), "float16").ok
    assert not fold_verdict(Data("intspan", "int64", lo=0, hi=2049), "float16").ok
    assert not fold_verdict(Data("float", None), "float16").ok  # default dtype changed in the file
    assert not fold_verdict(Data("values", "float32", (1.5,)), "int64").ok


def test_default_dtype_file_only_folds_constant_and_integer_data():
    src = (
        "import torch\ntorch.set_default_dtype(torch.float64)\n"
        "a = torch.zeros(3).half()\nb = torch.arange(5).float()\nc = torch.tensor([1.5]).half()\n"
        "d = torch.linspace(0, 1, 3).float()\ne = torch.rand(3).half()\n"
    )
    out = fix(src)
    assert "torch.zeros(3, dtype=torch.half)" in out and "torch.arange(5, dtype=torch.float32)" in out
    assert "torch.tensor([1.5]).half()" in out and "torch.linspace(0, 1, 3).float()" in out
    assert "torch.rand(3, dtype=torch.half)" in out  # random: rng either way (unsafe)
