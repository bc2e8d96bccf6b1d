"""TOP824: ``torch.backends.cuda.sdp_kernel(...)`` → ``torch.nn.attention.sdpa_kernel([...])``."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee, torch_ref
from torchopt.analysis.syntax import has_comments, in_version_guard
from torchopt.codemods.deprecated import FAMILY
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid

# The old keyword arguments in signature order, and the backend each one enables.
FLAGS = (
    ("enable_flash", "FLASH_ATTENTION"),
    ("enable_math", "MATH"),
    ("enable_mem_efficient", "EFFICIENT_ATTENTION"),
    ("enable_cudnn", "CUDNN_ATTENTION"),
)


class SdpKernel(Rule):
    """## What it does
    Migrates the deprecated `torch.backends.cuda.sdp_kernel(enable_flash=..., enable_math=...,
    enable_mem_efficient=..., enable_cudnn=...)` context manager to
    `torch.nn.attention.sdpa_kernel([...])`, listing the `SDPBackend` members whose flag is true.

    ## Why is this slow
    The old context manager emits a `FutureWarning` on every entry and will be removed; the new
    one takes the backends to allow directly (and can also set their priority order).

    ## Example
    ```python
    import torch

    with torch.backends.cuda.sdp_kernel(enable_math=False):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    ```

    ## Use instead
    ```python
    import torch

    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION, torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    ```

    ## Fix safety
    Safe when every flag is a literal `True`/`False` (or left at its default, `True`): the same set
    of backends is enabled, so the same kernel runs. A flag given as an expression, a call that
    disables every backend, and version-guarded calls are reported without a fix. Needs PyTorch
    2.4 or newer (`target-torch`).
    """

    code = "TOP824"
    name = "sdp-kernel"
    family = FAMILY
    message = "`torch.backends.cuda.sdp_kernel` is deprecated"
    fix_title = "Use `torch.nn.attention.sdpa_kernel([...])`"
    safety = Safety.SAFE
    prefilter = ("sdp_kernel",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, ("torch.backends.cuda.sdp_kernel",))

    min_torch = (2, 4)

    examples = (
        Invalid(
            "import torch\n\nwith torch.backends.cuda.sdp_kernel(enable_math=False):\n    pass\n",
            after="import torch\n\nwith torch.nn.attention.sdpa_kernel(\n    [\n        torch.nn.attention.SDPBackend.FLASH_ATTENTION,\n        torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,\n        torch.nn.attention.SDPBackend.CUDNN_ATTENTION,\n    ]\n):\n    pass\n",
            runnable=True,
        ),
        Invalid(
            "import torch\nimport torch.nn.functional as F\n\nq = torch.randn(1, 2, 4, 8)\n"
            "with torch.backends.cuda.sdp_kernel(False, True, False, False):\n"
            "    out = F.scaled_dot_product_attention(q, q, q)\n",
            after="import torch\nimport torch.nn.functional as F\n\nq = torch.randn(1, 2, 4, 8)\n"
            "with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):\n"
            "    out = F.scaled_dot_product_attention(q, q, q)\n",
            runnable=True,
        ),
        Invalid(
            "from torch.backends.cuda import sdp_kernel\n\ndef f(flash):\n    with sdp_kernel(enable_flash=flash):\n        pass\n",
            after=None,
            note="a flag that is not a literal: reported without a fix",
        ),
        Valid(
            "from torch.nn.attention import SDPBackend, sdpa_kernel\n\nwith sdpa_kernel(SDPBackend.MATH):\n    pass\n",
            runnable=True,
        ),
        Valid(
            "import torch\n\nif hasattr(torch.nn, 'attention'):\n    ctx = torch.nn.attention.sdpa_kernel([])\n"
            "else:\n    ctx = torch.backends.cuda.sdp_kernel()\n"
        ),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) != "torch.backends.cuda.sdp_kernel" or in_version_guard(self, node):
            return
        flags = self._flags(node)
        ref = torch_ref(self)
        if flags is None or not any(flags) or ref is None or has_comments(node):
            self.report(node)
            return
        ns = f"{ref.name}.nn.attention"
        members = ", ".join(f"{ns}.SDPBackend.{backend}" for (_, backend), on in zip(FLAGS, flags) if on)
        self.report(node, replacement=cst.parse_expression(f"{ns}.sdpa_kernel([{members}])"), imports=ref.imports)

    @staticmethod
    def _flags(node: cst.Call) -> list[bool] | None:
        """Each flag's literal value (defaults True); None if one is not a literal bool."""
        values: list[bool] = [True] * len(FLAGS)
        names = [n for n, _ in FLAGS]
        for i, arg in enumerate(node.args):
            if arg.star:
                return None
            if arg.keyword is None:
                if i >= len(FLAGS):
                    return None
                slot = i
            elif arg.keyword.value in names:
                slot = names.index(arg.keyword.value)
            else:
                return None
            if not (isinstance(arg.value, cst.Name) and arg.value.value in ("True", "False")):
                return None
            values[slot] = arg.value.value == "True"
        return values
