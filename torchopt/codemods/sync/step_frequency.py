"""Whether code in a hot region really runs on every step, or only now and then.

The step-loop analysis marks whole loop bodies and the functions they call as hot. A host read is
only worth reporting when it runs per step; these are the common shapes where it does not: under a
periodic (`if i % log_interval == 0`) or one-off (`if i == 0`) guard, on a branch that leaves the
loop (print the non-finite loss and exit), after the batch loop of a function called from an outer
loop (validation called from a retry loop), or in the per-epoch body of a loop whose batches are
iterated by a function it calls.
"""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.step_loops import LOOPS, HotMap, calls_in
from torchopt.analysis.syntax import walk

_EXITS = ("sys.exit", "exit", "quit", "os._exit")


def not_every_step(hot: HotMap, node: cst.CSTNode, epochs: bool = False) -> str | None:
    """Why ``node`` does not run on every step (a short phrase), or None when it may. With
    ``epochs``, the body of a loop that calls a function iterating its own batches counts as
    per-epoch code (a batch loop calling a gradient-accumulation helper looks the same, so only
    rules about rare work such as saving images use it)."""
    where = hot.where(node)
    if where is None:
        return None
    loop_body = getattr(where.loop.node, "body", None)
    cur = node
    while True:
        parent = hot.parent(cur)
        if parent is None or cur is loop_body:
            break
        if isinstance(parent, cst.If) and cur is parent.body:
            reason = _rare_branch(parent, _one_off_flags(hot, parent))
            if reason:
                return reason
        if isinstance(parent, cst.ExceptHandler):
            return "it runs only after an error (a retry path)"
        if isinstance(parent, cst.FunctionDef):
            return _after_inner_loop(hot, node, parent)
        cur = parent
    if epochs and _epoch_loop(hot, where.loop.node):
        return "it runs once per epoch; the batches are iterated by a function the loop calls"
    return None


def opt_in_switch(hot: HotMap, node: cst.CSTNode) -> str | None:
    """The name of the option that guards ``node`` (`if args.synchronize_step:`), or None."""
    cur = node
    while True:
        parent = hot.parent(cur)
        if parent is None or isinstance(parent, (cst.FunctionDef, cst.For, cst.While)):
            return None
        if isinstance(parent, cst.If) and cur is parent.body and isinstance(parent.test, cst.Attribute):
            return _dotted(parent.test)
        cur = parent


def _rare_branch(branch: cst.If, flags: frozenset[str] = frozenset()) -> str | None:
    test = branch.test
    if _periodic(test, flags):
        return "it already runs only every few steps"
    if _first_step(test):
        return "it runs once, on the first step"
    if _leaves_loop(branch.body):
        return "it runs only on the path that leaves the loop"
    return None


def _periodic(test: cst.BaseExpression, flags: frozenset[str] = frozenset()) -> bool:
    """`i % n == k`, `not i % n`, `(i + 1) % n == 0`, and such tests joined with `and`; also
    `i % n == 0 or last_batch`: every few steps plus once more (``flags``: names holding a one-off test)."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _periodic(test.left, flags) or _periodic(test.right, flags)
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.Or):
        sides = (test.left, test.right)
        return any(_periodic(side, flags) for side in sides) and all(
            _periodic(side, flags) or _one_off(side, flags) for side in sides
        )
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return _is_modulo(test.expression)
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        op = test.comparisons[0].operator
        right = test.comparisons[0].comparator
        return isinstance(op, cst.Equal) and (_is_modulo(test.left) or _is_modulo(right))
    return False


def _one_off(test: cst.BaseExpression, flags: frozenset[str]) -> bool:
    """`i == last_idx`, `i + 1 == len(loader)` (a counter equal to one value, not a string option), or a
    name assigned such a test."""
    if isinstance(test, cst.Name):
        return test.value in flags
    if not (
        isinstance(test, cst.Comparison)
        and len(test.comparisons) == 1
        and isinstance(test.comparisons[0].operator, cst.Equal)
    ):
        return False
    numeric = (cst.Name, cst.Attribute, cst.Integer, cst.BinaryOperation, cst.Call, cst.Subscript)
    return isinstance(test.left, numeric) and isinstance(test.comparisons[0].comparator, numeric)


def _one_off_flags(hot: HotMap, node: cst.CSTNode) -> frozenset[str]:
    """Names the enclosing function assigns a one-off test (`last_batch = batch_idx == last_idx`)."""
    fn = hot.parent(node)
    while fn is not None and not isinstance(fn, (cst.FunctionDef, cst.Module)):
        fn = hot.parent(fn)
    if fn is None:
        return frozenset()
    return frozenset(
        n.targets[0].target.value
        for n in walk(fn.body if isinstance(fn, cst.FunctionDef) else fn)
        if isinstance(n, cst.Assign)
        and len(n.targets) == 1
        and isinstance(n.targets[0].target, cst.Name)
        and _one_off(n.value, frozenset())
    )


def _is_modulo(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Modulo)


def _first_step(test: cst.BaseExpression) -> bool:
    """`i == 0` or `not i`: a counter compared with a literal once."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _first_step(test.left) or _first_step(test.right)
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        op = test.comparisons[0].operator
        right = test.comparisons[0].comparator
        return isinstance(op, cst.Equal) and isinstance(test.left, cst.Name) and isinstance(right, cst.Integer)
    return False


def _leaves_loop(body: cst.BaseSuite) -> bool:
    """The branch ends by raising, exiting the process, or breaking out (it runs at most once)."""
    if not isinstance(body, cst.IndentedBlock) or not body.body:
        return False
    last = body.body[-1]
    if not isinstance(last, cst.SimpleStatementLine) or not last.body:
        return False
    stmt = last.body[-1]
    if isinstance(stmt, (cst.Raise, cst.Break, cst.Return)):
        return True
    if isinstance(stmt, cst.Expr) and isinstance(stmt.value, cst.Call):
        return _dotted(stmt.value.func) in _EXITS
    return False


def _after_inner_loop(hot: HotMap, node: cst.CSTNode, fn: cst.FunctionDef) -> str | None:
    """A function called from a step loop that iterates its own batches: code outside that inner
    loop runs once per call, not once per batch."""
    if not any(id(n) in hot.step_loops for n in walk(fn.body) if isinstance(n, LOOPS)):
        return None
    cur = hot.parent(node)
    while cur is not None and cur is not fn:
        if isinstance(cur, LOOPS):
            return None
        cur = hot.parent(cur)
    return "it runs once per call, outside the batch loop of the function"


def _epoch_loop(hot: HotMap, loop: cst.CSTNode) -> bool:
    """A loop that calls a function of this file with a step loop of its own is an epoch loop."""
    for call in calls_in(getattr(loop, "body", loop), into_loops=False):
        for fn, _ in hot.resolve(call, None):
            if any(id(n) in hot.step_loops for n in walk(fn.body) if isinstance(n, LOOPS)):
                return True
    return False


def _dotted(expr: cst.BaseExpression) -> str:
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        return f"{_dotted(expr.value)}.{expr.attr.value}"
    return ""
