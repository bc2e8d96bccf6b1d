"""The shapes of the tests the control facts read (``analysis/control.py``), by syntax alone: a
periodic test (`i % n == 0`), a one-off one (`i == last_idx`), a first step (`i == 0`), a bounded
number of iterations (`j < 4`), a branch that leaves the loop, and what a loop body assigns."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import dotted
from torchopt.analysis.syntax import walk

_EXITS = ("sys.exit", "exit", "quit", "os._exit")
# The last part of a name or attribute that holds the process's rank (a convention, read only in a
# comparison with 0 or -1: `rank == 0`, `args.local_rank in (-1, 0)`).
RANK_NAMES = {"rank", "local_rank", "global_rank", "world_rank", "node_rank", "process_index", "local_process_index"}
FEW = 16  # iterations a counter test may let through and still be rare (`if j <= 4:` for figures)


def int_value(expr: cst.BaseExpression) -> int | None:
    if isinstance(expr, cst.Integer):
        return int(expr.evaluated_value)
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        inner = int_value(expr.expression)
        return -inner if inner is not None else None
    return None


def only_returns(body: cst.BaseSuite) -> bool:
    stmts = body.body if isinstance(body, cst.IndentedBlock) else [body]
    if len(stmts) != 1:
        return False
    line = stmts[0]
    return isinstance(line, (cst.SimpleStatementLine, cst.SimpleStatementSuite)) and all(
        isinstance(s, cst.Return) for s in line.body
    )


def periodic(
    test: cst.BaseExpression, flags: frozenset[str] = frozenset(), named: frozenset[str] = frozenset()
) -> bool:
    """`i % n == k`, `not i % n`, `(i + 1) % n == 0`, and such tests joined with `and`; also
    `i % n == 0 or last_batch`: every few steps plus once more (``flags``: names holding a one-off test;
    ``named``: names holding a periodic one)."""
    if isinstance(test, cst.Name):
        return test.value in named
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return periodic(test.left, flags, named) or periodic(test.right, flags, named)
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.Or):
        sides = (test.left, test.right)
        return any(periodic(side, flags, named) for side in sides) and all(
            periodic(side, flags, named) or one_off(side, flags) for side in sides
        )
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return is_modulo(test.expression)
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        op = test.comparisons[0].operator
        right = test.comparisons[0].comparator
        return isinstance(op, cst.Equal) and (is_modulo(test.left) or is_modulo(right))
    return False


def one_off(test: cst.BaseExpression, flags: frozenset[str]) -> bool:
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


def negated(test: cst.BaseExpression) -> cst.BaseExpression:
    """The test that holds when ``test`` does not, where that reads as a periodic test: `not x` of
    `x`, `i % n == 0` of `i % n != 0` and of `i % n` (a remainder, true when not 0); else `not test`."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return test.expression
    if is_modulo(test):
        return cst.Comparison(test, [cst.ComparisonTarget(cst.Equal(), cst.Integer("0"))])
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        target = test.comparisons[0]
        if isinstance(target.operator, cst.NotEqual):
            return test.with_changes(comparisons=[target.with_changes(operator=cst.Equal())])
    return cst.UnaryOperation(cst.Not(), test)


def is_modulo(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Modulo)


def first_step(test: cst.BaseExpression) -> bool:
    """`i == 0`, `i < 1`, `i <= 0`: a counter (not a rank) compared with a small literal, alone or
    `and`-ed."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return first_step(test.left) or first_step(test.right)
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        op = test.comparisons[0].operator
        right = test.comparisons[0].comparator
        if not (isinstance(test.left, cst.Name) and isinstance(right, cst.Integer)):
            return False
        if test.left.value.lower() in RANK_NAMES:
            return False  # `rank == 0` is a guard, not a first step
        n = int(right.evaluated_value)
        return (
            isinstance(op, cst.Equal)
            or (isinstance(op, cst.LessThan) and n <= 1)
            or (isinstance(op, cst.LessThanEqual) and n <= 0)
        )
    return False


def first_steps(test: cst.BaseExpression, counters: frozenset[str]) -> bool:
    """`j <= 4`, `j < 8`: a loop counter below a small literal (a bounded number of iterations)."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return first_steps(test.left, counters) or first_steps(test.right, counters)
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
        return False
    op, right = test.comparisons[0].operator, test.comparisons[0].comparator
    return (
        isinstance(test.left, cst.Name)
        and test.left.value in counters
        and isinstance(op, (cst.LessThan, cst.LessThanEqual))
        and isinstance(right, cst.Integer)
        and int(right.evaluated_value) <= FEW
    )


def assigns(body: cst.CSTNode, name: str) -> bool:
    for n in walk(body):
        if isinstance(n, (cst.AugAssign, cst.AnnAssign)) and isinstance(n.target, cst.Name) and n.target.value == name:
            return True
        if isinstance(n, cst.Assign) and any(
            isinstance(t, cst.Name) and t.value == name for a in n.targets for t in walk(a.target)
        ):
            return True
    return False


def assigns_attr(body: cst.CSTNode, name: str) -> bool:
    """``body`` assigns the attribute ``name`` (`self.warmup = ...`, `args.warmup += 1`)."""
    for n in walk(body):
        targets: list[cst.BaseExpression] = []
        if isinstance(n, (cst.AugAssign, cst.AnnAssign)):
            targets = [n.target]
        elif isinstance(n, cst.Assign):
            targets = [t for a in n.targets for t in walk(a.target) if isinstance(t, cst.Attribute)]
        if any(isinstance(t, cst.Attribute) and dotted(t) == name for t in targets):
            return True
    return False


def leaves_loop(body: cst.BaseSuite) -> bool:
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
        return dotted(stmt.value.func) in _EXITS
    return False


def ends_program(body: cst.BaseSuite) -> bool:
    """The branch ends by raising or exiting the process (`print("bad header"); exit(1)`): an error
    path, which runs at most once and whose output is the error report."""
    if not leaves_loop(body) or not isinstance(body, cst.IndentedBlock):
        return False
    last = body.body[-1]
    return isinstance(last, cst.SimpleStatementLine) and not isinstance(last.body[-1], (cst.Break, cst.Return))


def counted(loop: cst.CSTNode) -> bool:
    """`for _ in range(n):`: a loop that runs a number of times, not over a loader."""
    return (
        isinstance(loop, cst.For)
        and isinstance(loop.iter, cst.Call)
        and isinstance(loop.iter.func, cst.Name)
        and loop.iter.func.value == "range"
    )
