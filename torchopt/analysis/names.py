"""Names and what they refer to: qualified names of torch APIs, how torch is imported, the values that reach a name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import libcst as cst
from libcst.metadata import Assignment, BaseAssignment, QualifiedNameSource, ScopeProvider

from torchopt.rewrite.metadata import remembered, ParentProvider
from torchopt.rewrite.metadata import qualified_names as _qualified_names
from torchopt.rewrite.rule import ImportSpec, Rule


def qualified_names(rule: Rule, node: cst.CSTNode) -> set[str]:
    """Qualified names of ``node`` that come from an import (never a local called ``torch``)."""
    if not isinstance(node, (cst.Name, cst.Attribute)):
        return set()
    root = _root(node)
    if root is not None and root.value not in _import_bound_names(rule.ctx.module):
        return set()  # no import binds it (`self.x`, a local): only the scope analysis could say so, at a price
    try:
        names = _qualified_names(rule, node)
    except KeyError:
        return set()
    return {q.name for q in names if q.source is QualifiedNameSource.IMPORT}


def _torch_bound_names(module: cst.Module) -> frozenset[str] | None:
    """Names any import of torch binds anywhere in the file (None after `from torch... import *`).
    Walks statements only, so it is far cheaper than scope analysis."""
    return remembered(("torch-bound-names",), module, lambda: _find_torch_bound_names(module))


def _find_torch_bound_names(module: cst.Module) -> frozenset[str] | None:
    names: set[str] = set()
    star = False
    for node in _import_statements(module):
        if isinstance(node, cst.Import):
            for a in node.names:
                full = cst.helpers.get_full_name_for_node(a.name) or ""
                if full.split(".")[0] == "torch":
                    names.add(a.evaluated_alias or "torch")
        elif isinstance(node, cst.ImportFrom):
            mod = cst.helpers.get_full_name_for_node(node.module) if node.module else ""
            if mod and mod.split(".")[0] == "torch":
                if isinstance(node.names, cst.ImportStar):
                    star = True
                else:
                    for a in node.names:
                        names.add(a.evaluated_alias or a.evaluated_name)
    result = None if star else frozenset(names)
    return result


def _import_bound_names(module: cst.Module) -> frozenset[str]:
    """Every name an import statement binds anywhere in the file (a star import binds none that
    name resolution knows of). A chain whose root is not among them has no name from an import."""
    return remembered(("import-bound-names",), module, lambda: _find_import_bound_names(module))


def _find_import_bound_names(module: cst.Module) -> frozenset[str]:
    names: set[str] = set()
    for node in _import_statements(module):
        if isinstance(node, cst.Import):
            for a in node.names:
                bound: cst.BaseExpression = a.asname.name if a.asname else a.name
                while isinstance(bound, cst.Attribute):
                    bound = bound.value
                if isinstance(bound, cst.Name):
                    names.add(bound.value)
        elif isinstance(node, cst.ImportFrom):
            if not isinstance(node.names, cst.ImportStar):
                for a in node.names:
                    bound = a.asname.name if a.asname else a.name
                    if isinstance(bound, cst.Name):
                        names.add(bound.value)
    return frozenset(names)


# Fields of compound statements and their clauses that hold statements, blocks or clauses.
_STATEMENT_FIELDS = ("body", "orelse", "handlers", "finalbody", "cases")


def _import_statements(module: cst.Module) -> tuple[cst.Import | cst.ImportFrom, ...]:
    """Every ``import`` / ``from ... import`` of the file, at any depth, found by visiting
    statements only (never expressions)."""
    found: list[cst.Import | cst.ImportFrom] = []
    stack: list[object] = list(module.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
            found.extend(s for s in node.body if isinstance(s, (cst.Import, cst.ImportFrom)))
            continue
        for name in _STATEMENT_FIELDS:
            part = getattr(node, name, None)
            if isinstance(part, (list, tuple)):
                stack.extend(part)
            elif part is not None:
                stack.append(part)
    return tuple(found)


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
    """The torch name a call resolves to; ``f(a)(b)`` and method calls on results have none: LibCST would
    name ``torch.rand(3).cuda()`` ``torch.rand.cuda``, which is no torch function."""
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


@dataclass(frozen=True)
class TorchRef:
    """How generated code names the torch module, and the import that makes it true."""

    name: str
    imports: tuple[ImportSpec, ...] = ()

    def attr(self, dotted: str) -> cst.BaseExpression:
        return cst.parse_expression(f"{self.name}.{dotted}")


def torch_ref(rule: Rule) -> TorchRef | None:
    """Reuse the file's ``import torch [as T]``; else schedule ``import torch`` if that name is free."""
    module = rule.ctx.module
    return remembered(("torch-alias",), module, lambda: _find_torch_ref(rule, module))


def _find_torch_ref(rule: Rule, module: cst.Module) -> TorchRef | None:
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
                        asname = alias.evaluated_alias or "torch"
                        if ref is None:
                            ref = TorchRef(asname)
                    if alias.asname is None and dotted and dotted.split(".")[0] == "torch":
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
            assigned = [a for a in scope["torch"] if not is_import_of_torch(a)]
            # Only imports of torch bind it (e.g. under `if is_torch_available():`): reuse them, and
            # add no top-level import that the guard was there to avoid.
            ref = None if assigned else TorchRef("torch")
        elif bound_torch:
            ref = TorchRef("torch")  # `import torch.nn` binds `torch` too
        else:
            ref = TorchRef("torch", (ImportSpec("torch"),))
    return ref


def is_import_of_torch(assignment: object) -> bool:
    node = getattr(assignment, "node", None)
    if isinstance(node, cst.Import):
        return any((cst.helpers.get_full_name_for_node(a.name) or "").split(".")[0] == "torch" for a in node.names)
    return False


def plainly_assigned(rule: Rule, name: cst.Name) -> bool:
    """Whether some ``name = ...`` or ``name: T = ...`` anywhere in the file binds this spelling: when
    none does, ``reaching_values`` can only give definitions we cannot see through, and callers that
    treat those as unknown can skip the scope analysis of the whole file."""
    module = rule.ctx.module
    return name.value in remembered(("assigned-names",), module, lambda: _find_assigned_names(module))


def _find_assigned_names(module: cst.Module) -> frozenset[str]:
    names: set[str] = set()
    stack: list[object] = list(module.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
            for small in node.body:
                if isinstance(small, cst.Assign):
                    names.update(t.target.value for t in small.targets if isinstance(t.target, cst.Name))
                elif isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                    names.add(small.target.value)
            continue
        for field_name in _STATEMENT_FIELDS:
            part = getattr(node, field_name, None)
            if isinstance(part, (list, tuple)):
                stack.extend(part)
            elif part is not None:
                stack.append(part)
    return frozenset(names)


def bindings_of(rule: Rule, name: cst.Name) -> list[BaseAssignment] | None:
    """The bindings of ``name`` in the scope it is read in (scope analysis); None when the name has
    no scope or no binding there (a builtin, a global of another file, a node outside the module)."""
    try:
        scope = rule.get_metadata(ScopeProvider, name)
    except KeyError:
        return None
    if scope is None or name.value not in scope:
        return None
    return list(scope[name.value])


def reaching_values(rule: Rule, name: cst.Name) -> list[cst.BaseExpression | None] | None:
    """Values assigned to ``name`` in its scope: an expression per plain assignment, None for a
    definition we cannot see through (parameter, loop target, augmented assignment, import...).
    None overall when the name has no definition in the file."""
    bindings = bindings_of(rule, name)
    if bindings is None:
        return None
    out: list[cst.BaseExpression | None] = []
    for a in bindings:
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
    bindings = bindings_of(rule, name)
    if bindings is None:
        return None
    anns = set()
    for a in bindings:
        node = getattr(a, "node", None)
        if not isinstance(node, cst.Param):
            return None
        if node.annotation is None:
            return None
        anns.add(cst.helpers.get_full_name_for_node(node.annotation.annotation))
    return anns.pop() if len(anns) == 1 else None


# torch functions that do not return a tensor (for "is this name a tensor?").
NOT_TENSOR = {
    "device",
    "Size",
    "finfo",
    "iinfo",
    "dtype",
    "Generator",
    "get_default_dtype",
    "is_tensor",
    "is_storage",
    "is_floating_point",
    "is_complex",
    "numel",
    "typename",
    "is_grad_enabled",
    "get_num_threads",
    "manual_seed",
    "initial_seed",
    "seed",
    "no_grad",
    "enable_grad",
    "inference_mode",
    "autocast",
    "compile",
    "load",
    "save",
    "set_grad_enabled",
    "get_device",
    "is_nonzero",
    "equal",
    "allclose",
    "is_same_size",
    "broadcast_shapes",
    "use_deterministic_algorithms",
}


TENSOR_NAMESPACES = ("torch.", "torch.nn.functional.", "torch.linalg.", "torch.fft.", "torch.special.")


def is_tensor_name(rule: Rule, name: cst.Name) -> bool:
    """Whether ``name`` surely holds a tensor: a parameter annotated ``Tensor``, or bound only to
    results of torch functions that return tensors (through method chains such as ``.float()``)."""
    if param_annotation(rule, name) in ("torch.Tensor", "Tensor"):
        return True
    values = reaching_values(rule, name) if plainly_assigned(rule, name) else None
    if not values:
        return False
    for v in values:
        base = v
        while (
            isinstance(base, cst.Call)
            and isinstance(base.func, cst.Attribute)
            and isinstance(base.func.value, cst.Call)
        ):
            base = base.func.value  # `torch.zeros(3).float()` -> `torch.zeros(3)`
        if not isinstance(base, cst.Call):
            return False
        q = callee(rule, base)
        if q is None or not any(q.startswith(ns) and "." not in q[len(ns) :] for ns in TENSOR_NAMESPACES):
            return False
        if q.rsplit(".", 1)[1] in NOT_TENSOR:
            return False
    return True


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
