"""TOP101 `factory-then-move`: Flags a tensor factory whose result is moved to a device at once, e.g. `torch.zeros(n).cuda()`."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.layout_chains import REARRANGING, chain_root, replace_root
from torchopt.analysis.run_once import once_per_process
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.syntax import source
from torchopt.codemods.device.factory_analysis import (
    _NOTE_LEAF,
    _could_index,
    _could_move,
    _keep_parens,
    parse_cuda,
    parse_to,
)
from torchopt.codemods.device.factory_tables import CUDA_LEGACY, FACTORIES, LEGACY
from torchopt.codemods.device.move_checks import _MoveChecks
from torchopt.codemods.device.move_edits import fix_drops_comment, moved_factory
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class FactoryThenMove(_MoveChecks):
    """## What it does
    Flags a tensor factory whose result is moved to a device at once, e.g. `torch.zeros(n).cuda()`
    or `torch.arange(n).to(device)`, and creates the tensor on the device instead. The move may come
    after a chain that only rearranges the values (`.unsqueeze()`, `.repeat()`, `.view()`,
    `.reshape()`, `.flatten()`, `.flip()`, `.t()`, `.transpose()`, `.permute()`, `.tile()`,
    `.contiguous()`, `.clone()`, `.detach()`, `[:, None]`): the chain then runs on the device.
    A factory used as an index of a tensor that may be on a device (`x[torch.arange(n), idx]`, not
    a host program's) is created on `x.device`: indexing copies a host index to the device each time.
    So are the factories an index is computed from through names of the function, each assigned
    once and read once (`q = torch.arange(n)[:, None] * s` ... `x[(q - k).long()]`).

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
    pos = torch.arange(n).unsqueeze(0).repeat(b, 1).to(device)
    picked = logprobs[torch.arange(b), tokens]
    ```

    ## Use instead
    ```python
    x = torch.zeros(3, 4, device='cuda')
    y = torch.ones(n, device=torch.device('cuda', rank))
    z = torch.arange(10, device=device)
    w = torch.as_tensor(a, device='cuda')
    pos = torch.arange(n, device=device).unsqueeze(0).repeat(b, 1)
    picked = logprobs[torch.arange(b, device=logprobs.device), tokens]
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
    A rearranging chain gives the same values and, its result being dense, the same strides that
    `.to()` keeps; `expand`, slices with bounds or steps and integer indices leave gaps or overlaps
    that `.to()` would compact, so they end no chain. An index is created on `x.device` only when
    `x` is a name or an attribute path (read again at the factory) that holds a tensor; through
    names, only when `x` is a name whose every binding comes before the factories (otherwise the
    finding is display-only). Index arithmetic then runs on the device (**tolerance**: float steps
    may differ by about 1 ulp).
    Names such as `device`, `dev`, `*_device` and `<expr>.device` are assumed to hold a
    `torch.device` (the `device-names` setting); such findings say so. Not rewritten: `.to(x)` where
    `x` may be a dtype or a tensor, `.cuda(x)` with `x` of unknown type (reported only),
    `copy=True`, `memory_format=`, star-arguments, `out=`, `Tensor.new_*` (the receiver's type
    is unknown), and a factory bound to a name and moved later (the device may be bound after it).
    """

    code = "TOP101"
    name = "factory-then-move"
    message = "`{factory}(...)` is created on the host, then moved to `{device}`{assumption}"
    fix_title = "Create it on the device: `{new}(..., device={device})`"
    safety = Safety.SAFE
    # the last five: the names of INDEX_FACTORIES, for an index made on the host
    prefilter = (".cuda(", ".to(", "Tensor(", "arange", "randperm", "randint", "tensor", "_indices")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.patterns import chained_call

        # visit_Call: `<torch factory>(...).cuda()/.to()`, directly or through a rearranging chain
        # (`.unsqueeze(0).repeat(b, 1)`, `[:, None]`), or a bare `torch.cuda.<legacy type>(...)`
        # (spelled with "cuda" and the type's name); visit_Subscript: a factory as an index.
        moved = (
            super().could_match(text)
            and (
                chained_call(text, ("cuda", "to"), (*FACTORIES, *LEGACY, "from_numpy", *REARRANGING))
                or "].to(" in text
                or "].cuda(" in text
                or ("cuda" in text and any(name in text for name in CUDA_LEGACY))
            )
            and _could_move(text)
        )
        return moved or _could_index(text)

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Attribute) and node.func.attr.value in ("cuda", "to"):
            recv, meth = node.func.value, node.func.attr.value
            chain = chain_root(recv)
            if chain is not None and self.factory_of(chain[0]) is not None:
                self._trailing(node, chain[0], meth, (recv, chain[1]))
            elif isinstance(recv, cst.Call):
                self._trailing(node, recv, meth)
            return
        if isinstance(node.func, cst.Attribute) and node.func.attr.value not in CUDA_LEGACY:
            return  # resolving `a.b.c(...)` can cost the file's scope analysis; its last name must match
        q = callee(self, node)
        if q is not None and q.startswith("torch.cuda.") and q[len("torch.cuda.") :] in CUDA_LEGACY:
            self._bare_cuda_ctor(node, q[len("torch.cuda.") :])

    # ---- <factory>(...).cuda() / .to() ------------------------------------------------------

    def _trailing(
        self,
        node: cst.Call,
        inner: cst.Call,
        meth: str,
        chain: tuple[cst.BaseExpression, tuple[str, ...]] | None = None,
    ) -> None:
        """``<factory>(...).cuda()`` / ``.to(...)``: create the tensor on the target device instead.
        ``chain``: the receiver of the move when it rearranges the factory's result (layout_chains),
        and its links; the rearrangement then runs on the device, on the same values."""
        if once_per_process(self, node):
            return  # a converter's or export's one tensor: the copy cannot matter
        fk = self.factory_of(inner)
        if fk is None:
            return
        kind, _q = fk
        if self.factory_blockers(kind, inner) or self._skipped_arguments(kind, inner):
            return
        if self.follows_default_device(kind):
            return  # under `torch.set_default_device(...)` the factory may build it on the device already
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
            if chain is not None:
                return
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
        message = None
        made: cst.BaseExpression = new
        if chain is not None:
            made = replace_root(chain[0], inner, new)
            links = "".join("[...]" if link == "[]" else f".{link}()" for link in chain[1])
            fmt = {**fmt, "links": links}
            message = (
                "`{factory}(...)` is created on the host, rearranged (`{links}`), then moved to `{device}`{assumption}"
            )
        self.report(
            node,
            fmt=fmt,
            message=message,
            replacement=_keep_parens(node, made),
            safety=Safety.UNSAFE if tags else Safety.SAFE,
            tags=tuple(tags),
            note="; ".join(notes),
            imports=imports,
        )

    # ---- x[<factory>(...)] ------------------------------------------------------------------

    def visit_Subscript(self, node: cst.Subscript) -> None:
        for el in node.slice:
            if not isinstance(el.slice, cst.Index):
                continue
            chain = chain_root(el.slice.value)
            inner = chain[0] if chain is not None else el.slice.value
            if isinstance(inner, cst.Call) and self.factory_of(inner) is not None:
                self._host_index(node, inner)
            elif isinstance(node.value, cst.Name):
                self._host_index_named(node, el.slice.value)

    examples = (
        Valid(
            dedent("""\
                import torch

                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
                torch.set_default_device(device)
                rewards = torch.tensor([1.0, 0.5]).to(device)
            """),
            note="under `torch.set_default_device` a factory given no device already builds on it: the move copies nothing",
        ),
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
        # --- a rearranging chain between the factory and the move
        Invalid(
            dedent("""\
                import torch

                class Positions(torch.nn.Module):
                    def __init__(self, device):
                        super().__init__()
                        self.device = device

                    def forward(self, src):
                        b = src.size(0)
                        n = src.size(1)
                        return torch.arange(0, n).unsqueeze(0).repeat(b, 1).to(self.device)
            """),
            after=dedent("""\
                import torch

                class Positions(torch.nn.Module):
                    def __init__(self, device):
                        super().__init__()
                        self.device = device

                    def forward(self, src):
                        b = src.size(0)
                        n = src.size(1)
                        return torch.arange(0, n, device=self.device).unsqueeze(0).repeat(b, 1)
            """),
            note="position ids built at every forward: the arange, unsqueeze and repeat run on the device",
        ),
        Invalid(
            "import torch\ndevice = 'cpu'\nx = torch.arange(6)[:, None].repeat(1, 3).t().flip(0).to(device)\n",
            after="import torch\ndevice = 'cpu'\nx = torch.arange(6, device=device)[:, None].repeat(1, 3).t().flip(0)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\nx = torch.zeros(2, 3).view(3, 2).to('cpu', torch.float64)\n",
            after="import torch\nx = torch.zeros(2, 3, device='cpu', dtype=torch.float64).view(3, 2)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\ndef f(x, n):\n    return torch.arange(n).unsqueeze(0).to(x)\n",
            note="x may be a tensor, whose dtype `.to(x)` also gives: display-only",
        ),
        Valid(
            "import torch\ndevice = 'cpu'\nx = torch.arange(4).expand(2, 4).to(device)\n",
            runnable=True,
            note="an overlapping view: `.to()` to another device makes it dense, the device's expand would not",
        ),
        Valid("import torch\n\ndef f(device):\n    return torch.arange(9)[::2].to(device)\n", note="a stepped slice"),
        Valid(
            dedent("""\
                import torch

                def f(x, n):
                    pos = torch.arange(n).unsqueeze(0)
                    device = x.device
                    return pos.to(device)
            """),
            note="the factory is bound to a name; the device is bound after it",
        ),
        # --- a factory as an index of a tensor that may be on a device
        Invalid(
            dedent("""\
                import torch
                import torch.nn.functional as F

                def pick(logits: torch.Tensor, tokens: torch.Tensor, device):
                    logprobs = F.log_softmax(logits.to(device), dim=-1)
                    return logprobs[torch.arange(logprobs.shape[0]), tokens]
            """),
            after=dedent("""\
                import torch
                import torch.nn.functional as F

                def pick(logits: torch.Tensor, tokens: torch.Tensor, device):
                    logprobs = F.log_softmax(logits.to(device), dim=-1)
                    return logprobs[torch.arange(logprobs.shape[0], device=logprobs.device), tokens]
            """),
        ),
        Invalid(
            dedent("""\
                import torch
                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

                def pick(scores):
                    logits = torch.log_softmax(scores, -1)
                    tokens = logits.argmax(-1)
                    return logits[torch.arange(logits.shape[0]), tokens], logits[torch.arange(4)[:, None], tokens]

                picked, rows = pick(torch.randn(4, 6, device=device))
            """),
            after=dedent("""\
                import torch
                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

                def pick(scores):
                    logits = torch.log_softmax(scores, -1)
                    tokens = logits.argmax(-1)
                    return logits[torch.arange(logits.shape[0], device=logits.device), tokens], logits[
                        torch.arange(4, device=logits.device)[:, None], tokens
                    ]

                picked, rows = pick(torch.randn(4, 6, device=device))
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch

                def shuffle(data, device):
                    x = torch.flatten(data.to(device))
                    return x[torch.randperm(x.shape[0])]
            """),
            after=dedent("""\
                import torch

                def shuffle(data, device):
                    x = torch.flatten(data.to(device))
                    return x[torch.randperm(x.shape[0], device=x.device)]
            """),
            unsafe="rng",
        ),
        Valid(
            dedent("""\
                import numpy as np
                import torch
                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
                a = np.zeros(5)
                t = torch.zeros(5)
                y = a[torch.arange(3)] + t[torch.arange(3)].numpy()
            """),
            runnable=True,
            note="a NumPy array and a host tensor: no copy",
        ),
        Valid(
            dedent("""\
                import torch

                def f(x: torch.Tensor, device):
                    x = x.to(device)
                    return x[torch.arange(3, device=x.device)] + g(x)[torch.arange(3)]
            """),
            note="already on x's device; the second base is a call, which must not run twice",
        ),
        # --- an index computed on the host through names of the function
        Invalid(
            dedent("""\
                import torch

                def gather_rows(table: torch.Tensor, n: int):
                    rows = torch.arange(n).flip(0)
                    return table[rows]
            """),
            after=dedent("""\
                import torch

                def gather_rows(table: torch.Tensor, n: int):
                    rows = torch.arange(n, device=table.device).flip(0)
                    return table[rows]
            """),
        ),
        Invalid(
            dedent("""\
                import torch
                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

                def relative(q: int, k: int, table: torch.Tensor):
                    qc = torch.arange(q)[:, None] * max(k / q, 1.0)
                    kc = torch.arange(k)[None, :] * max(q / k, 1.0)
                    rel = (qc - kc) + (k - 1) * max(q / k, 1.0)
                    return table[rel.long()]

                out = relative(3, 5, torch.randn(9, 2, device=device))
            """),
            after=dedent("""\
                import torch
                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

                def relative(q: int, k: int, table: torch.Tensor):
                    qc = torch.arange(q, device=table.device)[:, None] * max(k / q, 1.0)
                    kc = torch.arange(k, device=table.device)[None, :] * max(q / k, 1.0)
                    rel = (qc - kc) + (k - 1) * max(q / k, 1.0)
                    return table[rel.long()]

                out = relative(3, 5, torch.randn(9, 2, device=device))
            """),
            unsafe="tolerance",
            runnable=True,
            note="relative positions of an attention block: the float steps run on the device",
        ),
        Invalid(
            dedent("""\
                import torch

                def pick(n: int, data, device):
                    idx = torch.arange(n)
                    table = torch.flatten(data.to(device))
                    return table[idx]
            """),
            note="`table` is bound after the factory: its device cannot be read there (display-only)",
        ),
        Valid(
            dedent("""\
                import torch

                def pick(table: torch.Tensor, n: int):
                    idx = torch.arange(n)
                    print(idx.sum())
                    return table[idx]
            """),
            note="the host index is read elsewhere too",
        ),
    )
