"""CPython's AST of the text being processed, parsed once per text: the rules' cheap prefilters
(torchopt/analysis/precheck) and the engine's syntax check of files no rule needs share it through
the text's ``SourceFacts`` (torchopt/rewrite/facts.py)."""

from __future__ import annotations

import ast

from torchopt.rewrite.facts import facts_for


def parse(text: str) -> ast.Module | BaseException:
    """The module's AST, or the exception ``ast.parse`` raised (SyntaxError, ValueError for NUL
    bytes, RecursionError/MemoryError for pathological nesting)."""
    return facts_for(text).python_ast


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
