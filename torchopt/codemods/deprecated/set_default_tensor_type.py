"""TOP823 `set-default-tensor-type`: Replaces `torch.set_default_tensor_type(...)`, deprecated since PyTorch 2.1, with."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.names import torch_ref
from torchopt.analysis.syntax import has_comments
from torchopt.analysis.syntax import in_version_guard
from torchopt.analysis.values import string_value
from torchopt.codemods.deprecated import FAMILY
from torchopt.codemods.deprecated.legacy_tensor_types import TENSOR_TYPES, callee_name, legacy_type
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


_FLOAT_TYPES = {"FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor"}


class SetDefaultTensorType(Rule):
    """## What it does
    Replaces `torch.set_default_tensor_type(...)`, deprecated since PyTorch 2.1, with
    `torch.set_default_dtype(...)` and, for a CUDA type, `torch.set_default_device("cuda")`.

    ## Why is this slow
    It is not slow, it is going away: PyTorch warns "torch.set_default_tensor_type() is deprecated
    as of PyTorch 2.1, please use torch.set_default_dtype() and torch.set_default_device() as
    alternatives". Scripts that create every tensor on the GPU this way keep doing so with
    `set_default_device`.

    ## Example
    ```python
    import torch

    torch.set_default_tensor_type(torch.cuda.FloatTensor)
    torch.set_default_tensor_type(torch.DoubleTensor)
    ```

    ## Use instead
    ```python
    import torch

    torch.set_default_dtype(torch.float32)
    torch.set_default_device("cuda")
    torch.set_default_dtype(torch.float64)
    ```

    ## Fix safety
    Safe: the default floating dtype and device are set to the same values. The two-statement form
    is only written where the call is a statement of its own. A CPU type is not migrated in a file
    that also sets a CUDA default type (the legacy call also moved the default back to the CPU,
    which `set_default_dtype` does not); non-float types (which raise) and version-guarded calls
    are left alone.
    """

    code = "TOP823"
    name = "set-default-tensor-type"
    family = FAMILY
    message = "`set_default_tensor_type({arg})` is deprecated since PyTorch 2.1"
    fix_title = "Use `{new}`"
    safety = Safety.SAFE
    prefilter = ("set_default_tensor_type",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, ("torch.set_default_tensor_type",))

    min_torch = (2, 0)

    examples = (
        Invalid(
            "import torch\n\ntorch.set_default_tensor_type(torch.cuda.FloatTensor)\nx = torch.zeros(2)\n",
            after='import torch\n\ntorch.set_default_dtype(torch.float32)\ntorch.set_default_device("cuda")\n'
            "x = torch.zeros(2)\n",
        ),
        Invalid(
            "import torch\n\n\ndef main():\n    torch.set_default_tensor_type('torch.DoubleTensor')\n"
            "    x = torch.ones(2) / 3\n    torch.set_default_dtype(torch.float32)\n    return x\n\nmain()\n",
            after="import torch\n\n\ndef main():\n    torch.set_default_dtype(torch.float64)\n"
            "    x = torch.ones(2) / 3\n    torch.set_default_dtype(torch.float32)\n    return x\n\nmain()\n",
            runnable=True,
        ),
        Invalid(
            "import torch as T\n\nok = T.set_default_tensor_type(T.cuda.HalfTensor) or True\n",
            after=None,
            note="not a statement of its own: reported without a fix",
        ),
        Valid(
            "import torch\n\ntorch.set_default_dtype(torch.float64)\ntorch.set_default_dtype(torch.float32)\n",
            runnable=True,
        ),
        Valid("import torch\n\ndef f(t):\n    torch.set_default_tensor_type(t)\n", note="unknown type"),
        Valid(
            "import torch\n\nif not hasattr(torch, 'set_default_device'):\n"
            "    torch.set_default_tensor_type(torch.cuda.FloatTensor)\n"
        ),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) != "torch.set_default_tensor_type" or len(node.args) != 1 or node.args[0].star:
            return
        arg = node.args[0].value
        text = string_value(arg)
        kind = legacy_type(text) if text is not None else legacy_type(callee_name(self, arg))
        if kind is None or kind[0] not in _FLOAT_TYPES or in_version_guard(self, node):
            return
        tname, cuda = kind
        ref = torch_ref(self)
        fmt = {"arg": self.ctx.module.code_for_node(arg)}
        stmt = self._own_statement(node)
        if ref is None or stmt is None or has_comments(node):
            self.report(node, fmt={**fmt, "new": ""})
            return
        if not cuda and "cuda." in self.ctx.text and self._sets_cuda_type():
            self.report(node, fmt={**fmt, "new": ""})
            return
        dtype_call = f"{ref.name}.set_default_dtype({ref.name}.{TENSOR_TYPES[tname]})"
        lines = [stmt.with_changes(body=[cst.Expr(cst.parse_expression(dtype_call))])]
        new = dtype_call
        if cuda:
            dev_call = f'{ref.name}.set_default_device("cuda")'
            lines.append(cst.SimpleStatementLine(body=[cst.Expr(cst.parse_expression(dev_call))]))
            new += f"; {dev_call}"
        self.report(
            node, fmt={**fmt, "new": new}, target=stmt, replacement=cst.FlattenSentinel(lines), imports=ref.imports
        )

    def _own_statement(self, node: cst.Call) -> cst.SimpleStatementLine | None:
        expr = self.get_metadata(ParentProvider, node, None)
        line = self.get_metadata(ParentProvider, expr, None) if isinstance(expr, cst.Expr) else None
        if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
            return line
        return None

    def _sets_cuda_type(self) -> bool:
        code = self.ctx.text
        return any(f"cuda.{t}" in code for t in _FLOAT_TYPES)
