"""TOP301: pad the vocabulary of embedding and output projection: the models it rewrites and its helpers."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.statement_edits import Edits, NodeEdit, statement
from torchopt.analysis.syntax import walk
from torchopt.codemods.pad.sizes import arg, code, pad_formula
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

PADDED = "padded_vocab"


@dataclass
class _Plan:
    """What the fix changes in one class."""

    vocab: cst.BaseExpression
    embeds: list[cst.Call]
    heads: list[cst.Call]
    head_attrs: set[str] = field(default_factory=set)
    calls: list[cst.Call] = field(default_factory=list)  # self.<head>(...)
    views: list[cst.Call] = field(default_factory=list)  # <logits>.view(...)
    vattr: str = ""
    insert_attr: bool = False
    index: int = 0


def _instance_of(value: cst.BaseExpression, cls_name: str) -> bool:
    """``C(...)`` or ``C(...).to(device)`` (any method chain on the new instance)."""
    cur = value
    while isinstance(cur, cst.Call) and isinstance(cur.func, cst.Attribute) and isinstance(cur.func.value, cst.Call):
        cur = cur.func.value
    return isinstance(cur, cst.Call) and isinstance(cur.func, cst.Name) and cur.func.value == cls_name


def _free_names(expr: cst.BaseExpression) -> set[str]:
    """Variables ``expr`` reads: ``config`` in ``config.vocab_size`` (not the attribute name)."""
    if isinstance(expr, cst.Name):
        return {expr.value}
    if isinstance(expr, cst.Attribute):
        return _free_names(expr.value)
    if isinstance(expr, cst.BinaryOperation):
        return _free_names(expr.left) | _free_names(expr.right)
    return set()


def _target_names(t: cst.BaseExpression) -> set[str]:
    if isinstance(t, cst.Name):
        return {t.value}
    if isinstance(t, (cst.Tuple, cst.List)):
        out: set[str] = set()
        for e in t.elements:
            out |= _target_names(e.value)
        return out
    if isinstance(t, cst.StarredElement):
        return _target_names(t.value)
    return set()


def _bound_names(stmt: cst.CSTNode) -> set[str]:
    out: set[str] = set()
    for n in walk(stmt, cross_scopes=False):
        if isinstance(n, cst.AssignTarget):
            out |= _target_names(n.target)
        elif isinstance(n, (cst.AugAssign, cst.AnnAssign)):
            out |= _target_names(n.target)
        elif isinstance(n, (cst.For, cst.CompFor)):
            out |= _target_names(n.target)
        elif isinstance(n, cst.NamedExpr):
            out |= _target_names(n.target)
        elif isinstance(n, cst.AsName):
            out |= _target_names(n.name)
    return out


def vocab_edits(rule: Rule, init: cst.FunctionDef, plan: _Plan, multiple: int) -> Edits:
    """The edits a _Plan makes to its class: the layers take the padded size, computed in ``__init__``
    before the first of them is built; the head's output is sliced back to the vocabulary, and ``.view``
    on it becomes ``.reshape`` (the slice is not contiguous)."""
    vcode = code(rule, plan.vocab)
    e = Edits()
    sizes = [arg(x, 0, "num_embeddings") for x in plan.embeds] + [arg(h, 1, "out_features") for h in plan.heads]
    for size in sizes:
        if size is not None:
            e.replace_node(size, lambda updated: updated.with_changes(value=cst.Name(PADDED)))
    views = {id(v) for v in plan.views}
    heads = {id(c) for c in plan.calls}
    for call in {id(c): c for c in plan.views + plan.calls}.values():
        e.replace_node(call, _head_edit(plan.vattr, reshape=id(call) in views, slice_back=id(call) in heads))
    new = []
    if plan.insert_attr:
        new.append(statement(f"self.{plan.vattr} = {vcode}\n"))
    new.append(statement(f"{PADDED} = {pad_formula(vcode, multiple)}  # a multiple of 8 for Tensor Cores\n"))
    e.add_before(cst.ensure_type(init.body, cst.IndentedBlock).body[plan.index], new)  # (planned on that block)
    return e


def _head_edit(vattr: str, reshape: bool, slice_back: bool) -> NodeEdit:
    """The edit of one use of the head: its rewritten call (still a call) goes through _sliced_head."""
    return lambda updated: _sliced_head(cst.ensure_type(updated, cst.Call), vattr, reshape, slice_back)


def _sliced_head(call: cst.Call, vattr: str, reshape: bool, slice_back: bool) -> cst.BaseExpression:
    if reshape:
        call = call.with_changes(func=call.func.with_changes(attr=cst.Name("reshape")))
    if not slice_back:
        return call
    sliced = cst.parse_expression(f"_[..., : self.{vattr}]")
    assert isinstance(sliced, cst.Subscript)
    return sliced.with_changes(value=call.with_changes(lpar=(), rpar=()), lpar=call.lpar, rpar=call.rpar)


def _literal(expr: cst.BaseExpression | None) -> list[int]:
    """Integer literals a size expression falls back to: `N`, `x or N`, `x if c else N`."""
    if isinstance(expr, cst.Integer):
        return [int(expr.evaluated_value)]
    if isinstance(expr, cst.BooleanOperation) and isinstance(expr.operator, cst.Or):
        return _literal(expr.left) + _literal(expr.right)
    if isinstance(expr, cst.IfExp):
        return _literal(expr.body) + _literal(expr.orelse)
    return []


def _name_defaults(rule: Rule, name: cst.Name) -> list[int]:
    """The literal sizes a name falls back to, when every definition of it has one (a parameter
    default, `N`, `x or N`); empty when one of them is computed (`len(tokenizer)`)."""
    try:
        scope = rule.get_metadata(ScopeProvider, name)
    except KeyError:
        return []
    if scope is None or name.value not in scope:
        return []
    out: list[int] = []
    for assignment in scope[name.value]:
        node = getattr(assignment, "node", None)
        parent = rule.get_metadata(ParentProvider, node, None) if node is not None else None
        if isinstance(node, cst.Param):
            found = _literal(node.default)
        elif isinstance(parent, cst.AssignTarget):
            stmt = rule.get_metadata(ParentProvider, parent, None)
            found = _literal(stmt.value) if isinstance(stmt, cst.Assign) else []
        elif isinstance(parent, cst.AnnAssign):
            found = _literal(parent.value)
        else:
            found = []
        if not found:
            return []
        out += found
    return out


def _field_defaults(module: cst.Module, attr: str) -> list[int]:
    """The defaults the file gives a configuration field `attr`: its declaration in a class body
    (`vocab_size: int = 50304` in a dataclass) and fallbacks (`meta_vocab_size or 50304`) wherever
    the field is set. Plain overrides (`Config(vocab_size=50257)` for a pretrained checkpoint) are
    not defaults: a checkpoint's size cannot be padded anyway."""
    out: list[int] = []
    for n in walk(module, cross_scopes=True):
        if isinstance(n, cst.ClassDef) and isinstance(n.body, cst.IndentedBlock):
            for line in n.body.body:
                for stmt in line.body if isinstance(line, cst.SimpleStatementLine) else ():
                    if isinstance(stmt, cst.AnnAssign) and _names(stmt.target, attr):
                        out += _literal(stmt.value)
                    elif isinstance(stmt, cst.Assign) and any(_names(t.target, attr) for t in stmt.targets):
                        out += _literal(stmt.value)
            continue
        value = None
        if isinstance(n, cst.Assign) and any(_names(t.target, attr) for t in n.targets):
            value = n.value
        elif isinstance(n, cst.Arg) and n.keyword is not None and n.keyword.value == attr:
            value = n.value
        elif isinstance(n, cst.DictElement) and isinstance(n.key, cst.SimpleString) and n.key.evaluated_value == attr:
            value = n.value
        if isinstance(value, (cst.BooleanOperation, cst.IfExp)):
            out += _literal(value)
    return out


def _names(target: cst.BaseExpression, attr: str) -> bool:
    """Whether an assignment target sets `attr`: `attr`, `x.attr` or `x["attr"]`."""
    if isinstance(target, cst.Name):
        return target.value == attr
    if isinstance(target, cst.Attribute):
        return target.attr.value == attr
    if isinstance(target, cst.Subscript) and len(target.slice) == 1 and isinstance(target.slice[0].slice, cst.Index):
        key = target.slice[0].slice.value
        return isinstance(key, cst.SimpleString) and key.evaluated_value == attr
    return False


def vocab_defaults(rule: Rule, vocab: cst.BaseExpression) -> list[int]:
    """The literal sizes the vocabulary falls back to when the program does not override it, as far
    as this file shows (nanoGPT's `vocab_size: int = 50304`, `meta_vocab_size or 50304`); empty
    when nothing in the file says."""
    if isinstance(vocab, cst.Name):
        return _name_defaults(rule, vocab)
    if isinstance(vocab, cst.Attribute):
        return _field_defaults(rule.ctx.module, vocab.attr.value)
    return _literal(vocab)
