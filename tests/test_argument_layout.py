"""An argument added to a call keeps the call's layout: one argument per line stays so, and the
closing parenthesis stays where the user put it."""

from __future__ import annotations

import libcst as cst
import pytest

from torchopt.analysis.arguments import set_kwarg


@pytest.mark.parametrize(
    "before, after",
    [
        ("f(a, b)", "f(a, b, n=1)"),
        ("f(a)", "f(a, n=1)"),
        ("f(a,)", "f(a, n=1,)"),
        # No trailing comma, `)` on its own line: the new argument goes on its own line before it.
        ("f(\n    a,\n    b\n)", "f(\n    a,\n    b,\n    n=1\n)"),
        ("f(a,\n  b\n)", "f(a,\n  b,\n  n=1\n)"),
        ("f(\n    a,\n    b,\n)", "f(\n    a,\n    b,\n    n=1,\n)"),
    ],
)
def test_added_keyword_follows_the_calls_layout(before, after):
    call = cst.ensure_type(cst.parse_expression(before), cst.Call)
    assert cst.Module([]).code_for_node(set_kwarg(call, "n", cst.Integer("1"))) == after


def test_dataloader_fix_on_a_multi_line_call_leaves_no_blank_line(tmp_path):
    from torchopt.rewrite.config import Settings
    from torchopt.rewrite.engine import fix_source

    src = (
        "import torch\n"
        "from torch.utils.data import DataLoader\n\n\n"
        "def loader(ds):\n"
        "    return DataLoader(\n"
        "        ds,\n"
        "        batch_size=8,\n"
        "        shuffle=True\n"
        "    )\n\n\n"
        "def train(model, opt, ds):\n"
        "    for x, y in loader(ds):\n"
        "        opt.zero_grad()\n"
        "        torch.nn.functional.mse_loss(model(x), y).backward()\n"
        "        opt.step()\n"
    )
    out = fix_source(src, Settings(), "train.py", unsafe=True).text
    # the touched call is laid out as ruff format would: its arguments on one indented line
    assert (
        "    return DataLoader(\n        ds, batch_size=8, shuffle=True, num_workers=min(8, os.cpu_count() or 1)\n    )\n"
        in out
    )
    assert not any(line.strip() == "" and line for line in out.splitlines()), "a line of only spaces"
    assert "\n    )\n" in out
