"""TOP102 `cast-after-factory`: Flags a tensor factory whose result is cast at once, e.g. `torch.zeros(n).half()` or."""

from __future__ import annotations

from textwrap import dedent

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
    FACTORIES,
    _FactoryRule,
    _NOTE_LEAF,
    _could_cast,
    _keep_parens,
    _removed_has_comments,
    factory_kind,
    parse_to,
)
from torchopt.codemods.device.dtype_folding import fold_verdict
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
        return super().could_match(text) and chained_call(text, (*CAST_METHODS, "to"), FACTORIES) and _could_cast(text)

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
            self.report(node, fmt={**fmt, "why": verdict.reason}, message=self.message + "; not folded: {why}")
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
        self.report(
            node,
            fmt=fmt,
            replacement=new,
            safety=Safety.UNSAFE if tags else Safety.SAFE,
            tags=tuple(tags),
            note="; ".join(notes),
            imports=imports,
        )

    examples = (
        Valid(
            dedent("""\
                import torch

                float_holder = torch.jit.trace(lambda: torch.ones([]).float(), example_inputs=[])
                float_input = list(float_holder.graph.findNode("aten::to").inputs())[1]
            """),
            note="the traced graph is what the program reads: folding the cast would remove its `aten::to` node",
        ),
        # --- the casts that fold into the factory
        Invalid(
            dedent("""\
                import torch
                x = torch.zeros(3).half()
            """),
            after=dedent("""\
                import torch
                x = torch.zeros(3, dtype=torch.half)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.ones(3).to(torch.float16)
            """),
            after=dedent("""\
                import torch
                x = torch.ones(3, dtype=torch.float16)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.arange(5).float()
            """),
            after=dedent("""\
                import torch
                x = torch.arange(5, dtype=torch.float32)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.tensor([1, 2]).float()
            """),
            after=dedent("""\
                import torch
                x = torch.tensor([1, 2], dtype=torch.float32)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.full((2,), 7.0).half()
            """),
            after=dedent("""\
                import torch
                x = torch.full((2,), 7.0, dtype=torch.half)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.arange(0, 1, 0.1).double()
            """),
            note="0.30000001192092896 vs 0.30000000000000004",
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.linspace(0, 1, 7).double()
            """),
            note="rounds to float32 first",
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.full((2,), 0.1).double()
            """),
            note="rounds to float32 first",
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.tensor([0.1]).double()
            """),
            note="rounds to float32 first",
        ),
        Invalid(
            dedent("""\
                import torch
                vals = [0.1, 0.2, 1 / 3]
                x = torch.tensor(vals).half()
            """),
            after=dedent("""\
                import torch
                vals = [0.1, 0.2, 1 / 3]
                x = torch.tensor(vals, dtype=torch.half)
            """),
            unsafe="tolerance",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                vals = [0.1, 0.2, 1 / 3]
                x = torch.tensor(vals).bfloat16()
            """),
            after=dedent("""\
                import torch
                vals = [0.1, 0.2, 1 / 3]
                x = torch.tensor(vals, dtype=torch.bfloat16)
            """),
            unsafe="tolerance",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.rand(4).double()
            """),
            after=dedent("""\
                import torch
                x = torch.rand(4, dtype=torch.float64)
            """),
            unsafe="rng",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.randn(100).half()
            """),
            after=dedent("""\
                import torch
                x = torch.randn(100, dtype=torch.half)
            """),
            unsafe="rng",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.randint(0, 10, (3,)).to(torch.int32)
            """),
            after=dedent("""\
                import torch
                x = torch.randint(0, 10, (3,), dtype=torch.int32)
            """),
            unsafe="rng",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.randperm(8).to(torch.int32)
            """),
            after=dedent("""\
                import torch
                x = torch.randperm(8, dtype=torch.int32)
            """),
            unsafe="rng",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.zeros(3, requires_grad=True).double()
            """),
            after=dedent("""\
                import torch
                x = torch.zeros(3, dtype=torch.float64, requires_grad=True)
            """),
            unsafe="semantics",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.zeros(3, dtype=torch.long).float()
            """),
            after=dedent("""\
                import torch
                x = torch.zeros(3, dtype=torch.float32)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.arange(5, dtype=torch.long).double()
            """),
            after=dedent("""\
                import torch
                x = torch.arange(5, dtype=torch.float64)
            """),
            runnable=True,
        ),
        # --- more value-preserving folds
        Invalid(
            dedent("""\
                import torch
                x = torch.zeros(3).to(dtype=torch.float64)
            """),
            after=dedent("""\
                import torch
                x = torch.zeros(3, dtype=torch.float64)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.eye(3).bool()
            """),
            after=dedent("""\
                import torch
                x = torch.eye(3, dtype=torch.bool)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.tensor([True, False]).float()
            """),
            after=dedent("""\
                import torch
                x = torch.tensor([True, False], dtype=torch.float32)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.tril_indices(3, 3).int()
            """),
            after=dedent("""\
                import torch
                x = torch.tril_indices(3, 3, dtype=torch.int32)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.rand(3).float()
                y = torch.rand(2)
            """),
            after=dedent("""\
                import torch
                x = torch.rand(3, dtype=torch.float32)
                y = torch.rand(2)
            """),
            runnable=True,
            note="a no-op cast: same generator calls",
        ),
        Invalid(
            dedent("""\
                import torch
                t = torch.ones(4)
                x = torch.arange(len(t)).double()
                y = torch.zeros_like(t).long()
            """),
            after=dedent("""\
                import torch
                t = torch.ones(4)
                x = torch.arange(len(t), dtype=torch.float64)
                y = torch.zeros_like(t, dtype=torch.long)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                t = torch.ones(4)
                x = torch.arange(len(t)).float()
            """),
            after=dedent("""\
                import torch
                t = torch.ones(4)
                x = torch.arange(len(t), dtype=torch.float32)
            """),
            unsafe="tolerance",
            runnable=True,
            note="exact only below 2**24",
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.full((2,), 0.1).half()
            """),
            after=dedent("""\
                import torch
                x = torch.full((2,), 0.1, dtype=torch.half)
            """),
            unsafe="tolerance",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.linspace(0, 1, 5).half()
            """),
            after=dedent("""\
                import torch
                x = torch.linspace(0, 1, 5, dtype=torch.half)
            """),
            unsafe="tolerance",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch as T
                x = T.zeros(3).half()
            """),
            after=dedent("""\
                import torch as T
                x = T.zeros(3, dtype=T.half)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                from torch import zeros
                x = zeros(3).half()
            """),
            after=dedent("""\
                import torch
                from torch import zeros
                x = zeros(3, dtype=torch.half)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.ones(
                    2,
                    3,
                ).to(torch.float16, non_blocking=True)
            """),
            after=dedent("""\
                import torch
                x = torch.ones(
                    2,
                    3,
                    dtype=torch.float16,
                )
            """),
            runnable=True,
        ),
        # --- not folded (display-only)
        Invalid(
            dedent("""\
                import torch
                x = torch.tensor([0.5]).long()
            """),
            note="float data to an integer dtype",
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.full((2,), 1e6).half()
            """),
            note="overflows float16",
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.rand(3).long()
            """),
            note="rand cannot generate integers",
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.tensor([0.1], dtype=torch.float32).double()
            """)
        ),
        Invalid(
            dedent("""\
                import torch

                def f(t):
                    return torch.full_like(t, 7).half()
            """),
            note="t's dtype is unknown",
        ),
        Invalid(
            dedent("""\
                import torch
                torch.set_default_dtype(torch.float64)
                x = torch.tensor([1.5]).half()
            """),
            note="default dtype unknown",
        ),
        Invalid(
            dedent("""\
                import torch
                torch.set_default_dtype(torch.float64)
                x = torch.zeros(3).half()
            """),
            after=dedent("""\
                import torch
                torch.set_default_dtype(torch.float64)
                x = torch.zeros(3, dtype=torch.half)
            """),
            note="zeros fold whatever the default dtype",
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.zeros(3).half(  # fp16
                )
            """),
            note="a comment would be lost",
        ),
        Valid(
            dedent("""\
                import torch
                x = torch.zeros(3, dtype=torch.half)
                y = torch.zeros(3).to('cpu')
            """),
            runnable=True,
        ),
        Valid(
            dedent("""\
                import mylib
                x = mylib.zeros(3).half()
            """)
        ),
        Valid(
            dedent("""\
                import torch

                def f(torch):
                    return torch.zeros(3).half()
            """)
        ),
        Valid(
            dedent("""\
                import torch

                def f(x):
                    return x.float()
            """)
        ),
        Valid(
            dedent("""\
                import torch
                x = torch.zeros(3).cuda().half()
            """),
            note="with TOP101 selected too this chain folds",
        ),
        Valid(
            dedent("""\
                import torch

                def f(x):
                    return torch.zeros(3).to(x)
            """),
            note="TOP101 reports it",
        ),
        Invalid(
            dedent("""\
                import torch

                def f(x):
                    return torch.arange(4).to(x.dtype)
            """),
            note="the target dtype is not known",
        ),
        Valid(
            dedent("""\
                import torch
                x = torch.zeros(3).to('cuda', torch.half)
            """),
            note="TOP101's",
        ),
        Valid(
            dedent("""\
                import torch

                def f(s):
                    return torch.zeros(*s).half()
            """)
        ),
        Valid(
            dedent("""\
                import torch
                x = torch.zeros(3).half(memory_format=torch.preserve_format)
            """)
        ),
        Valid(
            dedent("""\
                import torch

                def f(a):
                    return torch.from_numpy(a).float()
            """),
            note="from_numpy takes no dtype=",
        ),
    )
