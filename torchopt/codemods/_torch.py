"""Shared analysis for rules: resolving torch names, classifying device and dtype expressions
(rules.md G-1, G-7, G-8), and editing call arguments without losing formatting."""
from __future__ import annotations

import enum
import fnmatch
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import libcst as cst
from libcst.metadata import Assignment, QualifiedNameSource, ScopeProvider

from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.metadata import qualified_names as _qualified_names
from torchopt.rewrite.rule import ImportSpec, Rule

# --------------------------------------------------------------------------- names (G-1, G-2)


def qualified_names(rule: Rule, node: cst.CSTNode) -> set[str]:
    """Qualified names of ``node`` that come from an import (never a local called ``torch``)."""
    if not isinstance(node, (cst.Name, cst.Attribute)):
        return set()
    try:
        names = _qualified_names(rule, node)
    except KeyError:
        return set()
    return {q.name for q in names if q.source is QualifiedNameSource.IMPORT}


_BOUND_CACHE: dict[int, tuple[cst.Module, frozenset[str] | None]] = {}
_COMPOUND = (cst.If, cst.Else, cst.Try, cst.TryStar, cst.ExceptHandler, cst.ExceptStarHandler, cst.Finally,
             cst.FunctionDef, cst.ClassDef, cst.With, cst.For, cst.While, cst.IndentedBlock,
             cst.SimpleStatementSuite, cst.SimpleStatementLine, cst.Module)


def _torch_bound_names(module: cst.Module) -> frozenset[str] | None:
    """Names any import of torch binds anywhere in the file (None after `from torch... import *`).
    Walks statements only, so it is far cheaper than scope analysis."""
    hit = _BOUND_CACHE.get(id(module))
    if hit is not None and hit[0] is module:
        return hit[1]
    names: set[str] = set()
    star = False
    stack: list[cst.CSTNode] = [module]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Import):
            for a in node.names:
                full = cst.helpers.get_full_name_for_node(a.name) or ""
                if full.split(".")[0] == "torch":
                    names.add(a.asname.name.value if a.asname else "torch")  # type: ignore[union-attr]
        elif isinstance(node, cst.ImportFrom):
            mod = cst.helpers.get_full_name_for_node(node.module) if node.module else ""
            if mod and mod.split(".")[0] == "torch":
                if isinstance(node.names, cst.ImportStar):
                    star = True
                else:
                    for a in node.names:
                        names.add(a.asname.name.value if a.asname else a.name.value)  # type: ignore[union-attr]
        elif isinstance(node, _COMPOUND):
            stack.extend(node.children)
    result = None if star else frozenset(names)
    if len(_BOUND_CACHE) > 64:
        _BOUND_CACHE.clear()
    _BOUND_CACHE[id(module)] = (module, result)
    return result


def _root(node: cst.CSTNode) -> cst.Name | None:
    while isinstance(node, cst.Attribute):
        node = node.value
    return node if isinstance(node, cst.Name) else None


def torch_name(rule: Rule, node: cst.CSTNode) -> str | None:
    """``torch.zeros`` for ``torch.zeros``, ``T.zeros`` or an imported ``zeros``; else None."""
    bound = _torch_bound_names(rule.ctx.module)
    root = _root(node)
    if bound is not None and (root is None or root.value not in bound):
        return None  # cannot come from torch: skip the (costly) name resolution
    for name in qualified_names(rule, node):
        if name == "torch" or name.startswith("torch."):
            return name
    return None


def callee(rule: Rule, call: cst.Call) -> str | None:
    """The torch name a call resolves to; ``f(a)(b)`` and method calls on results have none (G-2)."""
    if isinstance(call.func, cst.Call):
        return None
    if isinstance(call.func, cst.Attribute) and not _is_dotted(call.func):
        return None
    return torch_name(rule, call.func)


def _is_dotted(node: cst.BaseExpression) -> bool:
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)


def method_call(node: cst.CSTNode, names: Iterable[str] | None = None) -> tuple[cst.Call, str] | None:
    """``X.meth(...)`` where X is a call: returns (inner call, method name)."""
    if not isinstance(node, cst.Call) or not isinstance(node.func, cst.Attribute):
        return None
    if not isinstance(node.func.value, cst.Call):
        return None
    meth = node.func.attr.value
    if names is not None and meth not in names:
        return None
    return node.func.value, meth


# --------------------------------------------------------------------------- the module's torch alias (G-6)


@dataclass(frozen=True)
class TorchRef:
    """How generated code names the torch module, and the import that makes it true."""

    name: str
    imports: tuple[ImportSpec, ...] = ()

    def attr(self, dotted: str) -> cst.BaseExpression:
        return cst.parse_expression(f"{self.name}.{dotted}")


_ALIAS_CACHE: dict[int, tuple[cst.Module, TorchRef | None]] = {}


def torch_ref(rule: Rule) -> TorchRef | None:
    """Reuse the file's ``import torch [as T]``; else schedule ``import torch`` if that name is free."""
    module = rule.ctx.module
    hit = _ALIAS_CACHE.get(id(module))
    if hit is not None and hit[0] is module:
        return hit[1]
    ref: TorchRef | None = None
    bound_torch = False
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Import):
                for alias in small.names:
                    dotted = cst.helpers.get_full_name_for_node(alias.name)
                    if dotted == "torch":
                        asname = alias.asname.name.value if alias.asname else "torch"  # type: ignore[union-attr]
                        if ref is None:
                            ref = TorchRef(asname)
                    if (alias.asname is None and dotted and dotted.split(".")[0] == "torch"):
                        bound_torch = True
    if ref is None:
        scope = None
        for stmt in module.body:
            try:
                scope = rule.get_metadata(ScopeProvider, stmt)
                break
            except KeyError:
                continue
        if scope is not None and "torch" in scope and not bound_torch:
            # `torch` is bound to something that is not the torch module: never shadow it.
            assigned = [a for a in scope["torch"] if not _is_import_of_torch(a)]
            # Only imports of torch bind it (e.g. under `if is_torch_available():`): reuse them, and
            # add no top-level import that the guard was there to avoid.
            ref = None if assigned else TorchRef("torch")
        elif bound_torch:
            ref = TorchRef("torch")  # `import torch.nn` binds `torch` too
        else:
            ref = TorchRef("torch", (ImportSpec("torch"),))
    if len(_ALIAS_CACHE) > 64:
        _ALIAS_CACHE.clear()
    _ALIAS_CACHE[id(module)] = (module, ref)
    return ref


def _is_import_of_torch(assignment: object) -> bool:
    node = getattr(assignment, "node", None)
    if isinstance(node, cst.Import):
        return any((cst.helpers.get_full_name_for_node(a.name) or "").split(".")[0] == "torch" for a in node.names)
    return False


# --------------------------------------------------------------------------- reaching definitions


def reaching_values(rule: Rule, name: cst.Name) -> list[cst.BaseExpression | None] | None:
    """Values assigned to ``name`` in its scope: an expression per plain assignment, None for a
    definition we cannot see through (parameter, loop target, augmented assignment, import...).
    None overall when the name has no definition in the file."""
    try:
        scope = rule.get_metadata(ScopeProvider, name)
    except KeyError:
        return None
    if scope is None or name.value not in scope:
        return None
    out: list[cst.BaseExpression | None] = []
    for a in scope[name.value]:
        if not isinstance(a, Assignment):
            out.append(None)
            continue
        node = a.node
        parent = rule.get_metadata(ParentProvider, node, None)
        if isinstance(parent, cst.AssignTarget) and parent.target is node:
            stmt = rule.get_metadata(ParentProvider, parent, None)
            out.append(stmt.value if isinstance(stmt, cst.Assign) else None)
        elif isinstance(parent, cst.AnnAssign) and parent.target is node:
            out.append(parent.value)
        elif isinstance(node, cst.Param):
            out.append(None)
        else:
            out.append(None)
    return out


def param_annotation(rule: Rule, name: cst.Name) -> str | None:
    """The annotation of the function parameter ``name`` refers to, if it is one."""
    try:
        scope = rule.get_metadata(ScopeProvider, name)
    except KeyError:
        return None
    if scope is None or name.value not in scope:
        return None
    anns = set()
    for a in scope[name.value]:
        node = getattr(a, "node", None)
        if not isinstance(node, cst.Param):
            return None
        if node.annotation is None:
            return None
        anns.add(cst.helpers.get_full_name_for_node(node.annotation.annotation))
    return anns.pop() if len(anns) == 1 else None


# --------------------------------------------------------------------------- dtypes (G-8)

DTYPES = {
    "float16": "float16", "half": "float16", "bfloat16": "bfloat16",
    "float32": "float32", "float": "float32", "float64": "float64", "double": "float64",
    "int8": "int8", "int16": "int16", "short": "int16", "int32": "int32", "int": "int32",
    "int64": "int64", "long": "int64", "uint8": "uint8", "bool": "bool",
    "complex64": "complex64", "cfloat": "complex64", "complex128": "complex128", "cdouble": "complex128",
}
FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}
INT_DTYPES = {"int8", "int16", "int32", "int64", "uint8"}

# Tensor cast methods and the dtype spelled in the fix (rules.md DEV-002 table).
CAST_METHODS = {
    "half": ("float16", "half"), "float": ("float32", "float32"), "double": ("float64", "float64"),
    "bfloat16": ("bfloat16", "bfloat16"), "long": ("int64", "long"), "int": ("int32", "int32"),
    "short": ("int16", "int16"), "char": ("int8", "int8"), "byte": ("uint8", "uint8"),
    "bool": ("bool", "bool"),
}


def dtype_of(rule: Rule, expr: cst.BaseExpression | None, depth: int = 0) -> str | None:
    """Canonical dtype name of ``torch.float16`` / ``T.half`` / a name bound only to one; else None."""
    if expr is None:
        return None
    name = torch_name(rule, expr)
    if name and name.startswith("torch."):
        return DTYPES.get(name[len("torch."):])
    if isinstance(expr, cst.Name) and depth < 3:
        values = reaching_values(rule, expr)
        if values:
            kinds = {dtype_of(rule, v, depth + 1) if v is not None else None for v in values}
            if len(kinds) == 1:
                return kinds.pop()
    return None


# --------------------------------------------------------------------------- devices (G-7)

_DEVICE_STR = re.compile(r"^(cuda|cpu|mps|xpu|meta|hpu|npu|xla|privateuseone)(:\d+)?$")


class DeviceKind(enum.Enum):
    LITERAL = "literal"  # 'cuda', 'cuda:1', torch.device(...), an int
    KNOWN = "known"  # a name every definition of which is a device
    CONVENTION = "convention"  # a name the device-names convention says is a device (G-7)
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
        values = reaching_values(rule, expr) if depth < 4 else None
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


# --------------------------------------------------------------------------- arguments


def has_star(call: cst.Call) -> bool:
    return any(a.star for a in call.args)


def positional(call: cst.Call) -> list[cst.Arg]:
    return [a for a in call.args if a.keyword is None and not a.star]


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a
    return None


def keywords(call: cst.Call) -> dict[str, cst.Arg]:
    return {a.keyword.value: a for a in call.args if a.keyword is not None}


def make_kwarg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(
        value=value,
        keyword=cst.Name(name),
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )


def _sep(args: Sequence[cst.Arg]) -> cst.Comma:
    """The separator to put between arguments, copied from the call's own style where it has one."""
    for a in args:
        if isinstance(a.comma, cst.Comma) and a is not args[-1]:
            return a.comma
    return cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


def set_kwarg(call: cst.Call, name: str, value: cst.BaseExpression, before: Sequence[str] = ()) -> cst.Call:
    """Replace ``name=`` in place if present; else insert it before the first of ``before`` that is
    present, else append it (keeping a trailing comma and multi-line layout)."""
    args = list(call.args)
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value == name:
            args[i] = a.with_changes(value=value)
            return call.with_changes(args=args)
    new = make_kwarg(name, value)
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value in before:
            args.insert(i, new.with_changes(comma=_sep(args) if len(args) > 1 else cst.Comma(
                whitespace_after=cst.SimpleWhitespace(" "))))
            return call.with_changes(args=args)
    if not args:
        return call.with_changes(args=[new])
    last = args[-1]
    if isinstance(last.comma, cst.Comma):  # trailing comma: the new argument takes it over
        if len(args) > 1 and isinstance(args[-2].comma, cst.Comma):
            sep = args[-2].comma
        elif isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace):
            # one argument per line, `f(\n    a,\n)`: the new one goes on its own line too
            sep = cst.Comma(whitespace_after=call.whitespace_before_args)
        else:
            sep = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        args[-1] = last.with_changes(comma=sep)
        args.append(new.with_changes(comma=last.comma))
    else:
        args[-1] = last.with_changes(comma=_sep(args))
        args.append(new)
    return call.with_changes(args=args)


def drop_kwarg(call: cst.Call, name: str) -> cst.Call:
    args = list(call.args)
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value == name:
            del args[i]
            if i == len(args) and args:  # removed the last one: keep its trailing-comma state
                args[-1] = args[-1].with_changes(comma=a.comma)
            return call.with_changes(args=args)
    return call


def has_comments(node: cst.CSTNode | None) -> bool:
    """Whether ``node`` holds a comment (a fix that would drop it is not offered)."""
    if node is None:
        return False
    found = False

    class _V(cst.CSTVisitor):
        def visit_Comment(self, _node: cst.Comment) -> bool:
            nonlocal found
            found = True
            return False

    node.visit(_V())
    return found


def source(rule: Rule, node: cst.CSTNode) -> str:
    """The code of ``node``, one line, for messages."""
    code = rule.ctx.module.code_for_node(node)
    code = " ".join(code.split())
    return code if len(code) <= 60 else code[:57] + "..."


def in_loop(rule: Rule, node: cst.CSTNode) -> cst.For | cst.While | None:
    """The innermost loop whose body holds ``node`` (not crossing a function or class)."""
    cur: cst.CSTNode | None = node
    while cur is not None:
        parent = rule.get_metadata(ParentProvider, cur, None)
        if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        if isinstance(parent, (cst.For, cst.While)) and cur is parent.body:
            return parent
        cur = parent
    return None


# --------------------------------------------------------------------------- tensors

# torch functions that do not return a tensor (for "is this name a tensor?").
_NOT_TENSOR = {
    "device", "Size", "finfo", "iinfo", "dtype", "Generator", "get_default_dtype", "is_tensor",
    "is_storage", "is_floating_point", "is_complex", "numel", "typename", "is_grad_enabled",
    "get_num_threads", "manual_seed", "initial_seed", "seed", "no_grad", "enable_grad",
    "inference_mode", "autocast", "compile", "load", "save", "set_grad_enabled", "get_device",
    "is_nonzero", "equal", "allclose", "is_same_size", "broadcast_shapes", "use_deterministic_algorithms",
}
_TENSOR_NAMESPACES = ("torch.", "torch.nn.functional.", "torch.linalg.", "torch.fft.", "torch.special.")


def is_tensor_name(rule: Rule, name: cst.Name) -> bool:
    """Whether ``name`` surely holds a tensor: a parameter annotated ``Tensor``, or bound only to
    results of torch functions that return tensors (through method chains such as ``.float()``)."""
    if param_annotation(rule, name) in ("torch.Tensor", "Tensor"):
        return True
    values = reaching_values(rule, name)
    if not values:
        return False
    for v in values:
        base = v
        while isinstance(base, cst.Call) and isinstance(base.func, cst.Attribute) \
                and isinstance(base.func.value, cst.Call):
            base = base.func.value  # `torch.zeros(3).float()` -> `torch.zeros(3)`
        if not isinstance(base, cst.Call):
            return False
        q = callee(rule, base)
        if q is None or not any(q.startswith(ns) and "." not in q[len(ns):] for ns in _TENSOR_NAMESPACES):
            return False
        if q.rsplit(".", 1)[1] in _NOT_TENSOR:
            return False
    return True


# --------------------------------------------------------------------------- walking

SCOPE_NODES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


def walk(node: cst.CSTNode, cross_scopes: bool = False) -> Iterable[cst.CSTNode]:
    """Every node under ``node`` (pre-order), not entering nested functions, classes or lambdas
    unless ``cross_scopes``. Cheaper than a CSTVisitor for the small subtrees rules inspect."""
    stack = [node]
    while stack:
        cur = stack.pop()
        yield cur
        for child in reversed(cur.children):
            if not cross_scopes and isinstance(child, SCOPE_NODES):
                continue
            stack.append(child)
