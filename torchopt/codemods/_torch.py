"""Shared analysis for rules: resolving torch names, classifying device and dtype expressions
(rules.md G-1, G-7, G-8), and editing call arguments without losing formatting."""
from __future__ import annotations

import enum
import fnmatch
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import libcst as cst
from libcst.metadata import Assignment, QualifiedNameSource, ScopeProvider

from torchopt.rewrite.metadata import ParentProvider, children_of, remembered
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
    finder = _CommentFinder()
    node.visit(finder)
    return finder.found


class _CommentFinder(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.found = False

    def visit_Comment(self, _node: cst.Comment) -> bool:
        self.found = True
        return False


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
_SCOPE_TYPES = frozenset(SCOPE_NODES)  # concrete classes: an exact type test is isinstance here


def walk(node: cst.CSTNode, cross_scopes: bool = False) -> Iterable[cst.CSTNode]:
    """Every node under ``node`` (pre-order), not entering nested functions, classes or lambdas
    unless ``cross_scopes``. Cheaper than a CSTVisitor for the small subtrees rules inspect.
    Rules scan the whole module this way over and over: while the engine analyses a file, the
    module's node list is made once and shared (``metadata.remembered``)."""
    if type(node) is cst.Module:
        return iter(remembered(("walk", cross_scopes), node, lambda: list(_walk(node, cross_scopes))))
    return _walk(node, cross_scopes)


def _walk(node: cst.CSTNode, cross_scopes: bool) -> Iterator[cst.CSTNode]:
    stack = [node]
    pop, push = stack.pop, stack.append
    while stack:
        cur = pop()
        yield cur
        if cross_scopes:
            stack.extend(reversed(children_of(cur)))
            continue
        for child in reversed(children_of(cur)):
            if type(child) not in _SCOPE_TYPES:
                push(child)


# --------------------------------------------------------------------------- version guards

# Exceptions a `try:` catches when it probes for an API (`except ImportError: <old API>`).
_PROBE_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "AttributeError", "TypeError", "Exception",
                     "BaseException"}
_VERSION_TOKENS = ("hasattr(", "getattr(", "__version__", "version", "VERSION", "is_torch_")


def _catches_probe(handler: cst.ExceptHandler) -> bool:
    if handler.type is None:
        return True  # bare `except:`
    types = handler.type.elements if isinstance(handler.type, cst.Tuple) else [handler.type]
    for t in types:
        node = t.value if isinstance(t, cst.Element) else t
        name = cst.helpers.get_full_name_for_node(node) or ""
        if name.rsplit(".", 1)[-1] in _PROBE_EXCEPTIONS:
            return True
    return False


def in_version_guard(rule: Rule, node: cst.CSTNode) -> bool:
    """Whether ``node`` is code the user already wrote to cope with several PyTorch versions: inside
    a ``try:`` whose handlers catch ImportError/AttributeError (or everything), in either branch of an
    ``if``/conditional expression testing ``hasattr``/``getattr``/a version, or in such a handler.
    Rules that migrate APIs leave it alone: the old spelling there is deliberate."""
    cur: cst.CSTNode = node
    while True:
        parent = rule.get_metadata(ParentProvider, cur, None)
        if parent is None:
            return False
        if isinstance(parent, cst.Try) and cur is parent.body and any(_catches_probe(h) for h in parent.handlers):
            return True
        if isinstance(parent, cst.ExceptHandler) and _catches_probe(parent):
            return True
        if isinstance(parent, (cst.If, cst.IfExp)) and cur is not parent.test:
            test = rule.ctx.module.code_for_node(parent.test)
            if any(tok in test for tok in _VERSION_TOKENS):
                return True
        cur = parent


# --------------------------------------------------------------------------- cheap text pre-checks
# Used by ``Rule.could_match`` overrides: necessary conditions computed on the raw text (or on
# CPython's ``ast``, far cheaper than LibCST + metadata). Each must say True for every file the
# rule could report on; when in doubt (a file ``ast`` cannot parse) they say True.

import ast as _ast  # noqa: E402 - appended section (the file is append-only)

_ASCOPES = (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef, _ast.Lambda)
_STEP_LOOP_MEMO: list = [None, True]  # (text, answer): the rules of one file ask in a row


def _ast_dotted(expr: _ast.AST | None) -> str | None:
    parts = []
    while isinstance(expr, _ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, _ast.Name):
        return None
    parts.append(expr.id)
    return ".".join(reversed(parts))


def _ast_calls(stmts: list) -> Iterable[_ast.Call]:
    """Calls under ``stmts`` not inside nested functions, classes or lambdas (sync._hot.calls_in)."""
    stack = [s for s in stmts if not isinstance(s, _ASCOPES)]
    while stack:
        cur = stack.pop()
        if isinstance(cur, _ast.Call):
            yield cur
        for child in _ast.iter_child_nodes(cur):
            if not isinstance(child, _ASCOPES):
                stack.append(child)


def _step_loops_possible(index: dict[type, list]) -> bool:
    from torchopt.codemods.sync._hot import _CONVENTIONAL_MODELS, _MODULE_METHODS

    loops = _nodes(index, _ast.For, _ast.AsyncFor, _ast.While)
    if not loops:
        return False
    funcs: dict[str, list] = {}
    maybe_modules: set[str] = set()
    for n in _nodes(index, _ast.FunctionDef, _ast.AsyncFunctionDef):
        funcs.setdefault(n.name, []).append(n)
    class_aliases = {a.asname for n in _nodes(index, _ast.ImportFrom) for a in n.names
                     if a.asname and a.name.rsplit(".", 1)[-1][:1].isupper()}
    for n in _nodes(index, _ast.Assign, _ast.Call):
        if isinstance(n, _ast.Assign) and isinstance(n.value, _ast.Call):
            base = n.value
            while isinstance(base, _ast.Call) and isinstance(base.func, _ast.Attribute) \
                    and isinstance(base.func.value, _ast.Call):
                base = base.func.value
            name = _ast_dotted(base.func) if isinstance(base, _ast.Call) else None
            last = (name or "").rsplit(".", 1)[-1]
            if last[:1].isupper() or last == "compile" or last in class_aliases:
                for t in n.targets:
                    d = _ast_dotted(t)
                    if d:
                        maybe_modules.add(d)
        elif isinstance(n, _ast.Call) and isinstance(n.func, _ast.Attribute) and n.func.attr in _MODULE_METHODS:
            d = _ast_dotted(n.func.value)
            if d:
                maybe_modules.add(d)

    def direct(c: _ast.Call) -> bool:
        if isinstance(c.func, _ast.Attribute) and c.func.attr == "backward":
            return True
        d = _ast_dotted(c.func)
        return d is not None and (d in maybe_modules or d.rsplit(".", 1)[-1] in _CONVENTIONAL_MODELS or d == "self")

    if not any(direct(c) for c in index.get(_ast.Call, ())):
        return False  # nothing anywhere that a loop could reach

    def scan(body: list) -> tuple[bool, set[str]]:
        refs: set[str] = set()
        for c in _ast_calls(body):
            if isinstance(c.func, _ast.Attribute) and c.func.attr == "backward":
                return True, refs
            d = _ast_dotted(c.func)
            if d is None:
                continue
            last = d.rsplit(".", 1)[-1]
            if d in maybe_modules or last in _CONVENTIONAL_MODELS or d == "self":
                return True, refs
            if d.startswith("self.") or "." not in d:
                refs.add(last)
        return False, refs

    # A function is "hot" when its body hits directly or calls (by name) a hot function: the least
    # fixed point, without the depth limit, over every def of a name (a superset of _hot's walk).
    info = {name: [scan(fn.body) for fn in fns] for name, fns in funcs.items()}
    hot = {name for name, scans in info.items() if any(h for h, _ in scans)}
    changed = True
    while changed:
        changed = False
        for name, scans in info.items():
            if name not in hot and any(refs & hot for _, refs in scans):
                hot.add(name)
                changed = True
    for loop in loops:
        direct, refs = scan(loop.body)
        if direct or refs & hot:
            return True
    return False


def may_have_step_loops(text: str) -> bool:
    """Cheap necessary condition for ``sync._hot.HotMap.step_loops`` to be non-empty: the same
    over-approximation as ``HotMap._may_have_step_loops``, on CPython's ``ast`` (no LibCST parse).
    True when the text does not parse (the engine reports that)."""
    if _STEP_LOOP_MEMO[0] is text:
        return _STEP_LOOP_MEMO[1]
    if "for" not in text and "while" not in text:
        answer = False
    else:
        index = ast_index(text)
        answer = True if index is None else _step_loops_possible(index)
    _STEP_LOOP_MEMO[0], _STEP_LOOP_MEMO[1] = text, answer
    return answer


_AST_MEMO: list = [None, None]


def ast_index(text: str) -> dict[type, list] | None:
    """The nodes of ``ast_tree(text)`` by type (one walk, shared by the pre-checks); None when the
    text does not parse."""
    if _INDEX_MEMO[0] is text:
        return _INDEX_MEMO[1]
    tree = ast_tree(text)
    index: dict[type, list] | None = None
    if tree is not None:
        index = {}
        for n in _ast.walk(tree):
            index.setdefault(type(n), []).append(n)
    _INDEX_MEMO[0], _INDEX_MEMO[1] = text, index
    return index


_INDEX_MEMO: list = [None, None]


def _nodes(index: dict[type, list], *types: type) -> list:
    out: list = []
    for t in types:
        out += index.get(t, ())
    return out


def ast_tree(text: str) -> _ast.Module | None:
    """CPython's AST of ``text`` (None when it does not parse), kept for the last text asked about:
    the rules' ``could_match`` of one file share one parse."""
    from torchopt.rewrite import pyast

    return pyast.tree(text)


def _ast_loop_under_context(tree: _ast.AST) -> bool:
    """Some ``for``/``while`` loop sits in a ``with <call>:`` of its own function (or the module),
    directly in a decorated function, or holds a ``with <call>:`` statement in its body: what
    amp.insert.InferenceAutocast needs (a loop under ``torch.no_grad()``/``inference_mode()``)."""
    loops = (_ast.For, _ast.AsyncFor, _ast.While)
    withs = (_ast.With, _ast.AsyncWith)

    def visit(node: _ast.AST, ctx: bool) -> bool:
        for child in _ast.iter_child_nodes(node):
            c = ctx
            if isinstance(child, (_ast.FunctionDef, _ast.AsyncFunctionDef)):
                c = bool(child.decorator_list)
            elif isinstance(child, (_ast.ClassDef, _ast.Lambda)):
                c = False
            elif isinstance(child, withs) and any(isinstance(i.context_expr, _ast.Call) for i in child.items):
                c = True
            if isinstance(child, loops):
                if c or any(isinstance(s, withs) and any(isinstance(i.context_expr, _ast.Call) for i in s.items)
                            for s in child.body):
                    return True
            if visit(child, c):
                return True
        return False

    return visit(tree, False)


def loop_under_context(text: str) -> bool:
    """Cheap necessary condition (see _ast_loop_under_context); True when the text does not parse."""
    index = ast_index(text)
    if index is None:
        return True
    if not _nodes(index, _ast.For, _ast.AsyncFor, _ast.While):
        return False
    if not any(isinstance(i.context_expr, _ast.Call) for w in _nodes(index, _ast.With, _ast.AsyncWith)
               for i in w.items) and not any(f.decorator_list for f in
                                              _nodes(index, _ast.FunctionDef, _ast.AsyncFunctionDef)):
        return False  # neither a `with <call>:` nor a decorator anywhere
    return _ast_loop_under_context(ast_tree(text))  # type: ignore[arg-type]


def module_level_with(text: str) -> bool:
    """A ``with`` statement outside every function, class and lambda; True when the text does not
    parse."""
    index = ast_index(text)
    if index is None:
        return True
    if not _nodes(index, _ast.With, _ast.AsyncWith):
        return False
    stack: list = [ast_tree(text)]
    while stack:
        cur = stack.pop()
        for child in _ast.iter_child_nodes(cur):
            if isinstance(child, (_ast.With, _ast.AsyncWith)):
                return True
            if not isinstance(child, _ASCOPES):
                stack.append(child)
    return False


def _ast_model_call(nodes: Iterable[_ast.AST]) -> bool:
    """Some call under ``nodes`` looks like a model forward (inference._evalcode.EvalRule.forward_calls,
    without its exclusions): its callee, past a ``.forward``/``.generate``, ends in a model word."""
    from torchopt.codemods.inference._evalcode import model_name

    for top in nodes:
        for n in _ast.walk(top):
            if isinstance(n, _ast.Call):
                func = n.func
                if isinstance(func, _ast.Attribute) and func.attr in ("forward", "generate"):
                    func = func.value
                d = _ast_dotted(func)
                if d is not None and model_name(d.rsplit(".", 1)[-1]):
                    return True
    return False


def eval_sites_possible(text: str) -> bool:
    """Cheap necessary condition for the evaluation-code analysis of inference._evalcode: a function
    named like evaluation, or a ``for`` loop over something named like held-out data, whose body
    calls something named like a model. True when the text does not parse."""
    from torchopt.codemods.inference._evalcode import EVAL_FUNCTION, eval_loader_name

    index = ast_index(text)
    if index is None:
        return True
    for n in _nodes(index, _ast.FunctionDef, _ast.AsyncFunctionDef, _ast.For, _ast.AsyncFor):
        if isinstance(n, (_ast.FunctionDef, _ast.AsyncFunctionDef)):
            if EVAL_FUNCTION.match(n.name) and _ast_model_call(n.body):
                return True
        elif isinstance(n, (_ast.For, _ast.AsyncFor)):
            names = [x.id if isinstance(x, _ast.Name) else x.attr for x in _ast.walk(n.iter)
                     if isinstance(x, (_ast.Name, _ast.Attribute))]
            if any(eval_loader_name(x) for x in names) and _ast_model_call(n.body):
                return True
    return False


def _ast_int_looking(expr: _ast.AST | None, names: set[str] | None) -> bool:
    """pad._common._int_looking on CPython's AST (a bool literal counts too: a superset)."""
    if isinstance(expr, _ast.Constant):
        return isinstance(expr.value, int)
    if isinstance(expr, _ast.Name):
        return names is None or expr.id in names
    if isinstance(expr, _ast.UnaryOp):
        return _ast_int_looking(expr.operand, names)
    if isinstance(expr, _ast.BinOp):
        return _ast_int_looking(expr.left, names) and _ast_int_looking(expr.right, names)
    return False


def _ast_last_name(func: _ast.AST) -> str | None:
    if isinstance(func, _ast.Attribute):
        return func.attr
    if isinstance(func, _ast.Name):
        return func.id
    return None


def int_sized_layer_call(text: str, layers: Iterable[str]) -> bool:
    """Cheap necessary condition for pad.gemm.PadGemmDims: a call whose callee's last name is one of
    ``layers`` with an argument that pad._common.maybe_int could evaluate (an integer literal, a name
    assigned an integer-looking expression somewhere in the file, or arithmetic of those). True when
    the text does not parse."""
    index = ast_index(text)
    if index is None:
        return True
    layers = set(layers)
    calls = [n for n in index.get(_ast.Call, ()) if _ast_last_name(n.func) in layers]
    if not calls:
        return False
    names: set[str] = set()
    for n in _nodes(index, _ast.Assign, _ast.AnnAssign):
        if isinstance(n, _ast.Assign) and _ast_int_looking(n.value, None):
            names |= {t.id for t in n.targets if isinstance(t, _ast.Name)}
        elif isinstance(n, _ast.AnnAssign) and isinstance(n.target, _ast.Name) and n.value is not None \
                and _ast_int_looking(n.value, None):
            names.add(n.target.id)
    for c in calls:
        for a in [*c.args, *(k.value for k in c.keywords)]:
            if isinstance(a, _ast.Constant) and isinstance(a.value, int) and _ast_last_name(c.func) != "MultiheadAttention":
                # A bare literal is flagged only from 8 up and when not a multiple of the padding
                # multiple (8 or 64); MultiheadAttention's head_dim is derived, so any literal counts.
                if a.value >= 8 and a.value % 64:
                    return True
            elif _ast_int_looking(a, names):
                return True
    return False


def embedding_and_head_in_init(text: str) -> bool:
    """Cheap necessary condition for pad.vocab.PadVocabulary: a class whose ``__init__`` calls an
    ``Embedding`` and a ``Linear`` (by last name) where the embedding's first argument
    (``num_embeddings``) is spelled like the linear's second (``out_features``). True when the text
    does not parse."""
    index = ast_index(text)
    if index is None:
        return True

    def arg(call: _ast.Call, index: int, name: str) -> _ast.AST | None:
        for k in call.keywords:
            if k.arg == name:
                return k.value
        pos = [a for a in call.args if not isinstance(a, _ast.Starred)]
        return pos[index] if index < len(pos) else None

    for cls in index.get(_ast.ClassDef, ()):
        for init in cls.body:
            if not (isinstance(init, (_ast.FunctionDef, _ast.AsyncFunctionDef)) and init.name == "__init__"):
                continue
            vocab, outs = set(), set()
            for n in _ast.walk(init):
                if isinstance(n, _ast.Call):
                    last = _ast_last_name(n.func)
                    a = arg(n, 0, "num_embeddings") if last == "Embedding" else \
                        arg(n, 1, "out_features") if last == "Linear" else None
                    if a is not None:
                        (vocab if last == "Embedding" else outs).add(_ast.dump(a))
            if vocab & outs:
                return True
    return False


def method_call_in_loop(text: str, methods: Iterable[str]) -> bool:
    """A call ``<expr>.<method>(...)`` (``method`` in ``methods``) in the body of a ``for``/``while``
    loop of the same function (what ``in_loop`` finds). True when the text does not parse."""
    index = ast_index(text)
    if index is None:
        return True
    methods = set(methods)
    if not any(isinstance(c.func, _ast.Attribute) and c.func.attr in methods for c in index.get(_ast.Call, ())):
        return False
    for loop in _nodes(index, _ast.For, _ast.AsyncFor, _ast.While):
        for c in _ast_calls(loop.body):
            if isinstance(c.func, _ast.Attribute) and c.func.attr in methods:
                return True
    return False


def has_method_call(text: str, methods: Iterable[str]) -> bool:
    """Some call ``<expr>.<method>(...)`` with ``method`` in ``methods``; True when the text does not
    parse."""
    index = ast_index(text)
    if index is None:
        return True
    methods = set(methods)
    return any(isinstance(c.func, _ast.Attribute) and c.func.attr in methods for c in index.get(_ast.Call, ()))


def chained_call(text: str, methods: Iterable[str], inner: Iterable[str]) -> bool:
    """Cheap necessary condition for rules built on ``method_call``: some ``F(...).<method>(...)``
    with ``method`` in ``methods`` where F's last name is in ``inner`` or imports one of them under
    another name (``from torch import zeros as z``). True when the text does not parse."""
    index = ast_index(text)
    if index is None:
        return True
    methods, names = set(methods), set(inner)
    for imp in index.get(_ast.ImportFrom, ()):
        for alias in imp.names:
            if alias.asname and alias.name in names:
                names.add(alias.asname)
    for c in index.get(_ast.Call, ()):
        f = c.func
        if isinstance(f, _ast.Attribute) and f.attr in methods and isinstance(f.value, _ast.Call) \
                and _ast_last_name(f.value.func) in names:
            return True
    return False


def call_named(text: str, names: Iterable[str]) -> bool:
    """Some call whose callee's last name is in ``names`` (``torch.tensor(...)``, ``tensor(...)``) or
    imports one of them under another name. True when the text does not parse."""
    index = ast_index(text)
    if index is None:
        return True
    names = set(names)
    for imp in index.get(_ast.ImportFrom, ()):
        for alias in imp.names:
            if alias.asname and alias.name in names:
                names.add(alias.asname)
    return any(_ast_last_name(c.func) in names for c in index.get(_ast.Call, ()))


def dotted(expr: cst.CSTNode | None) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None (no name resolution: the text as written)."""
    parts = []
    while isinstance(expr, cst.Attribute):
        parts.append(expr.attr.value)
        expr = expr.value
    if not isinstance(expr, cst.Name):
        return None
    parts.append(expr.value)
    return ".".join(reversed(parts))


# --------------------------------------------------------------------------- torch names on CPython's ast
# A superset of what QualifiedNameProvider resolves through imports, for ``could_match`` pre-checks.

_TORCH_IMPORT_MEMO: list = [None, None]


def torch_import_map(text: str) -> dict[str, frozenset[str]] | None:
    """Names an import of torch binds anywhere in the file (any scope, any branch), each with the
    torch-qualified names it can stand for: ``import torch as T`` -> T: {torch}; ``import torch.nn``
    -> torch: {torch}; ``import torch.nn as nn`` / ``from torch import nn`` -> nn: {torch.nn};
    ``from torch.optim import SGD as S`` -> S: {torch.optim.SGD}. None when the text does not parse
    or has a ``from torch... import *`` (then any name may come from torch)."""
    if _TORCH_IMPORT_MEMO[0] is text:
        return _TORCH_IMPORT_MEMO[1]
    index = ast_index(text)
    out: dict[str, set[str]] | None = None
    if index is not None:
        out = {}
        for imp in index.get(_ast.Import, ()):
            for a in imp.names:
                if a.name.split(".")[0] != "torch":
                    continue
                if a.asname:
                    out.setdefault(a.asname, set()).add(a.name)
                else:
                    out.setdefault("torch", set()).add("torch")
        for imp in index.get(_ast.ImportFrom, ()):
            if imp.level or not imp.module or imp.module.split(".")[0] != "torch":
                continue
            for a in imp.names:
                if a.name == "*":
                    out = None
                    break
                out.setdefault(a.asname or a.name, set()).add(f"{imp.module}.{a.name}")
            if out is None:
                break
    result = None if out is None else {k: frozenset(v) for k, v in out.items()}
    _TORCH_IMPORT_MEMO[0], _TORCH_IMPORT_MEMO[1] = text, result
    return result


def ast_torch_names(imports: dict[str, frozenset[str]], expr: _ast.AST | None) -> frozenset[str]:
    """The torch-qualified names a Name/Attribute chain can stand for under ``imports`` (from
    ``torch_import_map``): ``nn.Linear`` with nn: {torch.nn} -> {torch.nn.Linear}; empty when its
    root is bound by no import of torch or it is not a plain chain."""
    parts: list[str] = []
    while isinstance(expr, _ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, _ast.Name):
        return frozenset()
    roots = imports.get(expr.id)
    if not roots:
        return frozenset()
    if not parts:
        return roots
    tail = "." + ".".join(reversed(parts))
    return frozenset(r + tail for r in roots)


_TORCH_CALLEES_MEMO: list = [None, None]


def torch_callees(text: str) -> frozenset[str] | None:
    """Every torch-qualified name a call's callee (a plain Name/Attribute chain) can stand for in the
    file, resolved through its imports (``torch_import_map``): a superset of what ``callee`` finds.
    None when it cannot be told (the text does not parse, or a star import from torch)."""
    if _TORCH_CALLEES_MEMO[0] is text:
        return _TORCH_CALLEES_MEMO[1]
    imports = torch_import_map(text)
    result: frozenset[str] | None = None
    if imports is not None:
        index = ast_index(text) or {}
        names: set[str] = set()
        if imports:
            for c in index.get(_ast.Call, ()):
                root = c.func
                while isinstance(root, _ast.Attribute):
                    root = root.value
                if isinstance(root, _ast.Name) and root.id in imports:
                    names |= ast_torch_names(imports, c.func)
        result = frozenset(names)
    _TORCH_CALLEES_MEMO[0], _TORCH_CALLEES_MEMO[1] = text, result
    return result


# --------------------------------------------------------------------------- P1 pre-check helpers


def torch_calls_to(text: str, names: Iterable[str]) -> list[_ast.Call] | None:
    """The calls whose callee (a plain Name/Attribute chain) may resolve to one of the
    torch-qualified ``names`` through the file's imports (``torch_import_map``): a superset of the
    calls ``callee`` maps there. None when it cannot be told (no parse, or a star import from torch)."""
    imports = torch_import_map(text)
    if imports is None:
        return None
    wanted = set(names)
    callees = torch_callees(text)
    if not imports or callees is None or not (callees & wanted):
        return []
    index = ast_index(text) or {}
    return [c for c in index.get(_ast.Call, ()) if ast_torch_names(imports, c.func) & wanted]


_LOOP_CALLS_MEMO: list = [None, None]


def ast_loop_calls(text: str) -> list[tuple[_ast.Call, _ast.AST]] | None:
    """(call, innermost loop) for every call in the body of a ``for``/``while`` loop of its own
    function (what ``in_loop`` finds: not crossing a function, class or lambda; a loop's ``else``,
    iterable and condition belong to the enclosing loop). None when the text does not parse."""
    if _LOOP_CALLS_MEMO[0] is text:
        return _LOOP_CALLS_MEMO[1]
    index = ast_index(text)
    out: list[tuple[_ast.Call, _ast.AST]] | None = None
    if index is not None:
        # An enclosing loop starts before the loops it holds: walking each loop's body in source
        # order and letting later (inner) loops claim their calls again leaves the innermost loop.
        loops = sorted(_nodes(index, _ast.For, _ast.AsyncFor, _ast.While), key=lambda n: (n.lineno, n.col_offset))
        found: dict[int, tuple[_ast.Call, _ast.AST]] = {}
        for loop in loops:
            stack = [s for s in loop.body if not isinstance(s, _ASCOPES)]
            while stack:
                cur = stack.pop()
                if isinstance(cur, _ast.Call):
                    found[id(cur)] = (cur, loop)
                for child in _ast.iter_child_nodes(cur):
                    if not isinstance(child, _ASCOPES):
                        stack.append(child)
        out = list(found.values())
    _LOOP_CALLS_MEMO[0], _LOOP_CALLS_MEMO[1] = text, out
    return out


def may_call_torch(text: str, names: Iterable[str]) -> bool:
    """Some call's callee may resolve to one of the torch-qualified ``names`` through the file's
    imports (``torch_callees``); True when that cannot be told."""
    callees = torch_callees(text)
    return callees is None or not callees.isdisjoint(names)


_AST_SCOPE_TYPES = (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.Lambda, _ast.ClassDef, _ast.ListComp, _ast.SetComp,
                    _ast.DictComp, _ast.GeneratorExp)
def _ast_pos(n: _ast.AST) -> tuple[int, int]:
    return (n.lineno, n.col_offset)  # type: ignore[attr-defined]


def _ast_end(n: _ast.AST) -> tuple[int, int]:
    return (n.end_lineno, n.end_col_offset)  # type: ignore[attr-defined]


def _ast_inside(node: _ast.AST, outer: _ast.AST) -> bool:
    return _ast_pos(outer) <= _ast_pos(node) and _ast_end(node) <= _ast_end(outer)


def ast_scope_chain(text: str, node: _ast.AST) -> list[_ast.AST] | None:
    """The scopes ``node`` (a Name) is looked up in, innermost first: the functions, lambdas,
    classes and comprehensions whose own part holds it (not their decorators, defaults, annotations,
    bases or first iterable, which the enclosing scope evaluates), then the module. Found by source
    spans, without walking the tree. None when the text does not parse."""
    index = ast_index(text)
    tree = ast_tree(text)
    if index is None or tree is None:
        return None
    chain: list[_ast.AST] = []
    for scope in _nodes(index, *_AST_SCOPE_TYPES):
        if not _ast_inside(node, scope):
            continue
        if isinstance(scope, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)):
            if _ast_pos(node) < _ast_pos(scope.body[0]):
                continue
        elif isinstance(scope, _ast.Lambda):
            if not _ast_inside(node, scope.body):
                continue
        elif _ast_inside(node, scope.generators[0].iter):  # type: ignore[attr-defined]
            continue
        chain.append(scope)
    chain.sort(key=lambda n: (_ast_pos(n), tuple(-x for x in _ast_end(n))), reverse=True)
    return [*chain, tree]


def ast_reaching_values(text: str, name: _ast.Name) -> list | None:
    """reaching_values on CPython's ast, a superset for pre-checks: the values bound to ``name`` in
    the nearest scope (from its own outwards, skipping class bodies for functions) that binds it:
    an expression per plain assignment (``name = v`` / ``name: T = v``), None per other binding
    (parameter, loop target, unpacking, augmented assignment, import, def...); ``global`` goes to the
    module, ``nonlocal`` outwards. None overall when no scope binds it or the text does not parse."""
    chain = ast_scope_chain(text, name)
    if chain is None:
        return None
    for k, scope in enumerate(chain):
        if k and isinstance(scope, _ast.ClassDef):
            continue
        found = _ast_scope_values(scope, name.id)
        if found == "global":
            found = _ast_scope_values(chain[-1], name.id)
            return found if isinstance(found, list) else None
        if found not in (None, "nonlocal"):
            return found
    return None


def _ast_scope_values(scope: _ast.AST, name: str):
    params: list = []
    if isinstance(scope, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.Lambda)):
        a = scope.args
        params = [p for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p is not None and p.arg == name]
        stack = list(scope.body) if isinstance(scope.body, list) else [scope.body]
    elif isinstance(scope, _ast.ClassDef):
        stack = list(scope.body)
    elif isinstance(scope, (_ast.ListComp, _ast.SetComp, _ast.GeneratorExp, _ast.DictComp)):
        stack = [g.target for g in scope.generators] + [x for g in scope.generators for x in g.ifs]
    else:
        stack = list(scope.body) if isinstance(getattr(scope, "body", None), list) else []
    out: list = [None] * len(params)
    parent_of: dict[int, _ast.AST] = {}
    nested = [x for x in stack if isinstance(x, _AST_SCOPE_TYPES)]
    stack = [x for x in stack if not isinstance(x, _AST_SCOPE_TYPES)]
    for child in nested:  # a def or class directly in the scope binds its name here
        if isinstance(child, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)):
            if child.name == name:
                out.append(None)
            stack.extend(child.decorator_list)
    while stack:
        cur = stack.pop()
        if isinstance(cur, (_ast.Global, _ast.Nonlocal)) and name in cur.names:
            return "global" if isinstance(cur, _ast.Global) else "nonlocal"
        if isinstance(cur, _ast.Name) and cur.id == name and isinstance(cur.ctx, (_ast.Store, _ast.Del)):
            if isinstance(cur.ctx, _ast.Store):
                parent = parent_of.get(id(cur))
                if isinstance(parent, _ast.Assign) and any(t is cur for t in parent.targets):
                    out.append(parent.value)
                elif isinstance(parent, _ast.AnnAssign) and parent.target is cur:
                    out.append(parent.value)
                else:
                    out.append(None)
        elif isinstance(cur, (_ast.Import, _ast.ImportFrom)):
            out += [None for al in cur.names if (al.asname or al.name.split(".")[0]) == name]
        elif isinstance(cur, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)) and cur.name == name:
            out.append(None)
        elif isinstance(cur, _ast.ExceptHandler) and cur.name == name:
            out.append(None)
        elif isinstance(cur, (_ast.MatchAs, _ast.MatchStar)) and cur.name == name:
            out.append(None)
        elif isinstance(cur, _ast.MatchMapping) and cur.rest == name:
            out.append(None)
        for child in _ast.iter_child_nodes(cur):
            if isinstance(child, _AST_SCOPE_TYPES):
                if isinstance(child, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)):
                    if child.name == name:
                        out.append(None)
                    stack.extend(child.decorator_list)
                continue
            parent_of[id(child)] = cur
            stack.append(child)
    return out or None
