"""TOP825: ``torch.testing.assert_allclose`` → ``torch.testing.assert_close``."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee, is_tensor_name, torch_ref
from torchopt.analysis.arguments import has_star, keyword, positional, set_kwarg
from torchopt.analysis.syntax import has_comments, in_version_guard
from torchopt.codemods.deprecated import FAMILY
from torchopt.rewrite.rule import Invalid, Rule, Safety, Tag, Valid

_KNOWN_KWARGS = {"actual", "expected", "rtol", "atol", "equal_nan", "msg"}


def _is_number(expr: cst.BaseExpression) -> bool:
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
        expr = expr.expression
    return isinstance(expr, (cst.Integer, cst.Float))


class AssertAllclose(Rule):
    """## What it does
    Migrates `torch.testing.assert_allclose(actual, expected, ...)`, deprecated since PyTorch 1.12,
    to `torch.testing.assert_close(actual, expected, ..., equal_nan=True, check_dtype=False)`,
    wrapping a Python number compared with a tensor in `torch.as_tensor(number, dtype=actual.dtype,
    device=actual.device)`.

    ## Why is this slow
    It is a deprecated API (a `FutureWarning` on every call) that will be removed. `assert_close`
    is its replacement, but it is stricter by default: the fix spells out the options that keep the
    old behaviour.

    ## Example
    ```python
    import torch

    torch.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-5)
    torch.testing.assert_allclose(loss, 0.5, rtol=0, atol=1e-6)
    ```

    ## Use instead
    ```python
    import torch

    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-5, equal_nan=True, check_dtype=False)
    torch.testing.assert_close(loss, torch.as_tensor(0.5, dtype=loss.dtype, device=loss.device), rtol=0, atol=1e-6, equal_nan=True, check_dtype=False)
    ```

    ## Fix safety
    `assert_allclose` passed float32-vs-float64, NaN-vs-NaN and tensor-vs-float comparisons that
    `assert_close` fails or raises on by default; `check_dtype=False`, `equal_nan=True` and
    the `as_tensor` wrapping keep them passing. With `rtol` and `atol` given and both arguments
    known to be tensors (or one a number literal), the fix is safe.

    Unsafe otherwise: without explicit tolerances (tag tolerance) `assert_close` uses tighter
    defaults for float32 (`rtol=1.3e-6` instead of `1e-4`); when an argument may be a Python number
    or a list (tag semantics), `assert_close` compares it as a sequence or raises `TypeError`.
    """

    code = "TOP825"
    name = "assert-allclose"
    family = FAMILY
    message = "`torch.testing.assert_allclose` is deprecated since PyTorch 1.12"
    fix_title = "Use `torch.testing.assert_close(..., equal_nan=True, check_dtype=False)`"
    safety = Safety.SAFE
    prefilter = ("assert_allclose",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, ("torch.testing.assert_allclose",))

    examples = (
        Invalid(
            "import torch\n\nout = torch.ones(3)\nref = torch.ones(3, dtype=torch.float64)\n"
            "torch.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-5)\n",
            after="import torch\n\nout = torch.ones(3)\nref = torch.ones(3, dtype=torch.float64)\ntorch.testing.assert_close(\n    out, ref, rtol=1e-3, atol=1e-5, equal_nan=True, check_dtype=False\n)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\nloss = torch.tensor(0.5)\ntorch.testing.assert_allclose(loss, 0.5, rtol=0, atol=1e-6)\n",
            after="import torch\n\nloss = torch.tensor(0.5)\ntorch.testing.assert_close(\n    loss,\n    torch.as_tensor(0.5, dtype=loss.dtype, device=loss.device),\n    rtol=0,\n    atol=1e-6,\n    equal_nan=True,\n    check_dtype=False,\n)\n",
            runnable=True,
        ),
        Invalid(
            "from torch.testing import assert_allclose\n\ndef check(a, b):\n    assert_allclose(a, b)\n",
            after="import torch\nfrom torch.testing import assert_allclose\n\ndef check(a, b):\n    torch.testing.assert_close(a, b, equal_nan=True, check_dtype=False)\n",
            unsafe=("tolerance", "semantics"),
        ),
        Valid("import torch\n\ntorch.testing.assert_close(torch.ones(2), torch.ones(2))\n", runnable=True),
        Valid("import numpy.testing as npt\n\nnpt.assert_allclose([1.0], [1.0])\n", runnable=True),
        Valid("import torch\n\ndef f(**kw):\n    torch.testing.assert_allclose(**kw)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) != "torch.testing.assert_allclose":
            return
        pos = positional(node)
        if has_star(node) or len(pos) > 2 or {a.keyword.value for a in node.args if a.keyword} - _KNOWN_KWARGS:
            return
        if in_version_guard(self, node):
            return
        args = pos + [a for a in node.args if a.keyword is not None and a.keyword.value in ("actual", "expected")]
        ref = torch_ref(self)
        if len(args) != 2 or ref is None or has_comments(node) or len(pos) != 2:
            self.report(node)
            return
        actual, expected = pos[0].value, pos[1].value
        tags: list[Tag] = []
        if keyword(node, "rtol") is None or keyword(node, "atol") is None:
            tags.append(Tag.TOLERANCE)
        new_args = list(node.args)
        kinds = [self._kind(actual), self._kind(expected)]
        if kinds == ["tensor", "number"] and isinstance(actual, cst.Name):
            wrapped = cst.parse_expression(
                f"{ref.name}.as_tensor({self.ctx.module.code_for_node(expected)}, dtype={actual.value}.dtype, "
                f"device={actual.value}.device)"
            )
            new_args[1] = pos[1].with_changes(value=wrapped)
        elif kinds != ["tensor", "tensor"]:
            tags.append(Tag.SEMANTICS)
        new = node.with_changes(func=ref.attr("testing.assert_close"), args=new_args)
        if keyword(new, "equal_nan") is None:
            new = set_kwarg(new, "equal_nan", cst.Name("True"))
        new = set_kwarg(new, "check_dtype", cst.Name("False"))
        msg = keyword(new, "msg")
        if msg is not None and not isinstance(msg.value, cst.SimpleString):
            # assert_allclose treats "" as "no message"; assert_close wants None for that.
            new = set_kwarg(new, "msg", cst.parse_expression(f"({self.ctx.module.code_for_node(msg.value)}) or None"))
        self.report(
            node,
            replacement=new,
            safety=Safety.UNSAFE if tags else Safety.SAFE,
            tags=tags,
            note="; ".join(self._why(t) for t in tags),
            imports=ref.imports,
        )

    def _kind(self, expr: cst.BaseExpression) -> str:
        if _is_number(expr):
            return "number"
        if isinstance(expr, cst.Name) and is_tensor_name(self, expr):
            return "tensor"
        if isinstance(expr, cst.Call) and (q := callee(self, expr)) is not None and q.count(".") == 1:
            return (
                "tensor"
                if q.split(".")[1] in ("tensor", "ones", "zeros", "randn", "rand", "full", "arange")
                else "other"
            )
        return "other"

    @staticmethod
    def _why(tag: Tag) -> str:
        if tag is Tag.TOLERANCE:
            return "assert_close's default tolerances are tighter (float32: rtol 1.3e-6 instead of 1e-4)"
        return "an argument may not be a tensor: assert_close compares sequences or raises TypeError on numbers"
