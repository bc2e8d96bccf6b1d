"""Targeted tests for TOP201 (deprecated-amp-api) and the AMP advice rules TOP204, TOP206, TOP207:
a whole deprecated training script in one run, idempotence, the file's torch alias, isinstance and
annotations moving with the constructor, value uses, and no FutureWarning after the fix."""

from __future__ import annotations

import textwrap
import warnings

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

AMP = ("TOP201", "TOP204", "TOP206", "TOP207")


def fix(src: str, codes=("TOP201",), unsafe: bool = False) -> str:
    return fix_source(textwrap.dedent(src), Settings(select=tuple(codes)), unsafe=unsafe).text


def diags(src: str, code: str = "TOP201"):
    return [d for d in check_source(textwrap.dedent(src), Settings(select=(code,))).diagnostics if d.code == code]


def idempotent(src: str, codes=("TOP201",)) -> str:
    once = fix(src, codes)
    compile(once, "<out>", "exec")
    assert fix(once, codes) == once
    assert not [d for d in diags(once) if d.fix is not None]
    return once


def unchanged(src: str) -> None:
    src = textwrap.dedent(src)
    assert fix(src, unsafe=True) == src


SCRIPT = """\
import torch
import torch.nn as nn
from torch.cuda.amp import GradScaler, custom_bwd, custom_fwd


class Scale2(torch.autograd.Function):
    @staticmethod
    @custom_fwd
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @custom_bwd
    def backward(ctx, g):
        return g * 2


def make_scaler(enabled) -> GradScaler:
    return GradScaler(enabled=enabled)


def check(s: torch.cuda.amp.GradScaler) -> bool:
    return isinstance(s, torch.cuda.amp.GradScaler)


torch.manual_seed(0)
model = nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = make_scaler(False)
cpu_scaler = torch.cpu.amp.GradScaler(2.0 ** 8)
ok = check(scaler)
x = torch.randn(16, 8)
for step in range(3):
    with torch.cpu.amp.autocast(True, torch.bfloat16):
        out = Scale2.apply(model(x))
        loss = out.float().pow(2).mean()
    cpu_scaler.scale(loss).backward()
    cpu_scaler.step(opt)
    cpu_scaler.update()
    opt.zero_grad()
with torch.cuda.amp.autocast(enabled=False):
    final = model(x)
weight = model.weight.detach().clone()
"""

MIGRATED = """\
import torch
import torch.nn as nn
from torch.amp import GradScaler, custom_bwd, custom_fwd


class Scale2(torch.autograd.Function):
    @staticmethod
    @custom_fwd(device_type="cuda")
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @custom_bwd(device_type="cuda")
    def backward(ctx, g):
        return g * 2


def make_scaler(enabled) -> GradScaler:
    return GradScaler("cuda", enabled=enabled)


def check(s: torch.amp.GradScaler) -> bool:
    return isinstance(s, torch.amp.GradScaler)


torch.manual_seed(0)
model = nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = make_scaler(False)
cpu_scaler = torch.amp.GradScaler("cpu", 2.0 ** 8)
ok = check(scaler)
x = torch.randn(16, 8)
for step in range(3):
    with torch.autocast("cpu", enabled=True, dtype=torch.bfloat16):
        out = Scale2.apply(model(x))
        loss = out.float().pow(2).mean()
    cpu_scaler.scale(loss).backward()
    cpu_scaler.step(opt)
    cpu_scaler.update()
    opt.zero_grad()
with torch.autocast("cuda", enabled=False):
    final = model(x)
weight = model.weight.detach().clone()
"""


def _deprecation_warnings(src: str) -> list[str]:
    from semantic import run_program

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns = run_program(src)
    assert ns["ok"] is True
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, FutureWarning)
        and ("torch.cuda.amp" in str(w.message) or "torch.cpu.amp" in str(w.message))
    ]


def test_whole_script_in_one_run():
    result = fix_source(SCRIPT, Settings(select=("TOP201",)))
    assert result.text == MIGRATED
    assert not result.remaining
    assert fix_source(MIGRATED, Settings(select=("TOP201",)), unsafe=True).text == MIGRATED
    # One diagnostic per deprecated use: import, 2 decorators, 1 call, 2 type uses, 3 attribute calls.
    assert len(diags(SCRIPT)) == 9


def test_whole_script_same_results_and_no_future_warning():
    from semantic import compare_programs

    assert compare_programs(SCRIPT, MIGRATED) == []
    assert _deprecation_warnings(SCRIPT), "the original should warn (test sensitivity)"
    assert _deprecation_warnings(MIGRATED) == []


def test_alias_reused_everywhere():
    out = idempotent(
        """
        import torch as T

        scaler = T.cuda.amp.GradScaler()
        with T.cpu.amp.autocast(dtype=T.bfloat16):
            pass
        ok = isinstance(scaler, T.cuda.amp.GradScaler)
        """
    )
    assert out == textwrap.dedent(
        """
        import torch as T

        scaler = T.amp.GradScaler("cuda")
        with T.autocast("cpu", dtype=T.bfloat16):
            pass
        ok = isinstance(scaler, T.amp.GradScaler)
        """
    )


def test_module_alias_uses_file_torch_alias():
    out = idempotent(
        """
        import torch as T
        import torch.cuda.amp as amp

        scaler = amp.GradScaler()
        with amp.autocast(True):
            pass
        """
    )
    assert 'scaler = T.amp.GradScaler("cuda")' in out
    assert 'with T.autocast("cuda", enabled=True):' in out
    assert "import torch\n" not in out


def test_isinstance_and_annotation_move_with_constructor():
    src = """
        import torch
        from typing import Optional

        def build() -> torch.cuda.amp.GradScaler:
            return torch.cuda.amp.GradScaler(enabled=False)

        def is_scaler(s, cls=None) -> bool:
            return isinstance(s, (torch.cuda.amp.GradScaler, type(None)))

        s: Optional[torch.cuda.amp.GradScaler] = build()
        assert is_scaler(s)
        """
    out = idempotent(src)
    assert "torch.cuda.amp" not in out
    assert "isinstance(s, (torch.amp.GradScaler, type(None)))" in out
    assert "s: Optional[torch.amp.GradScaler] = build()" in out
    exec(compile(out, "<after>", "exec"), {})


def test_from_import_isinstance_needs_no_edit():
    out = idempotent(
        """
        from torch.cuda.amp import GradScaler

        s = GradScaler(enabled=False)
        ok = isinstance(s, GradScaler)
        """
    )
    assert "from torch.amp import GradScaler" in out
    assert 's = GradScaler("cuda", enabled=False)' in out
    assert "ok = isinstance(s, GradScaler)" in out


def test_value_use_rewrites_nothing():
    src = """
        from functools import partial
        from torch.cuda.amp import autocast, GradScaler

        ctx = partial(autocast, dtype=None)
        scaler = GradScaler()
        with autocast():
            pass
        """
    unchanged(src)
    found = diags(src)
    assert found and all(d.fix is None for d in found)
    assert any("used here as a value" in d.message and "torch.autocast" in d.message for d in found)


def test_value_use_of_attribute_form():
    src = """
        import contextlib
        import torch

        def ctx(use_amp):
            return torch.cuda.amp.autocast if use_amp else contextlib.nullcontext
        """
    unchanged(src)
    (d,) = diags(src)
    assert d.fix is None and "value" in d.message


def test_star_args_display_only():
    src = """
        import torch

        def run(*args, **kwargs):
            with torch.cuda.amp.autocast(*args):
                s = torch.cuda.amp.GradScaler(**kwargs)
        """
    unchanged(src)
    assert len(diags(src)) == 2


def test_positional_trap():
    out = idempotent(
        """
        import torch

        def f(use_amp, dt):
            with torch.cuda.amp.autocast(use_amp, dt, False):
                pass
        """
    )
    assert 'torch.autocast("cuda", enabled=use_amp, dtype=dt, cache_enabled=False)' in out


def test_positional_trap_runs():
    # `torch.autocast("cpu", False)` would raise on __enter__ (the bool lands in `dtype`); the fix must not.
    out = idempotent(
        "import torch\n\nwith torch.cpu.amp.autocast(False):\n    y = torch.ones(2, 2) @ torch.ones(2, 2)\n"
    )
    ns: dict = {}
    exec(compile(out, "<after>", "exec"), ns)
    assert ns["y"].dtype == __import__("torch").float32


def test_idempotent_on_new_api():
    unchanged(
        """
        import torch
        from torch.amp import GradScaler, autocast, custom_fwd

        scaler = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda"), autocast(device_type="cpu"):
            pass

        @custom_fwd(device_type="cuda")
        def f(ctx, x):
            return x
        """
    )


def test_try_except_fallback_left_alone():
    src = """
        try:
            from torch.amp import autocast
        except ImportError:
            from torch.cuda.amp import autocast

        with autocast("cuda"):
            pass
        """
    unchanged(src)
    assert not diags(src)


def test_unused_names_stay_in_old_import():
    out = idempotent(
        """
        from torch.cuda.amp import autocast, GradScaler

        scaler = GradScaler()
        """
    )
    assert out == textwrap.dedent(
        """
        from torch.cuda.amp import autocast
        from torch.amp import GradScaler

        scaler = GradScaler("cuda")
        """
    )


def test_function_scope_import():
    out = idempotent(
        """
        def step(model, x):
            from torch.cpu.amp import autocast
            with autocast(True):
                return model(x)
        """
    )
    assert "from torch.amp import autocast" in out
    assert 'with autocast("cpu", enabled=True):' in out


def test_single_quotes_kept():
    out = idempotent("import torch\n\nname = 'x'\ns = torch.cuda.amp.GradScaler()\n")
    assert "torch.amp.GradScaler('cuda')" in out


def test_decorators():
    out = idempotent(
        """
        import torch
        from torch.cuda.amp import custom_fwd

        class F(torch.autograd.Function):
            @staticmethod
            @custom_fwd(cast_inputs=torch.float32)
            def forward(ctx, x):
                return x

            @staticmethod
            @torch.cuda.amp.custom_bwd
            def backward(ctx, g):
                return g

        class Net(torch.nn.Module):
            @torch.cuda.amp.autocast()
            def forward(self, x):
                return x
        """
    )
    assert '@custom_fwd(device_type="cuda", cast_inputs=torch.float32)' in out
    assert '@torch.amp.custom_bwd(device_type="cuda")' in out
    assert '@torch.autocast("cuda")' in out


def test_torch_param_not_resolved():
    unchanged("def f(torch):\n    return torch.cuda.amp.GradScaler()\n")


# --------------------------------------------------------------------------- advice rules


def test_pure_fp16_subclass_chain_and_no_tensor():
    src = """
        import torch
        import torch.nn as nn

        class Base(nn.Module):
            pass

        class Net(Base):
            pass

        model = Net().to('cpu')
        model.half()
        x = torch.randn(3)
        x = x.half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        """
    found = diags(src, "TOP204")
    assert [d.line for d in found] == [12]
    assert fix(src, AMP, unsafe=True) == textwrap.dedent(src)


def test_gradient_penalty_needs_amp_in_file():
    src = "import torch\n\ndef gp(out, inp):\n    return torch.autograd.grad(out, inp, torch.ones_like(out), True, True)[0]\n"
    assert not diags(src, "TOP206")
    assert len(diags(src + "\nscaler = torch.amp.GradScaler('cuda')\n", "TOP206")) == 1


def test_custom_function_inherited_and_setup_context():
    src = """
        import torch

        class Base(torch.autograd.Function):
            pass

        class Op(Base):
            @staticmethod
            def forward(ctx, x):
                return x

        class New(torch.autograd.Function):
            @staticmethod
            def forward(x):
                return x

            @staticmethod
            def setup_context(ctx, inputs, output):
                pass

        with torch.autocast("cpu"):
            pass
        """
    found = diags(src, "TOP207")
    assert len(found) == 1 and "Op.forward" in found[0].message
