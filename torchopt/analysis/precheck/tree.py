"""CPython's ast of a file, indexed by node type: the cheap parse every pre-check shares."""
from __future__ import annotations

import ast as _ast
from typing import Iterable

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


_AST_MEMO: list = [None, None]


def ast_index(text: str) -> dict[type, list] | None:
    """The nodes of ``ast_tree(text)`` by type (one walk, shared by the pre-checks); None when the
    text does not parse."""
    if _INDEX_MEMO[0] is text:
        return _INDEX_MEMO[1]
    tree = ast_tree(text)
    index: dict[type, list] | None = None
    if tree is not None:
        index = {}
        for n in _ast.walk(tree):
            index.setdefault(type(n), []).append(n)
    _INDEX_MEMO[0], _INDEX_MEMO[1] = text, index
    return index


_INDEX_MEMO: list = [None, None]


def nodes_of(index: dict[type, list], *types: type) -> list:
    out: list = []
    for t in types:
        out += index.get(t, ())
    return out


def ast_tree(text: str) -> _ast.Module | None:
    """CPython's AST of ``text`` (None when it does not parse), kept for the last text asked about:
    the rules' ``could_match`` of one file share one parse."""
    from torchopt.rewrite import pyast

    return pyast.tree(text)
