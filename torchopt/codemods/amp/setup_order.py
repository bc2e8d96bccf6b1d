"""When the AMP set-up placed after a module-level statement exists for a step inside a function.

A script often builds its model and optimizer as module globals *below* the training function that
reads them (``def train(epoch):`` first, then ``net = Net()``, ``optimizer = SGD(...)`` at module
level or under ``if __name__ == "__main__":``, then ``train(epoch)`` in a loop). The scaler created
next to that optimizer is a module global too, and the function reads it the way it reads the
optimizer; what matters is that every call of the function runs after the set-up, not where the
function is written."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.program import Function, Program


def calls_follow(program: Program, fn: Function, at: cst.CSTNode, pos, seen: frozenset[str] = frozenset()) -> bool:
    """Whether every call of ``fn`` in the file runs after the module-level statement ``at``: each
    call written at module level comes after ``at`` (``pos`` gives a node's position), and each call
    from another function is itself only reached after ``at``. False when ``fn`` is never called in
    the file (nothing says when it runs) or is reached through recursion."""
    if not fn.callers or fn.qualname in seen:
        return False
    for edge in fn.callers:
        caller = program.function_of(edge.call)
        if caller is None:
            if pos(edge.call) <= pos(at):
                return False
        elif not calls_follow(program, caller, at, pos, seen | {fn.qualname}):
            return False
    return True
