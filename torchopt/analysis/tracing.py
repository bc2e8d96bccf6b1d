"""Code whose traced graph is what the program gets: a lambda or function handed to a tracer.

`torch.jit.trace(lambda: torch.ones([]).float())` records the operations the callable runs, and
a program may read that graph (`graph.findNode("aten::to")`). A rewrite that keeps every value
bitwise but drops or adds an operation (`ones(...).float()` folded into `ones(..., dtype=...)`)
changes the graph, so the rules that fold operations leave such code alone. It runs once, when
traced, so there is no per-call cost to win either.
"""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

TRACERS = frozenset(
    {
        "torch.jit.trace",
        "torch.jit.trace_module",
        "torch.jit.script",
        "torch.fx.symbolic_trace",
        "torch.onnx.export",
        "torch.export.export",
    }
)


def _traces(rule: Rule, node: cst.CSTNode | None) -> bool:
    return isinstance(node, cst.Call) and callee(rule, node) in TRACERS


def _traced_names(rule: Rule) -> set[str]:
    """Names of the file's functions passed as an argument to a tracer."""
    return {
        a.value.value
        for call in walk(rule.ctx.module, cross_scopes=True)
        if isinstance(call, cst.Call) and _traces(rule, call)
        for a in call.args
        if isinstance(a.value, cst.Name)
    }


def in_traced_callable(rule: Rule, node: cst.CSTNode) -> bool:
    """``node`` is in a lambda passed to a tracer, or in a function of the file whose name is passed to one."""
    cur: cst.CSTNode | None = rule.get_metadata(ParentProvider, node, None)
    names: set[str] | None = None
    while cur is not None:
        if isinstance(cur, cst.Lambda):
            arg = rule.get_metadata(ParentProvider, cur, None)
            if isinstance(arg, cst.Arg) and _traces(rule, rule.get_metadata(ParentProvider, arg, None)):
                return True
        elif isinstance(cur, cst.FunctionDef):
            names = _traced_names(rule) if names is None else names
            if cur.name.value in names:
                return True
        cur = rule.get_metadata(ParentProvider, cur, None)
    return False
