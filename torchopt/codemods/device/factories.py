"""TOP101 factory-then-move and TOP102 cast-after-factory (rules.md §2, DEV-001 and DEV-002).

Both rules look at one shape (G-2): ``Call(func=Attribute(value=Call(<torch factory>), attr=...))``,
resolve the inner callee by qualified name (G-1), and move the trailing ``.cuda()`` / ``.to()`` /
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
    TorchRef, callee, is_tensor_name, method_call, param_annotation, reaching_values, is_import_of_torch,
    torch_ref
)
from torchopt.analysis.values import (
    CAST_METHODS, DTYPES, FLOAT_DTYPES, INT_DTYPES, Device, DeviceKind, classify_device, dtype_of, int_value
)
from torchopt.analysis.arguments import drop_kwarg, has_star, keyword, positional, set_kwarg
from torchopt.analysis.syntax import has_comments, source
from torchopt.rewrite.metadata import qualified_names as _qualified_names
from torchopt.rewrite.rule import ImportSpec, Invalid, Rule, Safety, Tag, Valid

# --------------------------------------------------------------------------- factory tables (E-03)

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

#: Legacy typed constructors and the dtype they mean (E-23).
LEGACY = {
    "Tensor": None, "FloatTensor": "float32", "DoubleTensor": "float64", "HalfTensor": "float16",
    "BFloat16Tensor": "bfloat16", "LongTensor": "int64", "IntTensor": "int32", "ShortTensor": "int16",
    "CharTensor": "int8", "ByteTensor": "uint8", "BoolTensor": "bool",
}
CUDA_LEGACY = {k: v for k, v in LEGACY.items() if k != "Tensor"}

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
        return -v if isinstance(expr.operator, cst.Minus) else v  # type: ignore[operator]
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
        values = reaching_values(rule, expr)
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
        values = reaching_values(rule, expr)
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
    if any(n is None or isinstance(n, (bool, float)) for n in nums):
        return None
    if len(nums) == 1:
        start, end, step = 0, nums[0], 1
    elif len(nums) == 2:
        (start, end), step = nums, 1
    else:
        start, end, step = nums
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
    """Whether ``factory(...).to(dst)`` equals ``factory(..., dtype=dst)`` (rules.md DEV-002)."""
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
        else there (never shadow a local, G-6)."""
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
        """Shapes we never rewrite (G-4, DEV-001 condition 4)."""
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


_NOTE_RNG = "random values are drawn on {where} from its generator instead of the CPU one: they change, and later CPU random draws shift"
_NOTE_TOL = "values are computed by a device kernel instead of on the host: they may differ by about 1 ulp"
_NOTE_LEAF = "the tensor becomes a leaf that requires grad (its .grad is now populated; likely a bug fix)"


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

    `.to(device, dtype)` also folds the dtype when DEV-002 proves the cast value-preserving.
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
        return super().could_match(text) and (
            chained_call(text, ("cuda", "to"), (*FACTORIES, *LEGACY, "from_numpy"))
            or ("cuda" in text and any(name in text for name in CUDA_LEGACY))) and _could_move(text)

    def visit_Call(self, node: cst.Call) -> None:
        mc = method_call(node, ("cuda", "to"))
        if mc is not None:
            inner, meth = mc
            self._trailing(node, inner, meth)
            return
        q = callee(self, node)
        if q is not None and q.startswith("torch.cuda.") and q[len("torch.cuda."):] in CUDA_LEGACY:
            self._bare_cuda_ctor(node, q[len("torch.cuda."):])

    # ---- torch.cuda.FloatTensor(2, 3) -------------------------------------------------------

    def _bare_cuda_ctor(self, node: cst.Call, ctor: str) -> None:
        if not node.args or has_star(node) or any(
                a.keyword is not None or int_value(a.value) is None for a in node.args):
            return
        factory = source(self, node.func)
        ref = self.ref_at(node)
        fmt = {"factory": factory, "device": "'cuda'", "assumption": "", "new": factory}
        msg = "`{factory}(...)` is a legacy CUDA constructor"
        if ref is None or has_comments(node.func):
            self.report(node, fmt=fmt, message=msg)
            return
        new = node.with_changes(func=ref.attr("empty"))
        new = set_kwarg(new, "dtype", ref.attr(SPELLING[CUDA_LEGACY[ctor]]))  # type: ignore[index]
        new = set_kwarg(new, "device", cst.SimpleString("'cuda'"))
        self.report(node, fmt={**fmt, "new": f"{ref.name}.empty"}, message=msg, replacement=new,
                    imports=ref.imports, fix_title="Use `{new}(..., dtype=..., device={device})`")

    # ---- <factory>(...).cuda() / .to() ------------------------------------------------------

    def _trailing(self, node: cst.Call, inner: cst.Call, meth: str) -> None:
        fk = self.factory_of(inner)
        if fk is None:
            return
        kind, _q = fk
        if self.factory_blockers(kind, inner):
            return
        legacy = kind in LEGACY
        if legacy and (not inner.args or any(
                a.keyword is not None or a.star or int_value(a.value) is None for a in inner.args)):
            return  # torch.Tensor(data) / sizes we cannot see: overloaded, skip
        if kind == "from_numpy" and (len(inner.args) != 1 or inner.args[0].keyword is not None):
            return
        if kind in RANDOM and keyword(inner, "generator") is not None:
            return  # a CPU generator cannot feed a CUDA factory
        tr = parse_cuda(node) if meth == "cuda" else parse_to(self, node)
        if tr is None:
            return
        factory = source(self, inner.func)
        if tr.unknown is not None:
            self.report(node, fmt={"factory": factory, "x": source(self, tr.unknown)},
                        message="`{factory}(...).to({x})`: `{x}` may be a device, a dtype or a tensor "
                                "(a tensor gives both its dtype and its device); if it is a device, "
                                "pass `device={x}` to the factory")
            return
        if tr.device is None and not tr.cuda:
            return  # `.to(dtype)` / `.to(dtype=...)`: TOP102's
        ref = self.ref_at(node)

        # --- the device expression
        assumption = ""
        dev_kind: Device | None = None
        if tr.cuda:
            if tr.device is None:
                dev_expr: cst.BaseExpression | None = cst.SimpleString("'cuda'")
                dev_kind = Device(DeviceKind.LITERAL, "cuda")
            elif int_value(tr.device) is not None:
                dev_expr = cst.SimpleString(f"'cuda:{int_value(tr.device)}'")
                dev_kind = Device(DeviceKind.LITERAL, f"cuda:{int_value(tr.device)}")
            elif int_typed(self, tr.device):
                dev_expr = None if ref is None else cst.Call(
                    func=ref.attr("device"),
                    args=[cst.Arg(cst.SimpleString("'cuda'"),
                                  comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                          cst.Arg(tr.device)])
                dev_kind = Device(DeviceKind.LITERAL, "cuda")
                if dev_expr is None:
                    self.report(node, fmt={"factory": factory, "device": source(self, tr.device),
                                           "assumption": " (no fix: `torch` is bound to something else here)"})
                    return
            else:
                dev_kind = classify_device(self, tr.device)
                if not dev_kind.is_device or self._may_be_int(tr.device):
                    self.report(node, fmt={"factory": factory, "x": source(self, tr.device)},
                                message="`{factory}(...).cuda({x})`: the type of `{x}` is not known; pass "
                                        "`device=torch.device('cuda', {x})` if it is a GPU index, or "
                                        "`device={x}` if it is a device")
                    return
                dev_expr = tr.device
        else:
            dev_kind = classify_device(self, tr.device)
            dev_expr = tr.device
            if not dev_kind.is_device and not tr.forced:
                self.report(node, fmt={"factory": factory, "x": source(self, tr.device)},
                            message="`{factory}(...).to({x})`: `{x}` may be a device, a dtype or a tensor; "
                                    "if it is a device, pass `device={x}` to the factory")
                return
        assert dev_expr is not None
        if dev_kind is not None and dev_kind.kind is DeviceKind.CONVENTION and not tr.forced:
            assumption = f" (assuming `{source(self, tr.device)}` is a torch.device)"  # type: ignore[arg-type]
        device_text = " ".join(self.ctx.module.code_for_node(dev_expr).split())
        new_name = factory
        if (kind == "from_numpy" or kind in LEGACY) and ref is not None:
            new_name = f"{ref.name}.{'as_tensor' if kind == 'from_numpy' else 'empty'}"
        fmt = {"factory": factory, "device": device_text, "assumption": assumption, "new": new_name}

        # --- same device as now? (`.to('cpu')` on a host factory returns self)
        existing = keyword(inner, "device")
        target_cpu = dev_kind is not None and dev_kind.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and dev_kind.is_cpu
        if existing is None:
            same_device = target_cpu
        else:
            ex = classify_device(self, existing.value)
            same_device = target_cpu and ex.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and ex.is_cpu

        # --- tags from the factory kind
        tags: list[Tag] = []
        notes: list[str] = []
        where = "the device" if not dev_kind or not dev_kind.text else f"`{dev_kind.text}`"
        if not same_device:
            if kind in RANDOM:
                tags.append(Tag.RNG)
                notes.append(_NOTE_RNG.format(where=where))
            elif kind in COMPUTED or (kind == "arange" and not self._arange_exact_on_device(inner)):
                tags.append(Tag.TOLERANCE)
                notes.append(_NOTE_TOL)

        # --- dtype folded with the device
        dtype_expr: cst.BaseExpression | None = None
        if tr.dtype is not None:
            if kind in LEGACY or kind == "from_numpy":
                data = Data("host", LEGACY.get(kind)) if kind in LEGACY else Data("host")
            else:
                data = self.data(kind, inner)
            dst = dtype_of(self, tr.dtype)
            verdict = fold_verdict(data, dst)
            if not verdict.ok:
                self.report(node, fmt={**fmt, "why": verdict.reason},
                            message="`{factory}(...)` is created on the host, then moved to `{device}`"
                                    "{assumption}; not fixed: the dtype cannot be folded ({why})")
                return
            for t in verdict.tags:
                if t not in tags:
                    tags.append(t)
                    notes.append(verdict.reason)
            dtype_expr = tr.dtype
            if same_device and data.src is not None and data.src == dst:
                pass
            elif self.requires_grad(inner) and Tag.SEMANTICS not in tags:
                tags.append(Tag.SEMANTICS)
                notes.append(_NOTE_LEAF)
        if self.requires_grad(inner) and not same_device and Tag.SEMANTICS not in tags:
            tags.append(Tag.SEMANTICS)
            notes.append(_NOTE_LEAF)

        # --- existing tensor copied by torch.tensor(t)
        if kind == "tensor" and self._is_tensor_data(inner):
            data_src = source(self, positional(inner)[0].value)
            self.report(node, fmt={**fmt, "t": data_src},
                        message="`{factory}({t})` copy-constructs from a tensor, then moves it; use "
                                "`{t}.detach().to({device})`")
            return

        # --- comments that the fix would drop
        pin = keyword(inner, "pin_memory")
        drop_pin = pin is not None and not same_device
        if (_removed_has_comments(node) or (existing is not None and has_comments(existing.value))
                or (drop_pin and has_comments(pin)) or ((kind in LEGACY or kind == "from_numpy") and has_comments(inner.func))
                or (dtype_expr is not None and keyword(inner, "dtype") is not None and has_comments(keyword(inner, "dtype").value))):  # type: ignore[union-attr]
            self.report(node, fmt=fmt, message=self.message + "; not fixed automatically: a comment would be lost")
            return

        # --- build the replacement
        imports: tuple[ImportSpec, ...] = ()
        new = inner
        if kind == "from_numpy" or kind in LEGACY:
            if ref is None:
                self.report(node, fmt=fmt, message=self.message + "; no fix: `torch` is bound to something else here")
                return
            imports = ref.imports
            new = new.with_changes(func=ref.attr("as_tensor" if kind == "from_numpy" else "empty"))
            if kind in LEGACY and LEGACY[kind] is not None:
                new = set_kwarg(new, "dtype", ref.attr(SPELLING[LEGACY[kind]]))  # type: ignore[index]
        if isinstance(dev_expr, cst.Call) and dev_expr is not tr.device and ref is not None:
            imports = ref.imports
        if drop_pin:
            new = drop_kwarg(new, "pin_memory")
        before = ("requires_grad", "pin_memory")
        new = set_kwarg(new, "device", dev_expr, before=before)
        if dtype_expr is not None:
            new = set_kwarg(new, "dtype", dtype_expr, before=before)
        new = _keep_parens(node, new)
        self.report(node, fmt=fmt, replacement=new, safety=Safety.UNSAFE if tags else Safety.SAFE,
                    tags=tuple(tags), note="; ".join(notes), imports=imports)

    def _may_be_int(self, expr: cst.BaseExpression) -> bool:
        """A name with an int among its definitions (``.cuda(d)``, ``d = 0 if ... else 'cuda'``)."""
        if isinstance(expr, cst.Name):
            values = reaching_values(self, expr) or []
            return any(isinstance(v, cst.Integer) or (isinstance(v, cst.IfExp) and (
                isinstance(v.body, cst.Integer) or isinstance(v.orelse, cst.Integer))) for v in values)
        return False

    def _arange_exact_on_device(self, call: cst.Call) -> bool:
        if arange_is_int(self, call):
            return True
        span = _literal_int_span(call)
        if span == "empty":
            return True
        if isinstance(span, tuple):
            dt = keyword(call, "dtype")
            dst = dtype_of(self, dt.value) if dt is not None else None
            return dst is not None and _int_span_exact(span[0], span[1], dst)
        return False

    def _is_tensor_data(self, call: cst.Call) -> bool:
        pos = positional(call)
        return bool(pos) and isinstance(pos[0].value, cst.Name) and is_tensor_name(self, pos[0].value)

    examples = ()  # filled below


# --------------------------------------------------------------------------- TOP102


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


# --------------------------------------------------------------------------- examples (tests and docs)

FactoryThenMove.examples = (
    # --- the DEV-001 table
    Invalid("import torch\nx = torch.zeros(3, 4).cuda()\n",
            after="import torch\nx = torch.zeros(3, 4, device='cuda')\n"),
    Invalid("import torch as T\nx = T.ones(2).cuda(1)\n",
            after="import torch as T\nx = T.ones(2, device='cuda:1')\n"),
    Invalid('from torch import zeros\nimport torch\nx = zeros(5, dtype=torch.long).to("cuda:0", non_blocking=True)\n',
            after='from torch import zeros\nimport torch\nx = zeros(5, dtype=torch.long, device="cuda:0")\n'),
    Invalid("import torch\n\ndef f(dev):\n    return torch.full((2,), 7.0).to(device=dev, dtype=torch.float16)\n",
            after="import torch\n\ndef f(dev):\n    return torch.full((2,), 7.0, device=dev, dtype=torch.float16)\n"),
    Invalid("import torch\n\ndef train(model, device, loader):\n    return torch.arange(10).to(device)\n",
            after="import torch\n\ndef train(model, device, loader):\n    return torch.arange(10, device=device)\n",
            note="device-names convention: `device` is assumed to be a torch.device"),
    Invalid("import torch\n\ndef f(t, t2):\n    return torch.zeros_like(t).to(t2.device)\n",
            after="import torch\n\ndef f(t, t2):\n    return torch.zeros_like(t, device=t2.device)\n"),
    Invalid("import torch\nx = torch.zeros(3, pin_memory=True).cuda(non_blocking=True)\n",
            after="import torch\nx = torch.zeros(3, device='cuda')\n"),
    Invalid("import torch\n\ndef f(n, rank: int):\n    return torch.ones(n).cuda(rank)\n",
            after="import torch\n\ndef f(n, rank: int):\n    return torch.ones(n, device=torch.device('cuda', rank))\n"),
    Invalid("import torch\nx = torch.rand(5).cuda()\n",
            after="import torch\nx = torch.rand(5, device='cuda')\n", unsafe="rng"),
    Invalid('import torch\nx = torch.randn(2, 2, device="cpu").to(torch.device("cuda", 0))\n',
            after='import torch\nx = torch.randn(2, 2, device=torch.device("cuda", 0))\n', unsafe="rng"),
    Invalid("import torch\nx = torch.zeros(3, requires_grad=True).cuda()\n",
            after="import torch\nx = torch.zeros(3, device='cuda', requires_grad=True)\n", unsafe="semantics"),
    Invalid("import torch\n\ndef f(x):\n    return torch.empty(3).to(x)\n",
            note="x may be a device, a dtype or a tensor: display-only"),
    Invalid("import torch\n\ndef f(a):\n    return torch.from_numpy(a).cuda()\n",
            after="import torch\n\ndef f(a):\n    return torch.as_tensor(a, device='cuda')\n"),
    Invalid("import torch\nx = torch.Tensor(2, 3).cuda()\n",
            after="import torch\nx = torch.empty(2, 3, device='cuda')\n"),
    Invalid("import torch\nx = torch.cuda.FloatTensor(2, 3)\n",
            after="import torch\nx = torch.empty(2, 3, dtype=torch.float32, device='cuda')\n"),
    Invalid("import torch\nx = torch.cuda.LongTensor(4)\n",
            after="import torch\nx = torch.empty(4, dtype=torch.int64, device='cuda')\n"),
    Invalid("import torch\nx = torch.FloatTensor(2, 3).cuda()\n",
            after="import torch\nx = torch.empty(2, 3, dtype=torch.float32, device='cuda')\n"),
    # --- aliases and imports
    Invalid("import torch as T\n\ndef f(n, rank: int):\n    return T.ones(n).cuda(rank)\n",
            after="import torch as T\n\ndef f(n, rank: int):\n    return T.ones(n, device=T.device('cuda', rank))\n"),
    Invalid("from torch import ones\n\ndef f(n):\n    rank = int(2)\n    return ones(n).cuda(rank)\n",
            after="from torch import ones\nimport torch\n\ndef f(n):\n    rank = int(2)\n    return ones(n, device=torch.device('cuda', rank))\n"),
    Invalid("from torch import rand as R\nx = R(3).cuda()\n",
            after="from torch import rand as R\nx = R(3, device='cuda')\n", unsafe="rng"),
    Invalid("import torch\nimport torch.distributed as dist\nx = torch.zeros(3).cuda(dist.get_rank())\n",
            after="import torch\nimport torch.distributed as dist\nx = torch.zeros(3, device=torch.device('cuda', dist.get_rank()))\n"),
    Invalid("import torch\nx = torch.zeros(3).cuda(device=1)\n",
            after="import torch\nx = torch.zeros(3, device='cuda:1')\n"),
    Invalid("import torch\n\ndef f(target_device):\n    return torch.ones(3).to(device=target_device)\n",
            after="import torch\n\ndef f(target_device):\n    return torch.ones(3, device=target_device)\n"),
    # --- device-computed and random factories
    Invalid("import torch\nx = torch.linspace(0, 1, 5).cuda()\n",
            after="import torch\nx = torch.linspace(0, 1, 5, device='cuda')\n", unsafe="tolerance"),
    Invalid("import torch\nx = torch.arange(0, 1, 0.1).cuda()\n",
            after="import torch\nx = torch.arange(0, 1, 0.1, device='cuda')\n", unsafe="tolerance"),
    Invalid("import torch\nx = torch.hann_window(8).cuda()\n",
            after="import torch\nx = torch.hann_window(8, device='cuda')\n", unsafe="tolerance"),
    Invalid("import torch\n\ndef f(x):\n    return torch.arange(x.size(0)).cuda()\n",
            after="import torch\n\ndef f(x):\n    return torch.arange(x.size(0), device='cuda')\n"),
    Invalid("import torch\nx = torch.randint(0, 10, (3,)).to('cuda', torch.int32)\n",
            after="import torch\nx = torch.randint(0, 10, (3,), device='cuda', dtype=torch.int32)\n", unsafe="rng"),
    Invalid("import torch\nx = torch.zeros(3, requires_grad=True).to('cuda', torch.float64)\n",
            after="import torch\nx = torch.zeros(3, device='cuda', dtype=torch.float64, requires_grad=True)\n",
            unsafe="semantics"),
    Invalid("import torch\nx = torch.normal(0.0, 1.0, size=(3,)).cuda()\n",
            after="import torch\nx = torch.normal(0.0, 1.0, size=(3,), device='cuda')\n", unsafe="rng"),
    # --- layout: multi-line calls, existing device=, parentheses
    Invalid("import torch\nx = torch.zeros(\n    3,\n    4,\n).cuda()\n",
            after="import torch\nx = torch.zeros(\n    3,\n    4,\n    device='cuda',\n)\n"),
    Invalid("import torch\nx = torch.zeros(\n    3,\n).cuda()\n",
            after="import torch\nx = torch.zeros(\n    3,\n    device='cuda',\n)\n"),
    Invalid("import torch\nx = torch.zeros(3, device='cpu').cuda()\n",
            after="import torch\nx = torch.zeros(3, device='cuda')\n"),
    Invalid("import torch\nx = (torch.zeros(3)).cuda()\n",
            after="import torch\nx = (torch.zeros(3, device='cuda'))\n"),
    # --- display-only
    Invalid("import torch\n\ndef f(args):\n    return torch.zeros(3).cuda(args.local_rank)\n",
            note="type of args.local_rank unknown"),
    Invalid("import torch\nx = torch.zeros(3).cuda(  # on the GPU\n)\n", note="a comment would be lost"),
    Invalid("import torch\n\ndef f(device):\n    return torch.linspace(0, 1, 5).to(device, torch.float64)\n",
            note="the float64 fold is not value-preserving"),
    Invalid("import torch\nt = torch.ones(3)\nx = torch.tensor(t).cuda()\n", note="copy-construct from a tensor"),
    Invalid("from torch import zeros\ntorch = None\n\ndef f(rank: int):\n    return zeros(3).cuda(rank)\n",
            note="`torch` is bound to something else: no generated torch reference"),
    # --- runnable on the CPU (bitwise equal, RNG state included)
    Invalid("import torch\nx = torch.zeros(3, 4).to('cpu')\n",
            after="import torch\nx = torch.zeros(3, 4, device='cpu')\n", runnable=True),
    Invalid("import torch\nx = torch.rand(3).to('cpu')\ny = torch.randn(2)\n",
            after="import torch\nx = torch.rand(3, device='cpu')\ny = torch.randn(2)\n", runnable=True,
            note="same device: the same CPU generator is used"),
    Invalid("import torch\ndevice = 'cpu'\nx = torch.arange(10).to(device)\ny = torch.linspace(0, 1, 7).to(device)\n",
            after="import torch\ndevice = 'cpu'\nx = torch.arange(10, device=device)\ny = torch.linspace(0, 1, 7, device=device)\n",
            runnable=True),
    Invalid("import torch\nx = torch.tensor([1.0, 2.0]).to('cpu', torch.float64)\n",
            after="import torch\nx = torch.tensor([1.0, 2.0], device='cpu', dtype=torch.float64)\n", runnable=True),
    Invalid("import torch\nx = torch.zeros(3, requires_grad=True).to('cpu')\n",
            after="import torch\nx = torch.zeros(3, device='cpu', requires_grad=True)\n", runnable=True),
    Invalid("import numpy as np\nimport torch\na = np.arange(6.0)\nx = torch.from_numpy(a).to('cpu')\n",
            after="import numpy as np\nimport torch\na = np.arange(6.0)\nx = torch.as_tensor(a, device='cpu')\n",
            runnable=True),
    Invalid("import torch\nx = torch.full(\n    (2, 2),\n    7,\n    dtype=torch.long,\n).to(device='cpu', non_blocking=True)\n",
            after="import torch\nx = torch.full(\n    (2, 2),\n    7,\n    dtype=torch.long,\n    device='cpu',\n)\n",
            runnable=True),
    Valid("import torch\nx = torch.zeros(3, device='cpu')\ny = torch.arange(4).to(torch.float16)\n", runnable=True),
    Valid("import torch\n\ndef k(torch):\n    return torch.rand(3).cuda()\n", note="parameter named torch"),
    Valid("import mylib\nx = mylib.zeros(3).cuda()\n"),
    Valid("import torch\n\ndef zeros(n):\n    return torch.ones(n)\n\nx = zeros(3).cuda()\n"),
    Valid("import torch\n\ndef f(shape):\n    return torch.zeros(*shape).cuda()\n"),
    Valid("import torch\n\ndef f(kw):\n    return torch.zeros(3).cuda(**kw)\n"),
    Valid("import torch\n\ndef f(o):\n    return torch.zeros(3, out=o).cuda()\n"),
    Valid("import torch\nx = torch.ones(3).cuda(memory_format=torch.contiguous_format)\n"),
    Valid("import torch\nx = torch.arange(10).to('cpu', copy=True)\n", runnable=True),
    Valid("import torch\nx = torch.ones(3).to(torch.float16)\n", note="a dtype cast alone is TOP102's"),
    Valid("import torch\n\ndef f(a):\n    return a.new_zeros(3).cuda()\n", note="receiver type unknown"),
    Valid("import torch\n\ndef f(x, dtype):\n    return torch.arange(4).to(x.dtype) + torch.arange(4).to(dtype)\n",
          note="a cast by name: TOP102's"),
    Invalid("from x import is_torch_available\nif is_torch_available():\n    import torch\n\ndef f(a, rank: int):\n"
            "    return torch.zeros(3).cuda(rank)\n",
            after="from x import is_torch_available\nif is_torch_available():\n    import torch\n\ndef f(a, rank: int):\n"
                  "    return torch.zeros(3, device=torch.device('cuda', rank))\n",
            note="a guarded `import torch` is reused; no top-level import is added"),
    Valid("import torch\n\ndef f(data):\n    return torch.Tensor(data).cuda()\n", note="torch.Tensor is overloaded"),
    Valid("import torch\n\ndef f(mean, std):\n    return torch.normal(mean, std).cuda()\n"),
    Valid("import torch\n\ndef f(g):\n    return torch.rand(3, generator=g).cuda()\n", note="a CPU generator"),
    Valid("import torch\n\ndef f(x):\n    return torch.as_tensor(x, torch.float32).cuda()\n"),
    Valid("import torch\n\ndef f(x):\n    return torch.bernoulli(x).cuda()\n", note="no device= parameter"),
    Valid("import torch\n\ndef f(x):\n    return x.type(torch.cuda.FloatTensor)\n", note="TOP105's"),
)

CastAfterFactory.examples = (
    # --- the DEV-002 table
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
