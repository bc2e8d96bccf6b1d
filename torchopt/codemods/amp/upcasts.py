"""Which values an autocast block hands back to float32 code, and whether they can be upcast.

A name the autocast block assigns and later code reads is upcast with ``name = name.float()``
after the block. That is only right for a tensor: a model may return a tuple whose items are
lists (a multi-scale discriminator's per-scale outputs), and ``list.float()`` raises. A name
unpacked from a model call is known to be a tensor only where the model's ``forward`` is in the
file and returns a tuple whose item at that position is not a container literal, or where the
module is a ``torch.nn`` built-in."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee, dotted
from torchopt.analysis.statement_edits import Refusal
from torchopt.analysis.syntax import walk

_CONTAINERS = (cst.List, cst.Dict, cst.Set, cst.Tuple, cst.ListComp, cst.DictComp, cst.SetComp)
_UNPACKED = (cst.Element, cst.StarredElement, cst.Tuple, cst.List)


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
        return "its class is not defined in this file, so whether its items are tensors or lists is not known"
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
