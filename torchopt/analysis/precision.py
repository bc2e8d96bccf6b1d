"""The precision a training program runs in when it is started plainly (no option given).

Rules whose advice presumes float32 (mixed precision, TF32, pure-fp16 warnings) ask this fact
instead of each looking for `.half()` on its own. A cast under an `if` (other than the
``__main__`` guard) is an opt-in: it does not make the program half precision by default.

Public API:

* ``precision_of(rule) -> Precision`` (built once per parsed module).
* ``Precision.kind``: ``"mixed"`` (the file enters ``torch.autocast`` or builds a GradScaler),
  ``"half"`` (every model the file binds to a name is cast to float16/bfloat16 unconditionally in
  the function that builds it: ``model.half()``, ``model.to(torch.bfloat16)``), ``"float32"`` (the file builds a model and casts none of them
  unconditionally), ``"unknown"`` (no model of the file is seen).
* ``Precision.casts``: every cast of a model to float16/bfloat16, each with the ``if`` that guards
  it (``Cast.condition``; None: unconditional).
* ``Precision.restored``: after casting a model to half, the file puts some of its modules back to
  float32 (``for m in net.modules(): if isinstance(m, Norm): m.float()``): the precision of each
  module is managed by hand, deliberately.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from torchopt.analysis.names import callee, dotted, reaching_values
from torchopt.analysis.program import MODULE_WRAPPERS, Program, program_of
from torchopt.analysis.project_summary import AUTOCASTS
from torchopt.analysis.syntax import walk
from torchopt.analysis.values import dtype_of
from torchopt.rewrite.metadata import remembered
from torchopt.rewrite.rule import Rule

_SCALERS = {"torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.amp.grad_scaler.GradScaler"}
_HALF_METHODS = {"half", "bfloat16"}
_KEEPS_MODULE = {"to", "cuda", "cpu", "train", "eval", "half", "bfloat16", "float", "requires_grad_"}


@dataclass
class Cast:
    call: cst.Call = field(repr=False)
    model: str  # the receiver as written
    condition: cst.If | None = field(default=None, repr=False)


@dataclass
class Precision:
    kind: str
    casts: list[Cast] = field(default_factory=list)
    restored: bool = False

    def opt_in(self) -> list[Cast]:
        """The casts that run only under a switch."""
        return [c for c in self.casts if c.condition is not None]


def _half_cast(rule: Rule, call: cst.Call) -> bool:
    if not isinstance(call.func, cst.Attribute):
        return False
    meth = call.func.attr.value
    if meth in _HALF_METHODS:
        return not call.args
    if meth == "to":
        return any(not a.star and dtype_of(rule, a.value) in ("float16", "bfloat16") for a in call.args)
    return False


def _receiver(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``net`` of ``net.cuda().half()``."""
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _KEEPS_MODULE:
        expr = expr.func.value
    return expr


def _condition(program: Program, node: cst.CSTNode) -> cst.If | None:
    """The innermost ``if`` guarding ``node`` within its function (not the ``__main__`` guard)."""
    cur = program.parent(node)
    while cur is not None and not isinstance(cur, (cst.FunctionDef, cst.ClassDef, cst.Module)):
        if isinstance(cur, cst.If) and "__name__" not in (dotted(_first_name(cur.test)) or ""):
            return cur
        cur = program.parent(cur)
    return None


def _first_name(test: cst.BaseExpression) -> cst.BaseExpression:
    return test.left if isinstance(test, cst.Comparison) else test


def _is_model(program: Program, expr: cst.BaseExpression, at: cst.CSTNode) -> bool:
    if isinstance(expr, cst.Call):
        role = program.role_of(expr, at) if isinstance(expr.func, (cst.Name, cst.Attribute)) else None
        return role is not None and role.kind == "model"
    if not isinstance(expr, (cst.Name, cst.Attribute)):
        return False
    role = program.role_of(expr, at)
    if role is not None:
        return role.kind == "model"
    if isinstance(expr, cst.Name):  # `net = Net(); net = net.half()`: what the name is bound to, rebindings aside
        values = [
            v
            for v in reaching_values(program.rule, expr) or []
            if v is None
            or not (_holds(v, at) or dotted(_receiver(v)) == expr.value)  # `net = net.to(...)`: the same object
        ]
        return bool(values) and all(v is not None and _is_model(program, v, v) for v in values)
    return False


def _holds(node: cst.CSTNode, inner: cst.CSTNode) -> bool:
    return any(n is inner for n in walk(node, True))


def _restores(nodes: list[cst.CSTNode]) -> bool:
    """``for m in net.modules(): ... m.float()``: modules put back to float32 one by one."""
    for n in nodes:
        if not (isinstance(n, cst.For) and isinstance(n.target, cst.Name) and isinstance(n.iter, cst.Call)):
            continue
        it = n.iter.func
        if not (isinstance(it, cst.Attribute) and it.attr.value in ("modules", "children")):
            continue
        var = n.target.value
        for c in walk(n.body, True):
            if (
                isinstance(c, cst.Call)
                and isinstance(c.func, cst.Attribute)
                and c.func.attr.value == "float"
                and not c.args
                and dotted(c.func.value) == var
            ):
                return True
    return False


def _uncast_models(program: Program, casts: list[Cast]) -> bool:
    """A model of the program, bound to a plain name, that no unconditional cast of its function makes
    half (a second, float32 program beside a half one: `model` in `finetune` next to a module-level half one)."""
    cast = {(_fn(program, c.call), c.model) for c in casts if c.condition is None}
    for role in program.roles("model"):
        name = role.path[0] if role.path else ""
        if not name or "." in name:
            continue  # `self.conv1`: a layer of a module class
        origin = role.origin
        if isinstance(origin, cst.Call) and callee(program.rule, origin) in MODULE_WRAPPERS:
            continue  # `nn.DataParallel(model)`: the wrapped model counts
        if (_fn(program, origin), name) not in cast:
            return True
    return False


def _bound_to(program: Program, call: cst.Call) -> str:
    """``model`` for the cast in ``model = nn.Linear(4, 2).to(device).half()``."""
    cur = program.parent(call)
    while isinstance(cur, (cst.Call, cst.Attribute)):
        cur = program.parent(cur)
    if isinstance(cur, cst.Assign) and len(cur.targets) == 1:
        return dotted(cur.targets[0].target) or ""
    return ""


def _fn(program: Program, node: cst.CSTNode) -> str:
    f = program.function_of(node)
    return f.qualname if f is not None else "<module>"


def _build(rule: Rule) -> Precision:
    program = program_of(rule)
    nodes = program.nodes
    mixed = any(isinstance(n, cst.Call) and callee(rule, n) in AUTOCASTS | _SCALERS for n in nodes)
    casts: list[Cast] = []
    for n in nodes:
        if isinstance(n, cst.Call) and _half_cast(rule, n):
            recv = _receiver(cst.ensure_type(n.func, cst.Attribute).value)
            if _is_model(program, recv, n):
                casts.append(Cast(n, dotted(recv) or _bound_to(program, n), _condition(program, n)))
    if mixed:
        kind = "mixed"
    elif any(c.condition is None for c in casts) and not _uncast_models(program, casts):
        kind = "half"
    elif program.roles("model"):
        kind = "float32"
    else:
        kind = "unknown"
    return Precision(kind, casts, bool(casts) and _restores(nodes))


def precision_of(rule: Rule) -> Precision:
    """The program's precision, built once per parsed module."""
    return remembered(("precision",), rule.ctx.module, lambda: _build(rule))
