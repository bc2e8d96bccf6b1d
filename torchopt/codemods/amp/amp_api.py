"""What the AMP rules share: the deprecated `torch.cuda.amp` / `torch.cpu.amp` API and its `torch.amp`
replacement (TOP201), whether a file uses AMP, and the names the advice rules look for (TOP204
pure-fp16 model, TOP206 gradient penalty under AMP, TOP207 custom autograd Functions under autocast)."""

from __future__ import annotations

import io
import tokenize
from dataclasses import dataclass, field
from typing import Callable, Sequence

import libcst as cst

from torchopt.analysis.names import torch_name
from torchopt.analysis.arguments import has_star, positional, set_kwarg
from torchopt.rewrite.metadata import ParentProvider, remembered
from torchopt.rewrite.rule import ImportSpec, Replacement, Rule
from torchopt.rewrite.facts import source_of

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
# Where each member lives now, below the torch module (`torch.autocast is torch.amp.autocast`).
NEW_ATTR = {
    "autocast": "autocast",
    "GradScaler": "amp.GradScaler",
    "custom_fwd": "amp.custom_fwd",
    "custom_bwd": "amp.custom_bwd",
}
# The old autocast signature; every positional argument becomes one of these keywords.
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


def quote_style(module: cst.Module) -> str:
    """The quote the file mostly uses for one-line strings (double when undecided), counted once per
    parse while the engine analyses the file."""
    return remembered(("quote style",), module, lambda: _quote_style(module))


def _quote_style(module: cst.Module) -> str:
    single = double = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source_of(module)).readline):
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
    return "'" if single > double else '"'


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
        # positional argument must become its keyword, or `enabled` lands in `dtype`.
        args = []
        i = 0
        for a in call.args:
            if a.keyword is None:
                name = OLD_AUTOCAST_PARAMS[i]
                i += 1
                if name in kws:
                    return None
                a = a.with_changes(
                    keyword=cst.Name(name),
                    equal=cst.AssignEqual(
                        whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
                    ),
                )
            args.append(a)
        return _prepend(new.with_changes(args=args), cst.Arg(dev))
    if member == "GradScaler":
        # (init_scale, ...) -> (device, init_scale, ...): the old list shifted by one.
        return _prepend(new, cst.Arg(dev))
    # custom_fwd(fwd=None, *, cast_inputs=None) -> custom_fwd(fwd=None, *, device_type, cast_inputs=None)
    return set_kwarg(new, "device_type", dev, before=("cast_inputs",))


def _one_line(code: str) -> str:
    code = " ".join(code.split()).replace("( ", "(").replace(" )", ")").replace(",)", ")")
    return code if len(code) <= 60 else code[:57] + "..."


_TYPE_CONTAINERS = (
    cst.Subscript,
    cst.SubscriptElement,
    cst.Index,
    cst.BinaryOperation,
    cst.Tuple,
    cst.List,
    cst.Element,
)


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
        if (
            isinstance(call, cst.Call)
            and isinstance(call.func, cst.Name)
            and call.func.value in ("isinstance", "issubclass")
            and len(call.args) == 2
            and call.args[1] is par
        ):
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
    sep = next(
        (a.comma for a in original[:-1] if isinstance(a.comma, cst.Comma)),
        cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")),
    )
    for i, a in enumerate(aliases):
        last = i == len(aliases) - 1
        out.append(a.with_changes(comma=original[-1].comma if last else sep))
    return out


class _Edits(cst.CSTTransformer):
    def __init__(self, edits: dict[int, Callable[[cst.CSTNode], Replacement]]) -> None:
        super().__init__()
        self.edits = edits

    def on_leave(self, original_node, updated_node):
        fn = self.edits.get(id(original_node))
        return fn(updated_node) if fn is not None else updated_node


# --------------------------------------------------------------------------- shared: does the file use AMP?

AUTOCAST_NAMES = frozenset(
    {
        "torch.autocast",
        "torch.amp.autocast",
        "torch.amp.autocast_mode.autocast",
        "torch.cuda.amp.autocast",
        "torch.cuda.amp.autocast_mode.autocast",
        "torch.cpu.amp.autocast",
        "torch.cpu.amp.autocast_mode.autocast",
    }
)
SCALER_NAMES = frozenset(
    {
        "torch.GradScaler",
        "torch.amp.GradScaler",
        "torch.amp.grad_scaler.GradScaler",
        "torch.cuda.amp.GradScaler",
        "torch.cuda.amp.grad_scaler.GradScaler",
        "torch.cpu.amp.GradScaler",
        "torch.cpu.amp.grad_scaler.GradScaler",
    }
)


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

_NOT_MODULES = frozenset(
    {"Parameter", "Buffer", "UninitializedParameter", "UninitializedBuffer", "LinearCrossEntropyOptions"}
)
# Methods of nn.Module that return the module itself.
_SELF_RETURNING = frozenset(
    {
        "to",
        "cuda",
        "cpu",
        "float",
        "double",
        "half",
        "bfloat16",
        "train",
        "eval",
        "requires_grad_",
        "type",
        "apply",
        "to_empty",
        "xpu",
        "mps",
    }
)


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


# The base classes that make a class a custom autograd Function.
_FUNCTION_BASES = frozenset({"torch.autograd.Function", "torch.autograd.function.Function"})
