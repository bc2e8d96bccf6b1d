"""TOP301: once the vocabulary is padded, the model's logits are a slice of the padded ones, which is
not contiguous, so `.view` on them raises where `.reshape` works: these find the `.view` calls that
read those logits, inside the model class and in the code that calls an instance of it."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.syntax import walk
from torchopt.analysis.values import dtype_of
from torchopt.analysis.values import string_value
from torchopt.codemods.pad.vocab_models import _instance_of, _target_names
from torchopt.rewrite.metadata import children_of
from torchopt.rewrite.rule import Rule


def outside_views(rule: Rule, cls: cst.ClassDef) -> list[cst.Call]:
    """`.view(...)` calls outside ``cls`` on what an instance of it returns (`logits, loss = model(x)`)."""
    name = cls.name.value
    nodes: list[cst.CSTNode] = []
    stack: list[cst.CSTNode] = [rule.ctx.module]
    while stack:
        cur = stack.pop()
        if cur is cls:
            continue
        nodes.append(cur)
        stack.extend(reversed(children_of(cur)))
    models = set()
    for n in nodes:
        if isinstance(n, cst.Assign) and _instance_of(n.value, name):
            for t in n.targets:
                models |= _target_names(t.target)
    if not models:
        return []
    tainted: set[str] = set()

    def from_model(expr: cst.CSTNode) -> bool:
        cur = expr
        while True:
            if isinstance(cur, cst.Call):
                f = cur.func
                if isinstance(f, cst.Name):
                    return f.value in models
                if isinstance(f, cst.Attribute):
                    if isinstance(f.value, cst.Name) and f.value.value in models:
                        return f.attr.value == "forward"
                    cur = f.value
                    continue
                return False
            if isinstance(cur, (cst.Subscript, cst.Attribute)):
                cur = cur.value
                continue
            return isinstance(cur, cst.Name) and cur.value in tainted

    assigns = [n for n in nodes if isinstance(n, cst.Assign)]
    for _ in range(4):
        before = len(tainted)
        for a in assigns:
            if from_model(a.value):
                for t in a.targets:
                    tainted |= _target_names(t.target)
        if len(tainted) == before:
            break
    return [
        n
        for n in nodes
        if isinstance(n, cst.Call)
        and isinstance(n.func, cst.Attribute)
        and n.func.attr.value == "view"
        and from_model(n.func.value)
        and _shape_args(rule, n)
    ]


def views_in(rule: Rule, fn: cst.FunctionDef, head_calls: set[int]) -> list[cst.Call]:
    """`.view(...)` calls in method ``fn`` on the head's logits (the calls in ``head_calls``) or on
    what the model itself returns (`self(x)`, `self.forward(x)`), also through assigned names."""
    self_name = fn.params.params[0].name.value
    tainted: set[str] = set()

    def from_logits(expr: cst.CSTNode) -> bool:
        cur = expr
        while True:
            if isinstance(cur, cst.Call):
                if id(cur) in head_calls:
                    return True
                f = cur.func
                if isinstance(f, cst.Name) and f.value == self_name:
                    return True  # self(...): forward's output
                if (
                    isinstance(f, cst.Attribute)
                    and isinstance(f.value, cst.Name)
                    and f.value.value == self_name
                    and f.attr.value == "forward"
                ):
                    return True
                if isinstance(f, cst.Attribute):
                    cur = f.value
                    continue
                return False
            if isinstance(cur, (cst.Subscript, cst.Attribute)):
                cur = cur.value
                continue
            return isinstance(cur, cst.Name) and cur.value in tainted

    assigns = [n for n in walk(fn.body) if isinstance(n, cst.Assign)]
    for _ in range(4):
        before = len(tainted)
        for a in assigns:
            if from_logits(a.value):
                for t in a.targets:
                    tainted |= _target_names(t.target)
        if len(tainted) == before:
            break
    out = []
    for n in walk(fn.body):
        if (
            isinstance(n, cst.Call)
            and isinstance(n.func, cst.Attribute)
            and n.func.attr.value == "view"
            and from_logits(n.func.value)
            and _shape_args(rule, n)
        ):
            out.append(n)
    return out


def _shape_args(rule: Rule, call: cst.Call) -> bool:
    """The call's arguments are all shapes: `.view(dtype)` reinterprets bytes, and `.reshape` has no such form."""
    if not call.args or any(a.keyword is not None or a.star for a in call.args):
        return False
    return all(dtype_of(rule, a.value) is None and string_value(a.value) is None for a in call.args)
