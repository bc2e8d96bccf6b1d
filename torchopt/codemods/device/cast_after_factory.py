"""TOP102 `cast-after-factory`: Flags a tensor factory whose result is cast at once, e.g. `torch.zeros(n).half()` or."""
from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import set_kwarg
from torchopt.analysis.names import callee
from torchopt.analysis.names import method_call
from torchopt.analysis.syntax import has_comments
from torchopt.analysis.syntax import source
from torchopt.analysis.values import CAST_METHODS
from torchopt.analysis.values import dtype_of
from torchopt.codemods.device.factory_analysis import (
    FACTORIES, _FactoryRule, _NOTE_LEAF, _could_cast, _keep_parens, _removed_has_comments, factory_kind,
    fold_verdict, parse_to
)
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class CastAfterFactory(_FactoryRule):
    """## What it does
    Flags a tensor factory whose result is cast at once, e.g. `torch.zeros(n).half()` or
    `torch.arange(n).to(torch.float32)`, and passes `dtype=` to the factory instead.

    ## Why is this slow
    The tensor is created in the default dtype, then converted into a second tensor: one extra
    allocation and one extra kernel (or host loop) per call, and twice the memory traffic.

    ## Example
    ```python
    x = torch.zeros(3).half()
    i = torch.arange(5).float()
    y = torch.ones(3).to(torch.float16)
    ```

    ## Use instead
    ```python
    x = torch.zeros(3, dtype=torch.half)
    i = torch.arange(5, dtype=torch.float32)
    y = torch.ones(3, dtype=torch.float16)
    ```

    ## Fix safety
    Safe when the values cannot change: `zeros`/`ones`/`empty*`/`eye` and their `*_like`, integer
    literals (`arange(5)`, `tensor([1, 2])`) in a dtype that holds every value exactly, integer data of
    unknown size (`arange(len(x))`) cast to float64/int32/int64, and constant
    data exactly representable both in the factory's dtype and in the target dtype
    (`torch.full((2,), 7.0).half()`); also a cast to the dtype the factory already creates.
    An existing `dtype=` is replaced only under these conditions.

    Unsafe fixes:
    * **tolerance**: downcasts of deterministic data (`torch.tensor(vals).half()`,
      `torch.linspace(...).half()`): one rounding instead of two; no mismatch was observed, but
      nothing guarantees against double rounding. Also integer data of unknown size cast to
      float32/float16/bfloat16 (exact only below 2**24/2**11/2**8), and host data whose own dtype
      is unknown (`torch.tensor(x).float()`, `torch.arange(n).float()` with `n` of unknown type).
    * **rng**: random factories (`rand(n).double()`, `randn(n).half()`, `randint(...).int()`)
      generate in the new dtype, which gives other values.
    * **semantics**: with `requires_grad=True` the original result is a non-leaf copy; the
      rewritten tensor is a leaf (usually a bug fix).

    Not fixed (reported): upcasts of rounded data, which are **not** equivalent
    (`torch.arange(0, 1, 0.1).double()`, `torch.linspace(0, 1, 7).double()`,
    `torch.full((2,), 0.1).double()`, `torch.tensor([0.1]).double()` first round to float32),
    float data cast to an integer dtype, values that overflow the target dtype, and, in files that
    call `torch.set_default_dtype`/`set_default_tensor_type`, anything but zeros/ones/empty and
    integer data.
    """

    code = "TOP102"
    name = "cast-after-factory"
    message = "`{factory}(...)` is created, then cast with `{cast}`"
    fix_title = "Create it in that dtype: `{factory}(..., dtype={dtype})`"
    safety = Safety.SAFE
    prefilter = tuple(f".{m}(" for m in CAST_METHODS) + (".to(",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.patterns import chained_call

        # visit_Call: `<torch factory>(...).<cast>()` (method_call + factory_kind).
        return super().could_match(text) and chained_call(text, (*CAST_METHODS, "to"), FACTORIES) \
            and _could_cast(text)

    def visit_Call(self, node: cst.Call) -> None:
        mc = method_call(node, (*CAST_METHODS, "to"))
        if mc is None:
            return
        inner, meth = mc
        q = callee(self, inner)
        kind = factory_kind(q)
        if kind is None or self.factory_blockers(kind, inner):
            return
        ref = self.ref_at(node)
        if meth == "to":
            tr = parse_to(self, node)
            if tr is None or tr.dtype is None or tr.device is not None or tr.unknown is not None:
                return
            dtype_expr: cst.BaseExpression | None = tr.dtype
            dst = dtype_of(self, tr.dtype)
            cast = f".to({source(self, tr.dtype)})"
            dtype_text = source(self, tr.dtype)
        else:
            if node.args:
                return  # memory_format= and the like
            dst, spelling = CAST_METHODS[meth]
            dtype_expr = ref.attr(spelling) if ref is not None else None
            cast = f".{meth}()"
            dtype_text = f"{ref.name if ref else 'torch'}.{spelling}"
        factory = source(self, inner.func)
        fmt = {"factory": factory, "cast": cast, "dtype": dtype_text}
        data = self.data(kind, inner)
        verdict = fold_verdict(data, dst)
        if not verdict.ok:
            self.report(node, fmt={**fmt, "why": verdict.reason},
                        message=self.message + "; not folded: {why}")
            return
        tags = list(verdict.tags)
        notes = [verdict.reason] if verdict.tags else []
        noop = data.src is not None and data.src == dst
        if self.requires_grad(inner) and not noop:
            tags.append(Tag.SEMANTICS)
            notes.append(_NOTE_LEAF)
        if dtype_expr is None:
            self.report(node, fmt=fmt, message=self.message + "; no fix: `torch` is bound to something else here")
            return
        existing = keyword(inner, "dtype")
        if _removed_has_comments(node) or (existing is not None and has_comments(existing.value)):
            self.report(node, fmt=fmt, message=self.message + "; not fixed automatically: a comment would be lost")
            return
        new = set_kwarg(inner, "dtype", dtype_expr, before=("requires_grad", "pin_memory"))
        new = _keep_parens(node, new)
        imports = ref.imports if (meth != "to" and ref is not None) else ()
        self.report(node, fmt=fmt, replacement=new, safety=Safety.UNSAFE if tags else Safety.SAFE,
                    tags=tuple(tags), note="; ".join(notes), imports=imports)

    examples = ()  # filled below


CastAfterFactory.examples = (
    # --- the casts that fold into the factory
    Invalid("import torch\nx = torch.zeros(3).half()\n",
            after="import torch\nx = torch.zeros(3, dtype=torch.half)\n", runnable=True),
    Invalid("import torch\nx = torch.ones(3).to(torch.float16)\n",
            after="import torch\nx = torch.ones(3, dtype=torch.float16)\n", runnable=True),
    Invalid("import torch\nx = torch.arange(5).float()\n",
            after="import torch\nx = torch.arange(5, dtype=torch.float32)\n", runnable=True),
    Invalid("import torch\nx = torch.tensor([1, 2]).float()\n",
            after="import torch\nx = torch.tensor([1, 2], dtype=torch.float32)\n", runnable=True),
    Invalid("import torch\nx = torch.full((2,), 7.0).half()\n",
            after="import torch\nx = torch.full((2,), 7.0, dtype=torch.half)\n", runnable=True),
    Invalid("import torch\nx = torch.arange(0, 1, 0.1).double()\n", note="0.30000001192092896 vs 0.30000000000000004"),
    Invalid("import torch\nx = torch.linspace(0, 1, 7).double()\n", note="rounds to float32 first"),
    Invalid("import torch\nx = torch.full((2,), 0.1).double()\n", note="rounds to float32 first"),
    Invalid("import torch\nx = torch.tensor([0.1]).double()\n", note="rounds to float32 first"),
    Invalid("import torch\nvals = [0.1, 0.2, 1 / 3]\nx = torch.tensor(vals).half()\n",
            after="import torch\nvals = [0.1, 0.2, 1 / 3]\nx = torch.tensor(vals, dtype=torch.half)\n",
            unsafe="tolerance", runnable=True),
    Invalid("import torch\nvals = [0.1, 0.2, 1 / 3]\nx = torch.tensor(vals).bfloat16()\n",
            after="import torch\nvals = [0.1, 0.2, 1 / 3]\nx = torch.tensor(vals, dtype=torch.bfloat16)\n",
            unsafe="tolerance", runnable=True),
    Invalid("import torch\nx = torch.rand(4).double()\n",
            after="import torch\nx = torch.rand(4, dtype=torch.float64)\n", unsafe="rng", runnable=True),
    Invalid("import torch\nx = torch.randn(100).half()\n",
            after="import torch\nx = torch.randn(100, dtype=torch.half)\n", unsafe="rng", runnable=True),
    Invalid("import torch\nx = torch.randint(0, 10, (3,)).to(torch.int32)\n",
            after="import torch\nx = torch.randint(0, 10, (3,), dtype=torch.int32)\n", unsafe="rng", runnable=True),
    Invalid("import torch\nx = torch.randperm(8).to(torch.int32)\n",
            after="import torch\nx = torch.randperm(8, dtype=torch.int32)\n", unsafe="rng", runnable=True),
    Invalid("import torch\nx = torch.zeros(3, requires_grad=True).double()\n",
            after="import torch\nx = torch.zeros(3, dtype=torch.float64, requires_grad=True)\n",
            unsafe="semantics", runnable=True),
    Invalid("import torch\nx = torch.zeros(3, dtype=torch.long).float()\n",
            after="import torch\nx = torch.zeros(3, dtype=torch.float32)\n", runnable=True),
    Invalid("import torch\nx = torch.arange(5, dtype=torch.long).double()\n",
            after="import torch\nx = torch.arange(5, dtype=torch.float64)\n", runnable=True),
    # --- more value-preserving folds
    Invalid("import torch\nx = torch.zeros(3).to(dtype=torch.float64)\n",
            after="import torch\nx = torch.zeros(3, dtype=torch.float64)\n", runnable=True),
    Invalid("import torch\nx = torch.eye(3).bool()\n",
            after="import torch\nx = torch.eye(3, dtype=torch.bool)\n", runnable=True),
    Invalid("import torch\nx = torch.tensor([True, False]).float()\n",
            after="import torch\nx = torch.tensor([True, False], dtype=torch.float32)\n", runnable=True),
    Invalid("import torch\nx = torch.tril_indices(3, 3).int()\n",
            after="import torch\nx = torch.tril_indices(3, 3, dtype=torch.int32)\n", runnable=True),
    Invalid("import torch\nx = torch.rand(3).float()\ny = torch.rand(2)\n",
            after="import torch\nx = torch.rand(3, dtype=torch.float32)\ny = torch.rand(2)\n", runnable=True,
            note="a no-op cast: same generator calls"),
    Invalid("import torch\nt = torch.ones(4)\nx = torch.arange(len(t)).double()\ny = torch.zeros_like(t).long()\n",
            after="import torch\nt = torch.ones(4)\nx = torch.arange(len(t), dtype=torch.float64)\n"
                  "y = torch.zeros_like(t, dtype=torch.long)\n", runnable=True),
    Invalid("import torch\nt = torch.ones(4)\nx = torch.arange(len(t)).float()\n",
            after="import torch\nt = torch.ones(4)\nx = torch.arange(len(t), dtype=torch.float32)\n",
            unsafe="tolerance", runnable=True, note="exact only below 2**24"),
    Invalid("import torch\nx = torch.full((2,), 0.1).half()\n",
            after="import torch\nx = torch.full((2,), 0.1, dtype=torch.half)\n", unsafe="tolerance", runnable=True),
    Invalid("import torch\nx = torch.linspace(0, 1, 5).half()\n",
            after="import torch\nx = torch.linspace(0, 1, 5, dtype=torch.half)\n", unsafe="tolerance", runnable=True),
    Invalid("import torch as T\nx = T.zeros(3).half()\n",
            after="import torch as T\nx = T.zeros(3, dtype=T.half)\n", runnable=True),
    Invalid("from torch import zeros\nx = zeros(3).half()\n",
            after="from torch import zeros\nimport torch\n\nx = zeros(3, dtype=torch.half)\n", runnable=True),
    Invalid("import torch\nx = torch.ones(\n    2,\n    3,\n).to(torch.float16, non_blocking=True)\n",
            after="import torch\nx = torch.ones(\n    2,\n    3,\n    dtype=torch.float16,\n)\n", runnable=True),
    # --- not folded (display-only)
    Invalid("import torch\nx = torch.tensor([0.5]).long()\n", note="float data to an integer dtype"),
    Invalid("import torch\nx = torch.full((2,), 1e6).half()\n", note="overflows float16"),
    Invalid("import torch\nx = torch.rand(3).long()\n", note="rand cannot generate integers"),
    Invalid("import torch\nx = torch.tensor([0.1], dtype=torch.float32).double()\n"),
    Invalid("import torch\n\ndef f(t):\n    return torch.full_like(t, 7).half()\n", note="t's dtype is unknown"),
    Invalid("import torch\ntorch.set_default_dtype(torch.float64)\nx = torch.tensor([1.5]).half()\n",
            note="default dtype unknown"),
    Invalid("import torch\ntorch.set_default_dtype(torch.float64)\nx = torch.zeros(3).half()\n",
            after="import torch\ntorch.set_default_dtype(torch.float64)\nx = torch.zeros(3, dtype=torch.half)\n",
            note="zeros fold whatever the default dtype"),
    Invalid("import torch\nx = torch.zeros(3).half(  # fp16\n)\n", note="a comment would be lost"),
    Valid("import torch\nx = torch.zeros(3, dtype=torch.half)\ny = torch.zeros(3).to('cpu')\n", runnable=True),
    Valid("import mylib\nx = mylib.zeros(3).half()\n"),
    Valid("import torch\n\ndef f(torch):\n    return torch.zeros(3).half()\n"),
    Valid("import torch\n\ndef f(x):\n    return x.float()\n"),
    Valid("import torch\nx = torch.zeros(3).cuda().half()\n", note="with TOP101 selected too this chain folds"),
    Valid("import torch\n\ndef f(x):\n    return torch.zeros(3).to(x)\n", note="TOP101 reports it"),
    Invalid("import torch\n\ndef f(x):\n    return torch.arange(4).to(x.dtype)\n", note="the target dtype is not known"),
    Valid("import torch\nx = torch.zeros(3).to('cuda', torch.half)\n", note="TOP101's"),
    Valid("import torch\n\ndef f(s):\n    return torch.zeros(*s).half()\n"),
    Valid("import torch\nx = torch.zeros(3).half(memory_format=torch.preserve_format)\n"),
    Valid("import torch\n\ndef f(a):\n    return torch.from_numpy(a).float()\n", note="from_numpy takes no dtype="),
)
