"""Value facts: what a name or an expression holds at a point of the program, and where it lives.

For every expression a rule asks about, :meth:`Placements.value` answers a :class:`Value`: its
*kind* (a tensor, a Python scalar, a ``str``, a list or tuple, another Python object, or UNKNOWN)
and its *placement* (the host, a device, or UNKNOWN), with the reason when either is unknown. A
Python scalar, string or container is a host value; a tensor is on the host when it was made by a
torch factory without ``device=`` or moved with ``.cpu()``/``.to("cpu")``, on a device when moved
with ``.cuda()`` or ``.to(<a GPU literal>)``, and UNKNOWN otherwise (``.to(device)`` with a device
chosen at run time, a loader batch that was not moved, the output of a model). NumPy and SciPy
results are host values (``array @ x`` is NumPy's); a module's ``named_children()`` names are strings.

A name is followed statement by statement, as a type checker narrows: the assignment that reaches
the read replaces what the name held before (``t = t.cpu()`` then ``t.tolist()`` reads a host
tensor; ``x = x.tolist()`` makes ``x`` a list). Where several assignments may reach the read (two
branches, the previous iteration of a loop), the facts are joined: equal facts stay, different
ones give UNKNOWN. A program that never selects an accelerator (``accelerators.host_program``: no
device named or chosen elsewhere in it or in the project modules it imports) has every value on the
host. Nothing is guessed: a parameter without an annotation, an attribute, the result
of a call the analysis does not know, are UNKNOWN.

The facts of a file are built lazily, once per analysed text, and kept in its ``SourceFacts``
(``placements(rule)``); there is no module-level cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import libcst as cst
from libcst.metadata import Assignment, GlobalScope, ScopeProvider

from torchopt.analysis.arguments import passed
from torchopt.analysis.accelerators import host_program
from torchopt.analysis.program import program_of
from torchopt.analysis.project import index_of
from torchopt.analysis.names import NOT_TENSOR, TENSOR_NAMESPACES, callee, dotted, param_annotation
from torchopt.analysis.step_loops import TENSOR_METHODS, TUPLE_REDUCTIONS
from torchopt.analysis.value_names import FACTORIES, HOST_LIBRARIES, INT_BUILTINS, INT_METHODS, PROGRESS, STR_METHODS
from torchopt.analysis.values import DeviceKind, classify_device
from torchopt.rewrite.metadata import ParentProvider, children_of
from torchopt.rewrite.rule import Rule


class Kind(enum.Enum):
    TENSOR = "a tensor"
    SCALAR = "a Python number"  # int, float or bool
    STR = "a string"
    SEQUENCE = "a list or tuple"
    ARRAY = "a NumPy array"
    OTHER = "a Python object"  # None, a dict, a device, a dtype
    UNKNOWN = "unknown"


class Where(enum.Enum):
    HOST = "the host"
    DEVICE = "a device"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Value:
    """What an expression holds. ``item``: what iterating a SEQUENCE (or a tensor) gives; ``items``:
    the elements of a tuple of known length; ``why``: the evidence, or why a part is unknown."""

    kind: Kind
    where: Where
    why: str = ""
    item: "Value | None" = None
    items: "tuple[Value, ...] | None" = None

    @property
    def on_host(self) -> bool:
        """Reading it on the host cannot wait for a device: a Python value, or a tensor on the host
        (a list of them too); False when that is not established."""
        if self.kind in (Kind.SCALAR, Kind.STR, Kind.ARRAY, Kind.OTHER):
            return True
        if self.kind is Kind.SEQUENCE:
            if self.items is not None:
                return all(v.on_host for v in self.items)
            return self.item is not None and self.item.on_host
        return self.where is Where.HOST

    @property
    def unknown_part(self) -> str | None:
        """The fact that could not be established (for messages), or None when both are known."""
        if self.kind is Kind.UNKNOWN:
            return f"what it holds: {self.why}" if self.why else "what it holds"
        if self.kind is Kind.TENSOR and self.where is Where.UNKNOWN:
            return f"its device: {self.why}" if self.why else "its device"
        return None


def unknown(why: str) -> Value:
    return Value(Kind.UNKNOWN, Where.UNKNOWN, why)


# A name being resolved is assumed to hold what its other assignments give (the induction of a loop:
# `step = 0` then `step += 1`): it joins as nothing.
_PENDING = Value(Kind.UNKNOWN, Where.UNKNOWN, "pending")
_INT = Value(Kind.SCALAR, Where.HOST, "an int")
_FLOAT = Value(Kind.SCALAR, Where.HOST, "a float")
_BOOL = Value(Kind.SCALAR, Where.HOST, "a bool")
_STR = Value(Kind.STR, Where.HOST, "a string")
_OTHER = Value(Kind.OTHER, Where.HOST, "a Python object")
_HOST_ANY = Value(Kind.UNKNOWN, Where.HOST, "host data")
_PARSER = Value(Kind.OTHER, Where.HOST, "an `argparse.ArgumentParser`")
_OPTIONS = Value(Kind.OTHER, Where.HOST, "the options `argparse` parsed")
_BUDGET = 24


def join(values: list[Value]) -> Value:
    """Flat join: equal facts stay, different ones become UNKNOWN (a tensor stays a tensor)."""
    vals = [v for v in values if v is not _PENDING]
    if not vals:
        return unknown("it depends only on itself")
    first = vals[0]
    if all(v == first for v in vals):
        return first
    kinds = {v.kind for v in vals}
    wheres = {v.where for v in vals}
    kind = kinds.pop() if len(kinds) == 1 else Kind.UNKNOWN
    where = wheres.pop() if len(wheres) == 1 else Where.UNKNOWN
    if kind is Kind.SEQUENCE:
        inner = [v.item for v in vals]
        item = join([i for i in inner if i is not None]) if all(i is not None for i in inner) else None
        return Value(kind, where, "lists from several assignments", item=item)
    if kind in (Kind.SCALAR, Kind.STR, Kind.ARRAY, Kind.OTHER):
        return Value(kind, Where.HOST, first.why)
    return Value(kind, where, "it is assigned different values on different paths")


_MODULE = Value(Kind.OTHER, Where.HOST, "an `nn.Module`")
_PARAMETER = Value(Kind.TENSOR, Where.UNKNOWN, "a parameter or buffer of a module")
# What iterating the result of an `nn.Module` method gives: a module or a tensor, named by a string.
_MODULE_ITERATORS = {m: _MODULE for m in ("children", "modules", "named_children", "named_modules")} | {
    m: _PARAMETER for m in ("parameters", "buffers", "named_parameters", "named_buffers")
}


class Placements:
    """The value facts of one file (see the module's docstring)."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self._names: dict[int, tuple[cst.Name, Value]] = {}
        self._pending: set[int] = set()
        self._order: dict[int, dict[int, int]] = {}
        self._default_device = "set_default_device" in rule.ctx.text or "set_default_tensor_type" in rule.ctx.text
        self._host: str | None = None  # why the whole program is on the host ("": it may not be)

    @property
    def default_device_changed(self) -> bool:
        """The file sets the default device: where a factory given no device builds is unknown."""
        return self._default_device

    # ------------------------------------------------------------------ expressions
    def value(self, expr: cst.BaseExpression | None, depth: int = 0) -> Value:
        found = self._value(expr, depth)
        if found.on_host:
            return found
        if self._host is None:
            self._host = host_program(self.rule) or ""
        if not self._host:
            return found
        # A program that never selects an accelerator: whatever the value is, it is on the host.
        return Value(found.kind, Where.HOST, f"{found.why}; on the host: {self._host}", item=_HOST_ANY)

    def _value(self, expr: cst.BaseExpression | None, depth: int) -> Value:
        if expr is None:
            return unknown("no value")
        if depth > _BUDGET:
            return unknown("too deep to follow")
        if isinstance(expr, cst.Name):
            return self.name(expr, depth)
        if isinstance(expr, cst.Integer):
            return _INT
        if isinstance(expr, (cst.Float, cst.Imaginary)):
            return _FLOAT
        if isinstance(expr, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)):
            return _STR if not (isinstance(expr, cst.SimpleString) and "b" in expr.prefix.lower()) else _OTHER
        if isinstance(expr, (cst.List, cst.Tuple, cst.Set)):
            return self._display(expr, depth)
        if isinstance(expr, (cst.ListComp, cst.GeneratorExp, cst.SetComp)):
            return Value(Kind.SEQUENCE, Where.HOST, "a comprehension", item=self.value(expr.elt, depth + 1))
        if isinstance(expr, (cst.Dict, cst.DictComp, cst.Lambda)):
            return _OTHER
        if isinstance(expr, cst.Comparison):
            return self._comparison(expr, depth)
        if isinstance(expr, cst.UnaryOperation):
            if isinstance(expr.operator, cst.Not):
                return _BOOL
            return self.value(expr.expression, depth + 1)
        if isinstance(expr, cst.BooleanOperation):
            return join([self.value(expr.left, depth + 1), self.value(expr.right, depth + 1)])
        if isinstance(expr, cst.BinaryOperation):
            return self._binary(expr, depth)
        if isinstance(expr, cst.IfExp):
            return join([self.value(expr.body, depth + 1), self.value(expr.orelse, depth + 1)])
        if isinstance(expr, cst.Subscript):
            return self._subscript(expr, depth)
        if isinstance(expr, cst.Attribute):
            return self._attribute(expr, depth)
        if isinstance(expr, cst.Call):
            return self._call(expr, depth)
        if isinstance(expr, cst.NamedExpr):
            return self.value(expr.value, depth + 1)
        return unknown(f"a `{type(expr).__name__}` expression")

    def _display(self, expr: cst.List | cst.Tuple | cst.Set, depth: int) -> Value:
        if any(isinstance(e, cst.StarredElement) for e in expr.elements):
            return Value(Kind.SEQUENCE, Where.HOST, "a display with a starred element", item=None)
        vals = tuple(self.value(e.value, depth + 1) for e in expr.elements)
        item = join(list(vals)) if vals else None
        kind = Kind.OTHER if isinstance(expr, cst.Set) else Kind.SEQUENCE
        return Value(kind, Where.HOST, "a display", item=item, items=vals if isinstance(expr, cst.Tuple) else None)

    def _comparison(self, expr: cst.Comparison, depth: int) -> Value:
        if any(isinstance(c.operator, (cst.Is, cst.IsNot, cst.In, cst.NotIn)) for c in expr.comparisons):
            return _BOOL
        operands = [expr.left] + [c.comparator for c in expr.comparisons]
        vals = [self.value(o, depth + 1) for o in operands]
        tensors = [v for v in vals if v.kind is Kind.TENSOR]
        if tensors:
            return Value(Kind.TENSOR, join(tensors).where, "a comparison of tensors")
        if all(v.kind in (Kind.SCALAR, Kind.STR, Kind.SEQUENCE, Kind.OTHER) for v in vals):
            return _BOOL
        if any(v.kind is Kind.ARRAY for v in vals) and all(v.on_host for v in vals):
            return Value(Kind.ARRAY, Where.HOST, "a comparison of arrays")
        if all(v.on_host for v in vals):
            return Value(Kind.UNKNOWN, Where.HOST, "a comparison of host data")
        return unknown("a comparison of values of unknown kind")

    def _binary(self, expr: cst.BinaryOperation, depth: int) -> Value:
        left, right = self.value(expr.left, depth + 1), self.value(expr.right, depth + 1)
        tensors = [v for v in (left, right) if v.kind is Kind.TENSOR]
        if tensors:
            if any(v.kind is Kind.UNKNOWN for v in (left, right)):
                return Value(Kind.TENSOR, Where.UNKNOWN, "arithmetic with a value of unknown kind")
            return Value(Kind.TENSOR, join(tensors).where, "arithmetic on tensors")
        kinds = {left.kind, right.kind}
        if left.kind is Kind.ARRAY and (
            isinstance(expr.operator, cst.MatrixMultiply) or (right.kind in (Kind.ARRAY, Kind.SCALAR))
        ):
            # NumPy arithmetic; `array @ x` fails for a tensor `x` (NumPy defers, and a tensor's
            # `__rmatmul__` does not take an array): when it runs, it is NumPy's.
            return Value(Kind.ARRAY, Where.HOST, "NumPy arithmetic")
        if Kind.UNKNOWN in kinds and left.on_host and right.on_host:
            return Value(Kind.UNKNOWN, Where.HOST, "arithmetic on host data")
        if kinds == {Kind.SCALAR}:
            floats = "float" in (left.why, right.why) or isinstance(expr.operator, cst.Divide)
            return _FLOAT if floats else Value(Kind.SCALAR, Where.HOST, "a Python number")
        if Kind.STR in kinds and isinstance(expr.operator, (cst.Add, cst.Modulo, cst.Multiply)):
            return _STR if left.kind is Kind.STR or right.kind is Kind.STR else unknown("")
        if Kind.SEQUENCE in kinds and kinds <= {Kind.SEQUENCE, Kind.SCALAR}:
            seqs = [v for v in (left, right) if v.kind is Kind.SEQUENCE]
            items = [s.item for s in seqs]
            item = join([i for i in items if i is not None]) if all(i is not None for i in items) else None
            return Value(Kind.SEQUENCE, Where.HOST, "a list built from lists", item=item)
        return unknown("arithmetic on values of unknown kind")

    def _subscript(self, expr: cst.Subscript, depth: int) -> Value:
        base = self.value(expr.value, depth + 1)
        if base.kind is Kind.TENSOR:
            return Value(Kind.TENSOR, base.where, "an index into a tensor")
        if base.kind is Kind.STR:
            return _STR
        if base.kind is Kind.UNKNOWN and base.where is Where.HOST:
            return Value(Kind.UNKNOWN, Where.HOST, "an index into host data")
        if base.kind is Kind.SEQUENCE:
            sl = expr.slice[0].slice if len(expr.slice) == 1 else None
            if isinstance(sl, cst.Slice):
                return base
            if base.items is not None and isinstance(sl, cst.Index) and isinstance(sl.value, cst.Integer):
                i = int(sl.value.evaluated_value)
                if -len(base.items) <= i < len(base.items):
                    return base.items[i]
            return base.item or _HOST_ANY
        return unknown(f"an index into {base.kind.value} value" if base.kind is not Kind.UNKNOWN else base.why)

    def _attribute(self, expr: cst.Attribute, depth: int) -> Value:
        attr = expr.attr.value
        if isinstance(expr.value, cst.Name) and self.value(expr.value, depth + 1) == _OPTIONS:
            # What `argparse` gives: strings, or what a `type=` callable made of one (host values).
            return Value(Kind.UNKNOWN, Where.HOST, f"the option `{dotted(expr)}`")
        if attr in ("data", "T", "mT", "H", "real", "imag", "grad"):
            base = self.value(expr.value, depth + 1)
            if base.kind is Kind.TENSOR:
                return Value(Kind.TENSOR, base.where, f"`.{attr}` of a tensor")
        if attr == "shape":
            base = self.value(expr.value, depth + 1)
            if base.kind is Kind.TENSOR:
                return Value(Kind.SEQUENCE, Where.HOST, "a tensor's shape", item=_INT)
        if attr in ("ndim", "is_cuda") and self.value(expr.value, depth + 1).kind is Kind.TENSOR:
            return _INT if attr == "ndim" else _BOOL
        if attr in ("device", "dtype") and self.value(expr.value, depth + 1).kind is Kind.TENSOR:
            return _OTHER
        return unknown(f"the attribute `{dotted(expr) or attr}`")

    # ------------------------------------------------------------------ calls
    def _call(self, call: cst.Call, depth: int) -> Value:
        func = call.func
        if isinstance(func, cst.Name) and self._builtin(func):
            return self._builtin_call(func.value, call, depth)
        q = callee(self.rule, call) if isinstance(func, (cst.Name, cst.Attribute)) else None
        if q is not None:
            return self._torch_call(q, call, depth)
        names = self._qualified(func) if isinstance(func, (cst.Name, cst.Attribute)) else set()
        if "itertools.count" in names:
            return Value(Kind.SEQUENCE, Where.HOST, "`itertools.count()`", item=_INT)
        if "argparse.ArgumentParser" in names:
            return _PARSER
        host_lib = next((n for n in sorted(names) if n.split(".", 1)[0] in HOST_LIBRARIES), None)
        if host_lib is not None:
            # NumPy and SciPy compute on the host: an array, a NumPy scalar or a Python object.
            kind = Kind.ARRAY if host_lib.startswith("numpy.") else Kind.UNKNOWN
            return Value(kind, Where.HOST, f"the result of `{host_lib}()`, computed on the host")
        if names and not names & PROGRESS and isinstance(func, cst.Name):
            names = names | {index_of(self.rule).origin(func.value) or ""}  # re-exported by the project
        if names & PROGRESS and call.args and call.args[0].keyword is None and not call.args[0].star:
            # A progress bar iterates what it wraps (`tqdm(range(n))` gives ints); `trange(n)` is one.
            inner = _INT if any(n.endswith("trange") for n in names) else None
            item = inner or self._element(self.value(call.args[0].value, depth + 1))
            return Value(Kind.SEQUENCE, Where.HOST, f"`{dotted(func)}()`", item=item)
        if isinstance(func, cst.Attribute):
            if func.attr.value in ("parse_args", "parse_known_args") and self.value(func.value, depth + 1) == _PARSER:
                if func.attr.value == "parse_args":
                    return _OPTIONS
                rest = Value(Kind.SEQUENCE, Where.HOST, "the arguments `argparse` did not parse", item=_STR)
                return Value(Kind.SEQUENCE, Where.HOST, "`parse_known_args()`", items=(_OPTIONS, rest))
            return self._method(func.attr.value, func.value, call, depth)
        return unknown(f"the result of `{dotted(func) or 'a call'}()`, which is not analysed")

    def _builtin_call(self, name: str, call: cst.Call, depth: int) -> Value:
        args = [a.value for a in call.args if a.keyword is None and not a.star]
        if name in INT_BUILTINS:
            return _INT
        if name == "float":
            return _FLOAT
        if name in ("bool", "isinstance", "callable", "hasattr"):
            return _BOOL
        if name in ("str", "repr", "format", "chr"):
            return _STR
        if name == "range":
            return Value(Kind.SEQUENCE, Where.HOST, "`range()`", item=_INT)
        if name == "round" and len(args) == 1:
            return _INT
        if name in ("list", "tuple", "sorted", "reversed", "iter") and len(args) == 1:
            return Value(Kind.SEQUENCE, Where.HOST, f"`{name}()`", item=self._element(self.value(args[0], depth + 1)))
        if name == "enumerate" and args:
            inner = self._element(self.value(args[0], depth + 1))
            pair = Value(Kind.SEQUENCE, Where.HOST, "a pair", item=None, items=(_INT, inner))
            return Value(Kind.SEQUENCE, Where.HOST, "`enumerate()`", item=pair)
        if name == "zip" and args:
            parts = tuple(self._element(self.value(a, depth + 1)) for a in args)
            return Value(Kind.SEQUENCE, Where.HOST, "`zip()`", item=Value(Kind.SEQUENCE, Where.HOST, "", items=parts))
        if name == "next" and args:
            return self._element(self.value(args[0], depth + 1))
        if name in ("abs", "min", "max", "sum") and args:
            vals = [self.value(a, depth + 1) for a in args]
            if all(v.kind is Kind.SCALAR for v in vals):
                return join(vals)
            if name in ("min", "max") and len(vals) > 1 and all(v.on_host for v in vals):
                # One of its arguments (a comparison of host values cannot wait for a device).
                return Value(join(vals).kind, Where.HOST, f"`{name}()` of host values")
            if name == "abs":
                return vals[0]
            return unknown(f"`{name}()` of values that are not all Python numbers")
        if name in ("dict", "set", "open", "print", "type", "object", "vars", "getattr", "input"):
            return _OTHER if name != "getattr" else unknown("`getattr()`")
        return unknown(f"the result of `{name}()`")

    def _torch_call(self, q: str, call: cst.Call, depth: int) -> Value:
        name = q.rsplit(".", 1)[1]
        if not any(q.startswith(ns) and "." not in q[len(ns) :] for ns in TENSOR_NAMESPACES):
            return unknown(f"the result of `{q}()`")
        if name in NOT_TENSOR:
            return _OTHER
        if name in FACTORIES:
            for arg in call.args:
                if arg.keyword is not None and arg.keyword.value == "device":
                    return self._moved(arg.value, depth, f"`{name}(..., device=...)`")
                if arg.star:
                    return Value(Kind.TENSOR, Where.UNKNOWN, f"`{name}(*args)` may pass a device")
            if name.endswith("_like") and call.args:
                base = self.value(call.args[0].value, depth + 1)
                return Value(Kind.TENSOR, base.where if base.kind is Kind.TENSOR else Where.UNKNOWN, f"`{name}()`")
            if self._default_device:
                return Value(Kind.TENSOR, Where.UNKNOWN, "the file changes the default device")
            return Value(Kind.TENSOR, Where.HOST, f"`torch.{name}()` without a device")
        first = call.args[0].value if call.args and call.args[0].keyword is None else None
        if first is None:
            return Value(Kind.TENSOR, Where.UNKNOWN, f"`{q}()`")
        base = self.value(first, depth + 1)
        if base.kind is Kind.SEQUENCE:  # torch.cat([...]), torch.stack(...)
            base = base.item or unknown("")
        where = base.where if base.kind is Kind.TENSOR else Where.UNKNOWN
        return Value(Kind.TENSOR, where, f"`{q}()` of a tensor on {where.value}")

    def _method(self, meth: str, recv: cst.BaseExpression, call: cst.Call, depth: int) -> Value:
        if meth in _MODULE_ITERATORS and self._is_module(recv):
            item = _MODULE_ITERATORS[meth]
            if meth.startswith("named_"):
                item = Value(Kind.SEQUENCE, Where.HOST, "a name and what it names", items=(_STR, item))
            return Value(Kind.SEQUENCE, Where.HOST, f"`.{meth}()` of a module", item=item)
        base = self.value(recv, depth + 1)
        if base.kind is Kind.STR:
            if meth in STR_METHODS:
                return _STR
            if meth in ("split", "rsplit", "splitlines"):
                return Value(Kind.SEQUENCE, Where.HOST, "a split string", item=_STR)
            if meth in ("startswith", "endswith", "isdigit"):
                return _BOOL
        if base.kind is Kind.ARRAY:  # NumPy computes on the host
            return Value(Kind.UNKNOWN, Where.HOST, f"`.{meth}()` of a NumPy array")
        if meth in ("item", "tolist", "numpy") and not call.args:
            if base.kind not in (Kind.TENSOR, Kind.UNKNOWN):
                return unknown(f"`.{meth}()` of {base.kind.value}")
            # What it returns is host data whatever the receiver was (the read may have waited).
            if meth == "item":
                return Value(Kind.SCALAR, Where.HOST, "`.item()`")
            if meth == "tolist":
                return Value(Kind.SEQUENCE, Where.HOST, "`.tolist()`", item=_HOST_ANY)
            return Value(Kind.ARRAY, Where.HOST, "`.numpy()`", item=_HOST_ANY)
        kind = Kind.TENSOR if base.kind is Kind.TENSOR else Kind.UNKNOWN
        why = "" if kind is Kind.TENSOR else f" of a value not known to be a tensor ({base.why})"
        # `.cpu()` gives host data and `.cuda()` device data whatever the receiver (a tensor, a module).
        if meth == "cpu":
            return Value(kind, Where.HOST, "moved with `.cpu()`" + why)
        if meth == "cuda":
            return Value(kind, Where.DEVICE, "moved with `.cuda()`" + why)
        if meth == "to":
            return self._to(call, base, depth)
        if base.kind is not Kind.TENSOR:
            if base.where is Where.HOST and meth in TENSOR_METHODS:
                return Value(Kind.UNKNOWN, Where.HOST, f"`.{meth}()` of host data")
            return unknown(f"`.{meth}()` of a value that is not known to be a tensor ({base.why})")
        if meth in INT_METHODS or (meth == "size" and call.args):
            return _INT
        if meth == "size":
            return Value(Kind.SEQUENCE, Where.HOST, "a tensor's size", item=_INT)
        if meth in TUPLE_REDUCTIONS and call.args:
            t = Value(Kind.TENSOR, base.where, f"`.{meth}(dim)`")
            return Value(Kind.SEQUENCE, Where.HOST, "values and indices", item=t, items=(t, t))
        if meth in TENSOR_METHODS or meth.endswith("_"):
            return Value(Kind.TENSOR, base.where, base.why)
        return unknown(f"the tensor method `.{meth}()`, which is not analysed")

    def _to(self, call: cst.Call, base: Value, depth: int) -> Value:
        for arg in call.args:
            if arg.star:
                return Value(Kind.TENSOR, Where.UNKNOWN, "`.to(*args)`")
            if arg.keyword is not None and arg.keyword.value == "device":
                return self._moved(arg.value, depth, "`.to(device=...)`", base.kind)
        pos = [a.value for a in call.args if a.keyword is None]
        if not pos:
            return base
        first = pos[0]
        other = self.value(first, depth + 1)
        if other.kind is Kind.TENSOR:  # `.to(other)`: the other tensor's device
            return Value(base.kind, other.where, "moved to another tensor's device")
        dev = classify_device(self.rule, first)
        if dev.kind is DeviceKind.DTYPE:
            return base
        return self._moved(first, depth, "`.to(...)`", base.kind)

    def _moved(self, dev_expr: cst.BaseExpression, depth: int, how: str, kind: Kind = Kind.TENSOR) -> Value:
        kind = Kind.TENSOR if kind is Kind.TENSOR else Kind.UNKNOWN
        dev = classify_device(self.rule, dev_expr)
        if dev.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and dev.text:
            where = Where.HOST if dev.is_cpu else Where.DEVICE
            return Value(kind, where, f"{how} to `{dev.text}`")
        text = self.rule.ctx.module.code_for_node(dev_expr)
        return Value(kind, Where.UNKNOWN, f"{how} to `{text}`, which may be the CPU or a GPU")

    @staticmethod
    def _element(v: Value) -> Value:
        """What iterating ``v`` gives."""
        if v.kind is Kind.TENSOR:
            return Value(Kind.TENSOR, v.where, "a row of a tensor")
        if v.kind is Kind.SEQUENCE:
            if v.item is not None:
                return v.item
            return _HOST_ANY if v.why == "`.tolist()`" else unknown("an element of a list of unknown values")
        if v.kind is Kind.STR:
            return _STR
        if v.kind is Kind.OTHER and v.item is not None:
            return v.item
        return unknown(f"an element of {v.why}" if v.why else "an element of an unknown iterable")

    def _is_module(self, expr: cst.BaseExpression) -> bool:
        """``expr`` is an ``nn.Module``: ``self`` in a method of the file's module classes, or what the
        program model knows as a model."""
        program = program_of(self.rule)
        if isinstance(expr, cst.Name) and expr.value == "self":
            fn = program.function_of(expr)
            return fn is not None and fn.cls is not None and fn.cls in program.module_classes
        if isinstance(expr, (cst.Name, cst.Attribute)):
            role = program.role_of(expr)
            return role is not None and role.kind == "model"
        return False

    # ------------------------------------------------------------------ names
    def _loader(self, expr: cst.BaseExpression) -> bool:
        """``expr`` is a data loader of the program (its batches' devices are unknown until moved)."""
        if isinstance(expr, cst.Call) and dotted(expr.func) in ("enumerate", "tqdm", "iter") and expr.args:
            expr = expr.args[0].value
        return isinstance(expr, (cst.Name, cst.Attribute)) and _loader_role(self.rule, expr)

    def _builtin(self, name: cst.Name) -> bool:
        try:
            scope = self.rule.get_metadata(ScopeProvider, name)
        except KeyError:
            return False
        if scope is None:
            return False
        return not any(isinstance(a, Assignment) for a in scope[name.value])

    def _qualified(self, func: cst.Name | cst.Attribute) -> set[str]:
        """The imported names ``func`` may refer to (`count` from `from itertools import count`)."""
        try:
            scope = self.rule.get_metadata(ScopeProvider, func)
        except KeyError:
            return set()
        if scope is None:
            return set()
        return {q.name for q in scope.get_qualified_names_for(func)}

    def name(self, name: cst.Name, depth: int = 0) -> Value:
        """What ``name`` holds where it is read."""
        if name.value in ("True", "False"):
            return _BOOL
        if name.value == "None":
            return _OTHER
        hit = self._names.get(id(name))
        if hit is not None and hit[0] is name:
            return hit[1]
        if id(name) in self._pending:
            return _PENDING
        self._pending.add(id(name))
        try:
            val = self._name(name, depth)
        finally:
            self._pending.discard(id(name))
        if not self._pending:  # a value found while another name was assumed is not final
            self._names[id(name)] = (name, val)
        return val

    def _name(self, name: cst.Name, depth: int) -> Value:
        ann = param_annotation(self.rule, name)
        if ann in ("int", "float", "bool"):
            return Value(Kind.SCALAR, Where.HOST, f"annotated `{ann}`")
        if ann == "str":
            return _STR
        if ann in ("torch.Tensor", "Tensor"):  # (names.is_tensor_name's reading of the annotation)
            return Value(Kind.TENSOR, Where.UNKNOWN, f"a parameter annotated `{ann}`")
        try:
            scope = self.rule.get_metadata(ScopeProvider, name)
        except KeyError:
            return unknown(f"`{name.value}` is not in the analysed tree")
        if scope is None or name.value not in scope:
            return unknown(f"`{name.value}` is not bound in this file")
        assignments = list(scope[name.value])
        if not assignments:
            return unknown(f"`{name.value}` is not bound in this file")
        if not all(isinstance(a, Assignment) for a in assignments):
            return unknown(f"`{name.value}` is bound in another scope or imported")
        if all(isinstance(a.scope, GlobalScope) for a in assignments) and not isinstance(scope, GlobalScope):
            # A module-level name read in a function: any of its bindings may be the one a call sees.
            return join([self._binding(a.node, depth) for a in assignments])
        if any(a.scope is not scope for a in assignments):
            return unknown(f"`{name.value}` is bound in another scope or imported")
        reaching = self._reaching(name, [a.node for a in assignments], getattr(scope, "node", self.rule.ctx.module))
        return join([self._binding(n, depth) for n in reaching])

    def _reaching(self, use: cst.Name, targets: list[cst.CSTNode], scope_node: cst.CSTNode) -> list[cst.CSTNode]:
        """The assignments that may reach ``use``: the last one that surely runs before it in the same
        block (or an enclosing one) replaces every earlier one; later ones reach only through a loop."""
        order = self._order_of(scope_node)
        at = order.get(id(use))
        if at is None:
            return targets
        use_chain = self._blocks(use)
        # An assignment whose statement holds the use binds after the use is read (`x = x.cpu()`).
        late = {id(t) for t in targets if id(self._statement(t)) in use_chain}
        before = [t for t in targets if order.get(id(t), at + 1) < at and id(t) not in late]
        after = [t for t in targets if order.get(id(t), at + 1) >= at or id(t) in late]
        kill: cst.CSTNode | None = None
        for t in sorted(before, key=lambda t: order[id(t)]):
            if self._dominates(t, use_chain):
                kill = t
        if kill is not None:
            before = [t for t in before if order[id(t)] >= order[id(kill)]]
        loop = self._loop_of(use, scope_node)
        carried = [t for t in after if loop is not None and self._inside(t, loop)]
        if kill is not None and loop is not None and self._inside(kill, loop):
            carried = []
        return before + carried if before or carried else targets

    def _order_of(self, scope_node: cst.CSTNode) -> dict[int, int]:
        order = self._order.get(id(scope_node))
        if order is None:
            order = {}
            stack = [scope_node]
            while stack:
                cur = stack.pop()
                order[id(cur)] = len(order)
                stack.extend(reversed(_children(cur)))
            self._order[id(scope_node)] = order
        return order

    def _parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.rule.get_metadata(ParentProvider, node, None)

    def _statement(self, node: cst.CSTNode) -> cst.CSTNode | None:
        cur: cst.CSTNode | None = node
        while cur is not None and not isinstance(cur, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            cur = self._parent(cur)
        return cur

    def _blocks(self, node: cst.CSTNode) -> list[int]:
        """ids of every statement that holds ``node``, innermost first (the chain a dominator must be on)."""
        out = []
        cur: cst.CSTNode | None = node
        while cur is not None:
            if isinstance(cur, (cst.BaseSmallStatement, cst.BaseCompoundStatement, cst.SimpleStatementLine)):
                out.append(id(cur))
            cur = self._parent(cur)
        return out

    def _dominates(self, target: cst.CSTNode, use_chain: list[int]) -> bool:
        """The assignment of ``target`` runs, unconditionally, before the statement chain of the use:
        its statement is a sibling, in the same block, of a statement that holds the use."""
        stmt = self._statement(target)
        if stmt is None or isinstance(stmt, (cst.For, cst.While, cst.With, cst.Try)):
            return False  # a loop's target may never be bound; `with` and `try` bodies are not followed
        line = self._parent(stmt) if isinstance(stmt, cst.BaseSmallStatement) else stmt
        block = self._parent(line) if line is not None else None
        if block is None:
            return False
        siblings = getattr(block, "body", None)
        if not isinstance(siblings, (list, tuple)):
            return False
        return any(id(s) in use_chain for s in siblings if s is not line)

    def _loop_of(self, node: cst.CSTNode, scope_node: cst.CSTNode) -> cst.CSTNode | None:
        """The outermost loop of the scope that holds ``node`` (a later assignment in it reaches the
        read on the next iteration)."""
        found = None
        cur = self._parent(node)
        while cur is not None and cur is not scope_node:
            if isinstance(cur, (cst.For, cst.While)):
                found = cur
            cur = self._parent(cur)
        return found

    def _inside(self, node: cst.CSTNode, container: cst.CSTNode) -> bool:
        cur: cst.CSTNode | None = node
        while cur is not None:
            if cur is container:
                return True
            cur = self._parent(cur)
        return False

    def _passed(self, param: cst.Param, depth: int) -> Value:
        """A parameter of a module-level function takes what every call of it in this file passes
        (``train(args, ...)`` from the ``__main__`` block gives ``args`` the parsed options); unknown
        when the function is used other than by plain calls, or a call hides the argument."""
        why = f"`{param.name.value}` is a parameter"
        params = self._parent(param)
        fn = self._parent(params) if isinstance(params, cst.Parameters) else None
        if not isinstance(fn, cst.FunctionDef) or not isinstance(self._parent(fn), cst.Module) or depth > 6:
            return unknown(why)
        if param not in fn.params.params or fn.decorators:
            return unknown(why)
        at = fn.params.params.index(param)
        uses = self._uses_of(fn)
        if not uses:
            return unknown(why)
        values: list[Value] = []
        for use in uses:
            call = self._parent(use)
            if not (isinstance(call, cst.Call) and call.func is use):
                return unknown(why)
            known, arg = passed(call, param.name.value, at)
            if not known or arg is None:
                return unknown(why)
            values.append(self.value(arg, depth + 1))
        got = join(values)
        return got if got.kind is not Kind.UNKNOWN or got.where is Where.HOST else unknown(why)

    def _uses_of(self, fn: cst.FunctionDef) -> list[cst.Name]:
        """Every read of the module-level function ``fn``'s name, when that name has no other binding."""
        try:
            scope = self.rule.get_metadata(ScopeProvider, fn)
        except KeyError:
            return []
        if scope is None or fn.name.value not in scope:
            return []
        bindings = list(scope[fn.name.value])
        if len(bindings) != 1 or not isinstance(bindings[0], Assignment) or bindings[0].node is not fn:
            return []
        return [r.node for r in bindings[0].references if isinstance(r.node, cst.Name)]

    def _binding(self, target: cst.CSTNode, depth: int) -> Value:
        """What the binding at ``target`` gives the name."""
        if isinstance(target, cst.Param):
            default = target.default
            if isinstance(default, cst.UnaryOperation) and isinstance(default.operator, cst.Minus):
                default = default.expression
            if (
                target.annotation is None
                and isinstance(default, (cst.Integer, cst.Float))
                or (isinstance(default, cst.Name) and default.value in ("True", "False"))
            ):
                # An unannotated parameter takes the type of its default, as type checkers infer it.
                return Value(Kind.SCALAR, Where.HOST, f"`{target.name.value}` defaults to a Python number")
            return self._passed(target, depth)
        if isinstance(target, (cst.FunctionDef, cst.ClassDef)):
            return _OTHER
        path: list[int] = []  # indices into tuples, innermost last
        cur = target
        parent = self._parent(cur)
        while isinstance(parent, (cst.Element, cst.Tuple, cst.List, cst.StarredElement)):
            if isinstance(parent, cst.StarredElement):
                return Value(Kind.SEQUENCE, Where.HOST, "a starred assignment")
            if isinstance(parent, (cst.Tuple, cst.List)):
                path.append(next(i for i, e in enumerate(parent.elements) if e is cur))
            cur, parent = parent, self._parent(parent)
        source: Value
        if isinstance(parent, cst.AssignTarget):
            stmt = self._parent(parent)
            if not isinstance(stmt, cst.Assign):
                return unknown("an unusual assignment")
            source = self.value(stmt.value, depth + 1)
        elif isinstance(parent, (cst.AnnAssign, cst.NamedExpr)) and parent.target is cur:
            source = self.value(parent.value, depth + 1)
        elif isinstance(parent, cst.AugAssign) and parent.target is cur:
            left = self.name(parent.target, depth + 1) if isinstance(parent.target, cst.Name) else None
            right = self.value(parent.value, depth + 1)
            source = _augmented(left, right)
        elif isinstance(parent, (cst.For, cst.CompFor)) and parent.target is cur:
            source = self._element(self.value(parent.iter, depth + 1))
            if source.kind is Kind.UNKNOWN and source.where is Where.UNKNOWN and self._loader(parent.iter):
                text = self.rule.ctx.module.code_for_node(parent.iter)
                source = unknown(f"a batch of the loader `{text}`, not moved to a device yet")
        elif isinstance(parent, cst.AsName):
            return unknown("bound by `with ... as` or an import")
        else:
            return unknown("bound in a way the analysis does not follow")
        for i in reversed(path):
            if source.items is not None and i < len(source.items):
                source = source.items[i]
            elif source.kind is Kind.SEQUENCE:
                source = source.item or unknown("an element of a list of unknown values")
            elif source.kind is Kind.TENSOR:
                source = Value(Kind.TENSOR, source.where, "unpacked from a tensor")
            else:
                return unknown(f"unpacked from {source.why or 'an unknown value'}")
        return source


def _loader_role(rule: Rule, expr: cst.BaseExpression) -> bool:
    role = program_of(rule).role_of(expr)
    return role is not None and role.kind == "loader"


def _augmented(left: Value | None, right: Value) -> Value:
    """``x += v``: a tensor stays a tensor (its placement joined with ``v``'s when ``v`` is one); a
    Python number plus a Python number is one; anything else is unknown."""
    if left is _PENDING:
        # Whatever the name held, adding a number keeps its kind, adding a tensor makes a tensor.
        if right.kind is Kind.SCALAR:
            return _PENDING
        return right if right.kind is Kind.TENSOR else unknown("an augmented assignment")
    if left is None:
        return unknown("an augmented assignment")
    if left.kind is Kind.TENSOR:
        return Value(Kind.TENSOR, join([left, right]).where if right.kind is Kind.TENSOR else left.where, left.why)
    if left.kind is right.kind is Kind.SCALAR:
        return join([left, right])
    if left.kind is Kind.SEQUENCE and right.kind is Kind.SEQUENCE:
        return join([left, right])
    if left.kind is Kind.STR and right.kind is Kind.STR:
        return _STR
    return unknown("an augmented assignment of values of different kinds")


def _children(node: cst.CSTNode) -> list[cst.CSTNode]:
    return list(children_of(node))


def placements(rule: Rule) -> Placements:
    """The value facts of the rule's file, made once per analysed text and kept in its SourceFacts."""
    facts = rule.ctx.facts
    make: Callable[[], Placements] = lambda: Placements(rule)  # noqa: E731
    found = facts.about_node(("placements",), rule.ctx.module, make)
    found.rule = rule
    return found
