"""TOP826 `torch-range`: Replaces `torch.range(start, end, step)`, deprecated and end-inclusive, with."""
from __future__ import annotations

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
    Safe when start, end and step are integer literals: the elements and the default floating
    dtype are the same (E-33); the new end is computed into a literal. With an explicit `dtype=`
    it is kept. Unsafe (tag tolerance) for float or non-literal bounds: `end + step` may admit one
    more element through floating-point rounding.
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
            "import torch\n\ndown = torch.range(5, 0, -1, dtype=torch.int64)\n",
            after="import torch\n\ndown = torch.arange(5, -1, -1, dtype=torch.int64)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\n\ndef grid(lo, hi, h):\n    return torch.range(lo, hi, h)\n",
            after="import torch\n\n\ndef grid(lo, hi, h):\n    return torch.arange(lo, hi + h, h, dtype=torch.get_default_dtype())\n",
            unsafe="tolerance",
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
        ints = [_signed_int(e) for e in (start, end, step or cst.Integer("1"))]
        tags: tuple[Tag, ...] = ()
        if all(v is not None for v in ints):
            args = [code(start), str(ints[1] + ints[2])] + ([code(step)] if step is not None else [])  # type: ignore[operator]
        else:
            tags = (Tag.TOLERANCE,)
            plus = code(step) if step is not None else "1"
            args = [code(start), f"{code(end)} + {plus}"] + ([code(step)] if step is not None else [])
        extra = [f"{k}={code(a.value)}" for k, a in kws.items()]
        if "dtype" not in kws:
            extra.insert(0, f"dtype={ref.name}.get_default_dtype()")
        new = f"{ref.name}.arange({', '.join(args + extra)})"
        self.report(node, fmt={"new": new}, replacement=cst.parse_expression(new), tags=tags,
                    note="with float or unknown bounds `end + step` may admit one more element" if tags else "",
                    imports=ref.imports)
