"""Finding "the model" of a training or evaluation script, shared by the CL and CMP/CG rules.

A model is a plain name ``NAME``, called somewhere in the file (``NAME(x)``), whose parameters feed a ``torch.optim.*`` constructor
(``torch.optim.SGD(NAME.parameters(), ...)``) or which is put in eval mode (``NAME.eval()``), and
whose every binding in its scope is a ``NAME = <call>`` statement written directly in one block (the
module or a function body). Its *set-up* is those assignments plus statements such as
``NAME.to(device)`` or ``NAME.load_state_dict(...)``; the set-up ends before the first other
statement that mentions ``NAME`` (the training loop, a call that takes it)."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import callee, dotted, torch_name
from torchopt.analysis.arguments import positional
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider, remembered
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.facts import source_of

SETUP_METHODS = frozenset(
    {
        "to",
        "cuda",
        "cpu",
        "half",
        "float",
        "double",
        "bfloat16",
        "load_state_dict",
        "train",
        "eval",
        "apply",
        "requires_grad_",
        "share_memory",
        "zero_grad",
    }
)
# Methods whose result holds no reference to the model's code path (optimizer construction).
_PARAM_METHODS = frozenset({"parameters", "named_parameters"})
# Random ops: a compiled graph draws them with its own generator unless
# `torch._inductor.config.fallback_random` is set.
RANDOM_TOKENS = ("Dropout", "dropout", "rand", "bernoulli", "multinomial", "normal_", "uniform_", "RReLU", "rrelu")


def nn_module_classes(rule: Rule) -> frozenset[str]:
    """Names of the file's classes that derive from a ``torch.nn`` class (``nn.Module``,
    ``nn.Sequential``, ``nn.Linear``...), directly or through other classes of the file: the one scan
    the step-loop map, the program model and the AMP, DDP and zero_grad rules share (once per parse)."""
    module = rule.ctx.module
    return remembered(("nn.Module subclasses",), module, lambda: _find_nn_module_classes(rule, module))


def _find_nn_module_classes(rule: Rule, module: cst.Module) -> frozenset[str]:
    classes = [n for n in walk(module, cross_scopes=True) if isinstance(n, cst.ClassDef)]
    found: set[str] = set()
    changed = True
    while changed:  # a class may derive from one defined below it
        changed = False
        for c in classes:
            if c.name.value in found:
                continue
            for b in c.bases:
                q = torch_name(rule, b.value) if isinstance(b.value, (cst.Name, cst.Attribute)) else None
                if (q and q.startswith("torch.nn.") and q.rsplit(".", 1)[1][:1].isupper()) or dotted(b.value) in found:
                    found.add(c.name.value)
                    changed = True
                    break
    return frozenset(found)


def project_module_class(rule: Rule, func: cst.BaseExpression) -> bool:
    """Whether calling ``func`` (``Generator``, ``lpips.PerceptualLoss``, as written) builds an instance of a
    class another file of the project defines and that derives from ``torch.nn.Module`` (read through
    the project index). False when that is not established: a library name, a function, an unknown."""
    from torchopt.analysis.project import Definition, index_of

    written = dotted(func)
    if written is None or torch_name(rule, func) is not None:
        return False
    index = index_of(rule)
    found = index.resolve(written)
    return (
        isinstance(found, Definition)
        and found.kind == "class"
        and found.path != index.path
        and index.is_module_class(found) is True
    )


@dataclass
class Model:
    name: str
    suite: cst.Module | cst.IndentedBlock
    assigns: list[cst.SimpleStatementLine]  # in source order; the first builds the model
    setup_end: cst.SimpleStatementLine  # the last set-up statement (insert after it)
    base: cst.Call  # the constructor call of the first assignment, method chain stripped


def strip_chain(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``Net(...).to(device).cuda()`` → ``Net(...)``."""
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and isinstance(expr.func.value, cst.Call):
        expr = expr.func.value
    return expr


def _assigned_name(stmt: cst.CSTNode) -> str | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if (
            isinstance(small, cst.Assign)
            and len(small.targets) == 1
            and isinstance(small.targets[0].target, cst.Name)
            and isinstance(small.value, cst.Call)
        ):
            return small.targets[0].target.value
    return None


def _setup_call(stmt: cst.CSTNode, name: str) -> bool:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr):
        call = stmt.body[0].value
        return (
            isinstance(call, cst.Call)
            and isinstance(call.func, cst.Attribute)
            and isinstance(call.func.value, cst.Name)
            and call.func.value.value == name
            and call.func.attr.value in SETUP_METHODS
        )
    return False


def _mentions_outside_param_attr(stmt: cst.CSTNode, name: str) -> bool:
    names = [n for n in walk(stmt, cross_scopes=True) if isinstance(n, cst.Name) and n.value == name]
    params = [
        n
        for n in walk(stmt, cross_scopes=True)
        if isinstance(n, cst.Attribute)
        and isinstance(n.value, cst.Name)
        and n.value.value == name
        and n.attr.value in _PARAM_METHODS
    ]
    return len(names) > len(params)


def _candidates(rule: Rule, module: cst.Module) -> list[cst.Name]:
    out: list[cst.Name] = []
    for node in walk(module, cross_scopes=True):
        if not isinstance(node, cst.Call):
            continue
        f = node.func
        if isinstance(f, cst.Attribute) and f.attr.value == "eval" and isinstance(f.value, cst.Name) and not node.args:
            out.append(f.value)
            continue
        args = positional(node)
        if not args:
            continue
        first = args[0].value
        if (
            isinstance(first, cst.Call)
            and isinstance(first.func, cst.Attribute)
            and first.func.attr.value in _PARAM_METHODS
            and isinstance(first.func.value, cst.Name)
        ):
            q = callee(rule, node)
            if q and q.startswith("torch.optim."):
                out.append(first.func.value)
    return out


def find_models(rule: Rule, module: cst.Module) -> list[Model]:
    """Every model of the file (see the module docstring), each once."""
    models: list[Model] = []
    seen: set[tuple[int, str]] = set()
    for ref in _candidates(rule, module):
        try:
            scope = rule.get_metadata(ScopeProvider, ref)
        except KeyError:
            continue
        if scope is None or ref.value not in scope:
            continue
        lines: list[cst.SimpleStatementLine] = []
        ok = True
        for a in scope[ref.value]:
            node = getattr(a, "node", None)
            expr = rule.get_metadata(ParentProvider, node, None) if node is not None else None
            target = rule.get_metadata(ParentProvider, expr, None) if isinstance(expr, cst.AssignTarget) else None
            line = rule.get_metadata(ParentProvider, target, None) if isinstance(target, cst.Assign) else None
            if not isinstance(line, cst.SimpleStatementLine) or _assigned_name(line) != ref.value:
                ok = False
                break
            lines.append(line)
        if not ok or not lines:
            continue
        suites = {id(rule.get_metadata(ParentProvider, ln, None)) for ln in lines}
        suite = rule.get_metadata(ParentProvider, lines[0], None)
        if len(suites) != 1 or not isinstance(suite, (cst.Module, cst.IndentedBlock)):
            continue
        key = (id(suite), ref.value)
        if key in seen:
            continue
        seen.add(key)
        body = list(suite.body)
        ids = {id(ln) for ln in lines}
        ordered = [s for s in body if isinstance(s, cst.SimpleStatementLine) and id(s) in ids]
        start = body.index(ordered[0])
        end = ordered[0]
        for stmt in body[start + 1 :]:
            if isinstance(stmt, cst.SimpleStatementLine) and (id(stmt) in ids or _setup_call(stmt, ref.value)):
                end = stmt
                continue
            if _mentions_outside_param_attr(stmt, ref.value):
                break
        if any(body.index(s) > body.index(end) for s in ordered):
            continue  # rebound after it is used: not one model
        base = strip_chain(cst.ensure_type(ordered[0].body[0], cst.Assign).value)
        if not isinstance(base, cst.Call):
            continue
        if not calls_of(module, ref.value):
            continue  # built and returned (a factory), never run here
        models.append(Model(ref.value, suite, ordered, end, base))
    return models


def statement_of(rule: Rule, node: cst.CSTNode) -> cst.BaseStatement | None:
    cur: cst.CSTNode | None = node
    while cur is not None and not isinstance(cur, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        cur = rule.get_metadata(ParentProvider, cur, None)
    return cur


def calls_of(module: cst.Module, name: str) -> list[cst.Call]:
    """Calls ``name(...)`` anywhere in the file."""
    return [
        n
        for n in walk(module, cross_scopes=True)
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value == name
    ]


def has_random_ops(module: cst.Module) -> bool:
    """Random ops a compiled model would run: dropout/RReLU layers anywhere in the file, or a random
    call inside a ``forward`` (data generation outside the model does not count)."""
    code = source_of(module)
    if any(tok in code for tok in ("Dropout", "RReLU", "AlphaDropout")):
        return True
    for fn in walk(module, cross_scopes=True):
        if isinstance(fn, cst.FunctionDef) and fn.name.value == "forward":
            text = module.code_for_node(fn)
            if any(tok in text for tok in RANDOM_TOKENS):
                return True
    return False


def models_possible(text: str) -> bool:
    """Cheap necessary condition for ``find_models`` on CPython's ast: some plain name N is a
    candidate (``N.eval()``, or ``N.parameters()``/``N.named_parameters()`` first positional argument
    of a call that may resolve to ``torch.optim.*``), is assigned a call (``N = <call>``, one target)
    and is called (``N(...)``) somewhere in the file. True when the text does not parse."""
    import ast as _ast

    from torchopt.analysis.precheck.torch_imports import ast_torch_names, torch_import_map
    from torchopt.analysis.precheck.tree import ast_index

    index, imports = ast_index(text), torch_import_map(text)
    if index is None:
        return True
    calls = index.get(_ast.Call, ())
    cands: set[str] = set()
    for c in calls:
        f = c.func
        if (
            isinstance(f, _ast.Attribute)
            and f.attr == "eval"
            and isinstance(f.value, _ast.Name)
            and not c.args
            and not c.keywords
        ):
            cands.add(f.value.id)
            continue
        if not c.args:
            continue
        first = c.args[0]
        if isinstance(first, _ast.Starred):
            first = first.value
        if (
            isinstance(first, _ast.Call)
            and isinstance(first.func, _ast.Attribute)
            and first.func.attr in _PARAM_METHODS
            and isinstance(first.func.value, _ast.Name)
        ):
            if imports is None or any(q.startswith("torch.optim.") for q in ast_torch_names(imports, c.func)):
                cands.add(first.func.value.id)
    if not cands:
        return False
    called = {c.func.id for c in calls if isinstance(c.func, _ast.Name)} & cands
    if not called:
        return False
    return any(
        len(a.targets) == 1
        and isinstance(a.targets[0], _ast.Name)
        and a.targets[0].id in called
        and isinstance(a.value, _ast.Call)
        for a in index.get(_ast.Assign, ())
    )
