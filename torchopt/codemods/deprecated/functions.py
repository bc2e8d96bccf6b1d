"""Deprecated functions: ``torch.range`` (TOP826, rules.md DEP-006), ``torch.autograd.Variable``
(TOP829, DEP-009) and the linear-algebra functions ``torch.linalg`` replaced (TOP820, DEP-010)."""
from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee, torch_ref
from torchopt.analysis.values import int_value
from torchopt.analysis.arguments import has_star, keywords, positional
from torchopt.analysis.syntax import has_comments, in_version_guard
from torchopt.codemods.deprecated import FAMILY
from torchopt.rewrite.rule import Invalid, Rule, Safety, Tag, Valid


def _signed_int(expr: cst.BaseExpression) -> int | None:
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        inner = int_value(expr.expression)
        return None if inner is None else -inner
    return int_value(expr)


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


class AutogradVariable(Rule):
    """## What it does
    Removes the `torch.autograd.Variable(t)` wrapper: since PyTorch 0.4 it returns the tensor
    unchanged.

    ## Why is this slow
    A leftover of the Variable/Tensor split that costs a Python call per use and confuses readers
    into thinking the value is special.

    ## Example
    ```python
    from torch.autograd import Variable

    x = Variable(batch.cuda())
    ```

    ## Use instead
    ```python
    from torch.autograd import Variable

    x = batch.cuda()
    ```

    ## Fix safety
    Safe for `Variable(t)` with a single argument: the result is `t` itself. `Variable(t,
    requires_grad=True)` (it makes a new leaf) and `volatile=` (ignored since 0.4) are reported
    without a fix. The now-unused import is left for your import cleaner.
    """

    code = "TOP829"
    name = "autograd-variable"
    family = FAMILY
    message = "`Variable(...)` is a no-op since PyTorch 0.4"
    fix_title = "Drop the `Variable(...)` wrapper"
    safety = Safety.SAFE
    prefilter = ("Variable",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(
            text, ("torch.autograd.Variable", "torch.autograd.variable.Variable"))

    examples = (
        Invalid(
            "import torch\nfrom torch.autograd import Variable\n\nx = Variable(torch.ones(2)) * 2\n",
            after="import torch\nfrom torch.autograd import Variable\n\nx = torch.ones(2) * 2\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\na = torch.ones(2)\ny = torch.autograd.Variable(a + 1).sum()\n",
            after="import torch\n\na = torch.ones(2)\ny = (a + 1).sum()\n",
            runnable=True,
        ),
        Invalid(
            "import torch\nfrom torch.autograd import Variable\n\nw = Variable(torch.zeros(3), requires_grad=True)\n",
            after=None,
            note="makes a leaf that requires grad: reported without a fix",
        ),
        Valid("import torch\n\nw = torch.zeros(3, requires_grad=True)\n", runnable=True),
        Valid("import tensorflow as tf\n\nv = tf.Variable(1.0)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) not in ("torch.autograd.Variable", "torch.autograd.variable.Variable"):
            return
        if in_version_guard(self, node):
            return
        if len(node.args) != 1 or node.args[0].keyword is not None or node.args[0].star or has_comments(node):
            self.report(node)
            return
        value = node.args[0].value
        if not isinstance(value, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) and not value.lpar:
            value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        self.report(node, replacement=value.with_changes(
            lpar=[*node.lpar, *value.lpar], rpar=[*value.rpar, *node.rpar]) if node.lpar else value)


# Removed or deprecated functions and what replaces them (TorchFix TOR001/TOR101 cover these too).
REPLACED = {
    "torch.solve": "torch.linalg.solve(A, B) (note: arguments swapped, torch.solve(B, A))",
    "torch.symeig": "torch.linalg.eigh (or eigvalsh)",
    "torch.eig": "torch.linalg.eig (or eigvals)",
    "torch.lstsq": "torch.linalg.lstsq(A, B) (note: arguments swapped)",
    "torch.matrix_rank": "torch.linalg.matrix_rank",
    "torch.chain_matmul": "torch.linalg.multi_dot([...])",
    "torch.cholesky": "torch.linalg.cholesky (upper=True: .mH of the result)",
    "torch.qr": "torch.linalg.qr (some=False: mode='complete')",
    "torch.lu": "torch.linalg.lu_factor",
    "torch.norm": "torch.linalg.vector_norm / matrix_norm",
    "torch.ger": "torch.outer",
}


class ReplacedLinalg(Rule):
    """## What it does
    Reports linear-algebra functions removed from or deprecated in PyTorch (`torch.solve`,
    `torch.symeig`, `torch.eig`, `torch.lstsq`, `torch.matrix_rank`, `torch.chain_matmul`,
    `torch.cholesky`, `torch.qr`, `torch.lu`, `torch.norm`, `torch.ger`, ...) with their
    `torch.linalg` replacement.

    ## Why is this slow
    The removed ones raise on current PyTorch; the deprecated ones dispatch through slower
    compatibility paths. The `torch.linalg` functions are the maintained, batched, GPU-accelerated
    implementations.

    ## Example
    ```python
    import torch

    x, _ = torch.solve(b, A)
    ```

    ## Use instead
    ```python
    import torch

    x = torch.linalg.solve(A, b)
    ```

    ## Fix safety
    Display only: several replacements swap arguments, return other tuples or change defaults, so
    the edit needs a reader. TorchFix (TOR001/TOR101) offers fixes for some of them.
    """

    code = "TOP820"
    name = "replaced-linalg"
    family = FAMILY
    message = "`{old}` is removed or deprecated: use {new}"
    safety = Safety.DISPLAY
    # `.norm(`-style dotted calls, plus the distinctive names (`from torch import chain_matmul`).
    # A call that resolves to torch.X spells X (in the call or in its import).
    prefilter = tuple(q.rsplit(".", 1)[1] for q in REPLACED)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, REPLACED)

    examples = (
        Invalid("import torch\n\ndef f(A, b):\n    return torch.solve(b, A)\n"),
        Invalid("from torch import chain_matmul\n\ndef f(a, b, c):\n    return chain_matmul(a, b, c)\n"),
        Valid("import torch\n\nA = torch.eye(2)\nx = torch.linalg.solve(A, torch.ones(2))\n", runnable=True),
        Valid("import numpy as np\n\nn = np.linalg.norm([3.0, 4.0])\n", runnable=True),
    )

    def visit_Call(self, node: cst.Call) -> None:
        q = callee(self, node)
        if q in REPLACED and not in_version_guard(self, node):
            self.report(node, fmt={"old": q, "new": REPLACED[q]})

