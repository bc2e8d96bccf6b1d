"""Rearranging chains: a tensor expression that only rearranges the values of the call it starts from.

``torch.arange(n).unsqueeze(0).repeat(b, 1)`` or ``torch.arange(n)[:, None]`` hold the values of
``torch.arange(n)`` reshaped, repeated or reordered, on the device where that call made them. Such a
chain moved afterwards (``....to(device)``) gives the same tensor as the chain run on a tensor made
on ``device``: the links compute nothing (no arithmetic, no cast), take no tensor argument (their
arguments are sizes and dimensions), and their result is dense and non-overlapping, so ``.to()``
(which keeps a dense tensor's strides) does not change its layout either. Links that may leave gaps
or overlap (``expand``, ``narrow``, a stepped slice, an integer index) are not part of a chain.

The chain is read from the syntax; its methods are tensor methods because the bottom call is
resolved by the rule that asks (a torch factory returns a tensor). Both a LibCST and a CPython-ast
form are given: the second is for the rules' cheap prechecks.
"""

from __future__ import annotations

import ast as _ast

import libcst as cst

# Tensor methods that rearrange (or copy) the receiver's values on its device and give a dense,
# non-overlapping result for a dense receiver; their arguments are sizes, dimensions or a memory
# format, never a tensor whose device could matter.
REARRANGING = frozenset(
    {
        "unsqueeze",
        "squeeze",
        "view",
        "reshape",
        "flatten",
        "repeat",
        "tile",
        "flip",
        "fliplr",
        "flipud",
        "t",
        "transpose",
        "permute",
        "contiguous",
        "clone",
        "detach",
    }
)


def _plain_index(el: cst.SubscriptElement) -> bool:
    """``None``, ``...`` or a bare ``:``: a new axis or the whole axis (no gap, no overlap)."""
    sl = el.slice
    if isinstance(sl, cst.Slice):
        return sl.lower is None and sl.upper is None and sl.step is None
    if not isinstance(sl, cst.Index):
        return False
    v = sl.value
    return (isinstance(v, cst.Name) and v.value == "None") or isinstance(v, cst.Ellipsis)


def chain_root(expr: cst.BaseExpression) -> tuple[cst.Call, tuple[str, ...]] | None:
    """The call a rearranging chain starts from and its links in order (``("unsqueeze", "repeat")``,
    ``"[]"`` for an index); None when ``expr`` is no such chain of at least one link."""
    links: list[str] = []
    cur = expr
    while True:
        if (
            isinstance(cur, cst.Call)
            and isinstance(cur.func, cst.Attribute)
            and cur.func.attr.value in REARRANGING
            and not any(a.star for a in cur.args)
        ):
            links.append(cur.func.attr.value)
            cur = cur.func.value
        elif isinstance(cur, cst.Subscript) and all(_plain_index(el) for el in cur.slice):
            links.append("[]")
            cur = cur.value
        else:
            break
    if not links or not isinstance(cur, cst.Call):
        return None
    return cur, tuple(reversed(links))


def replace_root(expr: cst.BaseExpression, root: cst.Call, new: cst.Call) -> cst.BaseExpression:
    """``expr`` (a chain found by :func:`chain_root`) with its bottom call ``root`` replaced by ``new``."""
    if expr is root:
        return new
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        return expr.with_changes(func=expr.func.with_changes(value=replace_root(expr.func.value, root, new)))
    assert isinstance(expr, cst.Subscript)  # (chain_root admits only calls and subscripts)
    return expr.with_changes(value=replace_root(expr.value, root, new))


def _ast_plain_index(node: _ast.expr) -> bool:
    if isinstance(node, _ast.Slice):
        return node.lower is None and node.upper is None and node.step is None
    return isinstance(node, _ast.Constant) and (node.value is None or node.value is Ellipsis)


def ast_chain_root(node: _ast.expr) -> _ast.Call | None:
    """:func:`chain_root` on CPython's ast: the bottom call, or ``node`` itself when it is a call
    that starts no chain; None otherwise."""
    cur = node
    while True:
        if (
            isinstance(cur, _ast.Call)
            and isinstance(cur.func, _ast.Attribute)
            and cur.func.attr in REARRANGING
            and not any(isinstance(a, _ast.Starred) for a in cur.args)
            and not any(k.arg is None for k in cur.keywords)
        ):
            cur = cur.func.value
        elif isinstance(cur, _ast.Subscript):
            parts = cur.slice.elts if isinstance(cur.slice, _ast.Tuple) else [cur.slice]
            if not all(_ast_plain_index(p) for p in parts):
                return node if isinstance(node, _ast.Call) else None
            cur = cur.value
        else:
            break
    if isinstance(cur, _ast.Call):
        return cur
    return node if isinstance(node, _ast.Call) else None
