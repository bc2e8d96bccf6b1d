"""TOP201 (deprecated `torch.cuda.amp` / `torch.cpu.amp` → `torch.amp`) and the AMP advice rules
TOP204 (pure-fp16 model), TOP206 (gradient penalty under AMP) and TOP207 (custom autograd
Functions under autocast): rules.md AMP-001, AMP-004, AMP-006, AMP-007."""
from __future__ import annotations

import io
import tokenize
from dataclasses import dataclass, field
from typing import Callable, Sequence

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import callee, reaching_values, torch_name, torch_ref
from torchopt.analysis.values import dtype_of
from torchopt.analysis.arguments import has_star, keyword, make_kwarg, positional, set_kwarg
from torchopt.analysis.syntax import source
from torchopt.codemods.amp import FAMILY
from torchopt.codemods.amp import _prefilter
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import ImportSpec, Invalid, Rule, Safety, Valid

# --------------------------------------------------------------------------- the deprecated API

# Deprecated module -> (device, names it offers that torch.amp also offers).
AMP_MODULES: dict[str, tuple[str, frozenset[str]]] = {
    "torch.cuda.amp": ("cuda", frozenset({"autocast", "GradScaler", "custom_fwd", "custom_bwd"})),
    "torch.cuda.amp.autocast_mode": ("cuda", frozenset({"autocast", "custom_fwd", "custom_bwd"})),
    "torch.cuda.amp.grad_scaler": ("cuda", frozenset({"GradScaler"})),
    "torch.cpu.amp": ("cpu", frozenset({"autocast", "GradScaler"})),
    "torch.cpu.amp.autocast_mode": ("cpu", frozenset({"autocast"})),
    "torch.cpu.amp.grad_scaler": ("cpu", frozenset({"GradScaler"})),
}
MEMBERS = frozenset({"autocast", "GradScaler", "custom_fwd", "custom_bwd"})
# Where each member lives now, below the torch module (`torch.autocast is torch.amp.autocast`, E-18).
NEW_ATTR = {"autocast": "autocast", "GradScaler": "amp.GradScaler",
            "custom_fwd": "amp.custom_fwd", "custom_bwd": "amp.custom_bwd"}
# The old autocast signature; every positional argument becomes one of these keywords (E-31b).
OLD_AUTOCAST_PARAMS = ("enabled", "dtype", "cache_enabled")
OLD_KEYWORDS = {
    "autocast": frozenset(OLD_AUTOCAST_PARAMS),
    "GradScaler": frozenset({"init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"}),
    "custom_fwd": frozenset({"fwd", "cast_inputs"}),
    "custom_bwd": frozenset({"bwd"}),
}
MAX_POSITIONAL = {"autocast": 3, "GradScaler": 5, "custom_fwd": 1, "custom_bwd": 1}


def deprecated_member(qname: str | None) -> tuple[str, str, str] | None:
    """(module, device, member) for a qualified name in the deprecated API; else None."""
    if not qname or "." not in qname:
        return None
    module, member = qname.rsplit(".", 1)
    spec = AMP_MODULES.get(module)
    if spec is None or member not in spec[1]:
        return None
    return module, spec[0], member


_QUOTE_CACHE: dict[int, tuple[cst.Module, str]] = {}


def quote_style(module: cst.Module) -> str:
    """The quote the file mostly uses for one-line strings (double when undecided)."""
    hit = _QUOTE_CACHE.get(id(module))
    if hit is not None and hit[0] is module:
        return hit[1]
    single = double = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(module.code).readline):
            if tok.type != tokenize.STRING:
                continue
            body = tok.string.lstrip("rbuRBUfF")
            if body.startswith(("'''", '"""')):
                continue
            if body.startswith("'"):
                single += 1
            elif body.startswith('"'):
                double += 1
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    q = "'" if single > double else '"'
    if len(_QUOTE_CACHE) > 64:
        _QUOTE_CACHE.clear()
    _QUOTE_CACHE[id(module)] = (module, q)
    return q


def _comma_like(call: cst.Call) -> cst.Comma:
    """A separator in the call's own style, for an argument put in front of the others."""
    if isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace):
        return cst.Comma(whitespace_after=call.whitespace_before_args)
    for a in call.args[:-1]:
        if isinstance(a.comma, cst.Comma):
            return a.comma
    return cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


def _prepend(call: cst.Call, arg: cst.Arg) -> cst.Call:
    if not call.args:
        return call.with_changes(args=[arg])
    return call.with_changes(args=[arg.with_changes(comma=_comma_like(call)), *call.args])


def migrate_call(call: cst.Call, func: cst.BaseExpression, device: str, member: str, quote: str) -> cst.Call | None:
    """The `torch.amp` form of a call to a deprecated member (None: cannot be done exactly)."""
    if has_star(call):
        return None
    pos = positional(call)
    kws = [a.keyword.value for a in call.args if a.keyword is not None]
    if len(pos) > MAX_POSITIONAL[member] or set(kws) - OLD_KEYWORDS[member] or len(set(kws)) != len(kws):
        return None
    dev = cst.SimpleString(f"{quote}{device}{quote}")
    new = call.with_changes(func=func)
    if member == "autocast":
        # (enabled, dtype, cache_enabled) -> (device_type, dtype, enabled, cache_enabled): every
        # positional argument must become its keyword, or `enabled` lands in `dtype` (E-31b).
        args = []
        i = 0
        for a in call.args:
            if a.keyword is None:
                name = OLD_AUTOCAST_PARAMS[i]
                i += 1
                if name in kws:
                    return None
                a = a.with_changes(keyword=cst.Name(name), equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
            args.append(a)
        return _prepend(new.with_changes(args=args), cst.Arg(dev))
    if member == "GradScaler":
        # (init_scale, ...) -> (device, init_scale, ...): the old list shifted by one (E-31).
        return _prepend(new, cst.Arg(dev))
    # custom_fwd(fwd=None, *, cast_inputs=None) -> custom_fwd(fwd=None, *, device_type, cast_inputs=None)
    return set_kwarg(new, "device_type", dev, before=("cast_inputs",))


def _one_line(code: str) -> str:
    code = " ".join(code.split()).replace("( ", "(").replace(" )", ")").replace(",)", ")")
    return code if len(code) <= 60 else code[:57] + "..."


_TYPE_CONTAINERS = (cst.Subscript, cst.SubscriptElement, cst.Index, cst.BinaryOperation, cst.Tuple,
                    cst.List, cst.Element)


def use_kind(rule: Rule, ref: cst.CSTNode) -> tuple[str, cst.CSTNode | None]:
    """How a reference to a deprecated member is used: ("call", call), ("decorator", decorator),
    ("type", None) in an annotation or as the class argument of isinstance/issubclass, else ("value", None)."""
    parent = rule.get_metadata(ParentProvider, ref, None)
    if isinstance(parent, cst.Call) and parent.func is ref:
        return "call", parent
    if isinstance(parent, cst.Decorator) and parent.decorator is ref:
        return "decorator", parent
    while isinstance(parent, _TYPE_CONTAINERS):
        parent = rule.get_metadata(ParentProvider, parent, None)
    if isinstance(parent, cst.Annotation):
        return "type", None
    # isinstance(x, C) / issubclass(x, (A, C))
    node, par = ref, rule.get_metadata(ParentProvider, ref, None)
    if isinstance(par, cst.Element):
        tup = rule.get_metadata(ParentProvider, par, None)
        if isinstance(tup, cst.Tuple):
            node, par = tup, rule.get_metadata(ParentProvider, tup, None)
    if isinstance(par, cst.Arg) and par.value is node and par.keyword is None:
        call = rule.get_metadata(ParentProvider, par, None)
        if (isinstance(call, cst.Call) and isinstance(call.func, cst.Name)
                and call.func.value in ("isinstance", "issubclass") and len(call.args) == 2
                and call.args[1] is par):
            return "type", None
    return "value", None


@dataclass
class _Site:
    """One reference to a deprecated member and how to migrate it."""

    node: cst.CSTNode  # what the finding points at
    old: str
    new: str = ""
    edit: Callable[[cst.CSTNode], cst.CSTNode] | None = None  # applied to the updated node
    problem: str = ""  # why it cannot be migrated ("" when it can, or needs no edit)
    manual: str = ""  # the new form spelled with `torch.` (for advice when the import stays)
    message: str | None = None
    imports: tuple[ImportSpec, ...] = field(default_factory=tuple)


def _alias_list(aliases: list[cst.ImportAlias], original: Sequence[cst.ImportAlias]) -> list[cst.ImportAlias]:
    """``aliases`` as an import list: separators in the original's style, its trailing comma kept."""
    out = []
    sep = next((a.comma for a in original[:-1] if isinstance(a.comma, cst.Comma)),
               cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    for i, a in enumerate(aliases):
        last = i == len(aliases) - 1
        out.append(a.with_changes(comma=original[-1].comma if last else sep))
    return out


class _Edits(cst.CSTTransformer):
    def __init__(self, edits: dict[int, Callable[[cst.CSTNode], cst.CSTNode]]) -> None:
        super().__init__()
        self.edits = edits

    def on_leave(self, original_node, updated_node):  # type: ignore[override]
        fn = self.edits.get(id(original_node))
        return fn(updated_node) if fn is not None else updated_node


class DeprecatedAmpApi(Rule):
    """## What it does
    Migrates the deprecated `torch.cuda.amp.*` and `torch.cpu.amp.*` API to `torch.amp`:

    * `torch.cuda.amp.autocast(...)` → `torch.autocast("cuda", ...)` and
      `torch.cpu.amp.autocast(...)` → `torch.autocast("cpu", ...)`, with every positional argument
      turned into its keyword (`enabled=`, `dtype=`, `cache_enabled=`);
    * `torch.cuda.amp.GradScaler(...)` → `torch.amp.GradScaler("cuda", ...)` (and `"cpu"`);
    * `@torch.cuda.amp.custom_fwd[(cast_inputs=...)]` / `@torch.cuda.amp.custom_bwd` →
      `@torch.amp.custom_fwd(device_type="cuda"[, cast_inputs=...])` / `@torch.amp.custom_bwd(device_type="cuda")`;
    * the decorator `@torch.cuda.amp.autocast()` → `@torch.autocast("cuda")`;
    * `isinstance(x, torch.cuda.amp.GradScaler)` and annotations → `torch.amp.GradScaler`.

    Names imported with `from torch.cuda.amp import autocast, GradScaler` are migrated together:
    the import becomes `from torch.amp import autocast, GradScaler` and every call site gains the
    device (`autocast("cuda")`, `GradScaler("cuda")`) in one edit. Names are resolved by
    qualified name, so `import torch.cuda.amp as amp; amp.GradScaler()` and `import torch as T`
    are recognised, and the file's own torch alias is reused (`T.autocast("cuda")`). The device
    string follows the file's quote style.

    ## Why is this slow
    It is not slower, it is on its way out: every one of these calls emits a `FutureWarning` in
    torch 2.x (`torch.cuda.amp.autocast(args...)` is deprecated...) and they will be removed.
    `torch.amp` is the device-generic API that the other AMP rules generate.

    ## Example
    ```python
    import torch

    scaler = torch.cuda.amp.GradScaler()
    with torch.cuda.amp.autocast(use_amp):
        loss = model(x)
    ```

    ## Use instead
    ```python
    import torch

    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", enabled=use_amp):
        loss = model(x)
    ```

    ## Fix safety
    Safe and exact: the deprecated classes are thin subclasses that call the `torch.amp` ones with
    the device filled in, and the defaults are the same — `torch.autocast("cuda")` computes in
    float16 and `torch.autocast("cpu")` in bfloat16 (`torch.get_autocast_dtype`), and
    `cache_enabled=None` means the global default, which is `True` as before (a program that
    turned the cache off with `torch.set_autocast_cache_enabled(False)` now keeps it off inside
    the region too; the cache only reuses casts of the same weights, so the values are the same).
    Both forms work under TorchScript.

    Positional arguments of `autocast` always become keywords: the old signature is
    `(enabled, dtype, cache_enabled)` and the new one `(device_type, dtype, enabled, cache_enabled)`,
    so `torch.autocast("cuda", use_amp)` would put the bool into `dtype` and fail on `__enter__`
    (`TypeError: ... must be torch.dtype, not bool`). `GradScaler` keeps its positional
    arguments: its new parameter list is the old one shifted by `device`.

    `isinstance` checks and annotations are migrated too: an object built by
    `torch.amp.GradScaler(...)` is *not* an instance of `torch.cuda.amp.GradScaler`, while the old
    class is a subclass of the new one, so the new check accepts both.

    Imported names that `torch.amp` lacks, and module-level imported names the file does not use
    (another module may import them from here and call them without a device), stay in a
    `from torch.cuda.amp import ...` line of their own; only the names used here move.

    Not fixed (reported with advice): a deprecated name used as a value
    (`ctx = autocast if amp else nullcontext`, `partial(autocast, ...)`) — then its import and its
    other uses are left alone too; calls with `*args`/`**kwargs`; a star import. A name also bound
    by another statement (`try: from torch.amp import autocast` / `except ImportError: from
    torch.cuda.amp import autocast`) is left alone without a report.
    """

    code = "TOP201"
    min_torch = (2, 3)  # `torch.amp.GradScaler(device)`
    locality = "file"  # an import's fix depends on every use of the names it binds
    name = "deprecated-amp-api"
    family = FAMILY
    message = "`{old}` is deprecated (FutureWarning); use `{new}`"
    import_message = "`{old}` imports the deprecated AMP API; import from `torch.amp` and pass the device"
    value_message = (
        "`{old}` is deprecated, and used here as a value, so the device argument cannot be added: "
        "use `{new}` (e.g. `functools.partial({new}, {device})`) by hand"
    )
    manual_message = "`{old}` is deprecated (FutureWarning); migrate it to `{new}` by hand ({why})"
    fix_title = "Use `{new}`"
    safety = Safety.SAFE
    # "cuda import": `from torch.cuda import nccl, amp` / `from torch.cuda import (amp)`.
    prefilter = ("cuda.amp", "cpu.amp", "cuda import", "cpu import")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and _prefilter.deprecated_amp_possible(text)

    examples = (
        Invalid(
            "import torch\n\na = torch.randn(4, 4)\nwith torch.cpu.amp.autocast():\n    y = a @ a\n",
            after="import torch\n\na = torch.randn(4, 4)\nwith torch.autocast(\"cpu\"):\n    y = a @ a\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\na = torch.randn(4, 4)\nwith torch.cpu.amp.autocast(True, torch.float16):\n    y = a @ a\n",
            after="import torch\n\na = torch.randn(4, 4)\n"
            "with torch.autocast(\"cpu\", enabled=True, dtype=torch.float16):\n    y = a @ a\n",
            runnable=True,
            note="positional arguments become keywords (the E-31b trap)",
        ),
        Invalid(
            "import torch\n\nuse_amp = False\na = torch.randn(4, 4)\nwith torch.cpu.amp.autocast(use_amp):\n    y = a @ a\n",
            after="import torch\n\nuse_amp = False\na = torch.randn(4, 4)\n"
            "with torch.autocast(\"cpu\", enabled=use_amp):\n    y = a @ a\n",
            runnable=True,
            note="`torch.autocast(\"cpu\", use_amp)` would raise on entry",
        ),
        Invalid(
            "import torch\n\ndef step(model, x, use_amp):\n"
            "    with torch.cuda.amp.autocast(enabled=use_amp, dtype=torch.float16, cache_enabled=False):\n"
            "        return model(x)\n",
            after="import torch\n\ndef step(model, x, use_amp):\n"
            "    with torch.autocast(\"cuda\", enabled=use_amp, dtype=torch.float16, cache_enabled=False):\n"
            "        return model(x)\n",
        ),
        Invalid(
            "import torch\n\nscaler = torch.cuda.amp.GradScaler()\nloss = torch.ones(()) * 3\n"
            "scaled = scaler.scale(loss)\n",
            after="import torch\n\nscaler = torch.amp.GradScaler(\"cuda\")\nloss = torch.ones(()) * 3\n"
            "scaled = scaler.scale(loss)\n",
            runnable=True,
            note="disabled without CUDA, before and after",
        ),
        Invalid(
            "import torch\n\nscaler = torch.cuda.amp.GradScaler(2.0 ** 10, 2.0, enabled=False)\n",
            after="import torch\n\nscaler = torch.amp.GradScaler(\"cuda\", 2.0 ** 10, 2.0, enabled=False)\n",
            runnable=True,
            note="GradScaler's positional arguments shift by one and stay",
        ),
        Invalid(
            "import torch\n\nscaler = torch.cpu.amp.GradScaler(init_scale=4.0)\n"
            "loss = torch.ones(()) * 3\nscaled = scaler.scale(loss)\n",
            after="import torch\n\nscaler = torch.amp.GradScaler(\"cpu\", init_scale=4.0)\n"
            "loss = torch.ones(()) * 3\nscaled = scaler.scale(loss)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\n\nclass Mul(torch.autograd.Function):\n"
            "    @staticmethod\n    @torch.cuda.amp.custom_fwd\n    def forward(ctx, x):\n        return x * 2\n\n"
            "    @staticmethod\n    @torch.cuda.amp.custom_bwd\n    def backward(ctx, g):\n        return g * 2\n\n\n"
            "x = torch.ones(3, requires_grad=True)\nMul.apply(x).sum().backward()\ngrad = x.grad\n",
            after="import torch\n\n\nclass Mul(torch.autograd.Function):\n"
            "    @staticmethod\n    @torch.amp.custom_fwd(device_type=\"cuda\")\n    def forward(ctx, x):\n        return x * 2\n\n"
            "    @staticmethod\n    @torch.amp.custom_bwd(device_type=\"cuda\")\n    def backward(ctx, g):\n        return g * 2\n\n\n"
            "x = torch.ones(3, requires_grad=True)\nMul.apply(x).sum().backward()\ngrad = x.grad\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\n\nclass Exp(torch.autograd.Function):\n"
            "    @staticmethod\n    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)\n"
            "    def forward(ctx, x):\n        y = x.exp()\n        ctx.save_for_backward(y)\n        return y\n",
            after="import torch\n\n\nclass Exp(torch.autograd.Function):\n"
            "    @staticmethod\n    @torch.amp.custom_fwd(device_type=\"cuda\", cast_inputs=torch.float32)\n"
            "    def forward(ctx, x):\n        y = x.exp()\n        ctx.save_for_backward(y)\n        return y\n",
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\n\n\nclass Net(nn.Module):\n"
            "    @torch.cuda.amp.autocast()\n    def forward(self, x):\n        return x * 2\n",
            after="import torch\nimport torch.nn as nn\n\n\nclass Net(nn.Module):\n"
            "    @torch.autocast(\"cuda\")\n    def forward(self, x):\n        return x * 2\n",
        ),
        Invalid(
            "import torch\nfrom torch.cuda.amp import autocast, GradScaler\n\n"
            "scaler = GradScaler()\n\ndef step(model, x):\n    with autocast():\n        return model(x)\n",
            after="import torch\nfrom torch.amp import autocast, GradScaler\n\n"
            "scaler = GradScaler(\"cuda\")\n\ndef step(model, x):\n    with autocast(\"cuda\"):\n        return model(x)\n",
            note="the import and every call site change together",
        ),
        Invalid(
            "from torch.cpu.amp import autocast as cpu_autocast\nimport torch\n\na = torch.randn(4, 4)\n"
            "with cpu_autocast(dtype=torch.bfloat16):\n    y = a @ a\n",
            after="from torch.amp import autocast as cpu_autocast\nimport torch\n\na = torch.randn(4, 4)\n"
            "with cpu_autocast(\"cpu\", dtype=torch.bfloat16):\n    y = a @ a\n",
            runnable=True,
        ),
        Invalid(
            "import torch.cuda.amp as amp\n\nscaler = amp.GradScaler()\n",
            after="import torch.cuda.amp as amp\nimport torch\n\nscaler = torch.amp.GradScaler(\"cuda\")\n",
            note="resolved by qualified name; `import torch` is added",
        ),
        Invalid(
            "import torch as T\n\nwith T.cuda.amp.autocast(False):\n    pass\n",
            after="import torch as T\n\nwith T.autocast(\"cuda\", enabled=False):\n    pass\n",
            runnable=True,
            note="the file's alias is reused",
        ),
        Invalid(
            "import torch\n\nscaler = torch.cuda.amp.GradScaler(enabled=False)\n\n\n"
            "def save(s: torch.cuda.amp.GradScaler) -> dict:\n    return s.state_dict()\n\n\n"
            "ok = isinstance(scaler, torch.cuda.amp.GradScaler)\n",
            after="import torch\n\nscaler = torch.amp.GradScaler(\"cuda\", enabled=False)\n\n\n"
            "def save(s: torch.amp.GradScaler) -> dict:\n    return s.state_dict()\n\n\n"
            "ok = isinstance(scaler, torch.amp.GradScaler)\n",
            runnable=True,
            note="isinstance and annotations move with the constructor (E-31)",
        ),
        Invalid(
            "import torch\n\nmode = 'fast'\nwith torch.cuda.amp.autocast(enabled=mode == 'fast'):\n    pass\n",
            after="import torch\n\nmode = 'fast'\nwith torch.autocast('cuda', enabled=mode == 'fast'):\n    pass\n",
            note="the file's quote style is kept",
        ),
        Invalid(
            "import torch\n\nwith torch.cuda.amp.autocast(\n    enabled=True,\n    dtype=torch.float16,\n):\n    pass\n",
            after="import torch\n\nwith torch.autocast(\n    \"cuda\",\n    enabled=True,\n    dtype=torch.float16,\n):\n    pass\n",
        ),
        Invalid(
            "import torch\nfrom contextlib import nullcontext\nfrom torch.cuda.amp import autocast\n\n"
            "def ctx(use_amp):\n    return autocast if use_amp else nullcontext\n\nwith autocast():\n    pass\n",
            after=None,
            note="a value use: the device cannot be added, so nothing is rewritten",
        ),
        Invalid(
            "import functools\nimport torch\n\nctx = functools.partial(torch.cuda.amp.autocast, dtype=torch.float16)\n",
            after=None,
        ),
        Invalid(
            "import torch\n\ndef run(kwargs):\n    with torch.cuda.amp.autocast(**kwargs):\n        pass\n",
            after=None,
            note="`**kwargs` cannot be mapped",
        ),
        Valid("import torch\n\nwith torch.autocast(\"cuda\"):\n    pass\n", runnable=True),
        Valid("import torch\n\nscaler = torch.amp.GradScaler(\"cuda\")\n", runnable=True),
        Valid(
            "import torch\n\na = torch.randn(4, 4)\nwith torch.autocast(\"cpu\", dtype=torch.bfloat16):\n    y = a @ a\n",
            runnable=True,
        ),
        Valid("from torch.amp import autocast, GradScaler\n\nscaler = GradScaler(\"cuda\")\nwith autocast(\"cuda\"):\n    pass\n"),
        Valid("def f(torch):\n    return torch.cuda.amp.autocast()\n", note="a parameter named `torch`"),
        Valid(
            "import torch\n\nclass Sub(torch.amp.GradScaler):\n    pass\n\nok = isinstance(Sub(), torch.amp.GradScaler)\n"
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._imports: list[cst.ImportFrom] = []

    # ---- attribute forms: `torch.cuda.amp.X`, `T.cpu.amp.X`, `amp.X`: one finding per node

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value not in MEMBERS:
            return
        dep = deprecated_member(torch_name(self, node))
        if dep is None:
            return
        module, device, member = dep
        site = self._site(node, module, device, member, self._new_ref(node, member))
        self._report_site(site)

    def _new_ref(self, node: cst.Attribute, member: str) -> tuple[cst.BaseExpression, tuple[ImportSpec, ...]] | None:
        """`<torch>.autocast` / `<torch>.amp.X`, reusing the root of `<torch>.cuda.amp.X`."""
        amp = node.value
        if (isinstance(amp, cst.Attribute) and amp.attr.value == "amp" and isinstance(amp.value, cst.Attribute)
                and amp.value.attr.value in ("cuda", "cpu") and isinstance(amp.value.value, cst.Name)):
            return cst.parse_expression(f"{amp.value.value.value}.{NEW_ATTR[member]}"), ()
        ref = torch_ref(self)
        if ref is None:
            return None
        return ref.attr(NEW_ATTR[member]), ref.imports

    def _site(self, ref: cst.BaseExpression, module: str, device: str, member: str,
              new_ref: tuple[cst.BaseExpression, tuple[ImportSpec, ...]] | None, keep_name: bool = False) -> _Site:
        """What to do with one reference. ``keep_name``: the reference itself stays (a from-import
        that is migrated as a whole); else it is replaced by ``new_ref``."""
        q = quote_style(self.ctx.module)
        kind, holder = use_kind(self, ref)
        if keep_name:
            func: cst.BaseExpression = ref
            imports: tuple[ImportSpec, ...] = ()
        elif new_ref is None:
            return _Site(ref, source(self, ref), f"torch.{NEW_ATTR[member]}", problem="`torch` is shadowed here")
        else:
            func, imports = new_ref
        func_code = cst.Module([]).code_for_node(func)
        torch_code = f"torch.{NEW_ATTR[member]}" if keep_name else func_code
        if kind == "call":
            call = holder
            assert isinstance(call, cst.Call)
            old = source(self, call)
            new = migrate_call(call, func, device, member, q)
            if new is None:
                why = "`*args`/`**kwargs` cannot be mapped" if has_star(call) else "unexpected arguments"
                return _Site(call, old, _one_line(f"{torch_code}({q}{device}{q}, ...)"), problem=why)
            manual = migrate_call(call, cst.parse_expression(torch_code), device, member, q)
            return _Site(
                call, old, _one_line(cst.Module([]).code_for_node(new)),
                edit=lambda upd, f=func: migrate_call(upd, f, device, member, q),  # type: ignore[arg-type]
                imports=imports, manual=_one_line(cst.Module([]).code_for_node(manual)),  # type: ignore[arg-type]
            )
        if kind == "decorator" and member in ("custom_fwd", "custom_bwd"):
            new_dec = cst.Call(func=func, args=[make_kwarg("device_type", cst.SimpleString(f"{q}{device}{q}"))])
            manual_dec = new_dec.with_changes(func=cst.parse_expression(torch_code))
            return _Site(ref, source(self, ref), _one_line(cst.Module([]).code_for_node(new_dec)),
                         edit=lambda upd: new_dec, imports=imports,
                         manual=_one_line(cst.Module([]).code_for_node(manual_dec)))
        if kind == "type" and member in ("GradScaler", "autocast"):
            new_code = cst.Module([]).code_for_node(func)
            if keep_name:
                return _Site(ref, source(self, ref), new_code)  # the import change covers it
            return _Site(ref, source(self, ref), new_code, edit=lambda upd: func, imports=imports)
        return _Site(ref, source(self, ref), torch_code, problem="value",
                     message=self.value_message.format(old=source(self, ref), new=torch_code,
                                                       device=f"{q}{device}{q}"))

    def _report_site(self, site: _Site) -> None:
        if site.problem == "value":
            self.report(site.node, message=site.message)
        elif site.problem:
            self.report(site.node, message=self.manual_message, fmt={"old": site.old, "new": site.new, "why": site.problem})
        elif site.edit is not None:
            target = site.node
            self.report(site.node, fmt={"old": site.old, "new": site.new},
                        replacement=site.edit(target), target=target, imports=site.imports)

    # ---- `from torch.cuda.amp import autocast, GradScaler`: the import and all its uses at once

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative or node.module is None:
            return
        mod = cst.helpers.get_full_name_for_node(node.module)
        if mod in AMP_MODULES:
            self._imports.append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        for imp in self._imports:
            self._import_group(imp)

    def _import_group(self, imp: cst.ImportFrom) -> None:
        mod = cst.helpers.get_full_name_for_node(imp.module) or ""  # type: ignore[arg-type]
        device, offered = AMP_MODULES[mod]
        old_import = _one_line(self.ctx.module.code_for_node(imp))
        if isinstance(imp.names, cst.ImportStar):
            self.report(imp, message=self.manual_message,
                        fmt={"old": old_import, "new": "from torch.amp import ...", "why": "a star import"})
            return
        try:
            scope = self.get_metadata(ScopeProvider, imp)
        except KeyError:
            scope = None
        if scope is None:
            return
        sites: list[_Site] = []
        blocked: list[str] = []
        # Names that stay in the old import: those torch.amp lacks, and module-level names this
        # file does not use (another module may import them from here and call them without a device).
        stay: list[cst.ImportAlias] = []
        move: list[cst.ImportAlias] = []
        for alias in imp.names:
            name = alias.name.value if isinstance(alias.name, cst.Name) else ""
            bound = alias.asname.name.value if alias.asname is not None else name  # type: ignore[union-attr]
            refs = []
            for a in scope.assignments[bound] if bound in scope.assignments else ():
                if getattr(a, "node", None) is imp:
                    refs.extend(a.references)
            if name not in offered or (not refs and isinstance(scope, cst.metadata.GlobalScope)):
                stay.append(alias)
                continue
            move.append(alias)
            for access in refs:
                ref = access.node
                if not isinstance(ref, cst.Name):
                    continue  # a string annotation: still names the right class after the import changes
                if len(access.referents) > 1:
                    blocked.append(f"`{bound}` is also bound by another statement")
                    continue
                sites.append(self._site(ref, mod, device, name, None, keep_name=True))
        if not sites:
            return  # nothing here uses the old API (or only through another binding too)
        problems = [s for s in sites if s.problem]
        if blocked or problems:
            why = "; ".join(dict.fromkeys(blocked)) or "a use below cannot be migrated"
            for s in sites:
                if s.problem:
                    self._report_site(s)
                elif s.edit is not None:
                    self.report(s.node, message=self.manual_message,
                                fmt={"old": s.old, "new": s.manual or s.new, "why": why})
            if blocked:
                self.report(imp, message=self.manual_message,
                            fmt={"old": old_import, "new": "from torch.amp import ...", "why": why})
            return
        new_module = cst.Attribute(value=cst.Name("torch"), attr=cst.Name("amp"))
        edits: dict[int, Callable[[cst.CSTNode], cst.CSTNode]] = {}
        nodes: list[cst.CSTNode] = []
        if not stay:
            new_imp = imp.with_changes(module=new_module)
            edits[id(imp)] = lambda upd: upd.with_changes(module=new_module)  # type: ignore[union-attr]
            nodes.append(imp)
        else:
            # Split: `from torch.cuda.amp import <stay>` then `from torch.amp import <move>`.
            kept = imp.with_changes(names=_alias_list(stay, imp.names), lpar=imp.lpar, rpar=imp.rpar)
            new_imp = imp.with_changes(module=new_module, names=_alias_list(move, imp.names))
            line = self.get_metadata(ParentProvider, imp, None)
            if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
                pair = cst.FlattenSentinel([
                    line.with_changes(body=[kept]),
                    cst.SimpleStatementLine(body=[new_imp], leading_lines=[]),
                ])
                edits[id(line)] = lambda upd: pair  # type: ignore[assignment,return-value]
                holder = self.get_metadata(ParentProvider, line, None)
                nodes.append(holder if holder is not None else line)
            else:
                semi = cst.FlattenSentinel([kept.with_changes(semicolon=cst.Semicolon(
                    whitespace_after=cst.SimpleWhitespace(" "))), new_imp])
                edits[id(imp)] = lambda upd: semi  # type: ignore[assignment,return-value]
                nodes.append(line if line is not None else imp)
        for s in sites:
            if s.edit is not None:
                edits[id(s.node)] = s.edit
                nodes.append(s.node)
        target = self._common_ancestor(nodes)
        replacement = target.visit(_Edits(edits))
        new_import = _one_line(cst.Module([]).code_for_node(new_imp))
        self.report(imp, message=self.import_message, fmt={"old": old_import, "new": new_import},
                    fix_title=f"Use `{new_import}` and pass the device at every call",
                    replacement=replacement, target=target)  # type: ignore[arg-type]
        for s in sites:
            if s.edit is not None:
                self.report(s.node, fmt={"old": s.old, "new": s.new}, replacement=replacement,  # type: ignore[arg-type]
                            target=target)

    def _common_ancestor(self, nodes: list[cst.CSTNode]) -> cst.CSTNode:
        def chain(n: cst.CSTNode) -> list[cst.CSTNode]:
            out = [n]
            while True:
                p = self.get_metadata(ParentProvider, out[-1], None)
                if p is None:
                    return out[::-1]
                out.append(p)

        chains = [chain(n) for n in nodes]
        common = chains[0][0]
        for level in zip(*chains):
            if all(x is level[0] for x in level):
                common = level[0]
            else:
                break
        return common


# --------------------------------------------------------------------------- shared: does the file use AMP?

AUTOCAST_NAMES = frozenset({
    "torch.autocast", "torch.amp.autocast", "torch.amp.autocast_mode.autocast",
    "torch.cuda.amp.autocast", "torch.cuda.amp.autocast_mode.autocast",
    "torch.cpu.amp.autocast", "torch.cpu.amp.autocast_mode.autocast",
})
SCALER_NAMES = frozenset({
    "torch.GradScaler", "torch.amp.GradScaler", "torch.amp.grad_scaler.GradScaler",
    "torch.cuda.amp.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler",
    "torch.cpu.amp.GradScaler", "torch.cpu.amp.grad_scaler.GradScaler",
})


class _AmpUses(Rule):
    """Collects references named `autocast` / `GradScaler` and resolves them at the end."""

    _amp_watch: frozenset[str] = frozenset({"autocast", "GradScaler"})

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._amp_refs: list[cst.CSTNode] = []

    def visit_Name(self, node: cst.Name) -> None:
        if node.value in self._amp_watch:
            self._amp_refs.append(node)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value in self._amp_watch:
            self._amp_refs.append(node)

    def uses(self, names: frozenset[str]) -> bool:
        for ref in self._amp_refs:
            if torch_name(self, ref) in names:
                return True
        return False


# --------------------------------------------------------------------------- TOP204

_NOT_MODULES = frozenset({"Parameter", "Buffer", "UninitializedParameter", "UninitializedBuffer",
                          "LinearCrossEntropyOptions"})
# Methods of nn.Module that return the module itself.
_SELF_RETURNING = frozenset({"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "train", "eval",
                             "requires_grad_", "type", "apply", "to_empty", "xpu", "mps"})


def nn_module_class(qname: str | None) -> bool:
    """`torch.nn.Linear`, `torch.nn.modules.linear.Linear`, `torch.nn.parallel.DistributedDataParallel`."""
    if not qname:
        return False
    parts = qname.split(".")
    if parts[:2] != ["torch", "nn"] or not parts[-1][:1].isupper() or parts[-1] in _NOT_MODULES:
        return False
    return len(parts) == 3 or parts[2] in ("modules", "parallel")


def _maybe_fp16(expr: cst.BaseExpression) -> bool:
    """Cheap syntactic pre-check of a `.to(...)` argument: `<x>.float16`, `<x>.half`, or a name."""
    if isinstance(expr, cst.Attribute):
        return expr.attr.value in ("float16", "half")
    return isinstance(expr, cst.Name)


class _ParamReceivers(cst.CSTVisitor):
    """Adds to ``found`` the receivers of ``.parameters()`` / ``.named_parameters()`` calls."""

    def __init__(self, found: set[str]) -> None:
        super().__init__()
        self.found = found

    def visit_Call(self, n: cst.Call) -> None:
        if isinstance(n.func, cst.Attribute) and n.func.attr.value in ("parameters", "named_parameters"):
            d = _dotted(n.func.value)
            if d:
                self.found.add(d)


class _WithCalls(cst.CSTVisitor):
    """Adds to ``calls`` the calls used as ``with`` items in ``fn``, not in functions nested in it."""

    def __init__(self, fn: cst.FunctionDef, calls: list[cst.Call]) -> None:
        super().__init__()
        self.fn, self.calls = fn, calls

    def visit_WithItem(self, n: cst.WithItem) -> None:
        if isinstance(n.item, cst.Call):
            self.calls.append(n.item)

    def visit_FunctionDef(self, n: cst.FunctionDef) -> bool:
        return n is self.fn


def _dotted(node: cst.CSTNode) -> str | None:
    return cst.helpers.get_full_name_for_node(node) if isinstance(node, (cst.Name, cst.Attribute)) else None


class PureFp16Model(Rule):
    """## What it does
    Points at a model converted to float16 as a whole — `model.half()`, `model.to(torch.float16)`,
    `model.to(dtype=torch.half)` — in a file that trains (it builds a `torch.optim` optimizer or
    calls `.backward()` / `torch.autograd.grad`), and advises automatic mixed precision instead.

    Only `nn.Module`s count: a name bound to a `torch.nn` module constructor or to a class of the
    file whose bases resolve to `torch.nn.Module`, or whose `.parameters()` are given to an
    optimizer in the same file. Tensors are never flagged, nor are inference-only files (a pure
    fp16 model is a fine way to serve).

    ## Why is this slow
    It is fast but it trains badly, and fixing that by hand costs more than AMP. With fp16
    parameters the optimizer applies its updates in fp16: an update smaller than half a unit in
    the last place of a weight (about 1e-3 relative) is rounded away, so small learning rates
    stop training. Without loss scaling small gradients underflow to zero (fp16 has no values
    below ~6e-8) and large activations overflow to inf. AMP keeps float32 master weights,
    runs the matmuls and convolutions in fp16 (the same tensor-core speed) and scales the loss.

    ## Example
    ```python
    model = Net().cuda().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for x, y in loader:
        loss = loss_fn(model(x.half()), y)
        loss.backward()
        opt.step()
    ```

    ## Use instead
    ```python
    model = Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    ```

    ## Fix safety
    Display-only: the change touches the model, its inputs, the loss and the optimizer step, and
    it changes numerics on purpose (for the better); the message says what to do. On hardware
    with bfloat16, `torch.autocast(..., dtype=torch.bfloat16)` needs no scaler at all.
    """

    code = "TOP204"
    name = "pure-fp16-model"
    family = FAMILY
    message = (
        "`{call}` trains a pure-fp16 model: fp16 weights round small updates away and gradients "
        "underflow without loss scaling; keep the model in float32 and use "
        "`torch.autocast` + `torch.amp.GradScaler`"
    )
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("half", "float16")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and _prefilter.pure_fp16_possible(text)

    examples = (
        Invalid(
            "import torch\nimport torch.nn as nn\n\nmodel = nn.Linear(4, 2).half()\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
            after=None,
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\n\n\nclass Net(nn.Module):\n    pass\n\n\n"
            "def train(loader):\n    model = Net()\n    model.to(torch.float16)\n"
            "    for x in loader:\n        model(x).sum().backward()\n",
            after=None,
        ),
        Invalid(
            "import torch\nfrom torch import nn\n\nnet = nn.Sequential(nn.Linear(4, 4), nn.ReLU())\n"
            "net = net.to(dtype=torch.half)\nopt = torch.optim.Adam(net.parameters())\n",
            after=None,
        ),
        Invalid(
            "import torch\n\n\ndef train(model, loader):\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "    model.half()\n    for x in loader:\n        model(x).sum().backward()\n        opt.step()\n",
            after=None,
            note="the receiver of `.parameters()` given to an optimizer is a module",
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\n\nhalf = torch.float16\n"
            "model = nn.Conv2d(3, 8, 3).to('cuda', half)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
            after=None,
        ),
        Valid(
            "import torch\n\nx = torch.randn(4).half()\ny = x.to(torch.float16)\n"
            "opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)\n",
            runnable=True,
            note="tensors",
        ),
        Valid(
            "import torch\nimport torch.nn as nn\n\nmodel = nn.Linear(4, 2).half().eval()\n"
            "with torch.inference_mode():\n    y = model(torch.randn(1, 4).half())\n",
            note="inference only: pure fp16 is fine",
        ),
        Valid(
            "import torch\nimport torch.nn as nn\n\nmodel = nn.Linear(4, 2).to(torch.bfloat16)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
            note="bf16 has fp32's range (a separate question)",
        ),
        Valid(
            "import torch\n\n\ndef train(model, batch):\n    batch = batch.half()\n    model(batch).sum().backward()\n",
            note="`batch` is not known to be a module",
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._casts: list[cst.Call] = []
        self._classes: dict[str, list[cst.Arg]] = {}
        self._opt_receivers: set[str] = set()
        self._calls: list[cst.Call] = []
        self._trains = False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.setdefault(node.name.value, []).extend(node.bases)

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Attribute):
            meth = func.attr.value
            if meth == "backward":
                self._trains = True
            elif meth == "half" and not node.args:
                self._casts.append(node)
            elif meth == "to" and not has_star(node) and any(_maybe_fp16(a.value) for a in node.args):
                self._casts.append(node)
        # Only calls that can be an optimizer or `grad` are resolved, and only at the end if a cast
        # was seen at all: name resolution costs a scope analysis of the whole file.
        last = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
        if last == "grad" or last[:1].isupper():
            self._calls.append(node)

    def _resolve_calls(self) -> None:
        for node in self._calls:
            q = callee(self, node)
            if q is None:
                continue
            if q == "torch.autograd.grad":
                self._trains = True
            parts = q.split(".")
            if parts[:2] == ["torch", "optim"] and parts[-1][:1].isupper() and "lr_scheduler" not in parts \
                    and "swa_utils" not in parts:
                self._trains = True
                for arg in node.args:
                    self._collect_params(arg.value)

    def _collect_params(self, expr: cst.CSTNode) -> None:
        expr.visit(_ParamReceivers(self._opt_receivers))

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self._casts:
            return
        self._resolve_calls()
        if not self._trains:
            return
        for call in self._casts:
            if not self._is_fp16_cast(call):
                continue
            recv = call.func.value  # type: ignore[union-attr]
            if self._is_module(recv, set()):
                self.report(call, fmt={"call": source(self, call)})

    def _is_fp16_cast(self, call: cst.Call) -> bool:
        meth = call.func.attr.value  # type: ignore[union-attr]
        if meth == "half":
            return True
        kw = keyword(call, "dtype")
        cands = [kw.value] if kw is not None else [a.value for a in positional(call)]
        return any(dtype_of(self, c) == "float16" for c in cands)

    def _is_module(self, expr: cst.BaseExpression, seen: set[str], depth: int = 0) -> bool | None:
        """True: surely an nn.Module; False: surely not or unknown; None: no evidence (a cycle)."""
        if depth > 6:
            return False
        while (isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute)
               and expr.func.attr.value in _SELF_RETURNING):
            expr = expr.func.value
        d = _dotted(expr)
        if d is not None and d in self._opt_receivers:
            return True
        if isinstance(expr, cst.Call):
            if nn_module_class(callee(self, expr)):
                return True
            if isinstance(expr.func, cst.Name) and expr.func.value in self._classes:
                return self._user_module(expr.func.value, set())
            return False
        if isinstance(expr, cst.Name):
            if expr.value in seen:
                return None
            values = reaching_values(self, expr)
            if not values:
                return False
            results = [self._is_module(v, seen | {expr.value}, depth + 1) if v is not None else False
                       for v in values]
            return any(r is True for r in results) and all(r is not False for r in results)
        return False

    def _user_module(self, cls: str, seen: set[str]) -> bool:
        if cls in seen:
            return False
        for base in self._classes.get(cls, ()):
            if base.keyword is not None:
                continue
            q = torch_name(self, base.value)
            if q in ("torch.nn.Module", "torch.nn.modules.module.Module") or nn_module_class(q):
                return True
            if isinstance(base.value, cst.Name) and base.value.value in self._classes:
                if self._user_module(base.value.value, seen | {cls}):
                    return True
        return False


# --------------------------------------------------------------------------- TOP206


class GradientPenaltyAmp(_AmpUses):
    """## What it does
    Points at `torch.autograd.grad(..., create_graph=True)` (a gradient penalty, double backward)
    in a file that uses `GradScaler` or `autocast`, when the gradients are not taken of a scaled
    loss, and gives the `torch.amp` recipe for it.

    ## Why is this slow
    With loss scaling, gradients taken of the unscaled loss lose the scaler's protection: in fp16
    they underflow, and the penalty computed from them is wrong or zero. If they are taken of the
    scaled loss but not unscaled, the penalty is computed from gradients that are too large by
    the scale factor, which changes every step. Either way the step is silently wrong, and the
    safe alternative is to give up fp16 AMP for that step. The recipe (from the PyTorch AMP
    examples) keeps the step in AMP:

    ```python
    scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]
    with torch.autocast("cuda", dtype=torch.float16):
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        loss = loss + penalty
    scaler.scale(loss).backward()
    ```

    ## Example
    ```python
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
    penalty = sum(g.pow(2).sum() for g in grads)
    scaler.scale(loss + penalty).backward()
    ```

    ## Use instead
    ```python
    scaler = torch.amp.GradScaler("cuda")
    params = list(model.parameters())
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]
    with torch.autocast("cuda", dtype=torch.float16):
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        loss = loss + penalty
    scaler.scale(loss).backward()
    ```

    ## Fix safety
    Display-only: the recipe restructures the step (which loss is scaled, where gradients are
    unscaled, what runs under autocast), which needs the user's intent. Calls whose first
    argument is already `scaler.scale(...)` are taken to follow it.
    """

    code = "TOP206"
    name = "gradient-penalty-amp"
    family = FAMILY
    message = (
        "`{call}` under AMP: take the gradients of `scaler.scale(loss)`, multiply them by "
        "`1.0 / scaler.get_scale()`, and compute the penalty under autocast (see the rule's docs)"
    )
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("create_graph", "autograd")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and ("autocast" in text or "GradScaler" in text) \
            and _prefilter.gradient_penalty_possible(text)

    examples = (
        Invalid(
            "import torch\n\nscaler = torch.amp.GradScaler(\"cuda\")\n\n\ndef step(model, x):\n"
            "    with torch.autocast(\"cuda\"):\n        loss = model(x).sum()\n"
            "    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)\n"
            "    penalty = sum(g.pow(2).sum() for g in grads)\n    scaler.scale(loss + penalty).backward()\n",
            after=None,
        ),
        Invalid(
            "import torch\nfrom torch.autograd import grad\nfrom torch.cuda.amp import GradScaler\n\n"
            "scaler = GradScaler()\n\n\ndef gp(out, inp):\n    return grad(out, inp, create_graph=True)[0]\n",
            after=None,
        ),
        Valid(
            "import torch\n\n\ndef gp(out, inp):\n    return torch.autograd.grad(out, inp, create_graph=True)[0]\n",
            note="no AMP in the file",
        ),
        Valid(
            "import torch\n\nscaler = torch.amp.GradScaler(\"cuda\")\n\n\ndef step(loss, params):\n"
            "    scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)\n"
            "    inv = 1.0 / scaler.get_scale()\n    return [g * inv for g in scaled]\n",
            note="already follows the recipe",
        ),
        Valid(
            "import torch\n\nscaler = torch.amp.GradScaler(\"cuda\")\n\n\ndef step(loss, params):\n"
            "    return torch.autograd.grad(loss, params, create_graph=False)\n",
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._grads: list[cst.Call] = []

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) != "torch.autograd.grad":
            return
        kw = keyword(node, "create_graph")
        pos = positional(node)
        value = kw.value if kw is not None else (pos[4].value if len(pos) > 4 else None)
        if value is None or (isinstance(value, cst.Name) and value.value in ("False", "None")):
            return
        out = keyword(node, "outputs")
        first = out.value if out is not None else (pos[0].value if pos else None)
        if isinstance(first, cst.Call) and isinstance(first.func, cst.Attribute) and first.func.attr.value == "scale":
            return
        self._grads.append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        if self._grads and self.uses(AUTOCAST_NAMES | SCALER_NAMES):
            for call in self._grads:
                self.report(call, fmt={"call": source(self, call)})


# --------------------------------------------------------------------------- TOP207

_FUNCTION_BASES = frozenset({"torch.autograd.Function", "torch.autograd.function.Function"})
_CUSTOM_FWD = frozenset({"torch.amp.custom_fwd", "torch.amp.autocast_mode.custom_fwd",
                         "torch.cuda.amp.custom_fwd", "torch.cuda.amp.autocast_mode.custom_fwd"})
_CUSTOM_BWD = frozenset({"torch.amp.custom_bwd", "torch.amp.autocast_mode.custom_bwd",
                         "torch.cuda.amp.custom_bwd", "torch.cuda.amp.autocast_mode.custom_bwd"})


class CustomFunctionAmp(_AmpUses):
    """## What it does
    Points at the `forward` / `backward` of a custom `torch.autograd.Function` that lack
    `@torch.amp.custom_fwd(device_type=...)` / `@torch.amp.custom_bwd(device_type=...)`, in a file
    that uses `autocast`.

    ## Why is this slow
    Under autocast, a custom Function's `forward` receives tensors in whatever dtype autocast
    produced (fp16 for some, fp32 for others) and its own operations are autocast too, while its
    `backward` runs later, outside the autocast region, so it recomputes in other dtypes than the
    forward used. The results are dtype mismatch errors or silent precision loss, and the common
    workaround — disabling AMP — gives up its speed. `custom_fwd` records the autocast state for
    `backward` and `custom_bwd` restores it; `cast_inputs=torch.float32` runs an op that is not
    fp16-safe in float32 with autocast disabled inside.

    ## Example
    ```python
    class MyOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ...

        @staticmethod
        def backward(ctx, g):
            ...
    ```

    ## Use instead
    ```python
    class MyOp(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cuda")  # add cast_inputs=torch.float32 if not fp16-safe
        def forward(ctx, x):
            ...

        @staticmethod
        @torch.amp.custom_bwd(device_type="cuda")
        def backward(ctx, g):
            ...
    ```

    ## Fix safety
    Display-only: whether the op needs `cast_inputs=torch.float32` depends on its numerics, and
    the device type on where it runs. A `forward` that disables autocast itself
    (`@torch.autocast(..., enabled=False)` or such a `with` block) is not flagged, nor are
    Functions with a separate `setup_context` (their `forward` has no `ctx` for `custom_fwd`).
    """

    code = "TOP207"
    name = "custom-function-amp"
    family = FAMILY
    message = (
        "`{cls}.{method}` of a custom autograd Function lacks `@torch.amp.{deco}(device_type=...)`: "
        "under autocast it sees mixed dtypes and backward does not run in forward's autocast state"
    )
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("Function",)
    requires = ("autocast",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and _prefilter.custom_function_possible(text)
    _amp_watch = frozenset({"autocast"})

    examples = (
        Invalid(
            "import torch\n\n\nclass Square(torch.autograd.Function):\n    @staticmethod\n"
            "    def forward(ctx, x):\n        ctx.save_for_backward(x)\n        return x * x\n\n"
            "    @staticmethod\n    def backward(ctx, g):\n        (x,) = ctx.saved_tensors\n        return 2 * x * g\n\n\n"
            "def run(x):\n    with torch.autocast(\"cuda\"):\n        return Square.apply(x)\n",
            after=None,
        ),
        Invalid(
            "import torch\nfrom torch.autograd import Function\nfrom torch.cuda.amp import autocast\n\n\n"
            "class Double(Function):\n    @staticmethod\n    @torch.amp.custom_fwd(device_type=\"cuda\")\n"
            "    def forward(ctx, x):\n        return x * 2\n\n"
            "    @staticmethod\n    def backward(ctx, g):\n        return g * 2\n\n\nctx = autocast()\n",
            after=None,
            note="backward lacks custom_bwd",
        ),
        Valid(
            "import torch\n\n\nclass Square(torch.autograd.Function):\n    @staticmethod\n"
            "    def forward(ctx, x):\n        return x * x\n\n    @staticmethod\n    def backward(ctx, g):\n        return g\n",
            note="no autocast in the file",
        ),
        Valid(
            "import torch\n\n\nclass Square(torch.autograd.Function):\n    @staticmethod\n"
            "    @torch.amp.custom_fwd(device_type=\"cuda\", cast_inputs=torch.float32)\n"
            "    def forward(ctx, x):\n        return x * x\n\n    @staticmethod\n"
            "    @torch.amp.custom_bwd(device_type=\"cuda\")\n    def backward(ctx, g):\n        return g\n\n\n"
            "with torch.autocast(\"cpu\"):\n    y = Square.apply(torch.ones(2))\n",
            runnable=True,
        ),
        Valid(
            "import torch\n\n\nclass Square(torch.autograd.Function):\n    @staticmethod\n"
            "    @torch.autocast(\"cuda\", enabled=False)\n    def forward(ctx, x):\n        return x * x\n\n"
            "    @staticmethod\n    def backward(ctx, g):\n        return g\n\n\nctx = torch.autocast(\"cuda\")\n",
            note="forward disables autocast itself",
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._classes: dict[str, cst.ClassDef] = {}

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.setdefault(node.name.value, node)

    def _is_function(self, cls: cst.ClassDef, seen: set[str]) -> bool:
        for base in cls.bases:
            if base.keyword is not None:
                continue
            if torch_name(self, base.value) in _FUNCTION_BASES:
                return True
            if isinstance(base.value, cst.Name) and base.value.value in self._classes \
                    and base.value.value not in seen:
                if self._is_function(self._classes[base.value.value], seen | {cls.name.value}):
                    return True
        return False

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self._classes or not self.uses(AUTOCAST_NAMES):
            return
        for cls in self._classes.values():
            if not self._is_function(cls, set()):
                continue
            methods = {}
            for stmt in cls.body.body:
                if isinstance(stmt, cst.FunctionDef):
                    methods[stmt.name.value] = stmt
            if "setup_context" in methods:
                continue
            fwd = methods.get("forward")
            if fwd is None:
                continue
            if self._disables_autocast(fwd):
                continue
            if not self._decorated(fwd, _CUSTOM_FWD):
                self.report(fwd.name, fmt={"cls": cls.name.value, "method": "forward", "deco": "custom_fwd"})
            bwd = methods.get("backward")
            if bwd is not None and not self._decorated(bwd, _CUSTOM_BWD):
                self.report(bwd.name, fmt={"cls": cls.name.value, "method": "backward", "deco": "custom_bwd"})

    def _decorated(self, fn: cst.FunctionDef, names: frozenset[str]) -> bool:
        for d in fn.decorators:
            expr = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
            if torch_name(self, expr) in names:
                return True
        return False

    def _disables_autocast(self, fn: cst.FunctionDef) -> bool:
        calls = [d.decorator for d in fn.decorators if isinstance(d.decorator, cst.Call)]
        fn.visit(_WithCalls(fn, calls))
        for c in calls:
            if torch_name(self, c.func) in AUTOCAST_NAMES:
                en = keyword(c, "enabled")
                if en is not None and isinstance(en.value, cst.Name) and en.value.value == "False":
                    return True
        return False
