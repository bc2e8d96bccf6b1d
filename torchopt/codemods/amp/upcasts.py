"""Which values an autocast block hands back to float32 code, and whether they can be upcast.

A name the autocast block assigns and later code reads is upcast with ``name = name.float()``
after the block. That is only right for a tensor: a model may return a tuple whose items are
lists (a multi-scale discriminator's per-scale outputs), and ``list.float()`` raises. A name
unpacked from a model call is known to be a tensor only where the model's ``forward`` (in the file,
or in another file of the project, read through the project index) returns a tuple whose item at
that position is not a container literal, or where the module is a ``torch.nn`` built-in."""

from __future__ import annotations

import ast

import libcst as cst

from torchopt.analysis.names import callee, dotted
from torchopt.analysis.project import Definition, index_of
from torchopt.analysis.statement_edits import Refusal
from torchopt.analysis.syntax import walk

_CONTAINERS = (cst.List, cst.Dict, cst.Set, cst.Tuple, cst.ListComp, cst.DictComp, cst.SetComp)
_UNPACKED = (cst.Element, cst.StarredElement, cst.Tuple, cst.List)
_MOVES = frozenset(
    {"to", "cuda", "train", "eval", "float", "requires_grad_", "share_memory"}
)  # return the module itself


def is_store(analysis, name: cst.Name) -> bool:
    """``name`` is written, not read: an assignment target, also inside a tuple or list target."""
    cur: cst.CSTNode = name
    parent = analysis.parent(cur)
    while isinstance(parent, _UNPACKED):
        cur, parent = parent, analysis.parent(parent)
    if isinstance(parent, cst.AssignTarget):
        return parent.target is cur
    if isinstance(parent, (cst.For, cst.CompFor)):
        return parent.target is cur
    return False


def check_unpacked(analysis, region: list[cst.BaseStatement], upcasts: list[str]) -> None:
    """Refuse when a name to upcast is unpacked from a model call whose item there may not be a tensor."""
    for stmt in region:
        for n in walk(stmt):
            if not isinstance(n, cst.Assign) or not isinstance(n.value, cst.Call):
                continue
            for t in n.targets:
                if not isinstance(t.target, (cst.Tuple, cst.List)):
                    continue
                for i, el in enumerate(t.target.elements):
                    name = dotted(el.value)
                    if name not in upcasts or isinstance(el, cst.StarredElement):
                        continue
                    why = _not_known_tensor(analysis, n.value, i, len(t.target.elements))
                    if why is not None:
                        raise Refusal(
                            stmt,
                            f"`{name}` is unpacked from `{analysis.module.code_for_node(n.value.func)}(...)` and read "
                            f"after the autocast block (to be upcast to float32 there), but {why}",
                        )


def _not_known_tensor(analysis, call: cst.Call, index: int, count: int) -> str | None:
    """None when item ``index`` of what ``call`` returns is known not to be a container; else why not."""
    q = callee(analysis.rule, call) if isinstance(call.func, (cst.Name, cst.Attribute)) else None
    if q and q.startswith("torch.nn."):
        return None  # a built-in module: tensors, or an RNN's state, which autocast takes back as it is
    cls = _class_of(analysis, call)
    if cls is None:
        return _project_class_item(analysis, call, index, count)
    forward = next((s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "forward"), None)
    if forward is None:
        return f"`{cls.name.value}` defines no `forward` in this file"
    rets = [r.value for r in walk(forward.body) if isinstance(r, cst.Return) and r.value is not None]
    if not rets:
        return f"`{cls.name.value}.forward` returns nothing this analysis can read"
    containers = _container_names(forward)
    for r in rets:
        if not isinstance(r, cst.Tuple) or len(r.elements) != count:
            return f"`{cls.name.value}.forward` does not return a tuple of {count} items"
        item = r.elements[index].value
        if isinstance(item, _CONTAINERS) or dotted(item) in containers:
            return f"`{cls.name.value}.forward` returns a container there, not a tensor"
    return None


def _project_class_item(analysis, call: cst.Call, index: int, count: int) -> str | None:
    """The same question for a model whose class another file of the project defines (read with
    ``ast`` through the project index); else why it cannot be answered."""
    unknown = "its class is not defined in this file, so whether its items are tensors or lists is not known"
    written = _constructor(analysis, call)
    if written is None:
        return unknown
    project = index_of(analysis.rule)
    defn = project.resolve(written)
    if not isinstance(defn, Definition) or defn.kind != "class":
        return unknown
    where = project.shown(defn.path)
    returns = project.scope.file_fact(defn.path, "amp forward returns", _forward_returns)
    items = (returns or {}).get(defn.name)
    if items is None:
        return f"`{written}` (defined in {where}) has no `forward` there that this analysis can read"
    for ret in items:
        if ret is None or len(ret) != count:
            return f"`{written}.forward` (in {where}) does not return a tuple of {count} items"
        if ret[index]:
            return f"`{written}.forward` (in {where}) returns a container there (a list of tensors), not a tensor"
    return None


def _constructor(analysis, call: cst.Call) -> str | None:
    """``Net`` for a model call whose model is built as ``Net(...)`` (possibly ``.to(device)``), as
    written: by its program role, or by the one assignment of the name in the file that is not a
    rewrap (``model = DistributedDataParallel(model, ...)`` returns what the module returns)."""
    from torchopt.analysis.program import MODULE_WRAPPERS, program_of

    program = program_of(analysis.rule)
    role = program.role_of(call.func, call) if isinstance(call.func, (cst.Name, cst.Attribute)) else None
    if role is not None and role.kind == "model":
        return _built_class(role.origin)
    if not isinstance(call.func, cst.Name) or call.func.value not in analysis.models:
        return None
    name = call.func.value
    built = set()
    for stmt in analysis.assigning(name):
        small = stmt.body[0] if len(stmt.body) == 1 else None
        if not isinstance(small, cst.Assign) or len(small.targets) != 1:
            return None
        base = _unmoved(small.value)
        if (
            isinstance(base, cst.Call)
            and isinstance(base.func, (cst.Name, cst.Attribute))
            and callee(analysis.rule, base) in MODULE_WRAPPERS
            and base.args
            and dotted(base.args[0].value) == name
        ):
            continue
        if _moved_self(small.value, name):
            continue  # `model = model.to(device)`: the same module
        built.add(_built_class(small.value))
    return built.pop() if len(built) == 1 else None


def _unmoved(value: cst.CSTNode | None) -> cst.CSTNode | None:
    """``Net(...)`` for ``Net(...).to(device).train()``."""
    while (
        isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and isinstance(value.func.value, cst.Call)
    ):
        value = value.func.value
    return value


def _moved_self(value: cst.BaseExpression, name: str) -> bool:
    """``value`` is ``name.to(...)`` / ``name.cuda().train()``: methods a module returns itself from."""
    moved = False
    while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in _MOVES:
        value, moved = value.func.value, True
    return moved and isinstance(value, cst.Name) and value.value == name


def _built_class(value: cst.CSTNode | None) -> str | None:
    base = _unmoved(value)
    return dotted(base.func) if isinstance(base, cst.Call) else None


def _forward_returns(text: str) -> dict[str, list[list[bool] | None]]:
    """For each module-level class of ``text`` with a ``forward``: per ``return``, for a tuple, whether
    each item is a container (a literal, or a name ``forward`` binds to one); None for any other value."""
    out: dict[str, list[list[bool] | None]] = {}
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return out
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        fwd = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
        if fwd is None:
            continue
        containers = {
            t.id
            for n in ast.walk(fwd)
            if isinstance(n, ast.Assign) and isinstance(n.value, _AST_CONTAINERS)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        rets = [r.value for r in ast.walk(fwd) if isinstance(r, ast.Return) and r.value is not None]
        out[cls.name] = [
            [isinstance(e, _AST_CONTAINERS) or (isinstance(e, ast.Name) and e.id in containers) for e in r.elts]
            if isinstance(r, ast.Tuple)
            else None
            for r in rets
        ] or [None]
    return out


_AST_CONTAINERS = (ast.List, ast.Dict, ast.Set, ast.Tuple, ast.ListComp, ast.DictComp, ast.SetComp)


def _class_of(analysis, call: cst.Call) -> cst.ClassDef | None:
    """The file's nn.Module class a model call runs: ``Net(...)(x)`` or a name bound to ``Net(...)``."""
    from torchopt.analysis.program import program_of

    program = program_of(analysis.rule)
    role = program.role_of(call.func, call) if isinstance(call.func, (cst.Name, cst.Attribute)) else None
    origin = role.origin if role is not None and role.kind == "model" else None
    while isinstance(origin, cst.Call) and isinstance(origin.func, cst.Attribute):
        origin = origin.func.value  # `Net().to(device)`
    if isinstance(origin, cst.Call) and isinstance(origin.func, cst.Name):
        name = origin.func.value
        if name in program.module_classes:
            return program.classes.get(name)
    return None


def _container_names(fn: cst.FunctionDef) -> set[str]:
    """Names ``fn`` binds to a container literal somewhere (``outs = []``)."""
    out = set()
    for n in walk(fn.body):
        if isinstance(n, cst.Assign) and isinstance(n.value, _CONTAINERS):
            out |= {d for t in n.targets if (d := dotted(t.target))}
    return out
