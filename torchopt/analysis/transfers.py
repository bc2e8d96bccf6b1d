"""Host-to-device copies: which loader batches a loop copies to the device, and how."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import Assignment, PositionProvider, ScopeProvider

from torchopt.analysis.arguments import has_star, keyword, positional
from torchopt.analysis.syntax import walk
from torchopt.analysis.values import DeviceKind, classify_device, dtype_of
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

DATALOADERS = {"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"}


def start_of(rule: Rule, node: cst.CSTNode) -> tuple[int, int]:
    r = rule.get_metadata(PositionProvider, node)
    return (r.start.line, r.start.column)


def end_of(rule: Rule, node: cst.CSTNode) -> tuple[int, int]:
    r = rule.get_metadata(PositionProvider, node)
    return (r.end.line, r.end.column)


def inside(rule: Rule, node: cst.CSTNode, container: cst.CSTNode) -> bool:
    return start_of(rule, container) <= start_of(rule, node) and end_of(rule, node) <= end_of(rule, container)


def base_name(expr: cst.BaseExpression) -> cst.Name | None:
    """``x`` for ``x``, ``x[0]``, ``x['a'][1]``."""
    while isinstance(expr, cst.Subscript):
        expr = expr.value
    return expr if isinstance(expr, cst.Name) else None


def mutated_names(body: cst.CSTNode) -> set[str]:
    """Names mutated in place in ``body``: ``x.add_(...)``, ``x[i] = ...``, ``x += ...``, ``x.a = ...``."""
    out: set[str] = set()
    for n in walk(body):
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute):
            attr = n.func.attr.value
            if attr.endswith("_") and not attr.startswith("_"):
                b = base_name(n.func.value)
                if b is not None:
                    out.add(b.value)
        elif isinstance(n, cst.AugAssign):
            b = base_name(n.target) if not isinstance(n.target, cst.Attribute) else base_name(n.target.value)
            if b is not None:
                out.add(b.value)
        elif isinstance(n, cst.AssignTarget) and isinstance(n.target, (cst.Subscript, cst.Attribute)):
            b = base_name(n.target.value)
            if b is not None:
                out.add(b.value)
    return out


def statement_of(rule: Rule, node: cst.CSTNode) -> cst.CSTNode | None:
    cur: cst.CSTNode | None = node
    while cur is not None and not isinstance(cur, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
        cur = rule.get_metadata(ParentProvider, cur, None)
    return cur


def assigned_before(rule: Rule, name: cst.Name, start: cst.CSTNode, use: cst.CSTNode) -> bool:
    """Whether ``name`` may be rebound between the start of ``start`` (a loop body) and ``use``.
    An assignment in the same simple statement as ``use`` (``x = x.cuda()``) happens after it."""
    try:
        scope = rule.get_metadata(ScopeProvider, name)
    except KeyError:
        return True
    if scope is None:
        return True
    begin, at = start_of(rule, start), start_of(rule, use)
    for a in scope[name.value]:
        if not isinstance(a, Assignment):
            continue
        node = a.node
        try:
            p = start_of(rule, node)
        except KeyError:
            return True
        if not (begin <= p < at):
            continue
        stmt = statement_of(rule, node)
        if isinstance(stmt, cst.BaseSmallStatement) and stmt is statement_of(rule, use):
            continue
        return True
    return False


def move_device(rule: Rule, call: cst.Call) -> tuple[str, cst.BaseExpression | None] | None:
    """For ``<expr>.cuda(...)`` / ``<expr>.to(<device>, ...)`` that copies host→device: ("cuda"
    when the target is literally CUDA, else "device", the device expression); None otherwise."""
    if not isinstance(call.func, cst.Attribute) or has_star(call):
        return None
    meth = call.func.attr.value
    pos = positional(call)
    if meth == "cuda":
        if len(pos) > 1:  # .cuda(device, non_blocking)
            return None
        return "cuda", None
    if meth != "to":
        return None
    dev_arg = keyword(call, "device")
    if len(pos) > 2 or (len(pos) == 2 and dtype_of(rule, pos[1].value) is None):
        return None
    if dev_arg is not None:
        if pos and dtype_of(rule, pos[0].value) is None:
            return None
        expr = dev_arg.value
    elif pos:
        expr = pos[0].value
    else:
        return None
    dev = classify_device(rule, expr)
    if not dev.is_device or dev.is_cpu or dev.text == "meta":
        return None
    literal_cuda = dev.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and dev.text.split(":")[0] == "cuda"
    return ("cuda" if literal_cuda else "device"), expr


def loop_copies(rule: Rule, loop: cst.For, target: cst.BaseExpression) -> tuple[set[str], list[cst.Call]]:
    """Kinds of host→device copies of loop-target tensors in the body, and those lacking
    ``non_blocking``."""
    names = {n.value for n in walk(target) if isinstance(n, cst.Name)}
    if not names:
        return set(), []
    mutated = mutated_names(loop.body)
    kinds: set[str] = set()
    fixable: list[cst.Call] = []
    for n in walk(loop.body):
        if not isinstance(n, cst.Call) or not isinstance(n.func, cst.Attribute):
            continue
        if n.func.attr.value not in ("cuda", "to"):
            continue
        base = base_name(n.func.value)
        if base is None or base.value not in names or base.value in mutated:
            continue
        if assigned_before(rule, base, loop.body, n):
            continue
        mv = move_device(rule, n)
        if mv is None:
            continue
        kinds.add(mv[0])
        if keyword(n, "non_blocking") is None:
            fixable.append(n)
    return kinds, fixable
