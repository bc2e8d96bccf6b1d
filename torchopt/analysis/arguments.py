"""Reading and editing call arguments: positional and keyword arguments, adding or dropping a keyword."""

from __future__ import annotations

from typing import Sequence

import libcst as cst


def has_star(call: cst.Call) -> bool:
    return any(a.star for a in call.args)


def positional(call: cst.Call) -> list[cst.Arg]:
    return [a for a in call.args if a.keyword is None and not a.star]


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a
    return None


def keywords(call: cst.Call) -> dict[str, cst.Arg]:
    return {a.keyword.value: a for a in call.args if a.keyword is not None}


def passed(call: cst.Call, name: str, at: int) -> tuple[bool, cst.BaseExpression | None]:
    """What ``call`` passes for the parameter ``name`` at position ``at``: ``(True, value)``, ``(True, None)``
    when it passes nothing (the default applies), ``(False, None)`` when ``*args``/``**kwargs`` may hide it.
    A keyword written out wins over a star: Python refuses a second value for the same parameter."""
    given = keyword(call, name)
    if given is not None:
        return True, given.value
    if has_star(call):
        return False, None
    plain = positional(call)
    return True, (plain[at].value if at < len(plain) else None)


def make_kwarg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(
        value=value,
        keyword=cst.Name(name),
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )


def _sep(args: Sequence[cst.Arg]) -> cst.Comma:
    """The separator to put between arguments, copied from the call's own style where it has one."""
    for a in args:
        if isinstance(a.comma, cst.Comma) and a is not args[-1]:
            return a.comma
    return cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


def set_kwarg(call: cst.Call, name: str, value: cst.BaseExpression, before: Sequence[str] = ()) -> cst.Call:
    """Replace ``name=`` in place if present; else insert it before the first of ``before`` that is
    present, else append it (keeping a trailing comma and multi-line layout)."""
    args = list(call.args)
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value == name:
            args[i] = a.with_changes(value=value)
            return call.with_changes(args=args)
    new = make_kwarg(name, value)
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value in before:
            args.insert(
                i,
                new.with_changes(
                    comma=_sep(args) if len(args) > 1 else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
                ),
            )
            return call.with_changes(args=args)
    if not args:
        return call.with_changes(args=[new])
    last = args[-1]
    if isinstance(last.comma, cst.Comma):  # trailing comma: the new argument takes it over
        if len(args) > 1 and isinstance(args[-2].comma, cst.Comma):
            sep = args[-2].comma
        elif isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace):
            # one argument per line, `f(\n    a,\n)`: the new one goes on its own line too
            sep = cst.Comma(whitespace_after=call.whitespace_before_args)
        else:
            sep = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        args[-1] = last.with_changes(comma=sep)
        args.append(new.with_changes(comma=last.comma))
    else:
        # The space before `)` belongs to the last argument (`shuffle=True\n    )`): it moves to the new one.
        args[-1] = last.with_changes(comma=_sep(args), whitespace_after_arg=cst.SimpleWhitespace(""))
        args.append(new.with_changes(whitespace_after_arg=last.whitespace_after_arg))
    return call.with_changes(args=args)


def drop_kwarg(call: cst.Call, name: str) -> cst.Call:
    args = list(call.args)
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value == name:
            del args[i]
            if i == len(args) and args:  # removed the last one: keep its trailing-comma state
                args[-1] = args[-1].with_changes(comma=a.comma)
            return call.with_changes(args=args)
    return call
