"""Values a rule reasons about: dtypes, devices and literals, followed through assignments where that is sound."""

from __future__ import annotations

import enum
import fnmatch
import re
from dataclasses import dataclass
from typing import Sequence

import libcst as cst

from torchopt.analysis.names import callee, plainly_assigned, reaching_values, torch_name
from torchopt.rewrite.rule import Rule

DTYPES = {
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float": "float32",
    "float64": "float64",
    "double": "float64",
    "int8": "int8",
    "int16": "int16",
    "short": "int16",
    "int32": "int32",
    "int": "int32",
    "int64": "int64",
    "long": "int64",
    "uint8": "uint8",
    "bool": "bool",
    "complex64": "complex64",
    "cfloat": "complex64",
    "complex128": "complex128",
    "cdouble": "complex128",
}


FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}


INT_DTYPES = {"int8", "int16", "int32", "int64", "uint8"}

# Tensor cast methods and the dtype spelled in the fix (`.half()` becomes `dtype=torch.half`).
CAST_METHODS = {
    "half": ("float16", "half"),
    "float": ("float32", "float32"),
    "double": ("float64", "float64"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "long": ("int64", "long"),
    "int": ("int32", "int32"),
    "short": ("int16", "int16"),
    "char": ("int8", "int8"),
    "byte": ("uint8", "uint8"),
    "bool": ("bool", "bool"),
}


def dtype_of(rule: Rule, expr: cst.BaseExpression | None, depth: int = 0) -> str | None:
    """Canonical dtype name of ``torch.float16`` / ``T.half`` / a name bound only to one; else None."""
    if expr is None:
        return None
    name = torch_name(rule, expr)
    if name and name.startswith("torch."):
        return DTYPES.get(name[len("torch.") :])
    if isinstance(expr, cst.Name) and depth < 3 and plainly_assigned(rule, expr):
        values = reaching_values(rule, expr)
        if values:
            kinds = {dtype_of(rule, v, depth + 1) if v is not None else None for v in values}
            if len(kinds) == 1:
                return kinds.pop()
    return None


_DEVICE_STR = re.compile(r"^(cuda|cpu|mps|xpu|meta|hpu|npu|xla|privateuseone)(:\d+)?$")


class DeviceKind(enum.Enum):
    LITERAL = "literal"  # 'cuda', 'cuda:1', torch.device(...), an int
    KNOWN = "known"  # a name every definition of which is a device
    CONVENTION = "convention"  # a name the device-names convention says is a device (the message says "assuming")
    DTYPE = "dtype"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Device:
    kind: DeviceKind
    text: str = ""  # the literal string value, when there is one

    @property
    def is_device(self) -> bool:
        return self.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN, DeviceKind.CONVENTION)

    @property
    def is_cpu(self) -> bool:
        return self.text.split(":")[0] == "cpu"


def string_value(expr: cst.BaseExpression | None) -> str | None:
    if isinstance(expr, (cst.SimpleString, cst.ConcatenatedString)):
        val = expr.evaluated_value
        return val if isinstance(val, str) else None
    return None


def int_value(expr: cst.BaseExpression | None) -> int | None:
    if isinstance(expr, cst.Integer):
        return int(expr.evaluated_value)
    return None


def matches_device_name(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def classify_device(rule: Rule, expr: cst.BaseExpression | None, depth: int = 0) -> Device:
    if expr is None:
        return Device(DeviceKind.UNKNOWN)
    s = string_value(expr)
    if s is not None:
        return Device(DeviceKind.LITERAL, s) if _DEVICE_STR.match(s) else Device(DeviceKind.UNKNOWN)
    if isinstance(expr, cst.Integer):
        return Device(DeviceKind.LITERAL, str(int(expr.evaluated_value)))
    if isinstance(expr, cst.Call) and callee(rule, expr) == "torch.device":
        first = expr.args[0].value if expr.args else None
        text = string_value(first) or ""
        return Device(DeviceKind.LITERAL, text)
    if dtype_of(rule, expr) is not None:
        return Device(DeviceKind.DTYPE)
    if isinstance(expr, cst.IfExp):
        a, b = classify_device(rule, expr.body, depth + 1), classify_device(rule, expr.orelse, depth + 1)
        if a.is_device and b.is_device:
            kind = DeviceKind.LITERAL if a.kind == b.kind == DeviceKind.LITERAL else DeviceKind.KNOWN
            return Device(kind, a.text if a.text == b.text else "")
        return Device(DeviceKind.UNKNOWN)
    if isinstance(expr, cst.Attribute):
        if expr.attr.value == "device" or matches_device_name(expr.attr.value, rule.ctx.device_names):
            return Device(DeviceKind.CONVENTION)
        return Device(DeviceKind.UNKNOWN)
    if isinstance(expr, cst.Name):
        values = reaching_values(rule, expr) if depth < 4 and plainly_assigned(rule, expr) else None
        conventional = matches_device_name(expr.value, rule.ctx.device_names)
        if values:
            kinds = [classify_device(rule, v, depth + 1) if v is not None else None for v in values]
            if all(k is not None and k.is_device for k in kinds):
                texts = {k.text for k in kinds if k is not None}
                return Device(DeviceKind.KNOWN, texts.pop() if len(texts) == 1 else "")
            if any(k is not None and not k.is_device for k in kinds):
                # Some definition proves it is not a device (a dtype, a tensor, anything else).
                if any(k is not None and k.kind is DeviceKind.DTYPE for k in kinds):
                    return Device(DeviceKind.DTYPE)
                if not conventional or any(
                    k is not None and k.kind is DeviceKind.UNKNOWN and _proves_not_device(v)
                    for k, v in zip(kinds, values)
                ):
                    return Device(DeviceKind.UNKNOWN)
        return Device(DeviceKind.CONVENTION) if conventional else Device(DeviceKind.UNKNOWN)
    return Device(DeviceKind.UNKNOWN)


def _proves_not_device(value: cst.BaseExpression | None) -> bool:
    """A definition that cannot be a device: a call result we cannot see into counts as unknown
    (it may return a device), but literals of other kinds and tensor-making calls do not."""
    if value is None:
        return False
    if isinstance(value, (cst.Integer, cst.Float, cst.List, cst.Tuple, cst.Dict, cst.Set)):
        return True
    s = string_value(value)
    return s is not None and not _DEVICE_STR.match(s)
