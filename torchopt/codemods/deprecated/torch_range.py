"""TOP826 `torch-range`: Replaces `torch.range(start, end, step)`, deprecated and end-inclusive, with."""

from __future__ import annotations

import math

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import keywords
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.names import torch_ref
from torchopt.analysis.syntax import has_comments
from torchopt.analysis.syntax import in_version_guard
from torchopt.codemods.deprecated import FAMILY
from torchopt.codemods.deprecated.replacements import _signed_int
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class TorchRange(Rule):
    """## What it does
    Replaces `torch.range(start, end, step)`, deprecated and end-inclusive, with
    `torch.arange(start, end + step, step, dtype=torch.get_default_dtype())`.

    ## Why is this slow
    `torch.range` warns on every call and will be removed. Its end-inclusive bound and float
    result (unlike Python's `range` and `torch.arange`) are a classic source of off-by-one bugs.

    ## Example
    ```python
    import torch

    steps = torch.range(0, 9)
    ```

    ## Use instead
    ```python
    import torch

    steps = torch.arange(0, 10, dtype=torch.get_default_dtype())
    ```

    ## Fix safety
    Safe when start, end and step are integer literals: the end moves one unit past itself in the
    step's direction (`torch.range(1, 10, 2)` becomes `torch.arange(1, 11, 2, ...)`, still
    1, 3, 5, 7, 9), so the elements and the default floating dtype are the same. With an explicit
    `dtype=` it is kept. A call `torch.range` rejects (zero step, bounds against the step's sign)
    is reported without a fix, so that it keeps raising.

    Unsafe (tag tolerance) for float literals: the new end sits half a step past the last element
    PyTorch counts in double precision, so the length is the same, but `torch.arange` computes each
    element another way and values may differ in the last bits (most visibly near zero). Unsafe (tag semantics) for bounds that are not literals: `end + step` gives the
    same elements only when `end - start` is a whole multiple of the step, and one more element
    otherwise.
    """

    code = "TOP826"
    name = "torch-range"
    family = FAMILY
    message = "`torch.range` is deprecated (and includes its end)"
    fix_title = "Use `{new}`"
    safety = Safety.SAFE
    prefilter = ("range",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, ("torch.range",))

    examples = (
        Invalid(
            "import torch\n\nsteps = torch.range(0, 9)\n",
            after="import torch\n\nsteps = torch.arange(0, 10, dtype=torch.get_default_dtype())\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\nodd = torch.range(1, 10, 2)\n",
            after="import torch\n\nodd = torch.arange(1, 11, 2, dtype=torch.get_default_dtype())\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\ndown = torch.range(5, 0, -1, dtype=torch.int64)\n",
            after="import torch\n\ndown = torch.arange(5, -1, -1, dtype=torch.int64)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\ntenths = torch.range(0, 0.3, 0.1)\n",
            after="import torch\n\ntenths = torch.arange(0, 0.25, 0.1, dtype=torch.get_default_dtype())\n",
            unsafe="tolerance",
        ),
        Invalid(
            "import torch\n\n\ndef grid(lo, hi, h):\n    return torch.range(lo, hi, h)\n",
            after="import torch\n\n\ndef grid(lo, hi, h):\n    return torch.arange(lo, hi + h, h, dtype=torch.get_default_dtype())\n",
            unsafe="semantics",
        ),
        Invalid(
            "import torch\n\nbad = torch.range(5, 4, 1)\n",
            after=None,
            note="torch.range raises here; an arange would return an empty tensor",
        ),
        Valid("import torch\n\nx = torch.arange(10)\nfor i in range(3):\n    pass\n", runnable=True),
        Valid("import torch\n\ndef f(a):\n    return torch.range(*a)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) != "torch.range" or has_star(node) or in_version_guard(self, node):
            return
        pos = positional(node)
        kws = keywords(node)
        if len(pos) not in (2, 3) or set(kws) - {"dtype", "device", "requires_grad", "layout"}:
            return
        ref = torch_ref(self)
        if ref is None or has_comments(node):
            self.report(node, fmt={"new": ""})
            return
        code = self.ctx.module.code_for_node
        start, end = pos[0].value, pos[1].value
        step = pos[2].value if len(pos) == 3 else None
        bounds = _exclusive_end(start, end, step)
        if bounds is None:
            self.report(node, fmt={"new": ""})
            return
        new_end, tags, note = bounds
        args = [code(start), new_end] + ([code(step)] if step is not None else [])
        extra = [f"{k}={code(a.value)}" for k, a in kws.items()]
        if "dtype" not in kws:
            extra.insert(0, f"dtype={ref.name}.get_default_dtype()")
        new = f"{ref.name}.arange({', '.join(args + extra)})"
        self.report(
            node, fmt={"new": new}, replacement=cst.parse_expression(new), tags=tags, note=note, imports=ref.imports
        )


def _number(expr: cst.BaseExpression) -> int | float | None:
    """The value of an int or float literal, with an optional sign."""
    sign = 1
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
        sign = -1 if isinstance(expr.operator, cst.Minus) else 1
        expr = expr.expression
    if isinstance(expr, cst.Float):
        try:
            return sign * float(expr.evaluated_value)
        except (ValueError, OverflowError):
            return None
    whole = _signed_int(expr)
    return None if whole is None else sign * whole


def _exclusive_end(
    start: cst.BaseExpression, end: cst.BaseExpression, step: cst.BaseExpression | None
) -> tuple[str, tuple[Tag, ...], str] | None:
    """The end bound `torch.arange` needs to yield the elements of `torch.range`, with the tags and
    note of the fix; None when no fix should be written (a call `torch.range` rejects must keep
    raising rather than turn into an empty tensor)."""
    lo, hi = _number(start), _number(end)
    by = 1 if step is None else _number(step)
    if lo is None or hi is None or by is None:
        # Adding one step is exact only when the span is a whole number of steps: otherwise the
        # result has one more element, which changes shapes, not just rounding.
        plus = "1" if step is None else _source(step)
        return (
            f"{_source(end)} + {plus}",
            (Tag.SEMANTICS,),
            "exact when `end - start` is a whole multiple of the step; otherwise one more element",
        )
    if by == 0 or (hi - lo) * by < 0:
        return None
    if all(isinstance(v, int) for v in (lo, hi, by)):
        # Integers: `end` moved one unit past itself in the step's direction keeps exactly the
        # elements start + k*step <= end, and no more.
        return str(hi + (1 if by > 0 else -1)), (), ""
    # Floats: an end half a step past the last element PyTorch counts (in double precision) keeps the
    # length; the elements themselves are computed by another formula and may differ in rounding.
    count = int((hi - lo) / by) + 1
    new_end = lo + (count - 0.5) * by
    if not math.isfinite(new_end) or math.ceil((new_end - lo) / by) != count:
        return None
    return (
        repr(new_end),
        (Tag.TOLERANCE,),
        f"the same {count} elements, computed another way: values may differ in the last bits",
    )


_BINDS_TIGHTER_THAN_PLUS = (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.Integer, cst.Float)


def _source(expr: cst.BaseExpression) -> str:
    """The expression's text, parenthesised where `+ step` would otherwise bind into it."""
    text = cst.Module(body=[]).code_for_node(expr)
    if isinstance(expr, _BINDS_TIGHTER_THAN_PLUS) or expr.lpar:
        return text
    if isinstance(expr, cst.BinaryOperation) and isinstance(
        expr.operator, (cst.Add, cst.Subtract, cst.Multiply, cst.Divide, cst.FloorDivide, cst.Modulo, cst.Power)
    ):
        return text
    return f"({text})"
