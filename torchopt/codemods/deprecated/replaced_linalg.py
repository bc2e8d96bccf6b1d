"""TOP820 `replaced-linalg`: Reports linear-algebra functions removed from or deprecated in PyTorch (`torch.solve`,."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.syntax import in_version_guard
from torchopt.codemods.deprecated import FAMILY
from torchopt.codemods.deprecated.replacements import REPLACED
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


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
