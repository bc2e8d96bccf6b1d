"""What TOP101 factory-then-move and TOP102 cast-after-factory share.

Both rules look at one shape: ``Call(func=Attribute(value=Call(<torch factory>), attr=...))``,
resolve the inner callee by qualified name, and move the trailing ``.cuda()`` / ``.to()`` /
``.half()`` into the factory's ``device=`` / ``dtype=``. This module holds their base class, the
parsing of the trailing call and the cheap prechecks on CPython's ast; the factory tables live in
:mod:`factory_tables` and the dtype-folding verdict in :mod:`dtype_folding`.
"""

from __future__ import annotations

import ast as _ast
import re
from dataclasses import dataclass
from typing import Iterable, TypeVar

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.arguments import has_star, keyword, positional
from torchopt.analysis.layout_chains import ast_chain_root
from torchopt.analysis.placement import placements
from torchopt.analysis.names import TorchRef, callee, is_import_of_torch, param_annotation, reaching_values, torch_ref
from torchopt.analysis.precheck.torch_imports import ast_torch_names, torch_calls_to, torch_import_map
from torchopt.analysis.tracing import in_traced_callable
from torchopt.analysis.precheck.tree import ast_index
from torchopt.analysis.syntax import has_comments
from torchopt.analysis.values import CAST_METHODS, DTYPES, DeviceKind, classify_device, dtype_of
from torchopt.codemods.device.dtype_folding import Data, argument, factory_data, is_builtin
from torchopt.codemods.device.factory_tables import CUDA_LEGACY, FACTORIES, INDEX_FACTORIES, LEGACY, factory_kind
from torchopt.rewrite.facts import source_of
from torchopt.rewrite.rule import Rule

_SETS_DEFAULT_DTYPE = ("set_default_dtype", "set_default_tensor_type")


_FACTORY_NAMES = FACTORIES | set(LEGACY) | {"from_numpy"}  # the last names factory_of can answer for

_E = TypeVar("_E", cst.Call, cst.BaseExpression)

_NOTE_LEAF = "the tensor becomes a leaf that requires grad (its .grad is now populated; likely a bug fix)"


# --------------------------------------------------------------------------- shared rule plumbing


class _FactoryRule(Rule):
    """Common helpers of TOP101/TOP102 (abstract: no ``code``)."""

    family = "device"

    def visit_Module(self, node: cst.Module) -> None:
        self._default_float: str | None = "float32"
        code = source_of(node)
        if any(s in code for s in _SETS_DEFAULT_DTYPE):
            self._default_float = None

    def ref_at(self, node: cst.CSTNode) -> TorchRef | None:
        """The torch alias for generated code at ``node``; None if ``torch`` is bound to something
        else there (never shadow a local)."""
        ref = torch_ref(self)
        if ref is None or ref.name != "torch" or not ref.imports:
            return ref
        try:
            scope = self.get_metadata(ScopeProvider, node)
        except KeyError:
            return ref
        if scope is not None and "torch" in scope and any(not is_import_of_torch(a) for a in scope["torch"]):
            return None
        return ref

    def factory_of(self, inner: cst.Call) -> tuple[str, str] | None:
        """(kind, qualified name) of the factory ``inner`` calls, if we handle it."""
        if isinstance(inner.func, cst.Attribute) and inner.func.attr.value not in _FACTORY_NAMES:
            return None  # `a.b.c(...)` is named by its last part: skip resolving it (the file's scope analysis)
        q = callee(self, inner)
        if q is None:
            return None
        kind = factory_kind(q)
        if kind is not None:
            return kind, q
        short = q[len("torch.") :]
        if short == "from_numpy" or short in LEGACY:
            return short, q
        return None

    def factory_blockers(self, kind: str, inner: cst.Call) -> bool:
        """Shapes we never rewrite."""
        if has_star(inner) or keyword(inner, "out") is not None:
            return True
        if kind == "normal" and argument(inner, 2, "size") is None:
            return True  # the tensor-mean/std overloads take no device=/dtype=
        if kind == "as_tensor" and len(positional(inner)) > 1:
            return True  # positional dtype/device
        return in_traced_callable(self, inner)  # the traced graph is the product: keep its operations

    def follows_default_device(self, kind: str) -> bool:
        """The file sets the default device (``torch.set_default_device``) and this factory honours it
        (``from_numpy`` and the legacy typed constructors do not): it may build on the device already."""
        return kind != "from_numpy" and kind not in LEGACY and placements(self).default_device_changed

    def requires_grad(self, inner: cst.Call) -> bool:
        rg = keyword(inner, "requires_grad")
        return rg is not None and not (isinstance(rg.value, cst.Name) and rg.value.value == "False")

    def data(self, kind: str, inner: cst.Call) -> Data:
        return factory_data(self, kind, inner, self._default_float)


_DEVICE_RE = re.compile(r"^(cuda|cpu|mps|xpu|meta|hpu|npu|xla|privateuseone)(:\d+)?$")


def _ast_star(call: _ast.Call) -> bool:
    return any(isinstance(a, _ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)


def _ast_int_args(call: _ast.Call) -> bool:
    """Every argument an integer literal (int_value), at least one."""
    return (
        bool(call.args)
        and not call.keywords
        and all(isinstance(a, _ast.Constant) and type(a.value) is int for a in call.args)
    )


def _ast_factory_calls(text: str, methods: tuple[str, ...], kinds: Iterable[str], chains: bool = False):
    """(outer, inner, kind) for ``inner.<method>(...)`` where ``inner`` may call torch.<kind> and
    factory_blockers does not rule it out; with ``chains``, also where ``inner`` starts a rearranging
    chain (layout_chains) that ``.<method>`` ends. None when it cannot be told."""
    index, imports = ast_index(text), torch_import_map(text)
    if index is None or imports is None:
        return None
    kinds = set(kinds)
    out = []
    for c in index.get(_ast.Call, ()):
        f = c.func
        if not isinstance(f, _ast.Attribute) or f.attr not in methods:
            continue
        found = ast_chain_root(f.value) if chains else f.value
        if not isinstance(found, _ast.Call):
            continue
        inner = found
        for q in ast_torch_names(imports, inner.func):
            kind = q[len("torch.") :]
            if kind not in kinds or _ast_star(inner) or any(k.arg == "out" for k in inner.keywords):
                continue
            out.append((c, inner, kind))
    return out


def _could_move(text: str) -> bool:
    """FactoryThenMove's cheap necessary condition (True when it cannot be told)."""
    found = _ast_factory_calls(text, ("cuda", "to"), (*FACTORIES, *LEGACY, "from_numpy"), chains=True)
    if found is None:
        return True
    imports = torch_import_map(text) or {}
    for outer, inner, kind in found:
        if kind in LEGACY and not _ast_int_args(inner):
            continue
        if outer.func.attr == "to" and _ast_to_dtype_only(imports, outer):
            continue  # `.to(dtype)`: TOP102's
        if kind == "from_numpy" and (len(inner.args) != 1 or inner.keywords):
            continue
        return True
    calls = torch_calls_to(text, [f"torch.cuda.{t}" for t in CUDA_LEGACY])
    return calls is None or any(_ast_int_args(c) and not _ast_star(c) for c in calls)


def _could_index(text: str) -> bool:
    """FactoryThenMove's cheap necessary condition for an index made on the host (True when it
    cannot be told): some subscript with an element that is, or starts a rearranging chain from, a
    call of a torch factory of INDEX_FACTORIES without ``device=``."""
    index, imports = ast_index(text), torch_import_map(text)
    if index is None or imports is None:
        return True
    for sub in index.get(_ast.Subscript, ()):
        parts = sub.slice.elts if isinstance(sub.slice, _ast.Tuple) else [sub.slice]
        for part in parts:
            inner = ast_chain_root(part) if isinstance(part, (_ast.Call, _ast.Subscript)) else None
            if inner is None or _ast_star(inner) or any(k.arg in ("out", "device") for k in inner.keywords):
                continue
            if any(q[len("torch.") :] in INDEX_FACTORIES for q in ast_torch_names(imports, inner.func)):
                return True
    if not index.get(_ast.Subscript):
        return False
    for call in index.get(_ast.Call, ()):  # an index computed through names (index_sources)
        if _ast_star(call) or any(k.arg in ("out", "device") for k in call.keywords):
            continue
        if any(q[len("torch.") :] in INDEX_FACTORIES for q in ast_torch_names(imports, call.func)):
            return True
    return False


def _could_cast(text: str) -> bool:
    """FactoryCast's cheap necessary condition (True when it cannot be told)."""
    found = _ast_factory_calls(text, (*CAST_METHODS, "to"), FACTORIES)
    if found is None:
        return True
    imports = torch_import_map(text) or {}
    return any(
        not (o.args or o.keywords) if o.func.attr != "to" else not _ast_to_device_only(imports, o)
        for o, _i, _k in found
    )


def _ast_to_dtype_only(imports: dict, call: _ast.Call) -> bool:
    """parse_to surely finds no device (and no unknown) in ``.to(...)``: ``.to(dtype=...)``,
    ``.to(<torch dtype>[, non_blocking[, copy]])`` or something it does not fold."""
    if _ast_star(call):
        return True
    kws = {k.arg for k in call.keywords}
    if "device" in kws or not kws <= {"dtype", "non_blocking", "copy"}:
        return "device" not in kws
    if not call.args:
        return True
    names = ast_torch_names(imports, call.args[0])
    return (
        len(call.args) <= 3
        and all(isinstance(a, _ast.Constant) for a in call.args[1:])
        and bool(names)
        and all(q.startswith("torch.") and q[len("torch.") :] in DTYPES for q in names)
    )


def _ast_to_device_only(imports: dict, call: _ast.Call) -> bool:
    """parse_to surely gives CastAfterFactory nothing to fold in ``.to(...)`` (a device, or a form
    it does not fold): a ``device=`` keyword, ``dtype=`` with a positional, another keyword, no
    argument, or a sole ``<x>.device`` / ``'<device>'``."""
    if _ast_star(call):
        return True
    kws = {k.arg for k in call.keywords}
    if "device" in kws or not kws <= {"dtype", "non_blocking", "copy"}:
        return True
    if "dtype" in kws:
        return bool(call.args)
    if len(call.args) != 1:
        return not call.args
    a = call.args[0]
    if isinstance(a, _ast.Attribute) and a.attr == "device":
        return not ast_torch_names(imports, a)
    return isinstance(a, _ast.Constant) and isinstance(a.value, str) and bool(_DEVICE_RE.match(a.value))


def _keep_parens(outer: cst.Call, new: _E) -> _E:
    return new.with_changes(lpar=[*outer.lpar, *new.lpar], rpar=[*new.rpar, *outer.rpar])


def _removed_has_comments(outer: cst.Call) -> bool:
    func = outer.func
    assert isinstance(func, cst.Attribute)
    return any(
        has_comments(n)
        for n in (func.dot, func.attr, outer.whitespace_after_func, outer.whitespace_before_args, *outer.args)
    )


def _is_false(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "False"


@dataclass
class TrailingCall:
    """A parsed ``.cuda(...)``/``.to(...)``: what it asks for."""

    device: cst.BaseExpression | None = None  # the user's expression (None: `.cuda()` default)
    forced: bool = False  # the signature proves ``device`` is a device
    dtype: cst.BaseExpression | None = None
    unknown: cst.BaseExpression | None = None  # `.to(x)` with x unclassifiable
    cuda: bool = False


def parse_cuda(call: cst.Call) -> TrailingCall | None:
    """``.cuda([device][, non_blocking])``; None for anything else (memory_format, **kw)."""
    if has_star(call):
        return None
    pos = positional(call)
    kws = {a.keyword.value: a for a in call.args if a.keyword is not None}
    if len(pos) > 2 or set(kws) - {"device", "non_blocking"}:
        return None
    if pos and "device" in kws:
        return None
    dev = pos[0].value if pos else (kws["device"].value if "device" in kws else None)
    if dev is not None and isinstance(dev, cst.Name) and dev.value == "None":
        dev = None
    return TrailingCall(device=dev, cuda=True)


def parse_to(rule: Rule, call: cst.Call) -> TrailingCall | None:
    """``.to(...)`` in its device/dtype forms; None when it has something we do not fold
    (``copy=True``, ``memory_format=``, another keyword, star-args, an odd positional shape)."""
    if has_star(call):
        return None
    pos = [a.value for a in positional(call)]
    kws = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    if set(kws) - {"device", "dtype", "non_blocking", "copy"}:
        return None
    if "copy" in kws and not _is_false(kws["copy"]):
        return None
    if "device" in kws:
        if pos:
            return None
        return TrailingCall(device=kws["device"], forced=True, dtype=kws.get("dtype"))
    if "dtype" in kws:
        if len(pos) > 1:
            return None
        return TrailingCall(device=pos[0] if pos else None, forced=bool(pos), dtype=kws["dtype"])
    if not pos or len(pos) > 4:
        return None
    if len(pos) >= 2 and dtype_of(rule, pos[1]) is not None:
        # to(device, dtype[, non_blocking[, copy]])
        if len(pos) == 4 and not _is_false(pos[3]):
            return None
        return TrailingCall(device=pos[0], forced=True, dtype=pos[1])
    first = classify_device(rule, pos[0])
    if first.kind is DeviceKind.DTYPE:
        # to(dtype[, non_blocking[, copy]])
        if len(pos) == 3 and not _is_false(pos[2]):
            return None
        if len(pos) > 3:
            return None
        return TrailingCall(dtype=pos[0])
    if len(pos) > 1:
        return None
    if first.is_device:
        return TrailingCall(device=pos[0])
    if _dtype_named(pos[0]):
        return TrailingCall(dtype=pos[0])  # `.to(x.dtype)`, `.to(dtype)`: a cast whose dtype is unknown
    return TrailingCall(unknown=pos[0])


def _dtype_named(expr: cst.BaseExpression) -> bool:
    """``x.dtype``, ``dtype``, ``self.compute_dtype``: by name, a dtype (its value stays unknown)."""
    name = expr.attr.value if isinstance(expr, cst.Attribute) else expr.value if isinstance(expr, cst.Name) else ""
    return name == "dtype" or name.endswith("_dtype")


def int_typed(rule: Rule, expr: cst.BaseExpression, depth: int = 0) -> bool:
    """For ``.cuda(expr)``: an int-literal name, ``int(...)``, a ``get_rank()``/``get_local_rank()``/
    ``current_device()`` call, a parameter annotated ``int``, or a name bound only to those."""
    if isinstance(expr, cst.Integer):
        return True
    if isinstance(expr, cst.Call):
        f = expr.func
        if is_builtin(rule, f, "int"):
            return True
        fname = f.attr.value if isinstance(f, cst.Attribute) else f.value if isinstance(f, cst.Name) else ""
        return fname in ("get_rank", "get_local_rank", "current_device")
    if isinstance(expr, cst.Name) and depth < 3:
        if param_annotation(rule, expr) == "int":
            return True
        values = reaching_values(rule, expr) or []
        return bool(values) and all(v is not None and int_typed(rule, v, depth + 1) for v in values)
    return False


def may_be_int(rule: Rule, expr: cst.BaseExpression) -> bool:
    """A name with an int among its definitions (``.cuda(d)``, ``d = 0 if ... else 'cuda'``)."""
    if isinstance(expr, cst.Name):
        values = reaching_values(rule, expr) or []
        return any(
            isinstance(v, cst.Integer)
            or (isinstance(v, cst.IfExp) and (isinstance(v.body, cst.Integer) or isinstance(v.orelse, cst.Integer)))
            for v in values
        )
    return False
