"""TOP828 `legacy-constructor`: Replaces the legacy typed constructors called with sizes, `torch.cuda.FloatTensor(n)`,."""

from __future__ import annotations

import ast as _ast

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.names import method_call
from torchopt.analysis.names import torch_ref
from torchopt.analysis.syntax import has_comments
from torchopt.analysis.values import int_value
from torchopt.codemods.deprecated import FAMILY
from torchopt.codemods.deprecated.legacy_tensor_types import TENSOR_TYPES, legacy_type
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class LegacyConstructor(Rule):
    """## What it does
    Replaces the legacy typed constructors called with sizes, `torch.cuda.FloatTensor(n)`,
    `torch.LongTensor(2, 3)`, `torch.Tensor(sizes).cuda()`, with `torch.empty(sizes, dtype=...,
    device=...)`.

    ## Why is this slow
    `torch.Tensor(n).cuda()` allocates the tensor on the host and then copies it to the GPU; the
    legacy constructors are also a deprecated, error-prone API: `torch.Tensor(3)` makes three
    uninitialised values, `torch.Tensor([3])` a tensor holding 3, and on a CPU-only build
    `torch.cuda.FloatTensor(3)` raises `TypeError`. `torch.empty` allocates once, where the tensor
    belongs, and says what it means.

    ## Example
    ```python
    import torch

    buf = torch.cuda.FloatTensor(1024)
    idx = torch.LongTensor(4, 2)
    h = torch.Tensor(8, 16).cuda()
    ```

    ## Use instead
    ```python
    import torch

    buf = torch.empty(1024, dtype=torch.float32, device="cuda")
    idx = torch.empty(4, 2, dtype=torch.int64)
    h = torch.empty(8, 16, device="cuda")
    ```

    ## Fix safety
    Safe: both forms return uninitialised memory of the same shape, dtype and device. Only calls
    whose arguments are all integer literals are rewritten (`torch.Tensor(data)` with a list or a
    name may be data, not a size). `torch.Tensor(...)` keeps the default dtype; `.cuda(i)` becomes
    `device="cuda:i"`.
    """

    code = "TOP828"
    name = "legacy-constructor"
    family = FAMILY
    message = "`{old}` is a legacy constructor{extra}"
    fix_title = "Use `{new}`"
    safety = Safety.SAFE
    prefilter = ("Tensor",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import torch_calls_to

        if not super().could_match(text):
            return False
        names = ["torch.Tensor", *(f"torch.{t}" for t in TENSOR_TYPES), *(f"torch.cuda.{t}" for t in TENSOR_TYPES)]
        calls = torch_calls_to(text, names)
        # _sizes: every argument an integer literal (no keyword, no star).
        return calls is None or any(
            c.args and not c.keywords and all(isinstance(a, _ast.Constant) and type(a.value) is int for a in c.args)
            for c in calls
        )

    examples = (
        Invalid(
            "import torch\n\nbuf = torch.cuda.FloatTensor(1024)\n",
            after='import torch\n\nbuf = torch.empty(1024, dtype=torch.float32, device="cuda")\n',
        ),
        Invalid(
            "import torch\n\nidx = torch.LongTensor(4, 2)\nidx.fill_(1)\n",
            after="import torch\n\nidx = torch.empty(4, 2, dtype=torch.int64)\nidx.fill_(1)\n",
            runnable=True,
        ),
        Invalid(
            "import torch as T\n\nh = T.Tensor(8, 16).cuda(1)\n",
            after='import torch as T\n\nh = T.empty(8, 16, device="cuda:1")\n',
        ),
        Invalid(
            "import torch\n\nz = torch.Tensor(3, 2).zero_()\n",
            after="import torch\n\nz = torch.empty(3, 2).zero_()\n",
            runnable=True,
        ),
        Valid(
            "import torch\n\nt = torch.Tensor([3])\nu = torch.FloatTensor([1.0, 2.0])\n",
            runnable=True,
            note="data, not sizes",
        ),
        Valid("import torch\n\ndef f(n):\n    return torch.cuda.FloatTensor(n)\n", note="n may be data"),
        Valid("import torch\n\nx = torch.empty(3, device='cpu')\n", runnable=True),
        Valid("class Tensor:\n    def __init__(self, *a):\n        pass\n\nt = Tensor(3)\n", runnable=True),
    )

    def visit_Call(self, node: cst.Call) -> None:
        moved = method_call(node, ("cuda",))
        if moved is not None:
            inner = moved[0]
            if self._sizes(inner) is None or (legacy := self._kind(inner)) is None or legacy[1]:
                return
            dev = self._cuda_arg(node)
            if dev is None:
                return
            self._fix(node, inner, legacy[0], dev)
            return
        parent = self.get_metadata(ParentProvider, node, None)
        if isinstance(parent, cst.Attribute) and parent.attr.value == "cuda":
            return  # reported with the `.cuda()` around it
        kind = self._kind(node)
        if kind is None or self._sizes(node) is None:
            return
        self._fix(node, node, kind[0], '"cuda"' if kind[1] else None)

    def _kind(self, call: cst.Call) -> tuple[str | None, bool] | None:
        q = callee(self, call)
        if q == "torch.Tensor":
            return None, False
        return legacy_type(q)

    @staticmethod
    def _sizes(call: cst.Call) -> list[cst.Arg] | None:
        if not call.args or any(a.keyword is not None or a.star for a in call.args):
            return None
        if all(int_value(a.value) is not None for a in call.args):
            return list(call.args)
        return None

    @staticmethod
    def _cuda_arg(node: cst.Call) -> str | None:
        if not node.args:
            return '"cuda"'
        if len(node.args) == 1 and node.args[0].keyword is None and (n := int_value(node.args[0].value)) is not None:
            return f'"cuda:{n}"'
        return None

    def _fix(self, node: cst.Call, ctor: cst.Call, tname: str | None, device: str | None) -> None:
        ref = torch_ref(self)
        old = " ".join(self.ctx.module.code_for_node(node).split())
        extra = " that allocates on the host, then copies" if node is not ctor else ""
        if ref is None or has_comments(node):
            self.report(node, fmt={"old": old, "extra": extra, "new": ""})
            return
        sizes = ", ".join(self.ctx.module.code_for_node(a.value) for a in ctor.args)
        kw = ""
        if tname is not None:
            kw += f", dtype={ref.name}.{TENSOR_TYPES[tname]}"
        if device is not None:
            kw += f", device={device}"
        new = f"{ref.name}.empty({sizes}{kw})"
        self.report(
            node,
            fmt={"old": old, "extra": extra, "new": new},
            replacement=cst.parse_expression(new),
            imports=ref.imports,
        )
