"""Targeted tests for TOP103 (module-then-move), TOP104 (unpinned-host-copy) and TOP105
(device-placement-hint): the loop shapes, scoping and idempotence that examples cannot express."""

from __future__ import annotations

import textwrap

import pytest

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source


def fix(src: str, code: str, unsafe: bool = True) -> str:
    return fix_source(textwrap.dedent(src), Settings(select=(code,)), unsafe=unsafe).text


def diags(src: str, code: str):
    return [d for d in check_source(textwrap.dedent(src), Settings(select=(code,))).diagnostics if d.code == code]


def same(src: str, code: str) -> None:
    src = textwrap.dedent(src)
    assert not diags(src, code)
    assert fix(src, code) == src


def idempotent(src: str, code: str) -> str:
    once = fix(src, code)
    assert fix(once, code) == once
    compile(once, "<out>", "exec")
    return once


# --------------------------------------------------------------------------- TOP104


def test_enumerate_loop():
    out = idempotent(
        """
        from torch.utils.data import DataLoader
        loader = DataLoader(ds, batch_size=8)
        for i, (x, y) in enumerate(loader, 1):
            x = x.cuda()
            y = y.cuda(0)
        """,
        "TOP104",
    )
    assert "DataLoader(ds, batch_size=8, pin_memory=True)" in out
    assert "x = x.cuda(non_blocking=True)" in out
    assert "y = y.cuda(0, non_blocking=True)" in out


def test_tqdm_loop_with_device_parameter_adds_import():
    out = idempotent(
        """
        from torch.utils.data import DataLoader
        from tqdm import tqdm

        def train(ds, device):
            loader = DataLoader(ds)
            for batch in tqdm(loader, desc="train"):
                batch = batch.to(device)
        """,
        "TOP104",
    )
    assert "import torch\n" in out
    assert "DataLoader(ds, pin_memory=torch.cuda.is_available())" in out
    assert "batch = batch.to(device, non_blocking=True)" in out


def test_enumerate_of_tqdm_and_subscripted_batch():
    out = idempotent(
        """
        import torch
        import tqdm
        loader = torch.utils.data.DataLoader(ds)
        for step, batch in enumerate(tqdm.tqdm(loader)):
            inputs = batch["input"].to("cuda:0")
            labels = batch[1].to(device="cuda")
        """,
        "TOP104",
    )
    assert "DataLoader(ds, pin_memory=True)" in out
    assert 'batch["input"].to("cuda:0", non_blocking=True)' in out
    assert 'batch[1].to(device="cuda", non_blocking=True)' in out


def test_alias_reused():
    out = idempotent(
        """
        import torch as T
        from torch.utils.data import DataLoader
        device = T.device("cuda" if T.cuda.is_available() else "cpu")
        loader = DataLoader(ds)
        for x, y in loader:
            x = x.to(device)
        """,
        "TOP104",
    )
    assert "DataLoader(ds, pin_memory=T.cuda.is_available())" in out
    assert "\nimport torch\n" not in out


def test_loader_in_other_function_is_not_flagged():
    same(
        """
        from torch.utils.data import DataLoader

        def build(ds):
            loader = DataLoader(ds)
            return loader

        def train():
            loader = build(None)
            for x, y in loader:
                x = x.cuda()
        """,
        "TOP104",
    )


def test_global_loader_used_in_function():
    out = fix(
        """
        from torch.utils.data import DataLoader
        loader = DataLoader(ds)

        def train():
            for x, y in loader:
                x = x.cuda()
        """,
        "TOP104",
    )
    assert "pin_memory=True" in out and "x.cuda(non_blocking=True)" in out


def test_loader_name_also_bound_to_something_else():
    same(
        """
        from torch.utils.data import DataLoader
        if fast:
            loader = DataLoader(ds)
        else:
            loader = make_loader(ds)
        for x, y in loader:
            x = x.cuda()
        """,
        "TOP104",
    )


def test_device_to_host_never_gets_non_blocking():
    out = fix(
        """
        from torch.utils.data import DataLoader
        loader = DataLoader(ds)
        for x, y in loader:
            a = x.cpu()
            b = y.to("cpu")
            c = x.to(torch.float16)
            d = x.cuda().cpu().numpy()
        """,
        "TOP104",
    )
    assert "x.cpu()" in out and 'y.to("cpu")' in out and "x.to(torch.float16)" in out
    assert "x.cuda(non_blocking=True).cpu().numpy()" in out
    assert out.count("non_blocking") == 1


def test_tensors_not_from_the_loop_target():
    same(
        """
        from torch.utils.data import DataLoader
        loader = DataLoader(ds, pin_memory=True)
        w = torch.ones(3)
        for x, y in loader:
            w2 = w.cuda()
            z = torch.zeros(3).cuda()
        """,
        "TOP104",
    )


def test_rebound_or_mutated_targets_are_skipped():
    same(
        """
        from torch.utils.data import DataLoader
        loader = DataLoader(ds, pin_memory=True)
        for x, y in loader:
            x = preprocess(x)
            x = x.cuda()
            y.mul_(2)
            yy = y.cuda()
        """,
        "TOP104",
    )


def test_existing_arguments_are_respected():
    same(
        """
        from torch.utils.data import DataLoader
        loader = DataLoader(ds, 8, False, None, None, 0, None, False)
        for x, y in loader:
            x = x.cuda(non_blocking=False)
            y = y.to(device, True)
        """,
        "TOP104",
    )


def test_multiline_loader_keeps_layout():
    out = idempotent(
        """
        from torch.utils.data import DataLoader
        loader = DataLoader(
            ds,
            batch_size=8,
        )
        for x, y in loader:
            x = x.cuda()
        """,
        "TOP104",
    )
    assert "    batch_size=8,\n    pin_memory=True,\n)" in out


def test_loader_fix_is_safe_and_counted_once_for_two_loops():
    src = """
    from torch.utils.data import DataLoader
    loader = DataLoader(ds)
    for x, y in loader:
        x = x.cuda()
    for x, y in loader:
        y = y.cuda()
    """
    found = diags(src, "TOP104")
    assert len([d for d in found if "pin" in d.message]) == 1
    assert all(d.fix and d.fix.safety == "safe" for d in found)
    assert fix(src, "TOP104", unsafe=False).count("pin_memory=True") == 1


# --------------------------------------------------------------------------- TOP105


def test_reassigned_in_loop_is_not_flagged():
    same(
        """
        def run(xs, device):
            w = make()
            for x in xs:
                w = w.to(device)
            h = make()
            for x in xs:
                h.copy_(x)
                g = h.cuda()
            for k in range(3):
                for q in xs:
                    q.cuda()
        """,
        "TOP105",
    )


def test_hoistable_move_in_inner_loop():
    found = diags(
        """
        def run(epochs, xs):
            for e in range(epochs):
                w = make(e)
                for x in xs:
                    y = x @ w.cuda()
        """,
        "TOP105",
    )
    assert len(found) == 1 and "`w` is moved to the device on every iteration" in found[0].message


def test_global_read_from_a_function_loop_is_not_flagged():
    same(
        """
        w = make()
        def run(xs):
            for x in xs:
                y = w.cuda()
        """,
        "TOP105",
    )


def test_tensor_of_tensor_suggests_detach():
    found = diags(
        """
        import torch
        a = torch.randn(3)
        b = torch.tensor(a, device="cuda")
        c = torch.tensor(a).to(device)
        """,
        "TOP105",
    )
    msgs = [d.message for d in found]
    assert any('a.detach().to(device="cuda")' in m for m in msgs)
    assert any("a.detach().to(device)" in m for m in msgs)


def test_legacy_type_with_alias():
    found = diags("import torch as T\ny = x.type(T.cuda.LongTensor)\n", "TOP105")
    assert found and "x.to(device='cuda', dtype=T.int64)" in found[0].message
    same("import torch\ny = x.type(torch.FloatTensor)\nz = x.type()\n", "TOP105")


def test_empty_literal_is_not_a_copy():
    same('import torch\nfor i in range(3):\n    t = torch.tensor([], device="cuda")\n', "TOP105")


def test_display_only_never_changes_text():
    src = 'import torch\nfor i in range(3):\n    t = torch.tensor([i, i + 1], device="cuda")\n'
    found = diags(src, "TOP105")
    assert found and all(d.fix is None for d in found)
    assert fix(src, "TOP105") == src


# --------------------------------------------------------------------------- TOP103


def test_chain_folds_device_and_dtype():
    out = idempotent("import torch.nn as nn\nm = nn.LayerNorm(4).cuda().half()\n", "TOP103")
    # `import torch` goes to its sorted place, before `import torch.nn`
    assert out == 'import torch\nimport torch.nn as nn\nm = nn.LayerNorm(4, device="cuda", dtype=torch.half)\n'
    # a deterministic module folds without --unsafe-fixes
    assert 'device="cuda"' in fix("import torch.nn as nn\nm = nn.LayerNorm(4).cuda()\n", "TOP103", unsafe=False)


def test_random_module_waits_for_unsafe():
    src = "import torch.nn as nn\nm = nn.Linear(4, 3).cuda()\n"
    assert fix(src, "TOP103", unsafe=False) == src
    (d,) = diags(src, "TOP103")
    assert d.fix.safety == "unsafe" and d.fix.tags == ("rng",)


@pytest.mark.parametrize(
    "src",
    [
        "import torch.nn as nn\nm = nn.Linear(4, 3, True, 'cpu').cuda()\n",  # positional device
        "import torch.nn as nn\ndef f(rank):\n    return nn.Linear(4, 3).cuda(rank)\n",  # type of rank unknown
        "import torch.nn as nn\nm = nn.Linear(4, 3).to('cuda', copy=True)\n",
        "from mylib import nn\nm = nn.Linear(4, 3).cuda()\n",
        "import torch.nn as nn\ndef f(torch):\n    return torch.nn.Linear(4, 3).cuda()\n",
        "import torch.nn as nn\nm = nn.LazyBatchNorm1d().cuda()\n",
    ],
)
def test_module_not_flagged(src):
    same(src, "TOP103")


def test_prelu_with_init_and_dtype_is_tolerance():
    (d,) = diags("import torch.nn as nn\nm = nn.PReLU(init=0.1).double()\n", "TOP103")
    assert d.fix.safety == "unsafe" and d.fix.tags == ("tolerance",)
    (d,) = diags("import torch.nn as nn\nm = nn.PReLU().double()\n", "TOP103")
    assert d.fix.safety == "safe"
