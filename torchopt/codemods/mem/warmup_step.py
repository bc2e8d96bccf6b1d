"""The part of a training step that TOP711's warm-up replays (the statements before
``loss.backward()``), and the reasons it refuses to replay it: anything whose effect the warm-up
could not undo."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import callee
from torchopt.analysis.step_loops import HotMap, dotted
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

# Calls that must not be replayed in the warm-up: host reads, side effects, optimiser traffic.
DENY_METHODS = {
    "item",
    "tolist",
    "numpy",
    "append",
    "extend",
    "step",
    "update",
    "write",
    "log",
    "backward",
    "zero_grad",
    "set_postfix",
    "add_scalar",
    "send",
    "put",
    "insert",
    "pop",
    "clear",
}
DENY_FUNCS = {"print", "next", "input", "open", "exec", "eval"}


class Refused(Exception):
    """Why the warm-up is not written; the reason is added to the report."""


def step_prefix(loop: cst.For, module: cst.Module) -> tuple[list[cst.BaseStatement], str]:
    """The statements before ``loss.backward()`` (``zero_grad()`` left out) and the loss name."""
    if not isinstance(loop.body, cst.IndentedBlock):
        raise Refused("one-line loop body")
    prefix: list[cst.BaseStatement] = []
    for stmt in loop.body.body:
        loss = backward_of(stmt)
        if loss is not None:
            if not any(loss in assigned_names(s) for s in prefix):
                raise Refused("the loss is not computed in the loop before `backward()`")
            return prefix, loss
        if is_zero_grad(stmt):
            continue
        check_step_statement(stmt, module)
        prefix.append(stmt)
    raise Refused("no `loss.backward()` statement in the loop body")


def backward_of(stmt: cst.BaseStatement) -> str | None:
    """``loss`` for ``loss.backward()`` or ``scaler.scale(loss).backward()``; None for another statement."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Expr):
        return None
    c = stmt.body[0].value
    if (
        not isinstance(c, cst.Call)
        or not isinstance(c.func, cst.Attribute)
        or c.func.attr.value != "backward"
        or c.args
    ):
        return None
    recv = c.func.value
    if isinstance(recv, cst.Name):
        return recv.value
    if (
        isinstance(recv, cst.Call)
        and isinstance(recv.func, cst.Attribute)
        and recv.func.attr.value == "scale"
        and len(recv.args) == 1
        and isinstance(recv.args[0].value, cst.Name)
    ):
        return recv.args[0].value.value
    raise Refused("the backward call is not `loss.backward()`")


def is_zero_grad(stmt: cst.BaseStatement) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, cst.Call)
        and isinstance(stmt.body[0].value.func, cst.Attribute)
        and stmt.body[0].value.func.attr.value == "zero_grad"
    )


def check_step_statement(stmt: cst.BaseStatement, module: cst.Module) -> None:
    """Raise unless ``stmt`` only binds names from calls without side effects (``with`` blocks
    are looked into)."""
    if isinstance(stmt, cst.With):
        for s in stmt.body.body if isinstance(stmt.body, cst.IndentedBlock) else ():
            check_step_statement(s, module)
        if not isinstance(stmt.body, cst.IndentedBlock):
            raise Refused("one-line `with` in the step")
        if any(i.asname is not None for i in stmt.items):
            raise Refused("`with ... as` in the step")
        return
    if not isinstance(stmt, cst.SimpleStatementLine):
        raise Refused("the step before `backward()` holds control flow")
    for small in stmt.body:
        if isinstance(small, cst.Assign):
            for t in small.targets:
                tgt = t.target
                ok = isinstance(tgt, cst.Name) or (
                    isinstance(tgt, (cst.Tuple, cst.List)) and all(isinstance(e.value, cst.Name) for e in tgt.elements)
                )
                if not ok:
                    raise Refused("the step assigns to an attribute or an item")
        elif isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name) and small.value is not None:
            pass
        else:
            raise Refused(f"`{module.code_for_node(small).strip()}` in the step has side effects")
        _check_calls(small)


def _check_calls(small: cst.BaseSmallStatement) -> None:
    """Raise on a call the warm-up must not replay (host reads, in-place methods, I/O), a lambda or ``:=``."""
    for c in walk(small):
        if isinstance(c, cst.Call):
            if isinstance(c.func, cst.Attribute):
                meth = c.func.attr.value
                if meth in DENY_METHODS or (meth.endswith("_") and not meth.startswith("_")):
                    raise Refused(f"`.{meth}()` in the step has side effects")
            elif isinstance(c.func, cst.Name) and c.func.value in DENY_FUNCS:
                raise Refused(f"`{c.func.value}()` in the step has side effects")
        if isinstance(c, (cst.Lambda, cst.NamedExpr)):
            raise Refused("the step uses a lambda or `:=`")


def assigned_names(stmt: cst.BaseStatement) -> set[str]:
    out = set()
    for n in walk(stmt):
        if isinstance(n, cst.AssignTarget):
            out |= {x.value for x in walk(n.target) if isinstance(x, cst.Name)}
        elif isinstance(n, cst.AnnAssign):
            out |= {x.value for x in walk(n.target) if isinstance(x, cst.Name)}
    return out


def check_side_effects(rule: Rule, hot: HotMap) -> None:
    """Raise when a function of this file that the step calls changes a global or a ``self``
    attribute: the warm-up restores tensors, not Python state."""
    for fid, where in hot.hot_funcs.items():
        fn = next((f for f in walk(rule.ctx.module, True) if isinstance(f, cst.FunctionDef) and id(f) == fid), None)
        if fn is None:
            continue
        for n in walk(fn):
            if isinstance(n, (cst.Global, cst.Nonlocal)):
                raise Refused(f"`{where.via}` changes a global")
            targets = []
            if isinstance(n, cst.Assign):
                targets = [t.target for t in n.targets]
            elif isinstance(n, (cst.AugAssign, cst.AnnAssign)):
                targets = [n.target]
            for t in targets:
                for x in walk(t):
                    if isinstance(x, cst.Attribute) and dotted(x.value) == "self":
                        raise Refused(
                            f"`{where.via}` sets `self.{x.attr.value}` (Python attributes are not "
                            "restored after the warm-up)"
                        )


def step_optimizers(rule: Rule, loop: cst.For) -> list[str]:
    """Names whose ``.step()`` the loop calls and that are only ever bound to a ``torch.optim``
    optimizer: the warm-up saves and restores their parameters' gradients."""
    out = []
    for n in walk(loop.body):
        if (
            isinstance(n, cst.Call)
            and isinstance(n.func, cst.Attribute)
            and n.func.attr.value == "step"
            and isinstance(n.func.value, cst.Name)
        ):
            name = n.func.value
            try:
                scope = rule.get_metadata(ScopeProvider, name)
            except KeyError:
                continue
            if scope is None or name.value not in scope:
                continue
            ok = True
            for a in scope[name.value]:
                node = getattr(a, "node", None)
                parent = rule.get_metadata(ParentProvider, node, None) if node is not None else None
                stmt = rule.get_metadata(ParentProvider, parent, None) if isinstance(parent, cst.AssignTarget) else None
                q = (
                    callee(rule, stmt.value)
                    if isinstance(stmt, cst.Assign) and isinstance(stmt.value, cst.Call)
                    else None
                )
                if not (q and q.startswith("torch.optim.") and ".lr_scheduler" not in q):
                    ok = False
            if ok and name.value not in out:
                out.append(name.value)
    return out
