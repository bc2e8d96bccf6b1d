"""CPython's AST of the text being processed, parsed once per text: the rules' cheap prefilters
(torchopt/analysis/precheck) and the engine's syntax check of files no rule needs share it."""
from __future__ import annotations

import ast

_MEMO: list = [None, None]  # (text, tree or the exception): the last text asked about


def parse(text: str) -> ast.Module | BaseException:
    """The module's AST, or the exception ``ast.parse`` raised (SyntaxError, ValueError for NUL
    bytes, RecursionError/MemoryError for pathological nesting)."""
    if _MEMO[0] is text:
        return _MEMO[1]
    try:
        tree: ast.Module | BaseException = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as exc:
        tree = exc
    _MEMO[0], _MEMO[1] = text, tree
    return tree


def tree(text: str) -> ast.Module | None:
    got = parse(text)
    return got if isinstance(got, ast.Module) else None


def dotted_name(node: ast.AST | None) -> str | None:
    """``a.b.c`` for a Name/Attribute chain of CPython's AST, else None (the text as written)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))
