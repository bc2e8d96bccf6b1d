"""Cheap pre-checks on the raw text or CPython's ast: necessary conditions a rule's ``could_match`` tests
before LibCST parses the file (each says True whenever the rule could report, and when in doubt)."""

from __future__ import annotations

import ast as _ast
from typing import Iterable

from torchopt.analysis.conventions import (
    CONVENTIONAL_MODEL_NAMES,
    EVAL_FUNCTION,
    MODULE_ONLY_METHODS,
    eval_loader_name,
    model_name,
)
from torchopt.analysis.precheck.tree import AST_SCOPES, ast_calls, ast_dotted, ast_index, ast_tree, nodes_of
from torchopt.rewrite.facts import facts_for


def _step_loops_possible(index: dict[type, list]) -> bool:
    loops = nodes_of(index, _ast.For, _ast.AsyncFor, _ast.While)
    if not loops:
        return False
    funcs: dict[str, list] = {}
    maybe_modules: set[str] = set()
    for n in nodes_of(index, _ast.FunctionDef, _ast.AsyncFunctionDef):
        funcs.setdefault(n.name, []).append(n)
    class_aliases = {
        a.asname
        for n in nodes_of(index, _ast.ImportFrom)
        for a in n.names
        if a.asname and a.name.rsplit(".", 1)[-1][:1].isupper()
    }
    for n in nodes_of(index, _ast.Assign, _ast.Call):
        if isinstance(n, _ast.Assign) and isinstance(n.value, _ast.Call):
            base = n.value
            while (
                isinstance(base, _ast.Call)
                and isinstance(base.func, _ast.Attribute)
                and isinstance(base.func.value, _ast.Call)
            ):
                base = base.func.value
            name = ast_dotted(base.func) if isinstance(base, _ast.Call) else None
            last = (name or "").rsplit(".", 1)[-1]
            if last[:1].isupper() or last == "compile" or last in class_aliases:
                for t in n.targets:
                    d = ast_dotted(t)
                    if d:
                        maybe_modules.add(d)
        elif isinstance(n, _ast.Call) and isinstance(n.func, _ast.Attribute) and n.func.attr in MODULE_ONLY_METHODS:
            d = ast_dotted(n.func.value)
            if d:
                maybe_modules.add(d)

    def direct(c: _ast.Call) -> bool:
        if isinstance(c.func, _ast.Attribute) and c.func.attr == "backward":
            return True
        d = ast_dotted(c.func)
        return d is not None and (d in maybe_modules or d.rsplit(".", 1)[-1] in CONVENTIONAL_MODEL_NAMES or d == "self")

    if not any(direct(c) for c in index.get(_ast.Call, ())):
        return False  # nothing anywhere that a loop could reach

    def scan(body: list) -> tuple[bool, set[str]]:
        refs: set[str] = set()
        for c in ast_calls(body):
            if isinstance(c.func, _ast.Attribute) and c.func.attr == "backward":
                return True, refs
            d = ast_dotted(c.func)
            if d is None:
                continue
            last = d.rsplit(".", 1)[-1]
            if d in maybe_modules or last in CONVENTIONAL_MODEL_NAMES or d == "self":
                return True, refs
            if d.startswith("self.") or "." not in d:
                refs.add(last)
        return False, refs

    # A function is "hot" when its body hits directly or calls (by name) a hot function: the least
    # fixed point, without the depth limit, over every def of a name (a superset of _hot's walk).
    info = {name: [scan(fn.body) for fn in fns] for name, fns in funcs.items()}
    hot = {name for name, scans in info.items() if any(h for h, _ in scans)}
    changed = True
    while changed:
        changed = False
        for name, scans in info.items():
            if name not in hot and any(refs & hot for _, refs in scans):
                hot.add(name)
                changed = True
    for loop in loops:
        hits, refs = scan(loop.body)
        if hits or refs & hot:
            return True
    return False


def may_have_step_loops(text: str) -> bool:
    """Cheap necessary condition for ``sync._hot.HotMap.step_loops`` to be non-empty: the same
    over-approximation as ``HotMap._may_have_step_loops``, on CPython's ``ast`` (no LibCST parse).
    True when the text does not parse (the engine reports that)."""
    if "for" not in text and "while" not in text:
        return False
    return facts_for(text).derived("step loops possible", lambda: _step_loops_possible_in(text))


def _step_loops_possible_in(text: str) -> bool:
    index = ast_index(text)
    return True if index is None else _step_loops_possible(index)


def _ast_loop_under_context(tree: _ast.AST) -> bool:
    """Some ``for``/``while`` loop sits in a ``with <call>:`` of its own function (or the module),
    directly in a decorated function, or holds a ``with <call>:`` statement in its body: what
    amp.insert.InferenceAutocast needs (a loop under ``torch.no_grad()``/``inference_mode()``)."""
    loops = (_ast.For, _ast.AsyncFor, _ast.While)
    withs = (_ast.With, _ast.AsyncWith)

    def visit(node: _ast.AST, ctx: bool) -> bool:
        for child in _ast.iter_child_nodes(node):
            c = ctx
            if isinstance(child, (_ast.FunctionDef, _ast.AsyncFunctionDef)):
                c = bool(child.decorator_list)
            elif isinstance(child, (_ast.ClassDef, _ast.Lambda)):
                c = False
            elif isinstance(child, withs) and any(isinstance(i.context_expr, _ast.Call) for i in child.items):
                c = True
            if isinstance(child, loops):
                if c or any(
                    isinstance(s, withs) and any(isinstance(i.context_expr, _ast.Call) for i in s.items)
                    for s in child.body
                ):
                    return True
            if visit(child, c):
                return True
        return False

    return visit(tree, False)


def loop_under_context(text: str) -> bool:
    """Cheap necessary condition (see _ast_loop_under_context); True when the text does not parse."""
    index = ast_index(text)
    if index is None:
        return True
    if not nodes_of(index, _ast.For, _ast.AsyncFor, _ast.While):
        return False
    if not any(
        isinstance(i.context_expr, _ast.Call) for w in nodes_of(index, _ast.With, _ast.AsyncWith) for i in w.items
    ) and not any(f.decorator_list for f in nodes_of(index, _ast.FunctionDef, _ast.AsyncFunctionDef)):
        return False  # neither a `with <call>:` nor a decorator anywhere
    return _ast_loop_under_context(tree) if (tree := ast_tree(text)) is not None else True


def module_level_with(text: str) -> bool:
    """A ``with`` statement outside every function, class and lambda; True when the text does not
    parse."""
    index = ast_index(text)
    if index is None:
        return True
    if not nodes_of(index, _ast.With, _ast.AsyncWith):
        return False
    stack: list = [ast_tree(text)]
    while stack:
        cur = stack.pop()
        for child in _ast.iter_child_nodes(cur):
            if isinstance(child, (_ast.With, _ast.AsyncWith)):
                return True
            if not isinstance(child, AST_SCOPES):
                stack.append(child)
    return False


def ast_model_call(nodes: Iterable[_ast.AST]) -> bool:
    """Some call under ``nodes`` looks like a model forward (inference._evalcode.EvalRule.forward_calls,
    without its exclusions): its callee, past a ``.forward``/``.generate``, ends in a model word."""
    for top in nodes:
        for n in _ast.walk(top):
            if isinstance(n, _ast.Call):
                func = n.func
                if isinstance(func, _ast.Attribute) and func.attr in ("forward", "generate"):
                    func = func.value
                d = ast_dotted(func)
                if d is not None and model_name(d.rsplit(".", 1)[-1]):
                    return True
    return False


def eval_sites_possible(text: str) -> bool:
    """Cheap necessary condition for the evaluation-code analysis of inference._evalcode: a function
    named like evaluation, or a ``for`` loop over something named like held-out data, whose body
    calls something named like a model. True when the text does not parse."""
    index = ast_index(text)
    if index is None:
        return True
    for n in nodes_of(index, _ast.FunctionDef, _ast.AsyncFunctionDef, _ast.For, _ast.AsyncFor):
        if isinstance(n, (_ast.FunctionDef, _ast.AsyncFunctionDef)):
            if EVAL_FUNCTION.match(n.name) and ast_model_call(n.body):
                return True
        elif isinstance(n, (_ast.For, _ast.AsyncFor)):
            names = [
                x.id if isinstance(x, _ast.Name) else x.attr
                for x in _ast.walk(n.iter)
                if isinstance(x, (_ast.Name, _ast.Attribute))
            ]
            if any(eval_loader_name(x) for x in names) and ast_model_call(n.body):
                return True
    return False


def _ast_int_looking(expr: _ast.AST | None, names: set[str] | None) -> bool:
    """pad._common._int_looking on CPython's AST (a bool literal counts too: a superset)."""
    if isinstance(expr, _ast.Constant):
        return isinstance(expr.value, int)
    if isinstance(expr, _ast.Name):
        return names is None or expr.id in names
    if isinstance(expr, _ast.UnaryOp):
        return _ast_int_looking(expr.operand, names)
    if isinstance(expr, _ast.BinOp):
        return _ast_int_looking(expr.left, names) and _ast_int_looking(expr.right, names)
    return False


def _ast_last_name(func: _ast.AST) -> str | None:
    if isinstance(func, _ast.Attribute):
        return func.attr
    if isinstance(func, _ast.Name):
        return func.id
    return None


def int_sized_layer_call(text: str, layers: Iterable[str]) -> bool:
    """Cheap necessary condition for pad.gemm.PadGemmDims: a call whose callee's last name is one of
    ``layers`` with an argument that pad._common.maybe_int could evaluate (an integer literal, a name
    assigned an integer-looking expression somewhere in the file, or arithmetic of those). True when
    the text does not parse."""
    index = ast_index(text)
    if index is None:
        return True
    layers = set(layers)
    calls = [n for n in index.get(_ast.Call, ()) if _ast_last_name(n.func) in layers]
    if not calls:
        return False
    names: set[str] = set()
    for n in nodes_of(index, _ast.Assign, _ast.AnnAssign):
        if isinstance(n, _ast.Assign) and _ast_int_looking(n.value, None):
            names |= {t.id for t in n.targets if isinstance(t, _ast.Name)}
        elif (
            isinstance(n, _ast.AnnAssign)
            and isinstance(n.target, _ast.Name)
            and n.value is not None
            and _ast_int_looking(n.value, None)
        ):
            names.add(n.target.id)
    for c in calls:
        for a in [*c.args, *(k.value for k in c.keywords)]:
            if (
                isinstance(a, _ast.Constant)
                and isinstance(a.value, int)
                and _ast_last_name(c.func) != "MultiheadAttention"
            ):
                # A bare literal is flagged only from 8 up and when not a multiple of the padding
                # multiple (8 or 64); MultiheadAttention's head_dim is derived, so any literal counts.
                if a.value >= 8 and a.value % 64:
                    return True
            elif _ast_int_looking(a, names):
                return True
    return False


def embedding_and_head_in_init(text: str) -> bool:
    """Cheap necessary condition for pad.vocab.PadVocabulary: a class whose ``__init__`` calls an
    ``Embedding`` and a ``Linear`` (by last name) where the embedding's first argument
    (``num_embeddings``) is spelled like the linear's second (``out_features``). True when the text
    does not parse."""
    index = ast_index(text)
    if index is None:
        return True

    def arg(call: _ast.Call, index: int, name: str) -> _ast.AST | None:
        for k in call.keywords:
            if k.arg == name:
                return k.value
        pos = [a for a in call.args if not isinstance(a, _ast.Starred)]
        return pos[index] if index < len(pos) else None

    for cls in index.get(_ast.ClassDef, ()):
        for init in cls.body:
            if not (isinstance(init, (_ast.FunctionDef, _ast.AsyncFunctionDef)) and init.name == "__init__"):
                continue
            vocab: set[str] = set()
            outs: set[str] = set()
            for n in _ast.walk(init):
                if isinstance(n, _ast.Call):
                    last = _ast_last_name(n.func)
                    a = (
                        arg(n, 0, "num_embeddings")
                        if last == "Embedding"
                        else arg(n, 1, "out_features")
                        if last == "Linear"
                        else None
                    )
                    if a is not None:
                        (vocab if last == "Embedding" else outs).add(_ast.dump(a))
            if vocab & outs:
                return True
    return False


def method_call_in_loop(text: str, methods: Iterable[str]) -> bool:
    """A call ``<expr>.<method>(...)`` (``method`` in ``methods``) in the body of a ``for``/``while``
    loop of the same function (what ``in_loop`` finds). True when the text does not parse."""
    index = ast_index(text)
    if index is None:
        return True
    methods = set(methods)
    if not any(isinstance(c.func, _ast.Attribute) and c.func.attr in methods for c in index.get(_ast.Call, ())):
        return False
    for loop in nodes_of(index, _ast.For, _ast.AsyncFor, _ast.While):
        for c in ast_calls(loop.body):
            if isinstance(c.func, _ast.Attribute) and c.func.attr in methods:
                return True
    return False


def has_method_call(text: str, methods: Iterable[str]) -> bool:
    """Some call ``<expr>.<method>(...)`` with ``method`` in ``methods``; True when the text does not
    parse."""
    index = ast_index(text)
    if index is None:
        return True
    methods = set(methods)
    return any(isinstance(c.func, _ast.Attribute) and c.func.attr in methods for c in index.get(_ast.Call, ()))


def chained_call(text: str, methods: Iterable[str], inner: Iterable[str]) -> bool:
    """Cheap necessary condition for rules built on ``method_call``: some ``F(...).<method>(...)``
    with ``method`` in ``methods`` where F's last name is in ``inner`` or imports one of them under
    another name (``from torch import zeros as z``). True when the text does not parse."""
    index = ast_index(text)
    if index is None:
        return True
    methods, names = set(methods), set(inner)
    for imp in index.get(_ast.ImportFrom, ()):
        for alias in imp.names:
            if alias.asname and alias.name in names:
                names.add(alias.asname)
    for c in index.get(_ast.Call, ()):
        f = c.func
        if (
            isinstance(f, _ast.Attribute)
            and f.attr in methods
            and isinstance(f.value, _ast.Call)
            and _ast_last_name(f.value.func) in names
        ):
            return True
    return False


def call_named(text: str, names: Iterable[str]) -> bool:
    """Some call whose callee's last name is in ``names`` (``torch.tensor(...)``, ``tensor(...)``) or
    imports one of them under another name. True when the text does not parse."""
    index = ast_index(text)
    if index is None:
        return True
    names = set(names)
    for imp in index.get(_ast.ImportFrom, ()):
        for alias in imp.names:
            if alias.asname and alias.name in names:
                names.add(alias.asname)
    return any(_ast_last_name(c.func) in names for c in index.get(_ast.Call, ()))


# --------------------------------------------------------------------------- torch names on CPython's ast
# A superset of what QualifiedNameProvider resolves through imports, for ``could_match`` pre-checks.


# --------------------------------------------------------------------------- P1 pre-check helpers
