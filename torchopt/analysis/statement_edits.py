"""Statement-level editing shared by the rule families: statements inserted before or after a
statement, runs of statements wrapped in a ``with`` or guarded by an ``if``, statements and
expressions replaced, fresh names that clash with nothing, and the refusal a rule raises when it
cannot offer a fix.

Edits are keyed by the identity of the *original* nodes, so a rule plans them while it reads the
parsed module and applies them all in one pass with ``ApplyEdits``; the rewritten children (already
edited) are what the new statements surround."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import libcst as cst

from torchopt.rewrite.metadata import children_of


class Refusal(Exception):
    """A fix the rule will not offer: ``reason`` is what the user reads, ``node`` where the report
    points (None when the rule reports at a place it already knows)."""

    def __init__(self, node: cst.CSTNode | None, reason: str) -> None:
        super().__init__(reason)
        self.node = node
        self.reason = reason


def fresh_name(taken: set[str], base: str) -> str:
    """``base``, or ``base_1``, ``base_2``, ... whichever comes first that is not in ``taken``. The name
    is added to ``taken``, so that two new names asked of the same set never coincide."""
    name, suffix = base, 1
    while name in taken:
        name = f"{base}_{suffix}"
        suffix += 1
    taken.add(name)
    return name


def statement(text: str) -> cst.BaseStatement:
    """One statement parsed from ``text`` (a line, or a compound statement with its body)."""
    return cst.parse_statement(text)


def first_binding(scope: Any, body: Sequence[cst.BaseStatement], name: str) -> int | None:
    """Index of the first statement of ``body`` (the statements of ``scope``'s own block) that binds
    ``name`` in ``scope`` (an import, an assignment, a ``def``...); None when none of them does (the
    name comes from an enclosing scope, or is not bound at all). A statement inserted into ``body``
    that reads ``name`` must come after this one, or it raises NameError when it runs."""
    nodes = {id(node) for a in scope.assignments[name] if (node := getattr(a, "node", None)) is not None}
    if not nodes:
        return None
    for i, stmt in enumerate(body):
        stack: list[cst.CSTNode] = [stmt]
        while stack:
            node = stack.pop()
            if id(node) in nodes:
                return i
            stack.extend(children_of(node))
    return None


def body_list(block: cst.BaseSuite) -> Sequence[cst.BaseStatement] | None:
    """The statements of an indented block; None for a one-line body (``for x in y: f(x)``), which
    has no place for a new statement."""
    return block.body if isinstance(block, cst.IndentedBlock) else None


NodeEdit = Callable[[cst.CSTNode], cst.CSTNode]
# Every LibCST statement is one of these two, and both carry leading_lines (BaseStatement declares none).
Statement = cst.SimpleStatementLine | cst.BaseCompoundStatement
StatementEdit = Callable[[Statement], list[cst.BaseStatement]]
# A node's rewritten form has the class of the original, so an edit of a Call receives a Call.
NodeT = TypeVar("NodeT", bound=cst.CSTNode)


def _as_statement(node: cst.BaseStatement) -> Statement:
    assert isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement))  # (see Statement)
    return node


def _constant(new: cst.CSTNode) -> NodeEdit:
    """The edit that puts ``new`` in place whatever the rewritten node became."""
    return lambda _updated: new


@dataclass
class Wrap:
    """``count`` statements, starting at the keyed one, moved into ``with_node``'s body; ``trailing``
    statements follow the ``with``."""

    with_node: cst.With
    count: int
    trailing: list[cst.BaseStatement] = field(default_factory=list)


@dataclass
class Edits:
    """Statement-level edits to one parsed module, keyed by the identity of its original nodes."""

    before: dict[int, list[cst.BaseStatement]] = field(default_factory=dict)
    after: dict[int, list[cst.BaseStatement]] = field(default_factory=dict)
    replace: dict[int, StatementEdit] = field(default_factory=dict)
    nodes: dict[int, Callable[[Any], cst.CSTNode]] = field(default_factory=dict)  # called with that node, rewritten
    guards: dict[int, str] = field(default_factory=dict)
    body_end: dict[int, list[cst.BaseStatement]] = field(default_factory=dict)
    wraps: dict[int, Wrap] = field(default_factory=dict)
    hoist: dict[int, list[int]] = field(default_factory=dict)  # id(anchor) -> later statements moved above it
    hoisted: set[int] = field(default_factory=set)
    # Every edited original node: (node, True) when statements are added next to it or it is wrapped
    # (the block holding it changes), (node, False) when only the node itself is replaced.
    touched: list[tuple[cst.CSTNode, bool]] = field(default_factory=list)

    def add_before(self, stmt: cst.CSTNode, new: Sequence[cst.BaseStatement]) -> None:
        self.before.setdefault(id(stmt), []).extend(new)
        self.touched.append((stmt, True))

    def add_after(self, stmt: cst.CSTNode, new: Sequence[cst.BaseStatement]) -> None:
        self.after.setdefault(id(stmt), []).extend(new)
        self.touched.append((stmt, True))

    def wrap(
        self, stmts: Sequence[cst.BaseStatement], with_node: cst.With, trailing: Sequence[cst.BaseStatement] = ()
    ) -> None:
        """Move ``stmts`` (consecutive statements of one block) into ``with_node``, whose own body is
        dropped; statements added after any of them follow the ``with`` and ``trailing``."""
        self.wraps[id(stmts[0])] = Wrap(with_node, len(stmts), list(trailing))
        self.touched.append((stmts[0], True))

    def hoist_before(self, stmt: cst.CSTNode, anchor: cst.CSTNode) -> None:
        """Move ``stmt`` up above ``anchor``, an earlier statement of the same block (a path computed
        before the folder it names is created, so that a guard covers both)."""
        self.hoist.setdefault(id(anchor), []).append(id(stmt))
        self.hoisted.add(id(stmt))
        self.touched.append((stmt, True))

    def guard(self, stmt: cst.CSTNode, test: str) -> None:
        """Run ``stmt`` only when ``test`` holds; neighbours with the same test share one ``if``."""
        self.guards[id(stmt)] = test
        self.touched.append((stmt, True))

    def drop_nested_guards(self, parent: Callable[[cst.CSTNode], cst.CSTNode | None]) -> int:
        """Drop the guard of every statement inside another guarded statement: the outer test already
        decides whether it runs. ``parent`` maps a node to its parent. Returns how many were dropped."""
        guarded = {id(node): node for node, _ in self.touched if id(node) in self.guards}
        dropped = 0
        for key, node in guarded.items():
            outer = parent(node)
            while outer is not None and id(outer) not in self.guards:
                outer = parent(outer)
            if outer is not None:
                del self.guards[key]
                dropped += 1
        return dropped

    def replace_statement(self, stmt: cst.CSTNode, edit: StatementEdit) -> None:
        """Replace ``stmt`` by the statements ``edit`` makes of its rewritten form."""
        self.replace[id(stmt)] = edit
        self.touched.append((stmt, True))

    def replace_node(self, node: NodeT, new: cst.CSTNode | Callable[[NodeT], cst.CSTNode]) -> None:
        """Replace ``node``: by ``new``, or by what ``new`` makes of its rewritten form."""
        self.nodes[id(node)] = new if callable(new) else _constant(new)
        self.touched.append((node, False))

    def append_to_body(self, owner: cst.CSTNode, new: Sequence[cst.BaseStatement]) -> None:
        """Add ``new`` at the end of a module or an indented block, or of a function's body before
        its final ``return``."""
        self.body_end.setdefault(id(owner), []).extend(new)
        self.touched.append((owner, False))


class ApplyEdits(cst.CSTTransformer):
    """Applies an ``Edits`` to the module (or the statement) its keys were taken from."""

    def __init__(self, edits: Edits) -> None:
        super().__init__()
        self.edits = edits

    def on_leave(self, original_node, updated_node):
        updated = super().on_leave(original_node, updated_node)
        edit = self.edits.nodes.get(id(original_node))
        return edit(updated) if edit is not None else updated

    def _rebuild(self, orig: Sequence[cst.BaseStatement], upd: Sequence[cst.BaseStatement]) -> list:
        out: list[cst.BaseStatement] = []
        i = 0
        while i < len(orig):
            if id(orig[i]) in self.edits.hoisted:
                i += 1
                continue
            moved = set(self.edits.hoist.get(id(orig[i]), ()))
            out.extend(upd[k] for k in range(len(orig)) if id(orig[k]) in moved)
            out.extend(self.edits.before.get(id(orig[i]), []))
            if id(orig[i]) in self.edits.wraps:
                i = self._wrap(orig, upd, i, out)
            elif id(orig[i]) in self.edits.guards:
                i = self._guard(orig, upd, i, out)
            else:
                rep = self.edits.replace.get(id(orig[i]))
                out.extend(rep(_as_statement(upd[i])) if rep is not None else [upd[i]])
                out.extend(self.edits.after.get(id(orig[i]), []))
                i += 1
        return out

    def _wrap(
        self, orig: Sequence[cst.BaseStatement], upd: Sequence[cst.BaseStatement], i: int, out: list[cst.BaseStatement]
    ) -> int:
        wrap = self.edits.wraps[id(orig[i])]
        inner = list(upd[i : i + wrap.count])
        lead = _as_statement(inner[0]).leading_lines  # the comments above the first statement now sit above the `with`
        inner[0] = inner[0].with_changes(leading_lines=())
        out.append(wrap.with_node.with_changes(body=cst.IndentedBlock(body=inner), leading_lines=lead))
        out.extend(wrap.trailing)
        for j in range(i, i + wrap.count):
            out.extend(self.edits.after.get(id(orig[j]), []))
        return i + wrap.count

    def _guard(
        self, orig: Sequence[cst.BaseStatement], upd: Sequence[cst.BaseStatement], i: int, out: list[cst.BaseStatement]
    ) -> int:
        edits = self.edits
        test = edits.guards[id(orig[i])]
        group = [upd[i]]
        j = i + 1
        while j < len(orig) and id(orig[j]) in edits.hoisted:
            j += 1
        while (
            j < len(orig)
            and edits.guards.get(id(orig[j])) == test
            and not edits.before.get(id(orig[j]))
            and not edits.after.get(id(orig[j - 1]))
            and id(orig[j]) not in edits.replace
        ):
            group.append(upd[j])
            j += 1
            while j < len(orig) and id(orig[j]) in edits.hoisted:
                j += 1
        lead = _as_statement(group[0]).leading_lines
        group[0] = group[0].with_changes(leading_lines=())
        out.append(cst.If(test=cst.parse_expression(test), body=cst.IndentedBlock(body=group), leading_lines=lead))
        out.extend(edits.after.get(id(orig[j - 1]), []))
        return j

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock):
        body = self._rebuild(original_node.body, updated_node.body)
        body.extend(self.edits.body_end.get(id(original_node), []))
        return updated_node.with_changes(body=body)

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef):
        tail = self.edits.body_end.get(id(original_node))
        if tail and isinstance(updated_node.body, cst.IndentedBlock):
            body = list(updated_node.body.body)
            if body and isinstance(body[-1], cst.SimpleStatementLine) and isinstance(body[-1].body[0], cst.Return):
                body[-1:-1] = tail
            else:
                body.extend(tail)
            return updated_node.with_changes(body=updated_node.body.with_changes(body=body))
        return updated_node

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module):
        body = self._rebuild(original_node.body, updated_node.body)
        body.extend(self.edits.body_end.get(id(original_node), []))
        return updated_node.with_changes(body=body)


def with_statement(items: Sequence[cst.WithItem]) -> cst.With:
    """A ``with`` over ``items`` for ``Edits.wrap`` (its body is filled in when the edits apply)."""
    return cst.With(items=list(items), body=cst.IndentedBlock(body=[]))
