"""Optimizers held by a small wrapper class of the file, stepped through the wrapper's own method.

A training script often wraps its ``torch.optim`` optimizer in a class that adds a learning-rate
schedule (``ScheduledOptim(torch.optim.Adam(...), ...)`` whose ``step_and_update_lr()`` sets the
learning rate, then calls ``self._optimizer.step()``). A GradScaler can only step a real optimizer
(it unscales its ``param_groups``), so the scaler goes where the real step is: the wrapper's
method receives the scaler as a new last parameter and steps the inner optimizer through it,
``scaler.step(self._optimizer)``; every call of that method passes the scaler. The wrapper's own
logic (the schedule) runs exactly as before, once per call, whether or not the scaler skips the
inner step, as a ``torch.optim.lr_scheduler`` stepped after ``scaler.step(optimizer)`` does."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from torchopt.analysis.names import dotted
from torchopt.analysis.program import program_of
from torchopt.analysis.statement_edits import Edits, Refusal
from torchopt.analysis.syntax import walk
from torchopt.rewrite.rule import Rule


@dataclass
class Wrapper:
    cls: cst.ClassDef = field(repr=False)
    # method name -> (the method, its one `self.<inner>.step()` call)
    methods: dict[str, tuple[cst.FunctionDef, cst.Call]] = field(default_factory=dict, repr=False)


def optimizer_wrapper(rule: Rule, call: cst.Call) -> Wrapper | None:
    """The wrapper ``call`` builds: a class of the file, not an ``nn.Module``, with a method that calls
    ``self.<attr>.step()`` (no arguments) once, where ``self.<attr>`` holds a ``torch.optim``
    optimizer in every construction of the class; None for anything else."""
    if not isinstance(call.func, cst.Name):
        return None
    program = program_of(rule)
    name = call.func.value
    cls = program.classes.get(name)
    if cls is None or name in program.module_classes:
        return None
    out = Wrapper(cls)
    for fn in program.functions.values():
        if fn.cls != name or fn.name.startswith("__"):
            continue
        steps = [
            c
            for c in walk(fn.node.body)
            if isinstance(c, cst.Call)
            and isinstance(c.func, cst.Attribute)
            and c.func.attr.value == "step"
            and isinstance(c.func.value, cst.Attribute)
            and dotted(c.func.value.value) == "self"
        ]
        inner = [c for c in steps if _holds_optimizer(program, c)]
        if len(inner) == 1 and len(steps) == 1 and not inner[0].args:
            out.methods[fn.name] = (fn.node, inner[0])
    return out if out.methods else None


def _holds_optimizer(program, step: cst.Call) -> bool:
    receiver = step.func.value if isinstance(step.func, cst.Attribute) else None
    role = program.role_of(receiver, step) if receiver is not None else None
    return role is not None and role.kind == "optimizer"


def check_wrapper_steps(analysis, steps: list[tuple[cst.Call, Wrapper]], unscaled: set[str]) -> None:
    """Refuse when the scaler cannot reach the wrapper's inner step: the method is called somewhere
    else too (where no scaler exists), its parameters take no new positional one, or gradients are
    read before the step (``unscale_`` would need the inner optimizer from outside the wrapper)."""
    for call, w in steps:
        method = cst.ensure_type(call.func, cst.Attribute).attr.value
        fn, _ = w.methods[method]
        receiver = dotted(cst.ensure_type(call.func, cst.Attribute).value)
        if receiver in unscaled:
            raise Refusal(
                call,
                f"gradients are read before `{receiver}.{method}()`, and unscaling them first would reach "
                f"into `{w.cls.name.value}` for its inner optimizer",
            )
        params = fn.params
        if (
            params.star_arg is not cst.MaybeSentinel.DEFAULT
            or params.kwonly_params
            or params.star_kwarg
            or any(p.default is not None for p in params.params)
        ):
            raise Refusal(
                call,
                f"`{w.cls.name.value}.{method}` has default or variadic parameters, so the scaler cannot "
                "be passed to it as a new last parameter",
            )
        ours = {id(c) for c, _ in steps} | {id(inner) for _, inner in w.methods.values()}
        for other in analysis.module_calls():
            f = other.func
            if isinstance(f, cst.Attribute) and f.attr.value == method and id(other) not in ours:
                line = analysis.pos(other)[0]
                raise Refusal(
                    call,
                    f"`{w.cls.name.value}.{method}` steps the inner optimizer and is also called at line "
                    f"{line}, where no scaler exists",
                )


def scale_wrapper_steps(e: Edits, steps: list[tuple[cst.Call, Wrapper]], sc: str) -> None:
    """Pass the scaler ``sc`` to each wrapper call; the wrapper's method takes it as a new last
    parameter and steps its inner optimizer through it."""
    done: set[int] = set()
    for call, w in steps:
        args = list(call.args)
        if args:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        kw = any(a.keyword is not None for a in args)
        arg = cst.Arg(cst.Name(sc), keyword=cst.Name(sc), equal=_equal()) if kw else cst.Arg(cst.Name(sc))
        e.replace_node(call, call.with_changes(args=args + [arg]))
        fn, inner = w.methods[cst.ensure_type(call.func, cst.Attribute).attr.value]
        if id(fn) in done:
            continue
        done.add(id(fn))
        plist = list(fn.params.params)
        plist[-1] = plist[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        e.replace_node(fn.params, fn.params.with_changes(params=plist + [cst.Param(cst.Name(sc))]))
        receiver = cst.ensure_type(inner.func, cst.Attribute).value
        e.replace_node(inner, cst.Call(func=cst.parse_expression(f"{sc}.step"), args=[cst.Arg(receiver)]))


def _equal() -> cst.AssignEqual:
    return cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))
