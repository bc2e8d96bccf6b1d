"""Datasets that copy each sample to the device themselves (TOP104's report on the loader).

``DataLoader(ds, batch_size=B)`` over a dataset whose ``__getitem__`` moves its sample with
``.to(device)`` / ``.cuda()`` makes B small synchronous copies per batch (and, with workers, CUDA work
in the loader's processes, which fails under fork) where one pinned, non-blocking copy of the
collated batch would do. The dataset is followed only through this file: a class defined here,
built in the ``DataLoader(...)`` call or in every assignment of the name it passes."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import Assignment

from torchopt.analysis.arguments import keyword, positional
from torchopt.analysis.names import bindings_of, reaching_values
from torchopt.analysis.syntax import walk
from torchopt.analysis.transfers import move_device
from torchopt.rewrite.rule import Rule


def sample_copy(rule: Rule, loader: cst.Call) -> tuple[str, cst.Call] | None:
    """(``Class.__getitem__``, the copy) when the dataset of ``loader`` copies each sample to a
    device in its own ``__getitem__``; None when it does not or when that cannot be told."""
    pos = positional(loader)
    kw = keyword(loader, "dataset")
    ds = kw.value if kw is not None else (pos[0].value if pos else None)
    builds: list[cst.BaseExpression | None]
    if isinstance(ds, cst.Call):
        builds = [ds]
    elif isinstance(ds, cst.Name):
        builds = list(reaching_values(rule, ds) or [None])
    else:
        return None
    classes = {id(c): c for c in (_class_built(rule, b) for b in builds)}
    if len(classes) != 1 or None in classes.values():
        return None
    cls = next(iter(classes.values()))
    assert cls is not None
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    getitem = next((s for s in body if isinstance(s, cst.FunctionDef) and s.name.value == "__getitem__"), None)
    if getitem is None:
        return None
    for n in walk(getitem.body):
        if isinstance(n, cst.Call) and move_device(rule, n) is not None:
            return f"{cls.name.value}.__getitem__", n
    return None


def _class_built(rule: Rule, expr: cst.BaseExpression | None) -> cst.ClassDef | None:
    """The class of this file that ``expr`` (``Dataset(...)``) instantiates."""
    if not isinstance(expr, cst.Call) or not isinstance(expr.func, cst.Name):
        return None
    bindings = bindings_of(rule, expr.func)
    if not bindings or len(bindings) != 1 or not isinstance(bindings[0], Assignment):
        return None
    node = bindings[0].node
    return node if isinstance(node, cst.ClassDef) else None
