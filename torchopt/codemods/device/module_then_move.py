"""TOP103: build ``torch.nn`` modules on their device and in their dtype ."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee, method_call, torch_ref
from torchopt.analysis.values import CAST_METHODS, FLOAT_DTYPES, DeviceKind, classify_device, dtype_of, int_value
from torchopt.analysis.arguments import has_star, keyword, positional, set_kwarg
from torchopt.analysis.syntax import has_comments, source
from torchopt.codemods.device import FAMILY
from torchopt.rewrite.rule import ImportSpec, Invalid, Rule, Safety, Tag, Valid

# Built-in modules that take ``device=``/``dtype=`` (factory kwargs), with how many positional
# arguments precede ``device`` in their signature (more positionals than that: skip).
# Their initialisation draws random numbers (kaiming/xavier/normal init of weights).
RANDOM_INIT: dict[str, int] = {
    "Linear": 3,
    "Bilinear": 4,
    "LazyLinear": 2,
    "Conv1d": 9,
    "Conv2d": 9,
    "Conv3d": 9,
    "ConvTranspose1d": 10,
    "ConvTranspose2d": 10,
    "ConvTranspose3d": 10,
    "LazyConv1d": 8,
    "LazyConv2d": 8,
    "LazyConv3d": 8,
    "LazyConvTranspose1d": 9,
    "LazyConvTranspose2d": 9,
    "LazyConvTranspose3d": 9,
    "Embedding": 9,
    "EmbeddingBag": 10,
    "MultiheadAttention": 9,
    "RNN": 4,
    "LSTM": 4,
    "GRU": 4,  # (*args, **kwargs) forwarded to RNNBase; be conservative
    "RNNCell": 4,
    "LSTMCell": 3,
    "GRUCell": 3,
    "Transformer": 13,
    "TransformerEncoderLayer": 9,
    "TransformerDecoderLayer": 9,
    "AdaptiveLogSoftmaxWithLoss": 5,
}
# Modules whose parameters and buffers are constant fills (ones, zeros, a given constant): no RNG.
DETERMINISTIC_INIT: dict[str, int] = {
    "LayerNorm": 4,
    "GroupNorm": 4,
    "RMSNorm": 3,
    "BatchNorm1d": 5,
    "BatchNorm2d": 5,
    "BatchNorm3d": 5,
    "SyncBatchNorm": 6,
    "InstanceNorm1d": 5,
    "InstanceNorm2d": 5,
    "InstanceNorm3d": 5,
    "PReLU": 2,
}

_MOVES = ("cuda", "to", "half", "float", "double", "bfloat16")
_CUDA_STR = ("cuda",)


def module_class(qualified: str | None) -> str | None:
    """``Linear`` for ``torch.nn.Linear`` / ``torch.nn.modules.linear.Linear``; else None."""
    if not qualified:
        return None
    parts = qualified.split(".")
    if parts[:2] != ["torch", "nn"]:
        return None
    if len(parts) == 3 or (len(parts) == 5 and parts[2] == "modules"):
        cls = parts[-1]
        if cls in RANDOM_INIT or cls in DETERMINISTIC_INIT:
            return cls
    return None


class ModuleThenMove(Rule):
    """## What it does
    Flags a built-in `torch.nn` module that is constructed and then immediately moved or cast:
    `nn.Linear(4, 3).cuda()`, `nn.LayerNorm(8).to(device)`, `nn.Embedding(10, 3).half()`. It only
    looks at `torch.nn` classes that accept the `device=` and `dtype=` factory arguments (resolved
    by qualified name); your own `nn.Module` subclasses are never touched.

    ## Why is this slow
    The module first allocates and initialises its parameters on the host in float32, then `.cuda()`
    / `.to(...)` / `.half()` allocates them a second time and copies every tensor. Passing
    `device=`/`dtype=` to the constructor allocates and initialises them once, where they belong.

    ## Example
    ```python
    import torch.nn as nn

    layer = nn.Linear(4, 3).cuda()
    norm = nn.LayerNorm(8).double()
    ```

    ## Use instead
    ```python
    import torch
    import torch.nn as nn

    layer = nn.Linear(4, 3, device='cuda')
    norm = nn.LayerNorm(8, dtype=torch.float64)
    ```

    ## Fix safety
    Safe for modules whose initialisation is deterministic: `LayerNorm`, `GroupNorm`, `RMSNorm`,
    `BatchNorm*`, `SyncBatchNorm`, `InstanceNorm*` and `PReLU` fill their parameters and buffers
    with ones, zeros or a constant. Those values are exact in every floating dtype and on every
    device, and no random number is consumed, so the module is bitwise the same. (`PReLU` with an
    explicit `init=` and a dtype change is unsafe, tag tolerance: the constant is no longer rounded
    to float32 first.)

    Unsafe (tag rng) for modules whose weights are drawn at random (`Linear`, `Conv*`,
    `Embedding`, `MultiheadAttention`, RNNs, `Transformer*`, ...): on the device the weights are
    drawn from the device's generator instead of the CPU one, so they take other values, and the
    CPU generator is no longer advanced, so every later CPU random draw shifts. A dtype change
    draws the weights directly in that dtype, which also gives other values (`Linear(4, 3).double()`
    and `Linear(4, 3, dtype=torch.float64)` differ). Moving a random module to `'cpu'` is safe.

    An existing `device=`/`dtype=` is replaced (the move overrode it); `non_blocking` is dropped.
    The fix is not offered for `.to(x)` when `x` may be a tensor, for other arguments such as
    `memory_format=`, for `*args`/`**kwargs`, or when a comment would be lost.
    """

    code = "TOP103"
    name = "module-then-move"
    family = FAMILY
    message = "`{ctor}(...)` is initialised on the host in float32, then converted by `{move}`"
    fix_title = "Construct it in place: `{ctor}(..., {kwargs})`"
    safety = Safety.SAFE
    tags = (Tag.RNG,)
    prefilter = (".cuda(", ".to(", ".half(", ".float(", ".double(", ".bfloat16(")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.patterns import chained_call

        # visit_Call: `<torch.nn module>(...).<move>()` (method_call + module_class).
        return super().could_match(text) and chained_call(text, _MOVES, (*RANDOM_INIT, *DETERMINISTIC_INIT))

    examples = (
        Invalid(
            "import torch.nn as nn\n\nlayer = nn.Linear(4, 3).cuda()\n",
            after='import torch.nn as nn\n\nlayer = nn.Linear(4, 3, device="cuda")\n',
            unsafe="rng",
        ),
        Invalid(
            "import torch\nfrom torch import nn\n\nnorm = nn.LayerNorm(8).double()\n",
            after="import torch\nfrom torch import nn\n\nnorm = nn.LayerNorm(8, dtype=torch.float64)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\nfrom torch.nn import BatchNorm2d\n\ndevice = 'cpu'\n"
            "bn = BatchNorm2d(16).to(device, torch.float16)\n",
            after="import torch\nfrom torch.nn import BatchNorm2d\n\ndevice = 'cpu'\n"
            "bn = BatchNorm2d(16, device=device, dtype=torch.float16)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\ndevice = 'cpu'\ngn = torch.nn.GroupNorm(2, 8).to(device, non_blocking=True)\n",
            after="import torch\n\ndevice = 'cpu'\ngn = torch.nn.GroupNorm(2, 8, device=device)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\n\nlayer = nn.Linear(4, 3).to('cpu')\nx = torch.randn(2)\n",
            after="import torch\nimport torch.nn as nn\n\nlayer = nn.Linear(4, 3, device='cpu')\nx = torch.randn(2)\n",
            runnable=True,
            note="on the CPU the same generator draws the same weights",
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\n\nlayer = nn.Linear(4, 3).double()\n",
            after="import torch\nimport torch.nn as nn\n\nlayer = nn.Linear(4, 3, dtype=torch.float64)\n",
            unsafe="rng",
            runnable=True,
            note="different weights",
        ),
        Invalid(
            "import torch.nn as nn\n\nconv = nn.Conv2d(3, 8, 3, device='cpu').cuda(1)\n",
            after="import torch.nn as nn\n\nconv = nn.Conv2d(3, 8, 3, device='cuda:1')\n",
            unsafe="rng",
        ),
        Invalid(
            "import torch as T\nimport torch.nn as nn\n\nemb = nn.Embedding(10, 3).half()\n",
            after="import torch as T\nimport torch.nn as nn\n\nemb = nn.Embedding(10, 3, dtype=T.half)\n",
            unsafe="rng",
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\n\n"
            "def build(device):\n    return nn.LSTM(8, 16, batch_first=True).to(device=device, dtype=torch.bfloat16)\n",
            after="import torch\nimport torch.nn as nn\n\n"
            "def build(device):\n    return nn.LSTM(8, 16, batch_first=True, device=device, dtype=torch.bfloat16)\n",
            unsafe="rng",
        ),
        Invalid(
            "import torch.nn as nn\n\nln = nn.LayerNorm(8).cuda(  # move it\n)\n",
            after=None,
            note="a comment in the removed part: reported without a fix",
        ),
        Valid(
            "import torch.nn as nn\n\nclass Net(nn.Module):\n    pass\n\nnet = Net().cuda()\n",
            note="user classes may not accept device=",
        ),
        Valid("import torch.nn as nn\n\ndef f(x):\n    return nn.Linear(4, 3).to(x)\n", note="x may be a tensor"),
        Valid("import torch.nn as nn\n\ndef f(dims):\n    return nn.Linear(*dims).cuda()\n"),
        Valid(
            "import torch\nimport torch.nn as nn\n\nm = nn.Conv2d(3, 8, 3).to('cuda', memory_format=torch.channels_last)\n"
        ),
        Valid("import torch.nn as nn\n\nseq = nn.Sequential(nn.ReLU()).cuda()\n", note="no factory kwargs"),
        Valid("import torch\nimport torch.nn as nn\n\nlayer = nn.Linear(4, 3, device='cpu')\n", runnable=True),
        Valid(
            "import torch\nimport torch.nn as nn\n\ndef f():\n    return nn.Linear(4, 3).to(torch.long)\n",
            note="modules only cast to floating dtypes",
        ),
        Valid(
            "class nn:\n    class Linear:\n        def __init__(self, *a): pass\n        def cuda(self): return self\n\n"
            "layer = nn.Linear(4, 3).cuda()\n",
            runnable=True,
        ),
    )

    def visit_Call(self, node: cst.Call) -> None:
        mc = method_call(node, _MOVES)
        if mc is None:
            return
        inner, meth = mc
        cls = module_class(callee(self, inner))
        if cls is None or has_star(inner) or has_star(node):
            return
        limit = RANDOM_INIT.get(cls, DETERMINISTIC_INIT.get(cls, 0))
        if len(positional(inner)) > limit:
            return
        parsed = self._parse_move(node, meth)
        if parsed is None:
            return
        device, dtype, device_is_cpu = parsed
        ctor = source(self, inner.func)
        new = inner
        kwargs = []
        if device is not None:
            new = set_kwarg(new, "device", device, before=("dtype",))
            kwargs.append(f"device={self.ctx.module.code_for_node(device)}")
        imports: tuple[ImportSpec, ...] = ()
        if dtype is not None:
            new = set_kwarg(new, "dtype", dtype)
            kwargs.append(f"dtype={self.ctx.module.code_for_node(dtype)}")
        if meth in CAST_METHODS:
            ref = torch_ref(self)
            imports = ref.imports if ref is not None else ()
        code = self.ctx.module.code_for_node
        move = " ".join(code(node)[len(code(inner)) :].split()).replace("( ", "(").replace(" )", ")")
        fmt = {"ctor": ctor, "move": move if len(move) <= 60 else f".{meth}(...)", "kwargs": ", ".join(kwargs)}

        # The part the fix removes: `.meth(...)` after the inner call.
        removed = node.with_changes(func=node.func.with_changes(value=cst.Name("_")))
        if has_comments(removed) or new is inner:
            self.report(node, fmt=fmt)
            return

        tags: tuple[Tag, ...] = ()
        note = ""
        if cls in RANDOM_INIT and not (dtype is None and device_is_cpu):
            tags = (Tag.RNG,)
            if dtype is not None:
                note = "the weights are drawn directly in the new dtype and take other values"
            else:
                note = (
                    "the weights are drawn from the device's generator; later CPU random "
                    "draws shift because the CPU generator is no longer advanced"
                )
        elif (
            cls == "PReLU" and dtype is not None and (keyword(inner, "init") is not None or len(positional(inner)) >= 2)
        ):
            tags = (Tag.TOLERANCE,)
            note = "the `init` constant is no longer rounded to float32 before the cast"
        self.report(
            node,
            fmt=fmt,
            replacement=new,
            safety=Safety.UNSAFE if tags else Safety.SAFE,
            tags=tags,
            note=note,
            imports=imports,
        )

    def _parse_move(
        self, node: cst.Call, meth: str
    ) -> tuple[cst.BaseExpression | None, cst.BaseExpression | None, bool] | None:
        """(device expression, dtype expression, device is the CPU) for the move; None to skip."""
        pos = positional(node)
        kws = {a.keyword.value: a for a in node.args if a.keyword is not None}
        if meth in CAST_METHODS:
            if node.args:
                return None
            ref = torch_ref(self)
            if ref is None:
                return None
            return None, ref.attr(CAST_METHODS[meth][1]), False
        if meth == "cuda":
            if set(kws) - {"device"} or len(pos) + len(kws) > 1:
                return None
            arg = pos[0].value if pos else (kws["device"].value if kws else None)
            if arg is None:
                return cst.SimpleString("'cuda'"), None, False
            n = int_value(arg)
            if n is not None:
                return cst.SimpleString(f"'cuda:{n}'"), None, False
            dev = classify_device(self, arg)
            if dev.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and dev.text.split(":")[0] in _CUDA_STR:
                return arg, None, False
            return None
        # .to(...)
        if set(kws) - {"device", "dtype", "non_blocking"} or len(pos) > 2:
            return None
        device = kws["device"].value if "device" in kws else None
        dtype = kws["dtype"].value if "dtype" in kws else None
        if len(pos) == 2:
            if device is not None or dtype is not None:
                return None
            device, dtype = pos[0].value, pos[1].value
        elif len(pos) == 1:
            first = pos[0].value
            kind = classify_device(self, first)
            if kind.is_device and device is None:
                device = first
            elif kind.kind is DeviceKind.DTYPE and dtype is None and device is None:
                dtype = first
            else:
                return None
        if device is None and dtype is None:
            return None
        is_cpu = False
        if device is not None:
            dev = classify_device(self, device)
            if not dev.is_device:
                return None
            is_cpu = dev.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and dev.is_cpu
        if dtype is not None and dtype_of(self, dtype) not in FLOAT_DTYPES:
            return None
        return device, dtype, is_cpu
