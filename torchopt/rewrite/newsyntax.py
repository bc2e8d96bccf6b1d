"""Syntax newer than the running interpreter: LibCST reads grammars up to the newest Python, CPython
only its own. A file that LibCST parses and this Python cannot compile is reported as needing the
newer Python (a fix could never be checked by compiling it here), not as a syntax error or a broken
fix."""

from __future__ import annotations

import ast
import sys

import libcst as cst

# LibCST nodes that only exist in a newer grammar, with the Python that introduced them.
_NODE_VERSIONS: dict[type, tuple[tuple[int, int], str]] = {
    cst.TryStar: ((3, 11), "`except*`"),
    cst.TypeAlias: ((3, 12), "a `type` statement"),
    cst.TypeParameters: ((3, 12), "type parameters"),
}
_TEMPLATE = getattr(cst, "TemplatedString", None)


class _Newest(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.version: tuple[int, int] = (0, 0)
        self.what = ""

    def _saw(self, version: tuple[int, int], what: str) -> None:
        if version > self.version:
            self.version, self.what = version, what

    def on_visit(self, node: cst.CSTNode) -> bool:
        known = _NODE_VERSIONS.get(type(node))
        if known is not None:
            self._saw(*known)
        elif isinstance(node, cst.TypeParam) and node.default is not None:
            self._saw((3, 13), "a type parameter default")
        elif _TEMPLATE is not None and isinstance(node, _TEMPLATE):
            self._saw((3, 14), "a template string")
        elif isinstance(node, cst.FormattedString) and not _compiles_here(node):
            self._saw((3, 12), "an f-string nesting quotes, backslashes or comments")
            return False
        return True


def _compiles_here(node: cst.FormattedString) -> bool:
    try:
        ast.parse("(" + cst.Module([]).code_for_node(node) + ")", mode="eval")
    except (SyntaxError, ValueError):
        return False
    return True


def needs_newer_python(module: cst.Module, error: SyntaxError) -> str | None:
    """Why CPython refused a text LibCST parsed into ``module``: "needs Python 3.12: ..." when it
    uses syntax newer than this interpreter, else None (it is a plain syntax error)."""
    newest = _Newest()
    module.visit(newest)
    running = sys.version_info[:2]
    if newest.version <= running:
        return None
    need = ".".join(map(str, newest.version))
    return (
        f"needs Python {need}: {newest.what} (line {error.lineno}) is syntax that Python "
        f"{running[0]}.{running[1]}, which runs torchopt, cannot compile"
    )
