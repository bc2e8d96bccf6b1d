"""Where TOP711's warm-up goes (before the outermost loop around the training loop, in the same
scope) and whether every name it reads is already bound there."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import Assignment, PositionProvider, ScopeProvider

from torchopt.analysis.step_loops import SCOPES
from torchopt.analysis.syntax import walk
from torchopt.codemods.mem.warmup_step import Refused, assigned_names
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule


def outer_loop(rule: Rule, loop: cst.For) -> cst.BaseStatement:
    """The outermost loop statement around ``loop`` in its scope (the epoch loop), or ``loop``.
    Raises when a condition guards it."""
    cur: cst.CSTNode = loop
    best: cst.For = loop
    while True:
        parent = rule.get_metadata(ParentProvider, cur, None)
        if parent is None or isinstance(parent, SCOPES) or isinstance(parent, cst.Module):
            return best
        if isinstance(parent, (cst.If, cst.Try, cst.With, cst.While, cst.Else, cst.ExceptHandler, cst.Finally)):
            if isinstance(parent, (cst.If, cst.Else, cst.While, cst.ExceptHandler)):
                raise Refused("the loop runs under a condition (a rank guard?)")
        if isinstance(parent, cst.For):
            best = parent
        cur = parent


def scope_owner(rule: Rule, node: cst.CSTNode) -> cst.CSTNode:
    """The function (or the module) whose body holds ``node``; a class body is refused."""
    cur = rule.get_metadata(ParentProvider, node, None)
    while cur is not None and not isinstance(cur, SCOPES):
        cur = rule.get_metadata(ParentProvider, cur, None)
    if isinstance(cur, (cst.ClassDef, cst.Lambda)):
        raise Refused("the loop is in a class body")
    return cur if cur is not None else rule.ctx.module


def _position(rule: Rule, node: cst.CSTNode) -> tuple[int, int]:
    r = rule.get_metadata(PositionProvider, node)
    return (r.start.line, r.start.column)


def check_visible(rule: Rule, prefix: list[cst.BaseStatement], known: set[str], outer: cst.CSTNode) -> None:
    """Raise when a name the replayed statements read (other than ``known`` and what they bind
    themselves) is bound at or after ``outer``: state carried between steps."""
    known = set(known)
    for stmt in prefix:
        stores = set()
        for n in walk(stmt):
            if isinstance(n, cst.AssignTarget):
                stores |= {id(x) for x in walk(n.target) if isinstance(x, cst.Name)}
            elif isinstance(n, cst.Attribute):
                stores.add(id(n.attr))
            elif isinstance(n, cst.Arg) and n.keyword is not None:
                stores.add(id(n.keyword))
        for n in walk(stmt):
            if isinstance(n, cst.Name) and id(n) not in stores and n.value not in known:
                bound_before(rule, n, outer)
        known |= assigned_names(stmt)


def bound_before(rule: Rule, name: cst.Name, outer: cst.CSTNode) -> None:
    """Raise unless every binding of ``name`` that reaches it comes before ``outer``."""
    try:
        scope = rule.get_metadata(ScopeProvider, name)
    except KeyError:
        raise Refused("no scope") from None
    if scope is None:
        raise Refused("no scope")
    at = _position(rule, outer)
    for a in scope[name.value]:
        if not isinstance(a, Assignment):
            continue  # builtins
        node = a.node
        if isinstance(node, cst.Param):
            continue
        if a.scope is not scope and not isinstance(scope_owner(rule, outer), cst.Module):
            continue  # a global read by a function
        try:
            p = _position(rule, node)
        except KeyError:
            raise Refused(f"cannot place `{name.value}`") from None
        if p >= at:
            raise Refused(f"`{name.value}` is bound after the warm-up would run (state carried between steps?)")


def check_names_bound(rule: Rule, names: set[str], outer: cst.CSTNode) -> None:
    """Raise unless each of ``names`` (first use under ``outer``) is bound before ``outer``."""
    for name in names:
        use = next((n for n in walk(outer) if isinstance(n, cst.Name) and n.value == name), None)
        if use is not None:
            bound_before(rule, use, outer)
