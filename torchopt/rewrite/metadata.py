"""Cheaper stand-ins for LibCST metadata that rules ask for on most files.

LibCST's ParentNodeProvider and QualifiedNameProvider each run a full visitor over the module; on a
large file that costs more than the parse. A parent map built from ``children`` and qualified names
read straight from the scope analysis give the same answers for a fraction of the time.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from typing import Callable, TypeVar

import libcst as cst
from libcst.metadata import BaseMetadataProvider, QualifiedName, ScopeProvider

from torchopt.rewrite import pyast
from torchopt.rewrite.facts import SourceFacts, current_facts


_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def unordered_children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The same nodes as ``node.children``, read straight from the dataclass fields, not in source
    order. ``children`` runs a visitor that rebuilds the node; this is several times cheaper."""
    out: list[cst.CSTNode] = []
    for name in _field_names(type(node)):
        value = getattr(node, name)
        k = _kind(type(value))
        if k == 1:
            out.append(value)
        elif k == 2:
            out.extend(v for v in value if _kind(type(v)) == 1)
    return out


# ``CSTNode.children`` rebuilds the node through a visitor on every access, and rules walk subtrees
# through it again and again (it was the largest single cost on real code). The children of a node
# are its node-valued fields, in the order its ``_visit_and_replace_children`` visits them; that order
# is fixed per class and per set of non-empty fields, so it is learned once from the slow property and
# then read straight from the fields. Anything it cannot learn exactly falls back to the slow path.
# Rules walk through ``children_of`` (LibCST's ``children`` itself is left as it is).
_SLOW_CHILDREN = cst.CSTNode.children.fget  # type: ignore[attr-defined]  # mypy reads a property on a class as its value
_ORDER: dict[tuple[type, tuple[str, ...]], tuple[str, ...] | None] = {}


_KIND: dict[type, int] = {}  # 1: a node, 2: a tuple or list, 0: anything else (CSTNode is an ABC: isinstance is slow)


def _kind(t: type) -> int:
    k = _KIND.get(t)
    if k is None:
        k = _KIND[t] = 1 if issubclass(t, cst.CSTNode) else 2 if issubclass(t, (tuple, list)) else 0
    return k


# While the engine analyses one file, children are also remembered per node (rules walk the same
# subtrees many times), in the file's SourceFacts (torchopt/rewrite/facts.py), dropped afterwards.
T = TypeVar("T")


def children_of(node: cst.CSTNode) -> tuple[cst.CSTNode, ...] | list[cst.CSTNode]:
    """``node.children`` for reading only (not copied when remembered)."""
    facts = current_facts()
    if facts is None or facts.module is None:
        return _ordered_children(node)
    memo = facts.children
    hit = memo.get(id(node))
    if hit is None or hit[0] is not node:
        hit = memo[id(node)] = (node, tuple(_ordered_children(node)))
    return hit[1]


def remembered(kind: tuple, node: cst.CSTNode, make: Callable[[], T]) -> T:
    """``make()``, remembered for ``node`` while the engine analyses its file (computed each time
    outside an analysis): kept in that file's SourceFacts, so it never outlives the file."""
    facts = current_facts()
    if facts is None or facts.module is None:
        return make()
    return facts.about_node(kind, node, make)


def ordered_children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """Exactly ``node.children`` (same nodes, same order), several times cheaper."""
    return list(children_of(node))


def _ordered_children(node: cst.CSTNode) -> list[cst.CSTNode]:
    cls = type(node)
    present = []
    values = {}
    for name in _field_names(cls):
        value = getattr(node, name)
        k = _kind(type(value))
        if k == 1:
            present.append(name)
            values[name] = (value,)
        elif k == 2 and value:
            items = tuple(v for v in value if _kind(type(v)) == 1)
            if items:
                present.append(name)
                values[name] = items
    sig = (cls, tuple(present))
    try:
        order = _ORDER[sig]
    except KeyError:
        slow = list(_SLOW_CHILDREN(node))
        _ORDER[sig] = _learn(node, present, slow)
        return slow
    if order is None:
        return list(_SLOW_CHILDREN(node))
    if len(order) == 1:
        return list(values[order[0]])
    out: list[cst.CSTNode] = []
    for name in order:
        out.extend(values[name])
    return out


def _learn(node: cst.CSTNode, present: list[str], slow: list[cst.CSTNode]) -> tuple[str, ...] | None:
    owner: dict[int, str] = {}
    count = 0
    for name in present:
        value = getattr(node, name)
        items = [value] if _kind(type(value)) == 1 else [v for v in value if _kind(type(v)) == 1]
        for item in items:
            if id(item) in owner:
                return None  # one node in two places: cannot tell the fields apart
            owner[id(item)] = name
            count += 1
    if count != len(slow):
        return None
    order: list[str] = []
    for child in slow:
        field_name = owner.get(id(child))
        if field_name is None:
            return None
        if not order or order[-1] != field_name:
            if field_name in order:
                return None  # a field visited in two runs: not a plain field order
            order.append(field_name)
    return tuple(order) if set(order) == set(present) else None


class ParentProvider(BaseMetadataProvider[cst.CSTNode]):
    """node -> its parent, like ParentNodeProvider (the module has none)."""

    def _gen_impl(self, module: cst.Module) -> None:
        # unordered_children, inlined: this walk visits every node of the file
        table = self._computed
        stack: list[cst.CSTNode] = [module]
        pop, push, kinds = stack.pop, stack.append, _KIND
        while stack:
            node = pop()
            for name in _field_names(type(node)):
                value = getattr(node, name)
                k = kinds.get(type(value))
                if k is None:
                    k = _kind(type(value))
                if k == 1:
                    table[value] = node
                    push(value)
                elif k == 2:
                    for item in value:
                        if _kind(type(item)) == 1:
                            table[item] = node
                            push(item)


# ---------------------------------------------------------------------- import-only names, fast
# Scope analysis of a whole module costs two to three LibCST parses, and most files ask it only what
# an imported name such as ``torch.zeros`` or ``nn.Linear`` stands for. When the name's root is bound
# in the file by module-level imports and nothing else, and every one of those imports comes before
# any use of it, the answer depends on those imports alone: LibCST's own scope analysis is run on a
# small module made of just those imports followed by every dotted name of the file rooted there.
# Anything else (other bindings, star imports, uses before the import, text the engine did not
# register) goes to the full analysis. tests/test_fast_names.py compares the two node by node.


def _in_imports(module: cst.Module) -> set[int]:
    """ids of the nodes inside import statements: a walk over statements only (expressions are not
    entered), far cheaper than a parent map."""
    out: set[int] = set()
    stack: list[cst.CSTNode] = [module]
    while stack:
        cur = stack.pop()
        if isinstance(cur, cst.SimpleStatementLine):
            for small in cur.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)):
                    inner: list[cst.CSTNode] = [small]
                    while inner:
                        n = inner.pop()
                        out.add(id(n))
                        inner.extend(unordered_children(n))
            continue
        body = getattr(cur, "body", None)
        if isinstance(body, (list, tuple)):
            stack.extend(body)
        elif isinstance(body, cst.CSTNode):
            stack.append(body)
        for extra in ("orelse", "finalbody", "handlers"):
            value = getattr(cur, extra, None)
            if isinstance(value, (list, tuple)):
                stack.extend(value)
            elif isinstance(value, cst.CSTNode):
                stack.append(value)
        if isinstance(cur, cst.Match):
            stack.extend(cur.cases)
    return out


def _import_table(text: str) -> dict | None:
    """The roots the fast path may answer, and the small module that answers them (resolved when
    first asked, ``_answers``); None when it cannot help (a star import, text ``ast`` rejects)."""
    tree = pyast.tree(text)
    if tree is None:
        return None
    imports: dict[str, list[ast.stmt]] = {}
    other: set[str] = set()
    first_use: dict[str, int] = {}
    dotted: dict[str, set[str]] = {}
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
    stack: list[tuple[ast.AST, bool]] = [(tree, True)]
    while stack:
        node, top = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                root = alias.asname or alias.name.split(".")[0]
                if top:
                    imports.setdefault(root, []).append(node)
                else:
                    other.add(root)
            continue
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                line = node.lineno
                if line < first_use.get(node.id, 1 << 30):
                    first_use[node.id] = line
            else:
                other.add(node.id)
        elif isinstance(node, ast.Attribute):
            d = pyast.dotted_name(node)
            if d is not None:
                dotted.setdefault(d.split(".", 1)[0], set()).add(d)
        elif isinstance(node, ast.arg):
            other.add(node.arg)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            other.update(node.names)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            other.add(node.rest)
        name = getattr(node, "name", None)
        if isinstance(name, str) and not isinstance(node, ast.alias):
            other.add(name)  # def, class, except-as, match capture, type parameter
        inner = top and not isinstance(node, scopes)
        for child in ast.iter_child_nodes(node):
            stack.append((child, inner))
    lines = text.splitlines(keepends=True)
    roots: set[str] = set()
    chosen: dict[int, ast.stmt] = {}
    names: set[str] = set()
    for root, stmts in imports.items():
        if root in other:
            continue
        if max(st.end_lineno or st.lineno for st in stmts) >= first_use.get(root, 1 << 30):
            continue  # used before (or on the line of) an import that binds it
        roots.add(root)
        chosen.update((id(st), st) for st in stmts)
        names |= dotted.get(root, set()) | {root}
    if not roots:
        return {}
    # One small module for every such root: an import binds names under its own root only, so the
    # imports of one root cannot change what another root's names resolve to.
    head = "".join(_segment(lines, st) for st in sorted(chosen.values(), key=lambda st: (st.lineno, st.col_offset)))
    return {"roots": roots, "pending": (head, sorted(names))}


def _answers(table: dict, root: str) -> dict[str, frozenset] | None:
    if root not in table.get("roots", ()):
        return None
    answers = table.get("answers")
    if answers is None:
        try:
            answers = _resolve_small(*table["pending"])
        except Exception:  # anything unexpected: the full analysis answers
            answers = {}
            table["roots"] = set()
        table["answers"] = answers
    return answers


def _segment(lines: list[str], st: ast.stmt) -> str:
    first, last = st.lineno - 1, (st.end_lineno or st.lineno) - 1
    if first == last:
        return lines[first][st.col_offset : st.end_col_offset] + "\n"
    out = [lines[first][st.col_offset :]] + lines[first + 1 : last] + [lines[last][: st.end_col_offset]]
    return "".join(out) + "\n"


def _resolve_small(head: str, names: list[str]) -> dict[str, frozenset]:
    """LibCST's own answers on ``head`` (the imports) followed by one statement per dotted name."""
    from libcst.metadata import MetadataWrapper

    module = cst.parse_module(head + "".join(n + "\n" for n in names))
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    scopes = wrapper.resolve(ScopeProvider)
    out = {}
    for stmt, name in zip(module.body[-len(names) :], names):
        assert isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr)  # a dotted name
        expr = stmt.body[0].value
        scope = scopes.get(expr)
        out[name] = frozenset(scope.get_qualified_names_for(expr)) if scope is not None else frozenset()
    return out


def fast_qualified_names(visitor: cst.MetadataDependent, node: cst.CSTNode) -> frozenset | None:
    """The qualified names of an attribute chain (``torch.nn.Linear``) whose root only module-level
    imports bind; None: ask the scope analysis."""
    facts = _facts_of(visitor)
    if facts is None or facts.module is None or os.environ.get("TORCHOPT_SLOW_NAMES") == "1":
        return None
    wrapper = getattr(visitor, "_wrapper", None)
    if wrapper is None or wrapper.module is not facts.module or ScopeProvider in getattr(wrapper, "_metadata", ()):
        return None  # (once a rule has paid for the full analysis, it answers)
    if not isinstance(node, cst.Attribute):
        return None  # a bare Name may be an attribute's or a keyword's own name: not an access
    parts = []
    cur: cst.BaseExpression = node
    while isinstance(cur, cst.Attribute):
        parts.append(cur.attr.value)
        cur = cur.value
    if not isinstance(cur, cst.Name):
        return None
    parts.append(cur.value)
    table = facts.derived("import-only names", lambda: _safe_import_table(facts.text))
    by_name = _answers(table, cur.value)
    if by_name is None:
        return None
    answer = by_name.get(".".join(reversed(parts)))
    if answer is None:
        return None
    module = facts.module
    if id(node) in facts.about_node(("nodes in imports",), module, lambda: _in_imports(module)):
        return None  # a name inside an import statement is not an access
    return answer


def _facts_of(visitor: cst.MetadataDependent) -> SourceFacts | None:
    """The facts of the file a rule is visiting (its context's), else the engine's current ones."""
    facts = getattr(getattr(visitor, "ctx", None), "facts", None)
    return facts if facts is not None else current_facts()


def _safe_import_table(text: str) -> dict:
    try:
        table = _import_table(text)
    except Exception:  # anything unexpected: the full analysis answers
        table = None
    return table if table is not None else {}


def qualified_names(visitor: cst.MetadataDependent, node: cst.CSTNode) -> set[QualifiedName]:
    """What QualifiedNameProvider would say for ``node``, straight from its scope."""
    fast = fast_qualified_names(visitor, node)
    if fast is not None:
        return set(fast)
    try:
        scope = visitor.get_metadata(ScopeProvider, node, None)
    except KeyError:
        return set()
    if scope is None:
        return set()
    try:
        return set(scope.get_qualified_names_for(node))
    except Exception:  # nodes the scope cannot name (e.g. parts of a decorator) have none
        return set()
