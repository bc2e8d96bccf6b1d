"""What the file argument of a write (``torch.save(obj, f)``) holds: a *path* on the filesystem, an
in-memory *buffer* or an open *file* object, or *unknown*.

Only a path names a file that every process of a distributed program would write (and race on):
``torch.save(state, io.BytesIO())`` writes into the memory of the process that calls it, and a
save into ``f`` of ``with open(path, "wb") as f:`` is part of that ``with`` block's write. The
value is read from the expression itself, or from every assignment of the name in its scope
(LibCST scope analysis): a parameter counts by its default, a ``with ... as f`` target by the
context manager. Anything else (an attribute such as ``args.out``, a value returned by a call of
this file) is unknown, and a rule that needs the answer does not guess it."""

from __future__ import annotations

from typing import Literal

import libcst as cst
from libcst.metadata import Assignment

from torchopt.analysis.names import bindings_of, callee, qualified_names
from torchopt.analysis.values import string_value
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

Target = Literal["path", "buffer", "file", "unknown"]

_PATH_CALLS = {"pathlib.Path", "pathlib.PurePath", "pathlib.PosixPath", "pathlib.WindowsPath", "os.fspath"}
_BUFFER_CALLS = {"io.BytesIO", "io.StringIO", "tempfile.SpooledTemporaryFile", "tempfile.TemporaryFile"}
_PATH_METHODS = {"format", "joinpath", "with_suffix", "with_name", "with_stem", "resolve", "absolute", "expanduser"}
_FILE_CALLS = {"builtins.open", "open", "io.open", "gzip.open", "bz2.open", "lzma.open", "tempfile.NamedTemporaryFile"}


def file_target(rule: Rule, expr: cst.BaseExpression | None, depth: int = 0) -> Target:
    """What ``expr``, the file argument of a write, holds (see the module docstring)."""
    if expr is None or depth > 4:
        return "unknown"
    if isinstance(expr, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString)):
        return "path" if not isinstance(expr, cst.SimpleString) or string_value(expr) is not None else "unknown"
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Modulo, cst.Divide)):
        sides = (file_target(rule, expr.left, depth + 1), file_target(rule, expr.right, depth + 1))
        return "path" if "path" in sides else "unknown"
    if isinstance(expr, cst.Call):
        return _call_target(rule, expr, depth)
    if isinstance(expr, cst.Name):
        return _name_target(rule, expr, depth)
    return "unknown"


def _call_target(rule: Rule, call: cst.Call, depth: int) -> Target:
    q = callee(rule, call) or next(iter(sorted(qualified_names(rule, call.func))), None) or ""
    if q in _BUFFER_CALLS:
        return "buffer"
    if q in _FILE_CALLS:
        return "file"
    if q in _PATH_CALLS or q.startswith("os.path."):
        return "path"
    if isinstance(call.func, cst.Attribute) and call.func.attr.value in _PATH_METHODS:
        return "path" if file_target(rule, call.func.value, depth + 1) == "path" else "unknown"
    return "unknown"


def _name_target(rule: Rule, name: cst.Name, depth: int) -> Target:
    bindings = bindings_of(rule, name)
    if bindings is None:
        return "unknown"
    kinds: set[Target] = set()
    for a in bindings:
        kinds.add(_bound_target(rule, a.node, depth) if isinstance(a, Assignment) else "unknown")
    if len(kinds) == 1:
        return kinds.pop()
    return "buffer" if "buffer" in kinds else "unknown"


def _bound_target(rule: Rule, node: cst.CSTNode, depth: int) -> Target:
    """What the binding ``node`` (the name of an assignment, a parameter, a ``with`` target) holds."""
    if isinstance(node, cst.Param):
        return file_target(rule, node.default, depth + 1)
    parent = rule.get_metadata(ParentProvider, node, None)
    if isinstance(parent, cst.AssignTarget) and parent.target is node:
        stmt = rule.get_metadata(ParentProvider, parent, None)
        return file_target(rule, stmt.value, depth + 1) if isinstance(stmt, cst.Assign) else "unknown"
    if isinstance(parent, cst.AnnAssign) and parent.target is node:
        return file_target(rule, parent.value, depth + 1)
    if isinstance(parent, cst.AsName) and parent.name is node:
        item = rule.get_metadata(ParentProvider, parent, None)
        if isinstance(item, cst.WithItem):
            return file_target(rule, item.item, depth + 1)
    return "unknown"
