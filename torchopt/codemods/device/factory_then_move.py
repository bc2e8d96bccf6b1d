"""TOP101 `factory-then-move`: Flags a tensor factory whose result is moved to a device at once, e.g. `torch.zeros(n).cuda()`."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.run_once import once_per_process
from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.arguments import set_kwarg
from torchopt.analysis.names import TorchRef
from torchopt.analysis.names import callee
from torchopt.analysis.names import is_tensor_name
from torchopt.analysis.names import method_call
from torchopt.analysis.syntax import has_comments
from torchopt.analysis.syntax import source
from torchopt.analysis.values import Device
from torchopt.analysis.values import DeviceKind
from torchopt.analysis.values import classify_device
from torchopt.analysis.values import dtype_of
from torchopt.analysis.values import int_value
from torchopt.codemods.device.dtype_folding import Data, arange_exact_on_device, fold_verdict
from torchopt.codemods.device.factory_analysis import (
    TrailingCall,
    _FactoryRule,
    _NOTE_LEAF,
    _could_move,
    _keep_parens,
    int_typed,
    may_be_int,
    parse_cuda,
    parse_to,
)
from torchopt.codemods.device.factory_tables import COMPUTED, CUDA_LEGACY, FACTORIES, LEGACY, RANDOM, SPELLING
from torchopt.codemods.device.move_edits import fix_drops_comment, moved_factory
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


_NOTE_RNG = "random values are drawn on {where} from its generator instead of the CPU one: they change, and later CPU random draws shift"


_NOTE_TOL = "values are computed by a device kernel instead of on the host: they may differ by about 1 ulp"


class FactoryThenMove(_FactoryRule):
    """## What it does
    Flags a tensor factory whose result is moved to a device at once, e.g. `torch.zeros(n).cuda()`
    or `torch.arange(n).to(device)`, and creates the tensor on the device instead.

    ## Why is this slow
    The tensor is first allocated and filled on the host, then copied to the device, and the host
    copy is thrown away. Passing `device=` to the factory skips the host allocation and the
    host-to-device copy (PyTorch performance tuning guide, "Create tensors directly on the target
    device").

    ## Example
    ```python
    x = torch.zeros(3, 4).cuda()
    y = torch.ones(n).cuda(rank)
    z = torch.arange(10).to(device)
    w = torch.from_numpy(a).cuda()
    ```

    ## Use instead
    ```python
    x = torch.zeros(3, 4, device='cuda')
    y = torch.ones(n, device=torch.device('cuda', rank))
    z = torch.arange(10, device=device)
    w = torch.as_tensor(a, device='cuda')
    ```

    ## Fix safety
    Safe for deterministic factories: `zeros`, `ones`, `empty*`, `full`, `eye`, `scalar_tensor`,
    `tril/triu_indices`, `sparse_coo_tensor`, `tensor`/`as_tensor`/`asarray`, the non-random
    `*_like`, integer `arange`, `from_numpy` (rewritten to `as_tensor`) and legacy typed constructors
    with int sizes (rewritten to `empty`; contents are uninitialised in both). An `arange` is integer
    when every bound is an int literal, `len(...)`, `int(...)`, `x.size(i)`, `x.numel()`,
    `x.shape[i]`, or a name bound only to those, or when its `dtype=` is an integer dtype.
    `non_blocking` is dropped (no copy is left) and so is `pin_memory=True` (pinning only affects
    host tensors); an existing `device=` is replaced.

    Unsafe fixes:
    * **rng**: random factories (`rand`, `randn`, `randint`, `randperm`, `normal`, `*_like`) draw
      from the device generator instead of the CPU one, so values change and later CPU draws shift.
    * **tolerance**: `linspace`, `logspace`, `torch.range`, window functions and non-integer
      `arange` are computed by a device kernel and may differ by about 1 ulp.
    * **semantics**: with `requires_grad=True` the original result is a non-leaf copy whose `.grad`
      is never filled; the rewritten tensor is a leaf (usually a bug fix).

    `.to(device, dtype)` also folds the dtype when the cast provably keeps every value (TOP102's test).
    Names such as `device`, `dev`, `*_device` and `<expr>.device` are assumed to hold a
    `torch.device` (the `device-names` setting); such findings say so. Not rewritten: `.to(x)` where
    `x` may be a dtype or a tensor, `.cuda(x)` with `x` of unknown type (reported only),
    `copy=True`, `memory_format=`, star-arguments, `out=`, and `Tensor.new_*` (the receiver's type
    is unknown).
    """

    code = "TOP101"
    name = "factory-then-move"
    message = "`{factory}(...)` is created on the host, then moved to `{device}`{assumption}"
    fix_title = "Create it on the device: `{new}(..., device={device})`"
    safety = Safety.SAFE
    prefilter = (".cuda(", ".to(", "Tensor(")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.patterns import chained_call

        # visit_Call: `<torch factory>(...).cuda()/.to()` (method_call), or a bare
        # `torch.cuda.<legacy type>(...)` (spelled with "cuda" and the type's name).
        return (
            super().could_match(text)
            and (
                chained_call(text, ("cuda", "to"), (*FACTORIES, *LEGACY, "from_numpy"))
                or ("cuda" in text and any(name in text for name in CUDA_LEGACY))
            )
            and _could_move(text)
        )

    def visit_Call(self, node: cst.Call) -> None:
        mc = method_call(node, ("cuda", "to"))
        if mc is not None:
            inner, meth = mc
            self._trailing(node, inner, meth)
            return
        if isinstance(node.func, cst.Attribute) and node.func.attr.value not in CUDA_LEGACY:
            return  # resolving `a.b.c(...)` can cost the file's scope analysis; its last name must match
        q = callee(self, node)
        if q is not None and q.startswith("torch.cuda.") and q[len("torch.cuda.") :] in CUDA_LEGACY:
            self._bare_cuda_ctor(node, q[len("torch.cuda.") :])

    # ---- torch.cuda.FloatTensor(2, 3) -------------------------------------------------------

    def _bare_cuda_ctor(self, node: cst.Call, ctor: str) -> None:
        if (
            not node.args
            or has_star(node)
            or any(a.keyword is not None or int_value(a.value) is None for a in node.args)
        ):
            return
        factory = source(self, node.func)
        ref = self.ref_at(node)
        fmt = {"factory": factory, "device": "'cuda'", "assumption": "", "new": factory}
        msg = "`{factory}(...)` is a legacy CUDA constructor"
        if ref is None or has_comments(node.func):
            self.report(node, fmt=fmt, message=msg)
            return
        new = node.with_changes(func=ref.attr("empty"))
        new = set_kwarg(new, "dtype", ref.attr(SPELLING[CUDA_LEGACY[ctor]]))
        new = set_kwarg(new, "device", cst.SimpleString("'cuda'"))
        self.report(
            node,
            fmt={**fmt, "new": f"{ref.name}.empty"},
            message=msg,
            replacement=new,
            imports=ref.imports,
            fix_title="Use `{new}(..., dtype=..., device={device})`",
        )

    # ---- <factory>(...).cuda() / .to() ------------------------------------------------------

    def _trailing(self, node: cst.Call, inner: cst.Call, meth: str) -> None:
        """``<factory>(...).cuda()`` / ``.to(...)``: create the tensor on the target device instead."""
        if once_per_process(self, node):
            return  # a converter's or export's one tensor: the copy cannot matter
        fk = self.factory_of(inner)
        if fk is None:
            return
        kind, _q = fk
        if self.factory_blockers(kind, inner) or self._skipped_arguments(kind, inner):
            return
        tr = parse_cuda(node) if meth == "cuda" else parse_to(self, node)
        if tr is None:
            return
        factory = source(self, inner.func)
        if tr.unknown is not None:
            self.report(
                node,
                fmt={"factory": factory, "x": source(self, tr.unknown)},
                message="`{factory}(...).to({x})`: `{x}` may be a device, a dtype or a tensor "
                "(a tensor gives both its dtype and its device); if it is a device, "
                "pass `device={x}` to the factory",
            )
            return
        if tr.device is None and not tr.cuda:
            return  # `.to(dtype)` / `.to(dtype=...)`: TOP102's
        ref = self.ref_at(node)
        target = self._cuda_target(node, tr, ref, factory) if tr.cuda else self._to_target(node, tr, factory)
        if target is None:
            return
        dev_expr, dev_kind = target
        fmt = self._message_fields(kind, factory, tr, ref, dev_expr, dev_kind)
        same_device = self._already_there(inner, dev_kind)
        tags, notes = self._device_tags(kind, inner, dev_kind, same_device)
        if tr.dtype is not None and not self._fold_dtype(node, kind, inner, tr.dtype, same_device, fmt, tags, notes):
            return
        if self.requires_grad(inner) and not same_device and Tag.SEMANTICS not in tags:
            tags.append(Tag.SEMANTICS)
            notes.append(_NOTE_LEAF)
        if kind == "tensor" and self._is_tensor_data(inner):
            data_src = source(self, positional(inner)[0].value)
            self.report(
                node,
                fmt={**fmt, "t": data_src},
                message="`{factory}({t})` copy-constructs from a tensor, then moves it; use "
                "`{t}.detach().to({device})`",
            )
            return
        if fix_drops_comment(node, inner, kind, tr.dtype, same_device):
            self.report(node, fmt=fmt, message=self.message + "; not fixed automatically: a comment would be lost")
            return
        if (kind == "from_numpy" or kind in LEGACY) and ref is None:
            self.report(node, fmt=fmt, message=self.message + "; no fix: `torch` is bound to something else here")
            return
        new, imports = moved_factory(inner, kind, ref, tr, dev_expr, same_device)
        self.report(
            node,
            fmt=fmt,
            replacement=_keep_parens(node, new),
            safety=Safety.UNSAFE if tags else Safety.SAFE,
            tags=tuple(tags),
            note="; ".join(notes),
            imports=imports,
        )

    def _skipped_arguments(self, kind: str, inner: cst.Call) -> bool:
        """Factory calls whose meaning the fix cannot keep: legacy constructors given data or sizes
        we cannot see (overloaded), ``from_numpy`` not called with one array, and random factories
        fed by a generator (a CPU generator cannot feed a CUDA factory)."""
        if kind in LEGACY and (
            not inner.args or any(a.keyword is not None or a.star or int_value(a.value) is None for a in inner.args)
        ):
            return True
        if kind == "from_numpy" and (len(inner.args) != 1 or inner.args[0].keyword is not None):
            return True
        return kind in RANDOM and keyword(inner, "generator") is not None

    def _cuda_target(
        self, node: cst.Call, tr: TrailingCall, ref: TorchRef | None, factory: str
    ) -> tuple[cst.BaseExpression, Device] | None:
        """The ``device=`` expression for ``.cuda([x])`` and what it names; None (reported) when
        ``x`` may be an index or a device, or when ``torch.device`` cannot be spelled here."""
        if tr.device is None:
            return cst.SimpleString("'cuda'"), Device(DeviceKind.LITERAL, "cuda")
        index = int_value(tr.device)
        if index is not None:
            return cst.SimpleString(f"'cuda:{index}'"), Device(DeviceKind.LITERAL, f"cuda:{index}")
        if int_typed(self, tr.device):
            if ref is None:
                self.report(
                    node,
                    fmt={
                        "factory": factory,
                        "device": source(self, tr.device),
                        "assumption": " (no fix: `torch` is bound to something else here)",
                    },
                )
                return None
            comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            device_call = cst.Call(
                func=ref.attr("device"), args=[cst.Arg(cst.SimpleString("'cuda'"), comma=comma), cst.Arg(tr.device)]
            )
            return device_call, Device(DeviceKind.LITERAL, "cuda")
        dev_kind = classify_device(self, tr.device)
        if not dev_kind.is_device or may_be_int(self, tr.device):
            self.report(
                node,
                fmt={"factory": factory, "x": source(self, tr.device)},
                message="`{factory}(...).cuda({x})`: the type of `{x}` is not known; pass "
                "`device=torch.device('cuda', {x})` if it is a GPU index, or "
                "`device={x}` if it is a device",
            )
            return None
        return tr.device, dev_kind

    def _to_target(self, node: cst.Call, tr: TrailingCall, factory: str) -> tuple[cst.BaseExpression, Device] | None:
        """The ``device=`` expression for ``.to(x)`` and what it names; None (reported) when ``x``
        may be a dtype or a tensor and the signature does not say it is a device."""
        assert tr.device is not None  # (a `.to` without a device is TOP102's)
        dev_kind = classify_device(self, tr.device)
        if not dev_kind.is_device and not tr.forced:
            self.report(
                node,
                fmt={"factory": factory, "x": source(self, tr.device)},
                message="`{factory}(...).to({x})`: `{x}` may be a device, a dtype or a tensor; "
                "if it is a device, pass `device={x}` to the factory",
            )
            return None
        return tr.device, dev_kind

    def _message_fields(
        self,
        kind: str,
        factory: str,
        tr: TrailingCall,
        ref: TorchRef | None,
        dev_expr: cst.BaseExpression,
        dev_kind: Device,
    ) -> dict[str, str]:
        """The placeholders of the message and fix title: the factory as written, the device, the
        assumption made about it and the factory the fix calls."""
        assumption = ""
        if dev_kind.kind is DeviceKind.CONVENTION and not tr.forced:
            assumption = f" (assuming `{source(self, tr.device or dev_expr)}` is a torch.device)"
        device_text = " ".join(self.ctx.module.code_for_node(dev_expr).split())
        new_name = factory
        if (kind == "from_numpy" or kind in LEGACY) and ref is not None:
            new_name = f"{ref.name}.{'as_tensor' if kind == 'from_numpy' else 'empty'}"
        return {"factory": factory, "device": device_text, "assumption": assumption, "new": new_name}

    def _already_there(self, inner: cst.Call, dev_kind: Device) -> bool:
        """The move goes to the CPU the factory already creates on: ``.to('cpu')`` returns the same
        tensor, so nothing about its values changes."""
        target_cpu = dev_kind.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and dev_kind.is_cpu
        existing = keyword(inner, "device")
        if existing is None:
            return target_cpu
        ex = classify_device(self, existing.value)
        return target_cpu and ex.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and ex.is_cpu

    def _device_tags(
        self, kind: str, inner: cst.Call, dev_kind: Device, same_device: bool
    ) -> tuple[list[Tag], list[str]]:
        """What creating the values on the device changes: random draws come from its generator,
        computed factories from its kernels."""
        tags: list[Tag] = []
        notes: list[str] = []
        if same_device:
            return tags, notes
        where = "the device" if not dev_kind.text else f"`{dev_kind.text}`"
        if kind in RANDOM:
            tags.append(Tag.RNG)
            notes.append(_NOTE_RNG.format(where=where))
        elif kind in COMPUTED or (kind == "arange" and not arange_exact_on_device(self, inner)):
            tags.append(Tag.TOLERANCE)
            notes.append(_NOTE_TOL)
        return tags, notes

    def _fold_dtype(
        self,
        node: cst.Call,
        kind: str,
        inner: cst.Call,
        dtype: cst.BaseExpression,
        same_device: bool,
        fmt: dict[str, str],
        tags: list[Tag],
        notes: list[str],
    ) -> bool:
        """Fold ``.to(device, dtype)``'s dtype into the factory too, adding what that changes to
        ``tags``/``notes``; False (reported, no fix) when the values would not be the same."""
        if kind in LEGACY or kind == "from_numpy":
            data = Data("host", LEGACY.get(kind)) if kind in LEGACY else Data("host")
        else:
            data = self.data(kind, inner)
        dst = dtype_of(self, dtype)
        verdict = fold_verdict(data, dst)
        if not verdict.ok:
            self.report(
                node,
                fmt={**fmt, "why": verdict.reason},
                message="`{factory}(...)` is created on the host, then moved to `{device}`"
                "{assumption}; not fixed: the dtype cannot be folded ({why})",
            )
            return False
        for t in verdict.tags:
            if t not in tags:
                tags.append(t)
                notes.append(verdict.reason)
        cast_is_noop = same_device and data.src is not None and data.src == dst
        if not cast_is_noop and self.requires_grad(inner) and Tag.SEMANTICS not in tags:
            tags.append(Tag.SEMANTICS)
            notes.append(_NOTE_LEAF)
        return True

    def _is_tensor_data(self, call: cst.Call) -> bool:
        pos = positional(call)
        return bool(pos) and isinstance(pos[0].value, cst.Name) and is_tensor_name(self, pos[0].value)

    examples = (
        Valid(
            dedent("""\
                import torch

                def probe():
                    return torch.ones([]).to(torch.device("cuda"))

                holder = torch.jit.trace(probe, example_inputs=[])
                device_node = holder.graph.findAllNodes("prim::Constant")[-1]
            """),
            note="a function handed to a tracer: the graph it records, with its `to` node, is what the program gets",
        ),
        # --- the factories that take a device
        Invalid(
            "import torch\nx = torch.zeros(3, 4).cuda()\n", after='import torch\nx = torch.zeros(3, 4, device="cuda")\n'
        ),
        Invalid(
            "import torch as T\nx = T.ones(2).cuda(1)\n", after='import torch as T\nx = T.ones(2, device="cuda:1")\n'
        ),
        Invalid(
            'from torch import zeros\nimport torch\nx = zeros(5, dtype=torch.long).to("cuda:0", non_blocking=True)\n',
            after='from torch import zeros\nimport torch\nx = zeros(5, dtype=torch.long, device="cuda:0")\n',
        ),
        Invalid(
            "import torch\n\ndef f(dev):\n    return torch.full((2,), 7.0).to(device=dev, dtype=torch.float16)\n",
            after="import torch\n\ndef f(dev):\n    return torch.full((2,), 7.0, device=dev, dtype=torch.float16)\n",
        ),
        Invalid(
            "import torch\n\ndef train(model, device, loader):\n    return torch.arange(10).to(device)\n",
            after="import torch\n\ndef train(model, device, loader):\n    return torch.arange(10, device=device)\n",
            note="device-names convention: `device` is assumed to be a torch.device",
        ),
        Invalid(
            "import torch\n\ndef f(t, t2):\n    return torch.zeros_like(t).to(t2.device)\n",
            after="import torch\n\ndef f(t, t2):\n    return torch.zeros_like(t, device=t2.device)\n",
        ),
        Invalid(
            "import torch\nx = torch.zeros(3, pin_memory=True).cuda(non_blocking=True)\n",
            after='import torch\nx = torch.zeros(3, device="cuda")\n',
        ),
        Invalid(
            "import torch\n\ndef f(n, rank: int):\n    return torch.ones(n).cuda(rank)\n",
            after='import torch\n\ndef f(n, rank: int):\n    return torch.ones(n, device=torch.device("cuda", rank))\n',
        ),
        Invalid(
            "import torch\nx = torch.rand(5).cuda()\n",
            after='import torch\nx = torch.rand(5, device="cuda")\n',
            unsafe="rng",
        ),
        Invalid(
            'import torch\nx = torch.randn(2, 2, device="cpu").to(torch.device("cuda", 0))\n',
            after='import torch\nx = torch.randn(2, 2, device=torch.device("cuda", 0))\n',
            unsafe="rng",
        ),
        Invalid(
            "import torch\nx = torch.zeros(3, requires_grad=True).cuda()\n",
            after='import torch\nx = torch.zeros(3, device="cuda", requires_grad=True)\n',
            unsafe="semantics",
        ),
        Invalid(
            "import torch\n\ndef f(x):\n    return torch.empty(3).to(x)\n",
            note="x may be a device, a dtype or a tensor: display-only",
        ),
        Invalid(
            "import torch\n\ndef f(a):\n    return torch.from_numpy(a).cuda()\n",
            after='import torch\n\ndef f(a):\n    return torch.as_tensor(a, device="cuda")\n',
        ),
        Invalid(
            "import torch\nx = torch.Tensor(2, 3).cuda()\n",
            after='import torch\nx = torch.empty(2, 3, device="cuda")\n',
        ),
        Invalid(
            "import torch\nx = torch.cuda.FloatTensor(2, 3)\n",
            after='import torch\nx = torch.empty(2, 3, dtype=torch.float32, device="cuda")\n',
        ),
        Invalid(
            "import torch\nx = torch.cuda.LongTensor(4)\n",
            after='import torch\nx = torch.empty(4, dtype=torch.int64, device="cuda")\n',
        ),
        Invalid(
            "import torch\nx = torch.FloatTensor(2, 3).cuda()\n",
            after='import torch\nx = torch.empty(2, 3, dtype=torch.float32, device="cuda")\n',
        ),
        # --- aliases and imports
        Invalid(
            "import torch as T\n\ndef f(n, rank: int):\n    return T.ones(n).cuda(rank)\n",
            after='import torch as T\n\ndef f(n, rank: int):\n    return T.ones(n, device=T.device("cuda", rank))\n',
        ),
        Invalid(
            dedent("""\
                from torch import ones

                def f(n):
                    rank = int(2)
                    return ones(n).cuda(rank)
            """),
            after=dedent("""\
                import torch
                from torch import ones

                def f(n):
                    rank = int(2)
                    return ones(n, device=torch.device("cuda", rank))
            """),
        ),
        Invalid(
            "from torch import rand as R\nx = R(3).cuda()\n",
            after='from torch import rand as R\nx = R(3, device="cuda")\n',
            unsafe="rng",
        ),
        Invalid(
            "import torch\nimport torch.distributed as dist\nx = torch.zeros(3).cuda(dist.get_rank())\n",
            after='import torch\nimport torch.distributed as dist\nx = torch.zeros(3, device=torch.device("cuda", dist.get_rank()))\n',
        ),
        Invalid(
            "import torch\nx = torch.zeros(3).cuda(device=1)\n",
            after='import torch\nx = torch.zeros(3, device="cuda:1")\n',
        ),
        Invalid(
            "import torch\n\ndef f(target_device):\n    return torch.ones(3).to(device=target_device)\n",
            after="import torch\n\ndef f(target_device):\n    return torch.ones(3, device=target_device)\n",
        ),
        # --- device-computed and random factories
        Invalid(
            "import torch\nx = torch.linspace(0, 1, 5).cuda()\n",
            after='import torch\nx = torch.linspace(0, 1, 5, device="cuda")\n',
            unsafe="tolerance",
        ),
        Invalid(
            "import torch\nx = torch.arange(0, 1, 0.1).cuda()\n",
            after='import torch\nx = torch.arange(0, 1, 0.1, device="cuda")\n',
            unsafe="tolerance",
        ),
        Invalid(
            "import torch\nx = torch.hann_window(8).cuda()\n",
            after='import torch\nx = torch.hann_window(8, device="cuda")\n',
            unsafe="tolerance",
        ),
        Invalid(
            "import torch\n\ndef f(x):\n    return torch.arange(x.size(0)).cuda()\n",
            after='import torch\n\ndef f(x):\n    return torch.arange(x.size(0), device="cuda")\n',
        ),
        Invalid(
            "import torch\nx = torch.randint(0, 10, (3,)).to('cuda', torch.int32)\n",
            after="import torch\nx = torch.randint(0, 10, (3,), device='cuda', dtype=torch.int32)\n",
            unsafe="rng",
        ),
        Invalid(
            "import torch\nx = torch.zeros(3, requires_grad=True).to('cuda', torch.float64)\n",
            after="import torch\nx = torch.zeros(3, device='cuda', dtype=torch.float64, requires_grad=True)\n",
            unsafe="semantics",
        ),
        Invalid(
            "import torch\nx = torch.normal(0.0, 1.0, size=(3,)).cuda()\n",
            after='import torch\nx = torch.normal(0.0, 1.0, size=(3,), device="cuda")\n',
            unsafe="rng",
        ),
        # --- layout: multi-line calls, existing device=, parentheses
        Invalid(
            dedent("""\
                import torch
                x = torch.zeros(
                    3,
                    4,
                ).cuda()
            """),
            after=dedent("""\
                import torch
                x = torch.zeros(
                    3,
                    4,
                    device="cuda",
                )
            """),
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.zeros(
                    3,
                ).cuda()
            """),
            after=dedent("""\
                import torch
                x = torch.zeros(
                    3,
                    device="cuda",
                )
            """),
        ),
        Invalid(
            "import torch\nx = torch.zeros(3, device='cpu').cuda()\n",
            after="import torch\nx = torch.zeros(3, device='cuda')\n",
        ),
        Invalid(
            "import torch\nx = (torch.zeros(3)).cuda()\n", after='import torch\nx = torch.zeros(3, device="cuda")\n'
        ),
        # --- display-only
        Invalid(
            "import torch\n\ndef f(args):\n    return torch.zeros(3).cuda(args.local_rank)\n",
            note="type of args.local_rank unknown",
        ),
        Invalid("import torch\nx = torch.zeros(3).cuda(  # on the GPU\n)\n", note="a comment would be lost"),
        Invalid(
            "import torch\n\ndef f(device):\n    return torch.linspace(0, 1, 5).to(device, torch.float64)\n",
            note="the float64 fold is not value-preserving",
        ),
        Invalid("import torch\nt = torch.ones(3)\nx = torch.tensor(t).cuda()\n", note="copy-construct from a tensor"),
        Invalid(
            dedent("""\
                from torch import zeros
                torch = None

                def f(rank: int):
                    return zeros(3).cuda(rank)
            """),
            note="`torch` is bound to something else: no generated torch reference",
        ),
        # --- runnable on the CPU (bitwise equal, RNG state included)
        Invalid(
            "import torch\nx = torch.zeros(3, 4).to('cpu')\n",
            after="import torch\nx = torch.zeros(3, 4, device='cpu')\n",
            runnable=True,
        ),
        Invalid(
            "import torch\nx = torch.rand(3).to('cpu')\ny = torch.randn(2)\n",
            after="import torch\nx = torch.rand(3, device='cpu')\ny = torch.randn(2)\n",
            runnable=True,
            note="same device: the same CPU generator is used",
        ),
        Invalid(
            "import torch\ndevice = 'cpu'\nx = torch.arange(10).to(device)\ny = torch.linspace(0, 1, 7).to(device)\n",
            after="import torch\ndevice = 'cpu'\nx = torch.arange(10, device=device)\ny = torch.linspace(0, 1, 7, device=device)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\nx = torch.tensor([1.0, 2.0]).to('cpu', torch.float64)\n",
            after="import torch\nx = torch.tensor([1.0, 2.0], device='cpu', dtype=torch.float64)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\nx = torch.zeros(3, requires_grad=True).to('cpu')\n",
            after="import torch\nx = torch.zeros(3, device='cpu', requires_grad=True)\n",
            runnable=True,
        ),
        Invalid(
            "import numpy as np\nimport torch\na = np.arange(6.0)\nx = torch.from_numpy(a).to('cpu')\n",
            after="import numpy as np\nimport torch\na = np.arange(6.0)\nx = torch.as_tensor(a, device='cpu')\n",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                x = torch.full(
                    (2, 2),
                    7,
                    dtype=torch.long,
                ).to(device='cpu', non_blocking=True)
            """),
            after=dedent("""\
                import torch
                x = torch.full(
                    (2, 2),
                    7,
                    dtype=torch.long,
                    device='cpu',
                )
            """),
            runnable=True,
        ),
        Valid("import torch\nx = torch.zeros(3, device='cpu')\ny = torch.arange(4).to(torch.float16)\n", runnable=True),
        Valid("import torch\n\ndef k(torch):\n    return torch.rand(3).cuda()\n", note="parameter named torch"),
        Valid("import mylib\nx = mylib.zeros(3).cuda()\n"),
        Valid(
            dedent("""\
                import torch

                def zeros(n):
                    return torch.ones(n)

                x = zeros(3).cuda()
            """)
        ),
        Valid("import torch\n\ndef f(shape):\n    return torch.zeros(*shape).cuda()\n"),
        Valid("import torch\n\ndef f(kw):\n    return torch.zeros(3).cuda(**kw)\n"),
        Valid("import torch\n\ndef f(o):\n    return torch.zeros(3, out=o).cuda()\n"),
        Valid("import torch\nx = torch.ones(3).cuda(memory_format=torch.contiguous_format)\n"),
        Valid("import torch\nx = torch.arange(10).to('cpu', copy=True)\n", runnable=True),
        Valid("import torch\nx = torch.ones(3).to(torch.float16)\n", note="a dtype cast alone is TOP102's"),
        Valid("import torch\n\ndef f(a):\n    return a.new_zeros(3).cuda()\n", note="receiver type unknown"),
        Valid(
            "import torch\n\ndef f(x, dtype):\n    return torch.arange(4).to(x.dtype) + torch.arange(4).to(dtype)\n",
            note="a cast by name: TOP102's",
        ),
        Invalid(
            dedent("""\
                from x import is_torch_available
                if is_torch_available():
                    import torch

                def f(a, rank: int):
                    return torch.zeros(3).cuda(rank)
            """),
            after=dedent("""\
                from x import is_torch_available
                if is_torch_available():
                    import torch

                def f(a, rank: int):
                    return torch.zeros(3, device=torch.device("cuda", rank))
            """),
            note="a guarded `import torch` is reused; no top-level import is added",
        ),
        Valid(
            "import torch\n\ndef f(data):\n    return torch.Tensor(data).cuda()\n", note="torch.Tensor is overloaded"
        ),
        Valid("import torch\n\ndef f(mean, std):\n    return torch.normal(mean, std).cuda()\n"),
        Valid("import torch\n\ndef f(g):\n    return torch.rand(3, generator=g).cuda()\n", note="a CPU generator"),
        Valid("import torch\n\ndef f(x):\n    return torch.as_tensor(x, torch.float32).cuda()\n"),
        Valid("import torch\n\ndef f(x):\n    return torch.bernoulli(x).cuda()\n", note="no device= parameter"),
        Valid("import torch\n\ndef f(x):\n    return x.type(torch.cuda.FloatTensor)\n", note="TOP105's"),
    )
