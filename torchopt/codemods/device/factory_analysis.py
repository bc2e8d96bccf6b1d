"""TOP101 factory-then-move and TOP102 cast-after-factory.

Both rules look at one shape: ``Call(func=Attribute(value=Call(<torch factory>), attr=...))``,
resolve the inner callee by qualified name, and move the trailing ``.cuda()`` / ``.to()`` /
``.half()`` into the factory's ``device=`` / ``dtype=``. Whether folding a dtype keeps the values is
decided by one function, :func:`fold_verdict`, used by both rules (TOP101 needs it for
``.to(device, dtype)``).
"""
from __future__ import annotations

import ast as _ast
import math
import re
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import libcst as cst
from libcst.metadata import QualifiedNameSource, ScopeProvider

from torchopt.analysis.precheck.torch_imports import ast_torch_names, torch_calls_to, torch_import_map
from torchopt.analysis.precheck.tree import ast_index
from torchopt.analysis.names import (
    TorchRef, callee, param_annotation, reaching_values, is_import_of_torch,
    torch_ref
)
from torchopt.analysis.values import (
    CAST_METHODS, DTYPES, FLOAT_DTYPES, INT_DTYPES, DeviceKind, classify_device, dtype_of
)
from torchopt.analysis.arguments import has_star, keyword, positional
from torchopt.analysis.syntax import has_comments
from torchopt.rewrite.metadata import qualified_names as _qualified_names
from torchopt.rewrite.rule import Rule, Tag

# --------------------------------------------------------------------------- factory tables

#: Values do not depend on where they are computed.
DETERMINISTIC = frozenset({
    "zeros", "ones", "empty", "empty_strided", "empty_permuted", "full", "eye", "scalar_tensor",
    "tril_indices", "triu_indices", "sparse_coo_tensor", "tensor", "as_tensor", "asarray",
    "zeros_like", "ones_like", "empty_like", "full_like",
})
#: Draw from the generator of the device they are created on.
RANDOM = frozenset({"rand", "randn", "randint", "randperm", "normal", "rand_like", "randn_like", "randint_like"})
RANDOM_INT = frozenset({"randint", "randperm", "randint_like"})
#: Computed by a device kernel when created on the device (T, 1 ulp).
COMPUTED = frozenset({
    "linspace", "logspace", "range", "hann_window", "hamming_window", "bartlett_window",
    "blackman_window", "kaiser_window",
})
#: Values are 0, 1 or uninitialised: exact in every dtype.
CONSTANT = frozenset({
    "zeros", "ones", "empty", "empty_strided", "empty_permuted", "zeros_like", "ones_like", "empty_like", "eye",
})
FACTORIES = DETERMINISTIC | RANDOM | COMPUTED | {"arange"}

#: Legacy typed constructors and the dtype they mean.
LEGACY = {
    "Tensor": None, "FloatTensor": "float32", "DoubleTensor": "float64", "HalfTensor": "float16",
    "BFloat16Tensor": "bfloat16", "LongTensor": "int64", "IntTensor": "int32", "ShortTensor": "int16",
    "CharTensor": "int8", "ByteTensor": "uint8", "BoolTensor": "bool",
}
CUDA_LEGACY = {k: v for k, v in LEGACY.items() if v is not None}  # all but the dtype-less "Tensor"

INT_RANGE = {
    "int8": (-(2**7), 2**7 - 1), "int16": (-(2**15), 2**15 - 1), "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1), "uint8": (0, 255), "bool": (0, 1),
}
#: Integers up to 2**p are all exactly representable.
FLOAT_INT_BITS = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}
FLOAT_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
             "float64": math.inf}
#: Wider-than partial order on float dtypes (float16 and bfloat16 are not comparable).
_WIDER = {("float32", "float16"), ("float32", "bfloat16"), ("float64", "float16"), ("float64", "bfloat16"),
          ("float64", "float32")}
#: How generated code spells a canonical dtype.
SPELLING = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64",
            "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8",
            "bool": "bool"}

_SETS_DEFAULT_DTYPE = ("set_default_dtype", "set_default_tensor_type")


_FACTORY_NAMES = FACTORIES | set(LEGACY) | {"from_numpy"}  # the last names factory_of can answer for


def factory_kind(qname: str | None) -> str | None:
    """``zeros`` for ``torch.zeros``; None if not a factory we handle."""
    if not qname or not qname.startswith("torch."):
        return None
    short = qname[len("torch."):]
    return short if short in FACTORIES else None


# --------------------------------------------------------------------------- exact representability


def exact_in(v: int | float, dt: str) -> bool:
    """Whether the Python number ``v`` is exactly representable in dtype ``dt``."""
    if isinstance(v, bool):
        v = int(v)
    if dt in INT_RANGE:
        lo, hi = INT_RANGE[dt]
        return isinstance(v, int) and lo <= v <= hi
    if dt not in FLOAT_DTYPES:
        return False
    try:
        f = float(v)
    except OverflowError:
        return False
    if f != v:
        return False
    if dt == "float64":
        return True
    try:
        if dt == "float16":
            return struct.unpack("<e", struct.pack("<e", f))[0] == f
        r = struct.unpack("<f", struct.pack("<f", f))[0]
        if r != f:
            return False
        if dt == "bfloat16":
            return (struct.unpack("<I", struct.pack("<f", f))[0] & 0xFFFF) == 0
        return True
    except (OverflowError, struct.error):
        return False


def in_range(v: int | float, dt: str) -> bool:
    """Finite after conversion (torch raises on overflow when converting a Python scalar)."""
    if dt in INT_RANGE:
        lo, hi = INT_RANGE[dt]
        return lo <= v <= hi
    try:
        return abs(float(v)) <= FLOAT_MAX.get(dt, 0.0)
    except OverflowError:
        return False


def _int_span_exact(lo: int, hi: int, dt: str) -> bool:
    if dt in INT_RANGE:
        a, b = INT_RANGE[dt]
        return a <= lo and hi <= b
    if dt in FLOAT_INT_BITS:
        return max(abs(lo), abs(hi)) <= 2 ** FLOAT_INT_BITS[dt]
    return False


# --------------------------------------------------------------------------- what a factory computes


@dataclass(frozen=True)
class Data:
    """What a factory call produces, as far as dtype folding cares.

    kind: ``const`` (0, 1 or uninitialised), ``values`` (these Python numbers), ``intspan`` (all
    integers lo..hi step), ``int`` (integer-valued, magnitude unknown), ``float`` (computed floats),
    ``host`` (converted from host data we cannot see), ``indices`` (tril/triu), ``random``,
    ``random_int``, ``opaque`` (nothing can be proven).
    ``src`` is the dtype the factory creates; None when it depends on a default dtype this file changes
    or on an input tensor."""

    kind: str
    src: str | None = None
    values: tuple = ()
    lo: int = 0
    hi: int = 0


@dataclass(frozen=True)
class Fold:
    ok: bool
    tags: tuple[Tag, ...] = ()
    reason: str = ""  # why not (ok False) or what changes (tags)


def literal_number(expr: cst.BaseExpression) -> int | float | bool | None:
    if isinstance(expr, cst.Integer):
        return int(expr.evaluated_value)
    if isinstance(expr, cst.Float):
        return float(expr.evaluated_value)
    if isinstance(expr, cst.Name) and expr.value in ("True", "False"):
        return expr.value == "True"
    if (isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus))
            and isinstance(expr.expression, (cst.Integer, cst.Float))):
        v = literal_number(expr.expression)
        if v is None:
            return None
        return -v if isinstance(expr.operator, cst.Minus) else v
    return None


def literal_data(expr: cst.BaseExpression, depth: int = 0) -> list | None:
    """Flattened numbers of a (nested) list/tuple literal or scalar; None if anything is not literal."""
    if depth > 8:
        return None
    v = literal_number(expr)
    if v is not None:
        return [v]
    if isinstance(expr, (cst.List, cst.Tuple)):
        out: list = []
        for el in expr.elements:
            if isinstance(el, cst.StarredElement):
                return None
            sub = literal_data(el.value, depth + 1)
            if sub is None:
                return None
            out.extend(sub)
        return out
    return None


def _inferred_src(vals: Sequence, default_float: str | None) -> str | None:
    if any(isinstance(v, float) for v in vals):
        return default_float
    if any(not isinstance(v, bool) for v in vals):
        return "int64"
    return "bool" if vals else default_float


def _is_builtin(rule: Rule, node: cst.CSTNode, name: str) -> bool:
    if not isinstance(node, cst.Name) or node.value != name:
        return False
    try:
        names = _qualified_names(rule, node)
    except KeyError:
        return False
    return any(q.source is QualifiedNameSource.BUILTIN and q.name == f"builtins.{name}" for q in names)


def int_looking(rule: Rule, expr: cst.BaseExpression, depth: int = 0) -> bool:
    """An expression that is an int: a literal, ``len()``, ``int()``, ``x.size(...)``, ``x.numel()``,
    ``x.shape[i]``, arithmetic of those, or a name bound only to them."""
    v = literal_number(expr)
    if v is not None:
        return isinstance(v, int) and not isinstance(v, bool)
    if isinstance(expr, cst.Call):
        f = expr.func
        if _is_builtin(rule, f, "len") or _is_builtin(rule, f, "int"):
            return True
        return isinstance(f, cst.Attribute) and f.attr.value in ("size", "numel", "dim") and (
            f.attr.value != "size" or len(expr.args) == 1)
    if isinstance(expr, cst.Subscript):
        return (isinstance(expr.value, cst.Attribute) and expr.value.attr.value == "shape"
                and len(expr.slice) == 1 and isinstance(expr.slice[0].slice, cst.Index))
    if isinstance(expr, cst.BinaryOperation) and isinstance(
            expr.operator, (cst.Add, cst.Subtract, cst.Multiply, cst.FloorDivide, cst.Modulo)):
        return int_looking(rule, expr.left, depth) and int_looking(rule, expr.right, depth)
    if isinstance(expr, cst.Name) and depth < 3:
        if param_annotation(rule, expr) == "int":
            return True
        values = reaching_values(rule, expr) or []
        return bool(values) and all(v is not None and int_looking(rule, v, depth + 1) for v in values)
    return False


def int_typed(rule: Rule, expr: cst.BaseExpression, depth: int = 0) -> bool:
    """For ``.cuda(expr)``: an int-literal name, ``int(...)``, a ``get_rank()``/``get_local_rank()``/
    ``current_device()`` call, a parameter annotated ``int``, or a name bound only to those."""
    if isinstance(expr, cst.Integer):
        return True
    if isinstance(expr, cst.Call):
        f = expr.func
        if _is_builtin(rule, f, "int"):
            return True
        fname = f.attr.value if isinstance(f, cst.Attribute) else f.value if isinstance(f, cst.Name) else ""
        return fname in ("get_rank", "get_local_rank", "current_device")
    if isinstance(expr, cst.Name) and depth < 3:
        if param_annotation(rule, expr) == "int":
            return True
        values = reaching_values(rule, expr) or []
        return bool(values) and all(v is not None and int_typed(rule, v, depth + 1) for v in values)
    return False


def _arg(call: cst.Call, index: int, name: str) -> cst.BaseExpression | None:
    kw = keyword(call, name)
    if kw is not None:
        return kw.value
    pos = positional(call)
    return pos[index].value if index < len(pos) else None


def _arange_bounds(call: cst.Call) -> tuple[cst.BaseExpression, ...] | None:
    pos = positional(call)
    kws = {n: keyword(call, n) for n in ("start", "end", "step")}
    if any(kws.values()):
        if pos and kws["end"] is not None and len(pos) > 0 and kws["start"] is None:
            return None
        start = kws["start"].value if kws["start"] else (pos[0].value if len(pos) > 1 else None)
        end = kws["end"].value if kws["end"] else (pos[0].value if len(pos) == 1 else pos[1].value if len(pos) > 1 else None)
        step = kws["step"].value if kws["step"] else (pos[2].value if len(pos) > 2 else None)
        if end is None:
            return None
        return tuple(x for x in (start, end, step) if x is not None)
    if not 1 <= len(pos) <= 3:
        return None
    return tuple(a.value for a in pos)


def arange_is_int(rule: Rule, call: cst.Call) -> bool:
    """Integer ``arange``: every bound looks like an int, or ``dtype=`` is an integer dtype."""
    dt = keyword(call, "dtype")
    if dt is not None:
        return dtype_of(rule, dt.value) in INT_DTYPES
    bounds = _arange_bounds(call)
    return bounds is not None and all(int_looking(rule, b) for b in bounds)


def _literal_int_span(call: cst.Call) -> tuple[int, int] | None | str:
    """(lo, hi) of a literal-int arange; "empty" when it has no element; None otherwise."""
    bounds = _arange_bounds(call)
    if bounds is None:
        return None
    nums = [literal_number(b) for b in bounds]
    ints = [n for n in nums if isinstance(n, int) and not isinstance(n, bool)]
    if len(ints) != len(nums):
        return None
    if len(ints) == 1:
        start, end, step = 0, ints[0], 1
    elif len(ints) == 2:
        (start, end), step = ints, 1
    else:
        start, end, step = ints
    if step == 0:
        return None
    n = -((start - end) // step)  # ceil((end - start) / step)
    if n <= 0:
        return "empty"
    last = start + (n - 1) * step
    return (min(start, last), max(start, last))


def factory_data(rule: Rule, kind: str, call: cst.Call, default_float: str | None) -> Data:
    """What ``torch.<kind>(...)`` computes (see :class:`Data`)."""
    dt_arg = keyword(call, "dtype")
    given = dtype_of(rule, dt_arg.value) if dt_arg is not None else None
    if dt_arg is not None and given is None:
        return Data("opaque")
    if kind in CONSTANT:
        src = given or (None if kind.endswith("_like") else default_float)
        return Data("const", src)
    if kind in RANDOM:
        if kind in RANDOM_INT:
            return Data("random_int", given or (None if kind.endswith("_like") else "int64"))
        return Data("random", given or (None if kind.endswith("_like") else default_float))
    if kind in ("tril_indices", "triu_indices"):
        return Data("indices", given or "int64")
    if kind in ("full", "full_like", "scalar_tensor"):
        fill = _arg(call, 0 if kind == "scalar_tensor" else 1, "s" if kind == "scalar_tensor" else "fill_value")
        v = literal_number(fill) if fill is not None else None
        if v is None:
            return Data("host", given) if kind != "full_like" or given else Data("opaque")
        if kind == "full_like" and not given:
            return Data("const", None) if v in (0, 1) else Data("opaque")
        if kind == "scalar_tensor":
            src = given or default_float
        else:
            src = given or _inferred_src([v], default_float)
        return Data("values", src, (v,))
    if kind in ("tensor", "as_tensor", "asarray"):
        pos = positional(call)
        data = pos[0].value if pos else _arg(call, 0, "data")
        vals = literal_data(data) if data is not None else None
        if vals is None:
            return Data("host", given)
        return Data("values", given or _inferred_src(vals, default_float), tuple(vals))
    if kind == "arange":
        span = _literal_int_span(call)
        if span == "empty":
            return Data("const", given or "int64")
        if isinstance(span, tuple):
            return Data("intspan", given or "int64", lo=span[0], hi=span[1])
        if arange_is_int(rule, call):
            src = given or "int64"
            return Data("int", src) if src in INT_DTYPES else Data("float", src)
        bounds = _arange_bounds(call) or ()
        if any(isinstance(literal_number(b), float) for b in bounds):
            return Data("float", given or default_float)
        return Data("host", given)
    if kind in COMPUTED:
        return Data("float", given or default_float)
    return Data("opaque")


def fold_verdict(data: Data, dst: str | None) -> Fold:
    """Whether ``factory(...).to(dst)`` equals ``factory(..., dtype=dst)``."""
    if dst is None:
        return Fold(False, reason="the target dtype is not known")
    if dst not in FLOAT_DTYPES and dst not in INT_RANGE:
        return Fold(False, reason=f"folding into {dst} is not supported")
    src = data.src
    if data.kind == "opaque":
        return Fold(False, reason="the factory's own dtype and values are not known")
    if src is not None and src == dst:
        return Fold(True)  # the cast is a no-op
    k = data.kind
    if k == "const":
        return Fold(True)
    if k == "random":
        if dst in FLOAT_DTYPES:
            return Fold(True, (Tag.RNG,), "random values are generated in the new dtype: they differ")
        return Fold(False, reason="random floats cannot be generated in an integer dtype")
    if k == "random_int":
        if dst in INT_DTYPES:
            return Fold(True, (Tag.RNG,), "random integers are generated in the new dtype: they may differ")
        return Fold(False, reason="random integers are drawn differently in that dtype")
    if k == "indices":
        if dst in ("int32", "int64"):
            return Fold(True)
        return Fold(False, reason="tril/triu_indices only accept int32/int64 here")
    if src is None and k != "host":
        return Fold(False, reason="this file changes the default dtype, so the factory's dtype is not known")
    src_float = src in FLOAT_DTYPES
    if k == "values":
        assert src is not None  # (only host data may come without a dtype, above)
        if src_float and dst not in FLOAT_DTYPES:
            return Fold(False, reason="float data converted to an integer dtype")
        if not all(in_range(v, dst) for v in data.values):
            return Fold(False, reason=f"a value does not fit in {dst} (creating it there raises)")
        if all(exact_in(v, src) and exact_in(v, dst) for v in data.values):
            return Fold(True)
        if dst in FLOAT_DTYPES and ((src, dst) in _WIDER or src in INT_RANGE):
            return Fold(True, (Tag.TOLERANCE,), f"values are rounded once to {dst} instead of through {src}")
        return Fold(False, reason=f"not equivalent: the values are rounded to {src} first, then converted to {dst}")
    if k == "intspan":
        assert src is not None
        if src_float:
            if not (_int_span_exact(data.lo, data.hi, src) and _int_span_exact(data.lo, data.hi, dst)):
                return Fold(False, reason=f"not equivalent: values computed in {src} are rounded, then converted")
            if dst == "bool":
                return Fold(False, reason="arange cannot create bool tensors")
            return Fold(True)
        if dst == "bool":
            return Fold(False, reason="arange cannot create bool tensors")
        if _int_span_exact(data.lo, data.hi, dst):
            return Fold(True)
        return Fold(False, reason=f"not every integer in the range is exact in {dst}")
    if k == "int":
        # Integers of unknown magnitude: exact in float64 (2**53) and in int32/int64 for any sane
        # size; in float32/16/bf16 only below 2**24/2**11/2**8, above which they may round differently.
        if dst in ("float64", "int32", "int64"):
            return Fold(True)
        if dst in FLOAT_DTYPES:
            return Fold(True, (Tag.TOLERANCE,),
                        f"integers above 2**{FLOAT_INT_BITS[dst]} may round differently in {dst}")
        return Fold(False, reason=f"integers of unknown size may not fit in {dst}")
    if k == "float":
        if dst not in FLOAT_DTYPES:
            return Fold(False, reason="float data converted to an integer dtype")
        if (src, dst) in _WIDER:
            return Fold(True, (Tag.TOLERANCE,), f"values are computed in {dst} instead of rounded from {src}")
        return Fold(False, reason=f"not equivalent: the values are computed in {src}, then widened to {dst}")
    if k == "host":
        if dst in ("float16", "bfloat16", "float32"):
            return Fold(True, (Tag.TOLERANCE,), f"data are converted to {dst} in one rounding instead of two")
        return Fold(False, reason=f"the data's own dtype is not known, so converting to {dst} may not match")
    return Fold(False, reason="the factory's values are not known")


# --------------------------------------------------------------------------- shared rule plumbing


class _FactoryRule(Rule):
    """Common helpers of TOP101/TOP102 (abstract: no ``code``)."""

    family = "device"

    def visit_Module(self, node: cst.Module) -> None:
        self._default_float: str | None = "float32"
        code = node.code
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
        if scope is not None and "torch" in scope and any(
                not is_import_of_torch(a) for a in scope["torch"]):
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
        short = q[len("torch."):]
        if short == "from_numpy" or short in LEGACY:
            return short, q
        return None

    def factory_blockers(self, kind: str, inner: cst.Call) -> bool:
        """Shapes we never rewrite."""
        if has_star(inner) or keyword(inner, "out") is not None:
            return True
        if kind == "normal" and _arg(inner, 2, "size") is None:
            return True  # the tensor-mean/std overloads take no device=/dtype=
        if kind == "as_tensor" and len(positional(inner)) > 1:
            return True  # positional dtype/device
        return False

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
    return bool(call.args) and not call.keywords and all(
        isinstance(a, _ast.Constant) and type(a.value) is int for a in call.args)


def _ast_factory_calls(text: str, methods: tuple[str, ...], kinds: Iterable[str]):
    """(outer, inner, kind) for ``inner.<method>(...)`` where ``inner`` may call torch.<kind> and
    factory_blockers does not rule it out; None when it cannot be told."""
    index, imports = ast_index(text), torch_import_map(text)
    if index is None or imports is None:
        return None
    kinds = set(kinds)
    out = []
    for c in index.get(_ast.Call, ()):
        f = c.func
        if not (isinstance(f, _ast.Attribute) and f.attr in methods and isinstance(f.value, _ast.Call)):
            continue
        inner = f.value
        for q in ast_torch_names(imports, inner.func):
            kind = q[len("torch."):]
            if kind not in kinds or _ast_star(inner) or any(k.arg == "out" for k in inner.keywords):
                continue
            out.append((c, inner, kind))
    return out


def _could_move(text: str) -> bool:
    """FactoryThenMove's cheap necessary condition (True when it cannot be told)."""
    found = _ast_factory_calls(text, ("cuda", "to"), (*FACTORIES, *LEGACY, "from_numpy"))
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


def _could_cast(text: str) -> bool:
    """FactoryCast's cheap necessary condition (True when it cannot be told)."""
    found = _ast_factory_calls(text, (*CAST_METHODS, "to"), FACTORIES)
    if found is None:
        return True
    imports = torch_import_map(text) or {}
    return any(not (o.args or o.keywords) if o.func.attr != "to" else not _ast_to_device_only(imports, o)
               for o, _i, _k in found)


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
    return len(call.args) <= 3 and all(isinstance(a, _ast.Constant) for a in call.args[1:]) and bool(names) and all(
        q.startswith("torch.") and q[len("torch."):] in DTYPES for q in names)


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


def _keep_parens(outer: cst.Call, new: cst.Call) -> cst.Call:
    return new.with_changes(lpar=[*outer.lpar, *new.lpar], rpar=[*new.rpar, *outer.rpar])


def _removed_has_comments(outer: cst.Call) -> bool:
    func = outer.func
    assert isinstance(func, cst.Attribute)
    return any(has_comments(n) for n in (func.dot, func.attr, outer.whitespace_after_func,
                                         outer.whitespace_before_args, *outer.args))


def _is_false(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "False"


@dataclass
class _Trailing:
    """A parsed ``.cuda(...)``/``.to(...)``: what it asks for."""

    device: cst.BaseExpression | None = None  # the user's expression (None: `.cuda()` default)
    forced: bool = False  # the signature proves ``device`` is a device
    dtype: cst.BaseExpression | None = None
    unknown: cst.BaseExpression | None = None  # `.to(x)` with x unclassifiable
    cuda: bool = False


def parse_cuda(call: cst.Call) -> _Trailing | None:
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
    return _Trailing(device=dev, cuda=True)


def parse_to(rule: Rule, call: cst.Call) -> _Trailing | None:
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
        return _Trailing(device=kws["device"], forced=True, dtype=kws.get("dtype"))
    if "dtype" in kws:
        if len(pos) > 1:
            return None
        return _Trailing(device=pos[0] if pos else None, forced=bool(pos), dtype=kws["dtype"])
    if not pos or len(pos) > 4:
        return None
    if len(pos) >= 2 and dtype_of(rule, pos[1]) is not None:
        # to(device, dtype[, non_blocking[, copy]])
        if len(pos) == 4 and not _is_false(pos[3]):
            return None
        return _Trailing(device=pos[0], forced=True, dtype=pos[1])
    first = classify_device(rule, pos[0])
    if first.kind is DeviceKind.DTYPE:
        # to(dtype[, non_blocking[, copy]])
        if len(pos) == 3 and not _is_false(pos[2]):
            return None
        if len(pos) > 3:
            return None
        return _Trailing(dtype=pos[0])
    if len(pos) > 1:
        return None
    if first.is_device:
        return _Trailing(device=pos[0])
    if _dtype_named(pos[0]):
        return _Trailing(dtype=pos[0])  # `.to(x.dtype)`, `.to(dtype)`: a cast whose dtype is unknown
    return _Trailing(unknown=pos[0])


def _dtype_named(expr: cst.BaseExpression) -> bool:
    """``x.dtype``, ``dtype``, ``self.compute_dtype``: by name, a dtype (its value stays unknown)."""
    name = expr.attr.value if isinstance(expr, cst.Attribute) else expr.value if isinstance(expr, cst.Name) else ""
    return name == "dtype" or name.endswith("_dtype")


# --------------------------------------------------------------------------- TOP101


_NOTE_LEAF = "the tensor becomes a leaf that requires grad (its .grad is now populated; likely a bug fix)"


# --------------------------------------------------------------------------- TOP102


# --------------------------------------------------------------------------- examples (tests and docs)
