"""Scopes, loops and the values that reach a name, on CPython's ast."""

from __future__ import annotations

import ast as _ast

from torchopt.analysis.precheck.tree import AST_SCOPES, ast_index, ast_tree, nodes_of
from torchopt.rewrite.facts import facts_for


def ast_loop_calls(text: str) -> list[tuple[_ast.Call, _ast.AST]] | None:
    """(call, innermost loop) for every call in the body of a ``for``/``while`` loop of its own
    function (what ``in_loop`` finds: not crossing a function, class or lambda; a loop's ``else``,
    iterable and condition belong to the enclosing loop). None when the text does not parse."""
    return facts_for(text).derived("calls in loops", lambda: _loop_calls(text))


def _loop_calls(text: str) -> list[tuple[_ast.Call, _ast.AST]] | None:
    index = ast_index(text)
    out: list[tuple[_ast.Call, _ast.AST]] | None = None
    if index is not None:
        # An enclosing loop starts before the loops it holds: walking each loop's body in source
        # order and letting later (inner) loops claim their calls again leaves the innermost loop.
        loops = sorted(nodes_of(index, _ast.For, _ast.AsyncFor, _ast.While), key=lambda n: (n.lineno, n.col_offset))
        found: dict[int, tuple[_ast.Call, _ast.AST]] = {}
        for loop in loops:
            stack = [s for s in loop.body if not isinstance(s, AST_SCOPES)]
            while stack:
                cur = stack.pop()
                if isinstance(cur, _ast.Call):
                    found[id(cur)] = (cur, loop)
                for child in _ast.iter_child_nodes(cur):
                    if not isinstance(child, AST_SCOPES):
                        stack.append(child)
        out = list(found.values())
    return out


_AST_SCOPE_TYPES = (
    _ast.FunctionDef,
    _ast.AsyncFunctionDef,
    _ast.Lambda,
    _ast.ClassDef,
    _ast.ListComp,
    _ast.SetComp,
    _ast.DictComp,
    _ast.GeneratorExp,
)


def _ast_pos(n: _ast.AST) -> tuple[int, int]:
    return (n.lineno, n.col_offset)  # type: ignore[attr-defined]  # typeshed: positions are per node kind


def _ast_end(n: _ast.AST) -> tuple[int, int]:
    return (n.end_lineno, n.end_col_offset)  # type: ignore[attr-defined]  # typeshed: positions are per node kind


def _ast_inside(node: _ast.AST, outer: _ast.AST) -> bool:
    return _ast_pos(outer) <= _ast_pos(node) and _ast_end(node) <= _ast_end(outer)


def ast_scope_chain(text: str, node: _ast.AST) -> list[_ast.AST] | None:
    """The scopes ``node`` (a Name) is looked up in, innermost first: the functions, lambdas,
    classes and comprehensions whose own part holds it (not their decorators, defaults, annotations,
    bases or first iterable, which the enclosing scope evaluates), then the module. Found by source
    spans, without walking the tree. None when the text does not parse."""
    index = ast_index(text)
    tree = ast_tree(text)
    if index is None or tree is None:
        return None
    chain: list[_ast.AST] = []
    for scope in nodes_of(index, *_AST_SCOPE_TYPES):
        if not _ast_inside(node, scope):
            continue
        if isinstance(scope, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)):
            if _ast_pos(node) < _ast_pos(scope.body[0]):
                continue
        elif isinstance(scope, _ast.Lambda):
            if not _ast_inside(node, scope.body):
                continue
        elif _ast_inside(node, scope.generators[0].iter):
            continue
        chain.append(scope)
    chain.sort(key=lambda n: (_ast_pos(n), tuple(-x for x in _ast_end(n))), reverse=True)
    return [*chain, tree]


def ast_reaching_values(text: str, name: _ast.Name) -> list | None:
    """reaching_values on CPython's ast, a superset for pre-checks: the values bound to ``name`` in
    the nearest scope (from its own outwards, skipping class bodies for functions) that binds it:
    an expression per plain assignment (``name = v`` / ``name: T = v``), None per other binding
    (parameter, loop target, unpacking, augmented assignment, import, def...); ``global`` goes to the
    module, ``nonlocal`` outwards. None overall when no scope binds it or the text does not parse."""
    chain = ast_scope_chain(text, name)
    if chain is None:
        return None
    for k, scope in enumerate(chain):
        if k and isinstance(scope, _ast.ClassDef):
            continue
        found = _ast_scope_values(scope, name.id)
        if found == "global":
            found = _ast_scope_values(chain[-1], name.id)
            return found if isinstance(found, list) else None
        if found not in (None, "nonlocal"):
            return found
    return None


def _ast_scope_values(scope: _ast.AST, name: str):
    params: list = []
    stack: list[_ast.AST]
    if isinstance(scope, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.Lambda)):
        a = scope.args
        params = [
            p for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p is not None and p.arg == name
        ]
        stack = list(scope.body) if isinstance(scope.body, list) else [scope.body]
    elif isinstance(scope, _ast.ClassDef):
        stack = list(scope.body)
    elif isinstance(scope, (_ast.ListComp, _ast.SetComp, _ast.GeneratorExp, _ast.DictComp)):
        stack = [*[g.target for g in scope.generators], *[x for g in scope.generators for x in g.ifs]]
    else:
        stack = list(body) if isinstance(body := getattr(scope, "body", None), list) else []
    out: list = [None] * len(params)
    parent_of: dict[int, _ast.AST] = {}
    nested: list[_ast.AST] = [x for x in stack if isinstance(x, _AST_SCOPE_TYPES)]
    stack = [x for x in stack if not isinstance(x, _AST_SCOPE_TYPES)]
    for child in nested:  # a def or class directly in the scope binds its name here
        if isinstance(child, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)):
            if child.name == name:
                out.append(None)
            stack.extend(child.decorator_list)
    while stack:
        cur = stack.pop()
        if isinstance(cur, (_ast.Global, _ast.Nonlocal)) and name in cur.names:
            return "global" if isinstance(cur, _ast.Global) else "nonlocal"
        if isinstance(cur, _ast.Name) and cur.id == name and isinstance(cur.ctx, (_ast.Store, _ast.Del)):
            if isinstance(cur.ctx, _ast.Store):
                parent = parent_of.get(id(cur))
                if isinstance(parent, _ast.Assign) and any(t is cur for t in parent.targets):
                    out.append(parent.value)
                elif isinstance(parent, _ast.AnnAssign) and parent.target is cur:
                    out.append(parent.value)
                else:
                    out.append(None)
        elif isinstance(cur, (_ast.Import, _ast.ImportFrom)):
            out += [None for al in cur.names if (al.asname or al.name.split(".")[0]) == name]
        elif isinstance(cur, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)) and cur.name == name:
            out.append(None)
        elif isinstance(cur, _ast.ExceptHandler) and cur.name == name:
            out.append(None)
        elif isinstance(cur, (_ast.MatchAs, _ast.MatchStar)) and cur.name == name:
            out.append(None)
        elif isinstance(cur, _ast.MatchMapping) and cur.rest == name:
            out.append(None)
        for child in _ast.iter_child_nodes(cur):
            if isinstance(child, _AST_SCOPE_TYPES):
                if isinstance(child, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)):
                    if child.name == name:
                        out.append(None)
                    stack.extend(child.decorator_list)
                continue
            parent_of[id(child)] = cur
            stack.append(child)
    return out or None
