"""What a model does with train/eval mode, and whether calling it runs with autograd off.

``mode_matters(rule, model, at)``: does ``model.eval()`` change what the module bound to the name
``model`` computes where ``at`` runs? True when some way it is built has a layer or a function whose
output depends on the mode (Dropout, BatchNorm, an InstanceNorm that tracks running statistics, an
RNN or a Transformer layer with dropout, ``F.dropout``, a read of ``self.training``); False when every
way it is built is known and uses only layers that ignore the mode (Linear, convolutions,
activations, pooling, LayerNorm/GroupNorm, Embedding...); None (unknown) for anything else: a
library model (``torchvision.models.resnet18()``, ``X.from_pretrained(...)``), a class that cannot be
read, a parameter nobody in the file passes, an attribute (``self.net``).

The model is followed from its name to the statements that bind it (aliases, ``.to(device)`` and
the other methods that return the module, ``DistributedDataParallel(model)``), through a
parameter to what each call of the function passes, and into the class it builds: a class of this
file or of another module of the project, read through the project index (each module's summary
says what its classes build, ``project_summary.Unit.mode``; the classes and functions they build
from are followed here), ``nn.Sequential(...)``/``nn.ModuleList([...])`` through their contents.

``runs_without_grad(rule, model, at)``: every way the name is built makes an instance of a class
of the project whose ``__call__`` (else ``forward``) is decorated with ``torch.no_grad()`` /
``torch.inference_mode()`` or runs wholly inside one (a pipeline object): calling it records no graph.

What is learnt about a class is kept in the analysed file's facts (``remembered``), once per parse.
"""

from __future__ import annotations

from typing import Any

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import callee, dotted, torch_name
from torchopt.analysis.program import MODULE_WRAPPERS, program_of
from torchopt.analysis.project import MAX_DEPTH, Definition, ProjectIndex, Unknown, index_of
from torchopt.analysis.project_summary import _NOT_LITERAL, ModuleSummary, torch_mode
from torchopt.rewrite.metadata import ParentProvider, remembered
from torchopt.rewrite.rule import Rule

# Methods that return the module they are called on (`Net().to(device).eval()`).
_SELF_RETURNING = frozenset(
    {"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "eval", "train", "requires_grad_", "share_memory"}
)
_CONTAINERS = frozenset({"Sequential", "ModuleList"})


def mode_matters(rule: Rule, model: str, at: cst.CSTNode) -> bool | None:
    """See the module docstring: True (mode matters), False (it does not), None (unknown)."""
    if not model or "." in model:
        return None
    calls = _constructions(rule, model, at, 0)
    return _combine([_call_mode(rule, c, 0) if c is not None else None for c in calls])


def runs_without_grad(rule: Rule, model: str, at: cst.CSTNode) -> bool:
    """See the module docstring."""
    if not model or "." in model:
        return False
    calls = _constructions(rule, model, at, 0)
    if not calls:
        return False
    for c in calls:
        d = _class_of(rule, c) if c is not None else None
        if not isinstance(d, Definition) or d.unit is None or not d.unit.call_no_grad:
            return False
    return True


def _combine(verdicts: list[bool | None]) -> bool | None:
    if not verdicts:
        return None
    if True in verdicts:
        return True
    return False if all(v is False for v in verdicts) else None


# ---------------------------------------------------------------------- from a name to its constructions
def _constructions(rule: Rule, name: str, at: cst.CSTNode, depth: int) -> list[cst.Call | None]:
    """The calls that build what ``name`` is bound to where ``at`` runs; None for a way that is not known."""
    if depth > MAX_DEPTH or name in _changed_names(rule):
        return [None]
    try:
        scope = rule.get_metadata(ScopeProvider, at)
    except KeyError:
        return [None]
    if scope is None or name not in scope:
        return [None]
    out: list[cst.Call | None] = []
    for a in scope[name]:
        node = getattr(a, "node", None)
        if isinstance(node, cst.Param):
            out += _from_parameter(rule, node, depth)
            continue
        target = rule.get_metadata(ParentProvider, node, None) if node is not None else None
        stmt = rule.get_metadata(ParentProvider, target, None) if isinstance(target, cst.AssignTarget) else None
        if not isinstance(stmt, cst.Assign) or not isinstance(target, cst.AssignTarget) or target.target is not node:
            out.append(None)  # a loop variable, a tuple target, an import, a def
            continue
        out += _from_expression(rule, stmt.value, depth)
    return out or [None]


_ADDS_PARTS = frozenset({"add_module", "register_module", "append", "extend", "insert", "update", "apply"})


def _changed_names(rule: Rule) -> frozenset[str]:
    """Names whose object gets parts after it is built, anywhere in the file (``model.fc =
    nn.Sequential(nn.Dropout(), ...)``, ``model.add_module(...)``, ``setattr(model, ...)``,
    ``model.apply(fn)``): what such a model holds is not what its class builds."""
    module = rule.ctx.module
    return remembered(("names given parts",), module, lambda: _find_changed_names(module))


def _find_changed_names(module: cst.Module) -> frozenset[str]:
    from torchopt.analysis.syntax import walk

    out: set[str] = set()
    for n in walk(module, cross_scopes=True):
        targets: list[cst.BaseExpression] = []
        if isinstance(n, cst.AssignTarget):
            targets.append(n.target)
        elif isinstance(n, (cst.AugAssign, cst.AnnAssign)):
            targets.append(n.target)
        elif isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value in _ADDS_PARTS:
            targets.append(n.func)
        elif isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value == "setattr" and n.args:
            targets.append(cst.Attribute(value=n.args[0].value, attr=cst.Name("x")))
        for t in targets:
            for e in t.elements if isinstance(t, (cst.Tuple, cst.List)) else ():
                targets.append(e.value)
            if isinstance(t, (cst.Attribute, cst.Subscript)):
                root: cst.BaseExpression = t
                while isinstance(root, (cst.Attribute, cst.Subscript)):
                    root = root.value
                if isinstance(root, cst.Name):
                    out.add(root.value)
    return frozenset(out)


def _from_expression(rule: Rule, expr: cst.BaseExpression, depth: int) -> list[cst.Call | None]:
    for _ in range(8):
        if (
            isinstance(expr, cst.Call)
            and isinstance(expr.func, cst.Attribute)
            and expr.func.attr.value in _SELF_RETURNING
            and isinstance(expr.func.value, (cst.Call, cst.Name))
        ):
            expr = expr.func.value
        elif isinstance(expr, cst.Call) and expr.args and callee(rule, expr) in MODULE_WRAPPERS:
            expr = expr.args[0].value
        else:
            break
    if isinstance(expr, cst.Name):
        return _constructions(rule, expr.value, expr, depth + 1)
    if isinstance(expr, cst.Call) and isinstance(expr.func, (cst.Name, cst.Attribute)):
        return [expr]
    return [None]


def _from_parameter(rule: Rule, param: cst.Param, depth: int) -> list[cst.Call | None]:
    """What each call of the parameter's function passes for it (a function of the file)."""
    fn = rule.get_metadata(ParentProvider, rule.get_metadata(ParentProvider, param, None), None)
    if not isinstance(fn, cst.FunctionDef):
        return [None]
    func = program_of(rule).function_of(fn.body)
    name = param.name.value
    if func is None or func.node is not fn or name not in func.params or not func.callers:
        return [None]
    idx = func.params.index(name)
    out: list[cst.Call | None] = []
    for edge in func.callers:
        offset = 1 if edge.how in ("method", "constructor", "spawn") else 0
        arg = _argument(edge.call, idx - offset, name)
        out += _from_expression(rule, arg, depth + 1) if arg is not None else [None]
    return out


def _argument(call: cst.Call, index: int, name: str) -> cst.BaseExpression | None:
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a.value
    positional = [a for a in call.args if a.keyword is None]
    if any(a.star for a in positional[: index + 1]):
        return None
    return positional[index].value if 0 <= index < len(positional) else None


# ---------------------------------------------------------------------- what a construction builds
def _call_mode(rule: Rule, call: cst.Call, depth: int) -> bool | None:
    q = torch_name(rule, call.func)
    if q is not None:
        last = q.rsplit(".", 1)[-1]
        if q.startswith("torch.nn.") and last in _CONTAINERS:
            return _contents_mode(rule, call, depth)
        verdict = torch_mode(q, *_literal_arguments(call))
        return {"train": True, "": False}.get(verdict)
    d = _class_of(rule, call)
    if not isinstance(d, Definition):
        return None
    got = definition_mode(rule, d)
    return got if isinstance(got, bool) else None


def _contents_mode(rule: Rule, call: cst.Call, depth: int) -> bool | None:
    """``nn.Sequential(a, b)`` / ``nn.ModuleList([a, b])``: what each part builds."""
    parts: list[cst.BaseExpression] = []
    for a in call.args:
        if a.star or a.keyword is not None:
            return None
        if isinstance(a.value, (cst.List, cst.Tuple)):
            if any(isinstance(e, cst.StarredElement) for e in a.value.elements):
                return None
            parts += [e.value for e in a.value.elements]
        else:
            parts.append(a.value)
    verdicts: list[bool | None] = []
    for p in parts:
        for c in _from_expression(rule, p, depth + 1):
            verdicts.append(_call_mode(rule, c, depth + 1) if c is not None else None)
    return _combine(verdicts) if verdicts else False


def _literal_arguments(call: cst.Call) -> tuple[list[Any], dict[str, Any]]:
    if any(a.star for a in call.args):
        return [_NOT_LITERAL] * 8, {"training": _NOT_LITERAL}
    args = [_literal(a.value) for a in call.args if a.keyword is None]
    kwargs = {a.keyword.value: _literal(a.value) for a in call.args if a.keyword is not None}
    return args, kwargs


def _literal(expr: cst.BaseExpression) -> Any:
    if isinstance(expr, (cst.Integer, cst.Float)):
        return expr.evaluated_value
    if isinstance(expr, cst.Name) and expr.value in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[expr.value]
    return _NOT_LITERAL


def _class_of(rule: Rule, call: cst.Call) -> Definition | Unknown | None:
    """The project class (this file's or another module's) that ``call`` builds, if it builds one."""
    written = dotted(call.func)
    if written is None:
        return None
    index = index_of(rule)
    got = _resolve(index, written, index.own, index.path)
    return got if isinstance(got, Unknown) or (isinstance(got, Definition) and got.kind == "class") else None


def _resolve(index: ProjectIndex, written: str, module: ModuleSummary, path: str | None) -> Definition | Unknown | None:
    head, _, rest = written.partition(".")
    if not rest and (head in module.classes or head in module.functions):
        unit = module.classes.get(head) or module.functions[head]
        return Definition("class" if head in module.classes else "function", head, path or "", module, unit)
    return index.resolve(written, module, path) if path else None


def definition_mode(rule: Rule, d: Definition) -> bool | Unknown:
    """Whether building the project class ``d`` (or calling the function ``d``) builds anything whose
    output depends on the mode: through its bases and what it builds, ``MAX_DEPTH`` deep."""
    memo: dict[tuple[str, str], bool | Unknown] = remembered(("module modes",), rule.ctx.module, dict)
    return _definition_mode(index_of(rule), d, memo, set(), 0)


def _definition_mode(
    index: ProjectIndex, d: Definition, memo: dict[tuple[str, str], bool | Unknown], seen: set, depth: int
) -> bool | Unknown:
    key = (d.path, d.name)
    if key in memo:
        return memo[key]
    unit = d.unit
    if unit is None or key in seen or depth > MAX_DEPTH:
        return Unknown(f"`{d.name}` could not be followed")
    seen.add(key)
    if unit.mode == "train":
        memo[key] = True
        return True
    unknown: Unknown | None = Unknown(f"`{d.name}` builds something its code does not tell") if unit.mode else None
    for written in unit.mode_calls:
        got = _resolve(index, written, d.module, d.path or None)
        if isinstance(got, Definition) and got.kind in ("class", "function"):
            sub = _definition_mode(index, got, memo, seen, depth + 1)
            if sub is True:
                memo[key] = True
                return True
            if isinstance(sub, Unknown):
                unknown = unknown or sub
        else:
            unknown = unknown or Unknown(f"`{written}` (used by `{d.name}`) is not a class of the project")
    memo[key] = unknown or False
    return memo[key]
