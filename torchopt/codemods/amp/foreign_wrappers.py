"""Optimizers held by a class of another module of the project, stepped through that class.

A trainer often keeps ``self.optimizer = Optimizer(optim.Adam(model.parameters()), max_grad_norm=5)``,
where ``Optimizer`` is a small class of the project (in another file) whose ``step()`` clips the
gradients and steps the torch.optim optimizer it holds. A GradScaler can only step a real optimizer,
and must unscale its gradients before any clipping: both happen inside that class, in a file a fix of
this one does not edit (the same wrapper in this file is handled by ``optimizer_wrappers``). The rule
says so at the step, naming the class and its file, rather than staying silent."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import dotted, qualified_names
from torchopt.analysis.program import Function, Program, program_of
from torchopt.analysis.project import Definition, index_of
from torchopt.analysis.statement_edits import body_list
from torchopt.analysis.syntax import walk
from torchopt.codemods.amp.autocast_insertion import _Analysis, _calls, _single_small
from torchopt.codemods.amp.step_analysis import _backward_call
from torchopt.codemods.amp.prechecks import optim_class
from torchopt.rewrite.rule import Rule


def foreign_wrapper_steps(rule: Rule, analysis: _Analysis) -> list[tuple[cst.CSTNode, str, cst.FunctionDef]]:
    """(the backward statement, why, the function) for each function whose body runs ``backward()`` and then
    ``<x>.step()``, where ``<x>`` is built as an instance of a project class of another file (not an
    ``nn.Module``) given a ``torch.optim`` optimizer."""
    program = program_of(rule)
    out: list[tuple[cst.CSTNode, str, cst.FunctionDef]] = []
    for fn in program.functions.values():
        body = body_list(fn.node.body) or []
        first = next((i for i, s in enumerate(body) if _backward_call(s) is not None), None)
        if first is None or analysis.autocast_with(fn.node.body):
            continue
        if any(
            isinstance(c.func, cst.Attribute) and c.func.attr.value in ("scale", "unscale_") for c in _calls(fn.node)
        ):
            continue  # already scaled
        for s in body[first + 1 :]:
            small = _single_small(s)
            call = small.value if isinstance(small, cst.Expr) else None
            if not (
                isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value == "step"
            ):
                continue
            found = _wrapper_class(rule, program, fn, call.func.value)
            if found is not None:
                written, defn = found
                held = dotted(call.func.value)
                out.append(
                    (
                        body[first],
                        f"`{held}` is built as `{written}(...)` around a torch.optim optimizer, and `{written}` is a "
                        f"class of another file of the project ({index_of(rule).shown(defn.path)}): the GradScaler "
                        "has to step the optimizer it holds (and unscale the gradients before any clipping it "
                        f"does) inside `{written}`, in that file",
                        fn.node,
                    )
                )
                break
    return out


def _wrapper_class(rule: Rule, program: Program, fn: Function, held: cst.BaseExpression):
    """(the class as written, its definition) when a value ``held`` is bound to, in this file, is a call
    of a project class of another file given a ``torch.optim`` optimizer; else None."""
    index = index_of(rule)
    for value in _bound_values(program, fn, held):
        if not isinstance(value, cst.Call) or not isinstance(value.func, (cst.Name, cst.Attribute)):
            continue
        written = dotted(value.func)
        if not written or not any(_builds_optimizer(rule, a.value) for a in value.args):
            continue
        defn = index.resolve(written)
        if (
            isinstance(defn, Definition)
            and defn.kind == "class"
            and defn.path != index.path
            and index.is_module_class(defn) is False
        ):
            return written, defn
    return None


def _bound_values(program: Program, fn: Function, held: cst.BaseExpression) -> list[cst.BaseExpression]:
    """What ``held`` (``self.optimizer`` in a method, or a local name) is assigned, following a name
    assigned to it one step within the function that assigns it (``self.optimizer = optimizer``)."""
    d = dotted(held)
    if d is None:
        return []
    if d.startswith("self.") and d.count(".") == 1 and fn.cls is not None:
        stmts = program.attribute_bindings(fn.cls, d[len("self.") :])
        pairs = [(_value(s), program.function_of(s)) for s in stmts]
    elif "." not in d:
        pairs = [(v, fn) for v in _assigned_in(fn.node, d)]
    else:
        return []
    out: list[cst.BaseExpression] = []
    for v, owner in pairs:
        if isinstance(v, cst.Name) and owner is not None:
            out.extend(_assigned_in(owner.node, v.value))
        elif v is not None:
            out.append(v)
    return out


def _value(stmt: cst.CSTNode) -> cst.BaseExpression | None:
    small = _single_small(stmt)
    return small.value if isinstance(small, cst.Assign) else None


def _assigned_in(fn: cst.FunctionDef, name: str) -> list[cst.BaseExpression]:
    return [
        n.value
        for n in walk(fn.body)
        if isinstance(n, cst.Assign)
        and any(isinstance(t.target, cst.Name) and t.target.value == name for t in n.targets)
    ]


def _builds_optimizer(rule: Rule, arg: cst.BaseExpression) -> bool:
    """``arg`` is a ``torch.optim`` constructor call (``optim.Adam(model.parameters())``)."""
    return isinstance(arg, cst.Call) and any(optim_class(q) for q in qualified_names(rule, arg.func))
