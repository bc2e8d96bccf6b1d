"""The arguments a `DataLoader(...)` call gets through `**kwargs`: `DataLoader(ds, **loader_kwargs)`
where `loader_kwargs = dict(num_workers=4, pin_memory=True)` or `{"num_workers": 4}` is bound once
in the same scope, or is what a helper of the project returns (`loader_kwargs = get_loader_kwargs(args)`
with `def get_loader_kwargs(args): return dict(num_workers=args.workers)`, in this file or, through the
project index, in another module).

The DATA rules read such a call's arguments through :func:`loader_kwargs`, and a fix writes where the
argument belongs: in the call when it is given there or the dict does not have it, in the dict (the
only place that has it) when the call is that dict's only use. A dict also used elsewhere, changed
after it is built (`kw["pin_memory"] = ...`, `kw.update(...)`), or built in a way not followed (a
parameter, a comprehension) makes the call's arguments unknown: no finding, no fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import Assignment

from torchopt.analysis.arguments import keyword, make_kwarg, set_kwarg
from torchopt.analysis.names import bindings_of
from torchopt.analysis.project import Definition, index_of
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule


@dataclass
class LoaderKwargs:
    """A DataLoader call's keyword arguments, those of its ``**dict`` included."""

    call: cst.Call
    # name -> value of the ``**`` dict's entries (a value parsed from another file is not in this tree)
    entries: dict[str, cst.BaseExpression] = field(default_factory=dict)
    literal: cst.Call | cst.Dict | None = None  # the dict literal of this file, editable
    only_use: bool = False  # the call is the dict's only use
    source: str = ""  # where the entries come from, in words

    def value(self, name: str, positional: cst.Arg | None = None) -> cst.BaseExpression | None:
        """The value given for ``name``: in the call (``positional`` when it is given by position),
        else in the dict."""
        arg = keyword(self.call, name) or positional
        return arg.value if arg is not None else self.entries.get(name)

    def edit(self, name: str, value: cst.BaseExpression) -> tuple[cst.CSTNode, cst.CSTNode] | None:
        """(node, its replacement) that gives ``name`` the value ``value``, or None when no edit would
        reach only this loader (the dict has it and is used elsewhere too, or is in another file)."""
        if keyword(self.call, name) is not None:
            return self.call, set_kwarg(self.call, name, value)
        if self.literal is not None and self.only_use:
            return self.literal, _dict_with(self.literal, name, value)
        if name in self.entries:
            return None
        return self.call, _before_spread(self.call, name, value)


def loader_kwargs(rule: Rule, call: cst.Call) -> LoaderKwargs | None:
    """The arguments of ``call``; None when it has ``*args`` or a ``**`` that cannot be followed."""
    stars = [a for a in call.args if a.star]
    if not stars:
        return LoaderKwargs(call)
    if len(stars) != 1 or stars[0].star != "**":
        return None
    if isinstance(stars[0].value, cst.Call):  # `**loader_kwargs(args)`
        return _from_helper(rule, call, stars[0].value)
    name = stars[0].value
    if not isinstance(name, cst.Name):
        return None
    bindings = bindings_of(rule, name)
    if bindings is None:
        return None
    if len(bindings) != 1 or not isinstance(bindings[0], Assignment):
        return None
    refs = [r.node for r in bindings[0].references]
    if not all(_spread(rule, r) for r in refs):
        return None  # read, changed or passed on elsewhere: its entries here are not known
    value = _assigned_value(rule, bindings[0].node)
    if value is None:
        return None
    entries = _literal_entries(value)
    if entries is not None:
        assert isinstance(value, (cst.Call, cst.Dict))
        return LoaderKwargs(call, entries, value, len(refs) == 1, f"`{name.value}`")
    return _from_helper(rule, call, value)


def _spread(rule: Rule, ref: cst.CSTNode) -> bool:
    parent = rule.get_metadata(ParentProvider, ref, None)
    return isinstance(parent, cst.Arg) and parent.star == "**"


def _assigned_value(rule: Rule, node: cst.CSTNode) -> cst.BaseExpression | None:
    parent = rule.get_metadata(ParentProvider, node, None)
    if isinstance(parent, cst.AssignTarget) and parent.target is node:
        stmt = rule.get_metadata(ParentProvider, parent, None)
        if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1:
            return stmt.value
    return None


def _literal_entries(value: cst.BaseExpression) -> dict[str, cst.BaseExpression] | None:
    """``dict(k=v, ...)`` or ``{"k": v, ...}`` with plain keys: key -> value node."""
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "dict":
        if all(a.keyword is not None and not a.star for a in value.args):
            return {a.keyword.value: a.value for a in value.args if a.keyword is not None}
        return None
    if isinstance(value, cst.Dict):
        out: dict[str, cst.BaseExpression] = {}
        for el in value.elements:
            if not isinstance(el, cst.DictElement) or not isinstance(el.key, cst.SimpleString):
                return None
            out[el.key.evaluated_value if isinstance(el.key.evaluated_value, str) else ""] = el.value
        return out
    return None


def _from_helper(rule: Rule, call: cst.Call, value: cst.BaseExpression) -> LoaderKwargs | None:
    """``kw = helper(...)`` where the project's ``helper`` returns a dict literal (project index)."""
    if not isinstance(value, cst.Call) or not isinstance(value.func, (cst.Name, cst.Attribute)):
        return None
    written = cst.helpers.get_full_name_for_node(value.func)
    got = index_of(rule).resolve(written) if written else None
    if not (isinstance(got, Definition) and got.kind == "function" and got.unit is not None):
        return None
    returned = got.unit.returns_dict
    if returned is None:
        return None
    try:
        entries = {k: cst.parse_expression(v) for k, v in returned.items()}
    except cst.ParserSyntaxError:
        return None
    return LoaderKwargs(call, entries, None, False, f"`{written}()`")


def _dict_with(literal: cst.Call | cst.Dict, name: str, value: cst.BaseExpression) -> cst.CSTNode:
    if isinstance(literal, cst.Call):
        return set_kwarg(literal, name, value)
    elements = list(literal.elements)
    for i, el in enumerate(elements):
        if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString):
            if el.key.evaluated_value == name:
                elements[i] = el.with_changes(value=value)
                return literal.with_changes(elements=elements)
    key = cst.SimpleString(f'"{name}"')
    new = cst.DictElement(key, value)
    if elements:
        last = elements[-1]
        comma = (
            last.comma if isinstance(last.comma, cst.Comma) else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        )
        trailing = isinstance(last.comma, cst.Comma)
        elements[-1] = last.with_changes(comma=comma if not trailing else last.comma)
        if trailing:
            new = new.with_changes(comma=last.comma)
            if len(elements) > 1 and isinstance(elements[-2].comma, cst.Comma):
                elements[-1] = last.with_changes(comma=elements[-2].comma)
    elements.append(new)
    return literal.with_changes(elements=elements)


def _before_spread(call: cst.Call, name: str, value: cst.BaseExpression) -> cst.Call:
    """``name=value`` added to ``call``, before its ``**`` argument (``f(a, k=v, **kw)``, as written by hand)."""
    args = list(call.args)
    at = next((i for i, a in enumerate(args) if a.star == "**"), None)
    if at is None:
        return set_kwarg(call, name, value)
    comma = args[at - 1].comma if at > 0 and isinstance(args[at - 1].comma, cst.Comma) else None
    new = make_kwarg(name, value).with_changes(comma=comma or cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    args.insert(at, new)
    return call.with_changes(args=args)
