"""Statement and subtree helpers on LibCST nodes: walking one scope, comments, source text, enclosing loops and version guards."""

from __future__ import annotations

from typing import Iterable, Iterator

import libcst as cst

from torchopt.rewrite.metadata import ParentProvider, children_of, remembered
from torchopt.rewrite.rule import Rule


def has_comments(node: cst.CSTNode | None) -> bool:
    """Whether ``node`` holds a comment (a fix that would drop it is not offered)."""
    if node is None:
        return False
    finder = _CommentFinder()
    node.visit(finder)
    return finder.found


class _CommentFinder(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.found = False

    def visit_Comment(self, _node: cst.Comment) -> bool:
        self.found = True
        return False


def source(rule: Rule, node: cst.CSTNode) -> str:
    """The code of ``node``, one line, for messages."""
    code = rule.ctx.module.code_for_node(node)
    code = " ".join(code.split())
    return code if len(code) <= 60 else code[:57] + "..."


def in_loop(rule: Rule, node: cst.CSTNode) -> cst.For | cst.While | None:
    """The innermost loop whose body holds ``node`` (not crossing a function or class)."""
    cur: cst.CSTNode | None = node
    while cur is not None:
        parent = rule.get_metadata(ParentProvider, cur, None)
        if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        if isinstance(parent, (cst.For, cst.While)) and cur is parent.body:
            return parent
        cur = parent
    return None


SCOPE_NODES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


_SCOPE_TYPES = frozenset(SCOPE_NODES)  # concrete classes: an exact type test is isinstance here


def walk(node: cst.CSTNode, cross_scopes: bool = False) -> Iterable[cst.CSTNode]:
    """Every node under ``node`` (pre-order), not entering nested functions, classes or lambdas
    unless ``cross_scopes``. Cheaper than a CSTVisitor for the small subtrees rules inspect.
    Rules scan the whole module this way over and over: while the engine analyses a file, the
    module's node list is made once and shared (``metadata.remembered``)."""
    if type(node) is cst.Module:
        return iter(remembered(("walk", cross_scopes), node, lambda: list(_walk(node, cross_scopes))))
    return _walk(node, cross_scopes)


def _walk(node: cst.CSTNode, cross_scopes: bool) -> Iterator[cst.CSTNode]:
    stack = [node]
    pop, push = stack.pop, stack.append
    while stack:
        cur = pop()
        yield cur
        if cross_scopes:
            stack.extend(reversed(children_of(cur)))
            continue
        for child in reversed(children_of(cur)):
            if type(child) not in _SCOPE_TYPES:
                push(child)


# Exceptions a `try:` catches when it probes for an API (`except ImportError: <old API>`).
_PROBE_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "AttributeError", "TypeError", "Exception", "BaseException"}


_VERSION_TOKENS = ("hasattr(", "getattr(", "__version__", "version", "VERSION", "is_torch_")


def _catches_probe(handler: cst.ExceptHandler) -> bool:
    if handler.type is None:
        return True  # bare `except:`
    types = handler.type.elements if isinstance(handler.type, cst.Tuple) else [handler.type]
    for t in types:
        node = t.value if isinstance(t, cst.Element) else t
        name = cst.helpers.get_full_name_for_node(node) or ""
        if name.rsplit(".", 1)[-1] in _PROBE_EXCEPTIONS:
            return True
    return False


def in_version_guard(rule: Rule, node: cst.CSTNode) -> bool:
    """Whether ``node`` is code the user already wrote to cope with several PyTorch versions: inside
    a ``try:`` whose handlers catch ImportError/AttributeError (or everything), in either branch of an
    ``if``/conditional expression testing ``hasattr``/``getattr``/a version, or in such a handler.
    Rules that migrate APIs leave it alone: the old spelling there is deliberate."""
    cur: cst.CSTNode = node
    while True:
        parent = rule.get_metadata(ParentProvider, cur, None)
        if parent is None:
            return False
        if isinstance(parent, cst.Try) and cur is parent.body and any(_catches_probe(h) for h in parent.handlers):
            return True
        if isinstance(parent, cst.ExceptHandler) and _catches_probe(parent):
            return True
        if isinstance(parent, (cst.If, cst.IfExp)) and cur is not parent.test:
            test = rule.ctx.module.code_for_node(parent.test)
            if any(tok in test for tok in _VERSION_TOKENS):
                return True
        cur = parent


def picked_names(value: cst.BaseExpression) -> list[cst.Name] | None:
    """The names ``value`` picks one of: a name, an element of a literal list or tuple indexed by
    anything, either branch of a conditional expression (None: anything else)."""
    if isinstance(value, cst.Name):
        return [value]
    if isinstance(value, cst.Subscript) and isinstance(value.value, (cst.List, cst.Tuple)):
        elems = value.value.elements
        if elems and all(isinstance(e, cst.Element) and isinstance(e.value, cst.Name) for e in elems):
            return [cst.ensure_type(e.value, cst.Name) for e in elems]
        return None
    if isinstance(value, cst.IfExp):
        body, orelse = picked_names(value.body), picked_names(value.orelse)
        return body + orelse if body is not None and orelse is not None else None
    return None
