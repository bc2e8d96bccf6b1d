"""How a file imports torch, seen through CPython's ast: which names may resolve to which torch APIs."""

from __future__ import annotations

import ast as _ast
from typing import Iterable

from torchopt.analysis.precheck.tree import ast_index
from torchopt.rewrite.facts import facts_for


def torch_import_map(text: str) -> dict[str, frozenset[str]] | None:
    """Names an import of torch binds anywhere in the file (any scope, any branch), each with the
    torch-qualified names it can stand for: ``import torch as T`` -> T: {torch}; ``import torch.nn``
    -> torch: {torch}; ``import torch.nn as nn`` / ``from torch import nn`` -> nn: {torch.nn};
    ``from torch.optim import SGD as S`` -> S: {torch.optim.SGD}. None when the text does not parse
    or has a ``from torch... import *`` (then any name may come from torch)."""
    return facts_for(text).derived("torch imports", lambda: _torch_import_map(text))


def _torch_import_map(text: str) -> dict[str, frozenset[str]] | None:
    index = ast_index(text)
    out: dict[str, set[str]] | None = None
    if index is not None:
        out = {}
        for imp in index.get(_ast.Import, ()):
            for a in imp.names:
                if a.name.split(".")[0] != "torch":
                    continue
                if a.asname:
                    out.setdefault(a.asname, set()).add(a.name)
                else:
                    out.setdefault("torch", set()).add("torch")
        for imp in index.get(_ast.ImportFrom, ()):
            if imp.level or not imp.module or imp.module.split(".")[0] != "torch":
                continue
            for a in imp.names:
                if a.name == "*":
                    out = None
                    break
                out.setdefault(a.asname or a.name, set()).add(f"{imp.module}.{a.name}")
            if out is None:
                break
    return None if out is None else {k: frozenset(v) for k, v in out.items()}


def ast_torch_names(imports: dict[str, frozenset[str]], expr: _ast.AST | None) -> frozenset[str]:
    """The torch-qualified names a Name/Attribute chain can stand for under ``imports`` (from
    ``torch_import_map``): ``nn.Linear`` with nn: {torch.nn} -> {torch.nn.Linear}; empty when its
    root is bound by no import of torch or it is not a plain chain."""
    parts: list[str] = []
    while isinstance(expr, _ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, _ast.Name):
        return frozenset()
    roots = imports.get(expr.id)
    if not roots:
        return frozenset()
    if not parts:
        return roots
    tail = "." + ".".join(reversed(parts))
    return frozenset(r + tail for r in roots)


def torch_callees(text: str) -> frozenset[str] | None:
    """Every torch-qualified name a call's callee (a plain Name/Attribute chain) can stand for in the
    file, resolved through its imports (``torch_import_map``): a superset of what ``callee`` finds.
    None when it cannot be told (the text does not parse, or a star import from torch)."""
    return facts_for(text).derived("torch callees", lambda: _torch_callees(text))


def _torch_callees(text: str) -> frozenset[str] | None:
    imports = torch_import_map(text)
    result: frozenset[str] | None = None
    if imports is not None:
        index = ast_index(text) or {}
        names: set[str] = set()
        if imports:
            for c in index.get(_ast.Call, ()):
                root = c.func
                while isinstance(root, _ast.Attribute):
                    root = root.value
                if isinstance(root, _ast.Name) and root.id in imports:
                    names |= ast_torch_names(imports, c.func)
        result = frozenset(names)
    return result


def torch_calls_to(text: str, names: Iterable[str]) -> list[_ast.Call] | None:
    """The calls whose callee (a plain Name/Attribute chain) may resolve to one of the
    torch-qualified ``names`` through the file's imports (``torch_import_map``): a superset of the
    calls ``callee`` maps there. None when it cannot be told (no parse, or a star import from torch)."""
    imports = torch_import_map(text)
    if imports is None:
        return None
    wanted = set(names)
    callees = torch_callees(text)
    if not imports or callees is None or not (callees & wanted):
        return []
    index = ast_index(text) or {}
    return [c for c in index.get(_ast.Call, ()) if ast_torch_names(imports, c.func) & wanted]


def may_call_torch(text: str, names: Iterable[str]) -> bool:
    """Some call's callee may resolve to one of the torch-qualified ``names`` through the file's
    imports (``torch_callees``); True when that cannot be told."""
    callees = torch_callees(text)
    return callees is None or not callees.isdisjoint(names)
