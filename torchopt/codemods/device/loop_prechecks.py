"""Host→device copies in loops.

TOP104: a DataLoader whose batches are copied to the device: pin its batches and copy them
asynchronously. TOP105: diagnostics for device placement inside loops and legacy idioms."""

from __future__ import annotations

import ast as _ast
import re
from dataclasses import dataclass, field

import libcst as cst


from torchopt.analysis.precheck.scopes import ast_loop_calls, ast_scope_chain
from torchopt.analysis.precheck.torch_imports import ast_torch_names, torch_calls_to, torch_import_map
from torchopt.analysis.precheck.tree import ast_index
from torchopt.analysis.names import NOT_TENSOR, TENSOR_NAMESPACES
from torchopt.analysis.values import DTYPES


# --------------------------------------------------------------------------- small analysis helpers


# --------------------------------------------------------------------------- TOP104


@dataclass
class _LoaderUse:
    call: cst.Call
    kinds: set[str] = field(default_factory=set)


# --------------------------------------------------------------------------- TOP105


def _could_match(text: str) -> bool:
    """DevicePlacementHint's cheap necessary condition (True when the text does not parse)."""
    index = ast_index(text)
    imports = torch_import_map(text)
    if index is None or imports is None:
        return True
    calls = index.get(_ast.Call, ())
    # (iii) `.type(<one positional argument>)` naming a torch.cuda legacy type.
    for c in calls:
        if (
            isinstance(c.func, _ast.Attribute)
            and c.func.attr == "type"
            and len(c.args) == 1
            and not c.keywords
            and not isinstance(c.args[0], _ast.Starred)
        ):
            arg = c.args[0]
            if isinstance(arg, _ast.Constant):
                v = arg.value
                if isinstance(v, str) and v.startswith("torch.cuda.") and v[len("torch.cuda.") :] in _LEGACY_TYPES:
                    return True
            elif any(
                q.startswith("torch.cuda.") and q[len("torch.cuda.") :] in _LEGACY_TYPES
                for q in ast_torch_names(imports, arg)
            ):
                return True
    loop_calls = ast_loop_calls(text) or []
    in_loop_ids = {id(c) for c, _ in loop_calls}
    # (ii)/(iv) torch.tensor(<data>, ...).
    tensors = torch_calls_to(text, ("torch.tensor",)) or []
    if tensors:
        moved = {
            id(c.func.value)
            for c in calls
            if isinstance(c.func, _ast.Attribute)
            and c.func.attr in ("cuda", "to")
            and isinstance(c.func.value, _ast.Call)
            and not _ast_star(c)
            and _ast_maybe_move(imports, c)
        }
        for c in tensors:
            if not c.args or _ast_star(c):
                continue
            data = c.args[0]
            if isinstance(data, _ast.Name) and _ast_maybe_tensor_name(index, imports, data.id):
                chain = ast_scope_chain(text, data)
                if _ast_tensor_bindings(chain[0] if chain else None, imports, data.id):
                    return True  # (iv) copy-construction
            host = isinstance(data, (_ast.Name, _ast.ListComp)) or (
                isinstance(data, (_ast.List, _ast.Tuple)) and bool(data.elts)
            )  # _host_data
            dev = next((k.value for k in c.keywords if k.arg == "device"), None)
            if (
                host
                and id(c) in in_loop_ids
                and (id(c) in moved or (dev is not None and _ast_maybe_device(imports, dev)))
            ):
                return True  # (ii) built in a loop, on or moved to the device
    # (i) `<name>.cuda()` / `.to(<device>)` in a loop that neither rebinds nor mutates <name>.
    changed: dict[int, set[str]] = {}
    for c, loop in loop_calls:
        f = c.func
        if not (isinstance(f, _ast.Attribute) and f.attr in ("cuda", "to") and isinstance(f.value, _ast.Name)):
            continue
        if _ast_star(c) or not _ast_maybe_move(imports, c):
            continue
        if id(loop) not in changed:
            changed[id(loop)] = _ast_bound_in(loop) | _ast_mutated_names(loop)
        if f.value.id not in changed[id(loop)]:
            return True
    return False


def _ast_star(call: _ast.Call) -> bool:
    return any(isinstance(a, _ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)


_SCOPE_TYPES = (
    _ast.FunctionDef,
    _ast.AsyncFunctionDef,
    _ast.Lambda,
    _ast.ClassDef,
    _ast.ListComp,
    _ast.SetComp,
    _ast.DictComp,
    _ast.GeneratorExp,
)


def _ast_tensor_bindings(scope, imports: dict, name: str) -> bool:
    """is_tensor_name may hold for ``name`` read in ``scope``: mirrors reaching_values (every binding
    of the scope a plain assignment of a torch tensor call) and param_annotation. True when the
    scope does not bind ``name`` itself (it is looked up outside) or says ``global``/``nonlocal``."""
    if scope is None:
        return True
    params: list[_ast.arg] = []
    if isinstance(scope, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.Lambda)):
        a = scope.args
        params = [
            p for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p is not None and p.arg == name
        ]
    stores: list[_ast.Name] = []
    parents: dict[int, _ast.AST] = {}
    stack: list[_ast.AST] = (
        list(_ast.iter_child_nodes(scope)) if not isinstance(scope, _ast.Module) else list(scope.body)
    )
    if isinstance(scope, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.Lambda)):
        stack = list(scope.body) if isinstance(scope.body, list) else [scope.body]
    while stack:
        cur = stack.pop()
        if isinstance(cur, (_ast.Global, _ast.Nonlocal)) and name in cur.names:
            return True
        if isinstance(cur, _ast.Name) and cur.id == name and isinstance(cur.ctx, _ast.Store):
            stores.append(cur)
        if isinstance(cur, (_ast.Import, _ast.ImportFrom)) and any(
            (al.asname or al.name.split(".")[0]) == name for al in cur.names
        ):
            return False  # an import binding: reaching_values has None
        if isinstance(cur, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)) and cur.name == name:
            return False
        for child in _ast.iter_child_nodes(cur):
            if not isinstance(child, _SCOPE_TYPES):
                parents[id(child)] = cur
                stack.append(child)
            elif isinstance(child, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)) and child.name == name:
                return False
    if not stores and not params:
        return True  # looked up in an enclosing scope: not followed here
    if params:
        if stores:
            return False
        return any(
            p.annotation is not None
            and any(
                (isinstance(x, _ast.Name) and x.id == "Tensor")
                or (isinstance(x, _ast.Attribute) and x.attr == "Tensor")
                or (isinstance(x, _ast.Constant) and isinstance(x.value, str) and "Tensor" in x.value)
                for x in _ast.walk(p.annotation)
            )
            for p in params
        )
    for st in stores:
        parent = parents.get(id(st))
        if isinstance(parent, _ast.Assign) and any(t is st for t in parent.targets):
            value = parent.value
        elif isinstance(parent, _ast.AnnAssign) and parent.target is st and parent.value is not None:
            value = parent.value
        else:
            return False
        if not _ast_torch_tensor_call(imports, value):
            return False
    return True


def _ast_torch_tensor_call(imports: dict, value) -> bool:
    base = value
    while (
        isinstance(base, _ast.Call) and isinstance(base.func, _ast.Attribute) and isinstance(base.func.value, _ast.Call)
    ):
        base = base.func.value
    if not isinstance(base, _ast.Call):
        return False
    return any(
        any(q.startswith(ns) and "." not in q[len(ns) :] for ns in TENSOR_NAMESPACES)
        and q.rsplit(".", 1)[1] not in NOT_TENSOR
        for q in ast_torch_names(imports, base.func)
    )


def _ast_maybe_tensor_name(index: dict, imports: dict, name: str) -> bool:
    """is_tensor_name may hold: ``name`` is a parameter annotated with something spelling
    ``Tensor``, or some plain assignment ``name = <torch call>[.<method>(...)...]`` binds it (every
    binding must be one for is_tensor_name, so one is necessary)."""
    for a in index.get(_ast.arg, ()):
        if (
            a.arg == name
            and a.annotation is not None
            and any(
                (isinstance(x, _ast.Name) and x.id == "Tensor")
                or (isinstance(x, _ast.Attribute) and x.attr == "Tensor")
                or (isinstance(x, _ast.Constant) and isinstance(x.value, str) and "Tensor" in x.value)
                for x in _ast.walk(a.annotation)
            )
        ):
            return True
    for n in [*index.get(_ast.Assign, ()), *index.get(_ast.AnnAssign, ())]:
        targets = n.targets if isinstance(n, _ast.Assign) else [n.target]
        if n.value is None or not any(isinstance(t, _ast.Name) and t.id == name for t in targets):
            continue
        base = n.value
        while (
            isinstance(base, _ast.Call)
            and isinstance(base.func, _ast.Attribute)
            and isinstance(base.func.value, _ast.Call)
        ):
            base = base.func.value
        if not isinstance(base, _ast.Call):
            continue
        for q in ast_torch_names(imports, base.func):
            if (
                any(q.startswith(ns) and "." not in q[len(ns) :] for ns in TENSOR_NAMESPACES)
                and q.rsplit(".", 1)[1] not in NOT_TENSOR
            ):
                return True
    return False


AST_SCOPES = (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef, _ast.Lambda)
_DEVICE_LITERAL = re.compile(r"^(cuda|mps|xpu|hpu|npu|xla|privateuseone)(:\d+)?$")


def _ast_maybe_device(imports: dict, expr: _ast.AST) -> bool:
    """classify_device may call ``expr`` a non-CPU, non-meta device (the device-name convention is
    configurable, so every name and attribute may be one unless it resolves to a torch dtype)."""
    if isinstance(expr, _ast.Constant):
        v = expr.value
        if isinstance(v, str):
            return bool(_DEVICE_LITERAL.match(v))
        # an int is a device index; True/False/None are names to LibCST (the convention may match)
        return isinstance(v, int) or v is None
    if isinstance(expr, _ast.IfExp):
        return _ast_maybe_device(imports, expr.body) and _ast_maybe_device(imports, expr.orelse)
    if isinstance(expr, _ast.Call):
        return "torch.device" in ast_torch_names(imports, expr.func)
    if isinstance(expr, (_ast.Name, _ast.Attribute)):
        names = ast_torch_names(imports, expr)
        return not names or not all(q.startswith("torch.") and q[len("torch.") :] in DTYPES for q in names)
    return False


def _ast_maybe_move(imports: dict, call: _ast.Call) -> bool:
    """move_device may return a host→device move for ``call`` (``.cuda(...)``/``.to(...)``)."""
    pos = call.args
    if isinstance(call.func, _ast.Attribute) and call.func.attr == "cuda":  # (callers pass method calls)
        return len(pos) <= 1
    if len(pos) > 2:
        return False
    dev = next((k.value for k in call.keywords if k.arg == "device"), None)
    if dev is None:
        if not pos:
            return False
        dev = pos[0]
    return _ast_maybe_device(imports, dev)


def _ast_bound_in(loop: _ast.AST) -> set[str]:
    """Names a store in ``loop`` (its target included) binds in the loop's own scope."""
    out: set[str] = set()
    stack = [loop]
    while stack:
        cur = stack.pop()
        if isinstance(cur, _ast.Name) and isinstance(cur.ctx, _ast.Store):
            out.add(cur.id)
        for child in _ast.iter_child_nodes(cur):
            if not isinstance(child, (*AST_SCOPES, _ast.ListComp, _ast.SetComp, _ast.DictComp, _ast.GeneratorExp)):
                stack.append(child)
    return out


def _ast_base_name(expr: _ast.AST) -> str | None:
    while isinstance(expr, _ast.Subscript):
        expr = expr.value
    return expr.id if isinstance(expr, _ast.Name) else None


def _ast_mutated_names(loop: _ast.AST) -> set[str]:
    """mutated_names on CPython's ast (the same forms, so never more names)."""
    out: set[str] = set()
    stack = [loop]
    while stack:
        cur = stack.pop()
        b = None
        if isinstance(cur, _ast.Call) and isinstance(cur.func, _ast.Attribute):
            attr = cur.func.attr
            if attr.endswith("_") and not attr.startswith("_"):
                b = _ast_base_name(cur.func.value)
        elif isinstance(cur, _ast.AugAssign):
            t: _ast.expr = cur.target
            b = _ast_base_name(t.value if isinstance(t, _ast.Attribute) else t)
        elif isinstance(cur, _ast.Assign):
            for t in cur.targets:
                if isinstance(t, (_ast.Subscript, _ast.Attribute)) and (n := _ast_base_name(t.value)):
                    out.add(n)
        if b is not None:
            out.add(b)
        for child in _ast.iter_child_nodes(cur):
            if not isinstance(child, AST_SCOPES):
                stack.append(child)
    return out


_LEGACY_TYPES = {
    "FloatTensor": "float32",
    "DoubleTensor": "float64",
    "HalfTensor": "float16",
    "BFloat16Tensor": "bfloat16",
    "LongTensor": "int64",
    "IntTensor": "int32",
    "ShortTensor": "int16",
    "CharTensor": "int8",
    "ByteTensor": "uint8",
    "BoolTensor": "bool",
}
