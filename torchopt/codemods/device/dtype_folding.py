"""Whether ``factory(...).to(dtype)`` equals ``factory(..., dtype=dtype)``: what a factory call
computes (:class:`Data`), which numbers each dtype holds exactly, and the one verdict,
:func:`fold_verdict`, that TOP101 (``.to(device, dtype)``) and TOP102 both follow."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Sequence

import libcst as cst
from libcst.metadata import QualifiedNameSource

from torchopt.analysis.arguments import keyword, positional
from torchopt.analysis.names import param_annotation, reaching_values
from torchopt.analysis.values import FLOAT_DTYPES, INT_DTYPES, dtype_of
from torchopt.codemods.device.factory_tables import COMPUTED, CONSTANT, RANDOM, RANDOM_INT
from torchopt.rewrite.metadata import qualified_names
from torchopt.rewrite.rule import Rule, Tag

INT_RANGE = {
    "int8": (-(2**7), 2**7 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint8": (0, 255),
    "bool": (0, 1),
}
#: Integers up to 2**p are all exactly representable.
FLOAT_INT_BITS = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}
FLOAT_MAX = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": math.inf,
}
#: Wider-than partial order on float dtypes (float16 and bfloat16 are not comparable).
_WIDER = {
    ("float32", "float16"),
    ("float32", "bfloat16"),
    ("float64", "float16"),
    ("float64", "bfloat16"),
    ("float64", "float32"),
}


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


def int_span_exact(lo: int, hi: int, dt: str) -> bool:
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
    if (
        isinstance(expr, cst.UnaryOperation)
        and isinstance(expr.operator, (cst.Minus, cst.Plus))
        and isinstance(expr.expression, (cst.Integer, cst.Float))
    ):
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


def is_builtin(rule: Rule, node: cst.CSTNode, name: str) -> bool:
    """``node`` is the builtin ``name`` itself, not a local or an import that shadows it."""
    if not isinstance(node, cst.Name) or node.value != name:
        return False
    try:
        names = qualified_names(rule, node)
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
        if is_builtin(rule, f, "len") or is_builtin(rule, f, "int"):
            return True
        return (
            isinstance(f, cst.Attribute)
            and f.attr.value in ("size", "numel", "dim")
            and (f.attr.value != "size" or len(expr.args) == 1)
        )
    if isinstance(expr, cst.Subscript):
        return (
            isinstance(expr.value, cst.Attribute)
            and expr.value.attr.value == "shape"
            and len(expr.slice) == 1
            and isinstance(expr.slice[0].slice, cst.Index)
        )
    if isinstance(expr, cst.BinaryOperation) and isinstance(
        expr.operator, (cst.Add, cst.Subtract, cst.Multiply, cst.FloorDivide, cst.Modulo)
    ):
        return int_looking(rule, expr.left, depth) and int_looking(rule, expr.right, depth)
    if isinstance(expr, cst.Name) and depth < 3:
        if param_annotation(rule, expr) == "int":
            return True
        values = reaching_values(rule, expr) or []
        return bool(values) and all(v is not None and int_looking(rule, v, depth + 1) for v in values)
    return False


def argument(call: cst.Call, index: int, name: str) -> cst.BaseExpression | None:
    """The argument at ``index`` or named ``name`` (a keyword wins); None when neither is given."""
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
        end = (
            kws["end"].value
            if kws["end"]
            else (pos[0].value if len(pos) == 1 else pos[1].value if len(pos) > 1 else None)
        )
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


def literal_int_span(call: cst.Call) -> tuple[int, int] | None | str:
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


def arange_exact_on_device(rule: Rule, call: cst.Call) -> bool:
    """``arange`` creates the same numbers on a device as on the host: integers, or a literal span
    exact in the dtype it is given."""
    if arange_is_int(rule, call):
        return True
    span = literal_int_span(call)
    if span == "empty":
        return True
    if isinstance(span, tuple):
        dt = keyword(call, "dtype")
        dst = dtype_of(rule, dt.value) if dt is not None else None
        return dst is not None and int_span_exact(span[0], span[1], dst)
    return False


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
        fill = argument(call, 0 if kind == "scalar_tensor" else 1, "s" if kind == "scalar_tensor" else "fill_value")
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
        data = pos[0].value if pos else argument(call, 0, "data")
        vals = literal_data(data) if data is not None else None
        if vals is None:
            return Data("host", given)
        return Data("values", given or _inferred_src(vals, default_float), tuple(vals))
    if kind == "arange":
        span = literal_int_span(call)
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
            if not (int_span_exact(data.lo, data.hi, src) and int_span_exact(data.lo, data.hi, dst)):
                return Fold(False, reason=f"not equivalent: values computed in {src} are rounded, then converted")
            if dst == "bool":
                return Fold(False, reason="arange cannot create bool tensors")
            return Fold(True)
        if dst == "bool":
            return Fold(False, reason="arange cannot create bool tensors")
        if int_span_exact(data.lo, data.hi, dst):
            return Fold(True)
        return Fold(False, reason=f"not every integer in the range is exact in {dst}")
    if k == "int":
        # Integers of unknown magnitude: exact in float64 (2**53) and in int32/int64 for any sane
        # size; in float32/16/bf16 only below 2**24/2**11/2**8, above which they may round differently.
        if dst in ("float64", "int32", "int64"):
            return Fold(True)
        if dst in FLOAT_DTYPES:
            return Fold(
                True, (Tag.TOLERANCE,), f"integers above 2**{FLOAT_INT_BITS[dst]} may round differently in {dst}"
            )
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
