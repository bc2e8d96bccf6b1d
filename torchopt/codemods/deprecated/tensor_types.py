"""Legacy tensor-type APIs: ``set_default_tensor_type`` (TOP823, rules.md DEP-003) and the typed
constructors ``torch.cuda.FloatTensor(n)`` / ``torch.Tensor(sizes).cuda()`` (TOP828, DEP-008)."""
from __future__ import annotations

import ast as _ast

import libcst as cst

from torchopt.analysis.names import callee, method_call, torch_name, torch_ref
from torchopt.analysis.values import int_value, string_value
from torchopt.analysis.syntax import has_comments, in_version_guard
from torchopt.codemods.deprecated import FAMILY
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid

# Legacy tensor type name -> the dtype attribute of torch it stands for.
TENSOR_TYPES = {
    "FloatTensor": "float32", "DoubleTensor": "float64", "HalfTensor": "float16", "BFloat16Tensor": "bfloat16",
    "ByteTensor": "uint8", "CharTensor": "int8", "ShortTensor": "int16", "IntTensor": "int32",
    "LongTensor": "int64", "BoolTensor": "bool",
}
_FLOAT_TYPES = {"FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor"}


def legacy_type(qualified: str | None) -> tuple[str, bool] | None:
    """(type name, is CUDA) for ``torch.FloatTensor`` / ``torch.cuda.FloatTensor``; else None."""
    if not qualified:
        return None
    for prefix, cuda in (("torch.cuda.", True), ("torch.", False)):
        if qualified.startswith(prefix) and qualified[len(prefix):] in TENSOR_TYPES:
            return qualified[len(prefix):], cuda
    return None


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
            after="import torch\n\ntorch.set_default_dtype(torch.float32)\ntorch.set_default_device(\"cuda\")\n"
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
        Valid("import torch\n\ntorch.set_default_dtype(torch.float64)\ntorch.set_default_dtype(torch.float32)\n", runnable=True),
        Valid("import torch\n\ndef f(t):\n    torch.set_default_tensor_type(t)\n", note="unknown type"),
        Valid("import torch\n\nif not hasattr(torch, 'set_default_device'):\n"
              "    torch.set_default_tensor_type(torch.cuda.FloatTensor)\n"),
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
        if not cuda and "cuda." in self.ctx.module.code and self._sets_cuda_type():
            self.report(node, fmt={**fmt, "new": ""})
            return
        dtype_call = f"{ref.name}.set_default_dtype({ref.name}.{TENSOR_TYPES[tname]})"
        lines = [stmt.with_changes(body=[cst.Expr(cst.parse_expression(dtype_call))])]
        new = dtype_call
        if cuda:
            dev_call = f'{ref.name}.set_default_device("cuda")'
            lines.append(cst.SimpleStatementLine(body=[cst.Expr(cst.parse_expression(dev_call))]))
            new += f"; {dev_call}"
        self.report(node, fmt={**fmt, "new": new}, target=stmt, replacement=cst.FlattenSentinel(lines),
                    imports=ref.imports)

    def _own_statement(self, node: cst.Call) -> cst.SimpleStatementLine | None:
        expr = self.get_metadata(ParentProvider, node, None)
        line = self.get_metadata(ParentProvider, expr, None) if isinstance(expr, cst.Expr) else None
        if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
            return line
        return None

    def _sets_cuda_type(self) -> bool:
        code = self.ctx.module.code
        return any(f"cuda.{t}" in code for t in _FLOAT_TYPES)


def callee_name(rule: Rule, expr: cst.BaseExpression) -> str | None:
    return torch_name(rule, expr) if isinstance(expr, (cst.Name, cst.Attribute)) else None


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
            for c in calls)

    examples = (
        Invalid(
            "import torch\n\nbuf = torch.cuda.FloatTensor(1024)\n",
            after="import torch\n\nbuf = torch.empty(1024, dtype=torch.float32, device=\"cuda\")\n",
        ),
        Invalid(
            "import torch\n\nidx = torch.LongTensor(4, 2)\nidx.fill_(1)\n",
            after="import torch\n\nidx = torch.empty(4, 2, dtype=torch.int64)\nidx.fill_(1)\n",
            runnable=True,
        ),
        Invalid(
            "import torch as T\n\nh = T.Tensor(8, 16).cuda(1)\n",
            after="import torch as T\n\nh = T.empty(8, 16, device=\"cuda:1\")\n",
        ),
        Invalid(
            "import torch\n\nz = torch.Tensor(3, 2).zero_()\n",
            after="import torch\n\nz = torch.empty(3, 2).zero_()\n",
            runnable=True,
        ),
        Valid("import torch\n\nt = torch.Tensor([3])\nu = torch.FloatTensor([1.0, 2.0])\n", runnable=True,
              note="data, not sizes"),
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
        self.report(node, fmt={"old": old, "extra": extra, "new": new},
                    replacement=cst.parse_expression(new), imports=ref.imports)
