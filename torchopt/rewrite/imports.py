"""Imports a fix needs, added where isort (and ruff's ``I`` rules, with their defaults) would put them.

The module's first run of imports is read as isort sections: ``__future__``, the standard library,
third party, first party (``known-first-party``) and relative imports, in that order. A new import
goes into its section at its sorted place: within a section ``import x`` statements come first, then
``from x import y``, each sorted by module name ignoring case, numbers in natural order (ruff's
defaults: ``force-sort-within-sections = false``, ``case-sensitive = false``); a name imported from a
module the file already imports from joins that statement, members ordered constants, classes, then
the rest. A section the file does not have yet starts its own block, with a blank line around it.
"""

from __future__ import annotations

import re
import sys
from typing import Sequence

import libcst as cst

from torchopt.rewrite.rule import ImportSpec
from torchopt.rewrite.style import Style

FUTURE, STDLIB, THIRD_PARTY, FIRST_PARTY, LOCAL = range(5)
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"__future__"}


def _natural(text: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def _dotted(node: cst.BaseExpression | None) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    return ""


def section(module: str, level: int, style: Style) -> int:
    if level:
        return LOCAL
    top = module.split(".")[0]
    if top == "__future__":
        return FUTURE
    if top in style.known_first_party:
        return FIRST_PARTY
    if top in style.known_third_party:
        return THIRD_PARTY
    return STDLIB if top in _STDLIB else THIRD_PARTY


def _member_key(name: str) -> tuple:
    kind = 0 if len(name) > 1 and name.isupper() else 1 if name[:1].isupper() else 2
    return (name != "*", kind, _natural(name.lower()), _natural(name))


def _key(stmt: cst.Import | cst.ImportFrom) -> tuple:
    """isort's order within a section: straight imports, then from-imports, each by module."""
    if isinstance(stmt, cst.Import):
        alias = stmt.names[0]
        name = _dotted(alias.name)
        asname = _dotted(alias.asname.name) if alias.asname else ""
        return (0, 0, _natural(name.lower()), _natural(name), (), asname)
    name = _dotted(stmt.module)
    first = stmt.names[0].evaluated_name if isinstance(stmt.names, Sequence) and stmt.names else "*"
    return (1, len(stmt.relative), _natural(name.lower()), _natural(name), _member_key(first), "")


def _import_of(line: cst.BaseStatement) -> cst.Import | cst.ImportFrom | None:
    if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
        stmt = line.body[0]
        if isinstance(stmt, (cst.Import, cst.ImportFrom)):
            return stmt
    return None


def _at(body: Sequence[cst.BaseStatement], i: int) -> cst.Import | cst.ImportFrom:
    """The import at ``body[i]``, a line of the import run."""
    stmt = _import_of(body[i])
    assert stmt is not None
    return stmt


def _section_of(stmt: cst.Import | cst.ImportFrom, style: Style) -> int:
    if isinstance(stmt, cst.Import):
        return section(_dotted(stmt.names[0].name), 0, style)
    return section(_dotted(stmt.module), len(stmt.relative), style)


def _region(body: Sequence[cst.BaseStatement]) -> tuple[int, int]:
    """[start, end) of the module's first run of imports (after its docstring); empty when none."""
    start = 0
    if body and isinstance(body[0], cst.SimpleStatementLine) and len(body[0].body) == 1:
        first = body[0].body[0]
        if isinstance(first, cst.Expr) and isinstance(first.value, (cst.SimpleString, cst.ConcatenatedString)):
            start = 1
    for i in range(start, len(body)):
        if _import_of(body[i]) is not None:
            end = i
            while end < len(body) and _import_of(body[end]) is not None:
                end += 1
            return i, end
        break
    return start, start


def _has(body: Sequence[cst.BaseStatement], spec: ImportSpec) -> bool:
    for line in body:
        stmt = _import_of(line)
        if isinstance(stmt, cst.Import) and spec.obj is None:
            for alias in stmt.names:
                asname = _dotted(alias.asname.name) if alias.asname else None
                if _dotted(alias.name) == spec.module and asname == spec.asname:
                    return True
        elif isinstance(stmt, cst.ImportFrom) and spec.obj is not None and not stmt.relative:
            if _dotted(stmt.module) == spec.module and isinstance(stmt.names, Sequence):
                for alias in stmt.names:
                    asname = _dotted(alias.asname.name) if alias.asname else None
                    if alias.evaluated_name == spec.obj and asname == spec.asname:
                        return True
    return False


def _merge(stmt: cst.ImportFrom, spec: ImportSpec) -> cst.ImportFrom | None:
    """``stmt`` with ``spec.obj`` among its names, in member order; None when it cannot take it."""
    names = stmt.names
    if spec.asname is not None or not isinstance(names, Sequence) or any(a.asname for a in names):
        return None
    key = _member_key(spec.obj or "")
    at = next((i for i, a in enumerate(names) if _member_key(a.evaluated_name) > key), len(names))
    seps = [a.comma for a in names[:-1] if isinstance(a.comma, cst.Comma)]
    sep = seps[0] if seps else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    new = list(names)
    alias = cst.ImportAlias(name=cst.Name(spec.obj or ""))
    if at == len(new):
        last = new[-1]
        new[-1] = last.with_changes(comma=sep)
        new.append(alias.with_changes(comma=last.comma))
    else:
        new.insert(at, alias.with_changes(comma=sep))
    return stmt.with_changes(names=new)


def _statement(spec: ImportSpec) -> cst.SimpleStatementLine:
    if spec.obj is None:
        text = f"import {spec.module}" + (f" as {spec.asname}" if spec.asname else "")
    else:
        text = f"from {spec.module} import {spec.obj}" + (f" as {spec.asname}" if spec.asname else "")
    line = cst.parse_statement(text + "\n")
    assert isinstance(line, cst.SimpleStatementLine)
    return line


def _blank_then_comments(lines: Sequence[cst.EmptyLine]) -> tuple[list[cst.EmptyLine], list[cst.EmptyLine]]:
    i = 0
    while i < len(lines) and lines[i].comment is None:
        i += 1
    return list(lines[:i]), list(lines[i:])


def _insert(body: list[cst.BaseStatement], spec: ImportSpec, style: Style) -> None:
    start, end = _region(body)
    new = _statement(spec)
    new_stmt = _import_of(new)
    assert new_stmt is not None
    sec, key = _section_of(new_stmt, style), _key(new_stmt)
    same: list[int] = []
    for i in range(start, end):
        stmt = _import_of(body[i])
        assert stmt is not None
        if _section_of(stmt, style) != sec:
            continue
        same.append(i)
        if isinstance(stmt, cst.ImportFrom) and spec.obj is not None and not stmt.relative:
            if _dotted(stmt.module) == spec.module:
                merged = _merge(stmt, spec)
                if merged is not None:
                    body[i] = cst.ensure_type(body[i], cst.SimpleStatementLine).with_changes(body=[merged])
                    return
    if same:
        after = [i for i in same if _key(_at(body, i)) > key]
        if after:
            at = after[0]
            old = cst.ensure_type(body[at], cst.SimpleStatementLine)
            body[at] = old.with_changes(leading_lines=())
            body.insert(at, new.with_changes(leading_lines=old.leading_lines))
        else:
            body.insert(same[-1] + 1, new)
        return
    later = [i for i in range(start, end) if _section_of(_at(body, i), style) > sec]
    if later:  # a section of its own, before the first later one
        at = later[0]
        old = cst.ensure_type(body[at], cst.SimpleStatementLine)
        blank, comments = _blank_then_comments(old.leading_lines)
        body[at] = old.with_changes(leading_lines=[cst.EmptyLine(), *comments])
        body.insert(at, new.with_changes(leading_lines=blank))
    elif end > start:  # after the last section
        body.insert(end, new.with_changes(leading_lines=[cst.EmptyLine()]))
    else:  # the first import of the module: after its docstring
        body.insert(start, new.with_changes(leading_lines=[cst.EmptyLine()] if start else []))
        if start < len(body) - 1:
            nxt = body[start + 1]
            if isinstance(nxt, (cst.SimpleStatementLine, cst.BaseCompoundStatement)) and not nxt.leading_lines:
                body[start + 1] = nxt.with_changes(leading_lines=[cst.EmptyLine()])


def add_imports(module: cst.Module, specs: Sequence[ImportSpec], style: Style) -> cst.Module:
    """``module`` with every import of ``specs`` it lacks, each in its isort place."""
    body: list[cst.BaseStatement] = list(module.body)
    for spec in specs:
        if not _has(body, spec):
            _insert(body, spec, style)
    return module.with_changes(body=body)
