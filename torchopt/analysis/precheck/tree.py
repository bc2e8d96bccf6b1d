"""CPython's ast of a file, indexed by node type: the cheap parse every pre-check shares."""

from __future__ import annotations

import ast as _ast
from collections import deque
from typing import Iterable

from torchopt.rewrite.facts import facts_for
from torchopt.rewrite.pyast import dotted_name

AST_SCOPES = (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef, _ast.Lambda)


ast_dotted = dotted_name  # the name the pre-checks know it by


def ast_calls(stmts: list) -> Iterable[_ast.Call]:
    """Calls under ``stmts`` not inside nested functions, classes or lambdas (sync._hot.calls_in)."""
    stack = [s for s in stmts if not isinstance(s, AST_SCOPES)]
    while stack:
        cur = stack.pop()
        if isinstance(cur, _ast.Call):
            yield cur
        for child in _ast.iter_child_nodes(cur):
            if not isinstance(child, AST_SCOPES):
                stack.append(child)


def ast_index(text: str) -> dict[type, list] | None:
    """The nodes of ``ast_tree(text)`` by type (one walk per text, shared by the pre-checks through
    the text's SourceFacts); None when the text does not parse."""
    return facts_for(text).derived("ast index", lambda: _index(ast_tree(text)))


def _index(tree: _ast.Module | None) -> dict[type, list] | None:
    if tree is None:
        return None
    # ast.walk's order (breadth first, fields in order) without its two generators per node: on a
    # large file the walk cost more than the parse. The shared Load/Store and operator objects under
    # `ctx`, `op` and `ops` are left out: no pre-check looks them up, and they are a third of the nodes.
    index: dict[type, list] = {}
    queue: deque[_ast.AST] = deque([tree])
    pop, push, push_all = queue.popleft, queue.append, queue.extend
    node_type = _ast.AST
    while queue:
        node = pop()
        kind = type(node)
        found = index.get(kind)
        if found is None:
            found = index[kind] = []
        found.append(node)
        for name in node._fields:
            if name in _SKIPPED_FIELDS:
                continue
            value = getattr(node, name, None)
            if isinstance(value, node_type):
                push(value)
            elif type(value) is list:
                push_all([v for v in value if isinstance(v, node_type)])
    return index


_SKIPPED_FIELDS = frozenset(("ctx", "op", "ops"))


def nodes_of(index: dict[type, list], *types: type) -> list:
    out: list = []
    for t in types:
        out += index.get(t, ())
    return out


def ast_tree(text: str) -> _ast.Module | None:
    """CPython's AST of ``text`` (None when it does not parse): the rules' ``could_match`` of one file
    share one parse (the text's SourceFacts)."""
    from torchopt.rewrite import pyast

    return pyast.tree(text)
