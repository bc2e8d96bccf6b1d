"""TOP831 (``zero_grad(set_to_none=False)``) and TOP832 (hand-written loops that zero every
gradient). Both become a plain ``zero_grad()``, which sets gradients
to None (the default since PyTorch 2.0)."""

from __future__ import annotations

import ast as _ast

import libcst as cst


_SAFETY_DOC = """\
    Unsafe (tag semantics). Gradients become None instead of zero tensors. Results are bitwise
    identical when every trainable parameter receives a gradient on every step and nothing reads
    `.grad` between the zeroing and the next backward. Otherwise they change:
    optimizers *skip* a parameter whose `.grad` is None, whereas a zero gradient still moves it
    through momentum, weight decay and Adam's moment decay (verified for `SGD(momentum=0.9)`,
    `SGD(weight_decay=0.1)` and `AdamW`; plain SGD is unaffected). That happens with conditional
    sub-modules, mixture-of-experts routing, partially frozen towers or multi-task heads used
    alternately, which a static tool cannot rule out, so the fix is never applied by default.

    No fix is offered (display-only) when the file reads `.grad` outside an
    `if <p>.grad is not None:` guard (`p.grad.norm()`, `p.grad.add_(...)`, custom accumulation):
    with gradients set to None that code raises `AttributeError: 'NoneType' object has no
    attribute ...`. Nor when the receiver resolves to an optimizer that is not a `torch.optim`
    built-in (its `zero_grad` may not accept or honour `set_to_none`)."""


_ZERO_METHODS = {"zero_", "detach_", "requires_grad_"}


def _zeroing_statement(stmt: cst.CSTNode, var: str) -> str | None:
    """``p.grad.zero_()`` / ``p.grad.data.zero_()`` / ``p.grad.detach_()`` /
    ``p.grad.requires_grad_(False)``: the method name, else None."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr)):
        return None
    call = stmt.body[0].value
    if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Attribute):
        return None
    meth = call.func.attr.value
    if meth not in _ZERO_METHODS:
        return None
    if meth == "requires_grad_":
        if not (
            len(call.args) == 1 and isinstance(call.args[0].value, cst.Name) and call.args[0].value.value == "False"
        ):
            return None
    elif call.args:
        return None
    target = call.func.value
    if isinstance(target, cst.Attribute) and target.attr.value == "data" and meth == "zero_":
        target = target.value
    if (
        isinstance(target, cst.Attribute)
        and target.attr.value == "grad"
        and isinstance(target.value, cst.Name)
        and target.value.value == var
    ):
        return meth
    return None


def _zeroing_body(body: cst.BaseSuite, var: str) -> bool:
    """The body of ``for <var> in ...:`` only zeroes ``<var>.grad`` (optionally under
    ``if <var>.grad is not None:``)."""
    if not isinstance(body, cst.IndentedBlock):
        return False
    stmts = list(body.body)
    if len(stmts) == 1 and isinstance(stmts[0], cst.If) and stmts[0].orelse is None:
        test = stmts[0].test
        if not (
            isinstance(test, cst.Comparison)
            and len(test.comparisons) == 1
            and isinstance(test.comparisons[0].operator, cst.IsNot)
            and isinstance(test.comparisons[0].comparator, cst.Name)
            and test.comparisons[0].comparator.value == "None"
            and isinstance(test.left, cst.Attribute)
            and test.left.attr.value == "grad"
            and isinstance(test.left.value, cst.Name)
            and test.left.value.value == var
        ):
            return False
        if not isinstance(stmts[0].body, cst.IndentedBlock):
            return False
        stmts = list(stmts[0].body.body)
    meths = [_zeroing_statement(s, var) for s in stmts]
    return bool(meths) and all(meths) and "zero_" in meths


def _loop_var(loop: cst.For) -> str | None:
    if loop.orelse is not None or loop.asynchronous is not None or not isinstance(loop.target, cst.Name):
        return None
    return loop.target.value


def _ast_loop_var(loop: _ast.stmt) -> str | None:
    """The loop variable of a plain ``for <name> in ...:`` (no ``else``), as _loop_var reads it."""
    return (
        loop.target.id
        if isinstance(loop, _ast.For) and not loop.orelse and isinstance(loop.target, _ast.Name)
        else None
    )


def _ast_zeroing_statement(stmt: _ast.stmt, var: str) -> str | None:
    """_zeroing_statement on CPython's ast: the zeroing method ``stmt`` calls on ``<var>.grad``."""
    call = stmt.value if isinstance(stmt, _ast.Expr) else None
    if not (isinstance(call, _ast.Call) and isinstance(call.func, _ast.Attribute)):
        return None
    meth = call.func.attr
    if meth not in _ZERO_METHODS:
        return None
    nargs = len(call.args) + len(call.keywords)
    if meth == "requires_grad_":
        arg = call.args[0] if call.args else (call.keywords[0].value if call.keywords else None)
        if not (nargs == 1 and isinstance(arg, _ast.Constant) and arg.value is False):
            return None
    elif nargs:
        return None
    target = call.func.value
    if isinstance(target, _ast.Attribute) and target.attr == "data" and meth == "zero_":
        target = target.value
    if (
        isinstance(target, _ast.Attribute)
        and target.attr == "grad"
        and isinstance(target.value, _ast.Name)
        and target.value.id == var
    ):
        return meth
    return None


def _ast_zeroing_body(body: list[_ast.stmt], var: str) -> bool:
    """_zeroing_body on CPython's ast (the guard ``if <var>.grad is not None:`` included)."""
    stmts = body
    if len(stmts) == 1 and isinstance(stmts[0], _ast.If) and not stmts[0].orelse:
        t = stmts[0].test
        if not (
            isinstance(t, _ast.Compare)
            and len(t.ops) == 1
            and isinstance(t.ops[0], _ast.IsNot)
            and isinstance(t.comparators[0], _ast.Constant)
            and t.comparators[0].value is None
            and isinstance(t.left, _ast.Attribute)
            and t.left.attr == "grad"
            and isinstance(t.left.value, _ast.Name)
            and t.left.value.id == var
        ):
            return False
        stmts = stmts[0].body
    meths = [_ast_zeroing_statement(st, var) for st in stmts]
    return bool(meths) and all(meths) and "zero_" in meths


def _ast_owner_ok(owner: _ast.expr) -> bool:
    """The receiver visit_For accepts: a name or ``self.<name>``."""
    return isinstance(owner, _ast.Name) or (
        isinstance(owner, _ast.Attribute) and isinstance(owner.value, _ast.Name) and owner.value.id == "self"
    )


def _ast_parameters_loop(loop: _ast.For, var: str) -> bool:
    """``for <var> in <X>.parameters():`` whose body only zeroes ``<var>.grad``."""
    it = loop.iter
    return (
        isinstance(it, _ast.Call)
        and not it.args
        and not it.keywords
        and isinstance(it.func, _ast.Attribute)
        and it.func.attr == "parameters"
        and _ast_owner_ok(it.func.value)
        and _ast_zeroing_body(loop.body, var)
    )


def _ast_param_groups_loop(loop: _ast.For, var: str) -> bool:
    """``for <var> in <X>.param_groups:`` around exactly one ``for <v> in <var>["params"]:`` whose
    body only zeroes ``<v>.grad``."""
    it = loop.iter
    if not (
        isinstance(it, _ast.Attribute)
        and it.attr == "param_groups"
        and _ast_owner_ok(it.value)
        and len(loop.body) == 1
        and isinstance(loop.body[0], _ast.For)
    ):
        return False
    inner = loop.body[0]
    ivar = _ast_loop_var(inner)
    sub = inner.iter if isinstance(inner.iter, _ast.Subscript) else None
    return (
        ivar is not None
        and sub is not None
        and isinstance(sub.value, _ast.Name)
        and sub.value.id == var
        and isinstance(sub.slice, _ast.Constant)
        and sub.slice.value == "params"
        and _ast_zeroing_body(inner.body, ivar)
    )


def _zeroing_loop_possible(text: str) -> bool:
    """visit_For's shapes on CPython's ast, a cheap test before the file is parsed with libcst:
    ``for <v> in <X>.parameters():`` or ``for <g> in <X>.param_groups:`` around exactly one
    ``for <v> in <g>["params"]:``, whose body only zeroes ``<v>.grad`` (_zeroing_body: optionally
    under ``if <v>.grad is not None:``, at least one ``zero_()``), with X a name or
    ``self.<name>``. True when the text does not parse."""
    from torchopt.analysis.precheck.tree import ast_index

    index = ast_index(text)
    if index is None:
        return True
    for loop in index.get(_ast.For, ()):
        var = _ast_loop_var(loop)
        if var is not None and (_ast_parameters_loop(loop, var) or _ast_param_groups_loop(loop, var)):
            return True
    return False
