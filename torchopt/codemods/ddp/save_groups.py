"""The statements that belong to one save, for the rank-0 guards (TOP405 and the DDP conversions).

A checkpoint is rarely one statement: the folder is created (``os.makedirs(d, exist_ok=True)``,
``if not os.path.exists(d): os.mkdir(d)``, ``Path(d).mkdir(...)``), the path computed, the file written,
copied and logged. Guarding only the write leaves every process creating the folder at once: with
``os.mkdir`` behind an ``exists`` test, all but one of them fail with ``FileExistsError``. The folder
creation right before a guarded save (in the same block, separated from it only by path computations
and statements already guarded with the same test) joins the save's guard, so the group reads as one
``if``; a path computed in between stays visible to every process: it is guarded with the group when
nothing outside the group reads it, else moved above the group (a path computation does not need the
folder to exist).

A folder created anywhere else runs on every process of the converted program (``race_free_folders``):
``if not os.path.isdir(d): os.mkdir(d)`` is a test then a creation, and the processes race between the
two; it becomes ``os.makedirs(d, exist_ok=True)`` (``p.mkdir(exist_ok=True)`` for a pathlib path),
which creates the folder once and lets every process go on with it. A bare ``os.mkdir(d)`` fails when
the folder exists, on purpose or not: it runs on rank 0 only, which keeps that failure.
"""

from __future__ import annotations

import posixpath
from typing import Callable

import libcst as cst

from torchopt.analysis.arguments import keyword, set_kwarg
from torchopt.analysis.statement_edits import Edits
from torchopt.analysis.values import string_value
from torchopt.analysis.syntax import walk
from torchopt.codemods.ddp.program_analysis import Analysis, calls, dotted

_MKDIRS = {"os.mkdir", "os.makedirs"}
_EXISTS = ("exists", "isdir", "is_dir")
# Calls a path computation may make: it neither writes nor needs the folder to exist.
_PATH_CALLS = {"os.path.join", "os.path.dirname", "os.path.basename", "os.path.abspath", "os.path.expanduser"}
_PATH_METHODS = {"format", "joinpath", "with_suffix", "with_name", "replace", "strip", "lower", "resolve"}


def group_with_save(analysis: Analysis, e: Edits, save: cst.CSTNode, path: cst.BaseExpression, test: str) -> int:
    """Join the folder creation before the guarded ``save`` (writing ``path``) to its guard ``test``;
    run once every statement of the file has its guard. Returns how many statements were added."""
    block = analysis.parent(save)
    if not isinstance(block, (cst.IndentedBlock, cst.Module)):
        return 0
    body = list(block.body)
    at = next((i for i, s in enumerate(body) if s is save), None)
    if at is None:
        return 0
    code = analysis.module.code_for_node
    wanted, texts = _names(path), [code(path)]
    between: list[cst.BaseStatement] = []
    start = None
    for i in range(at - 1, -1, -1):
        s = body[i]
        folder = _folder_created(analysis, s)
        if folder is not None:
            if _names(folder) & wanted or any(code(folder) in t for t in texts) or _literally_inside(folder, path):
                start = i
            continue
        if e.guards.get(id(s)) == test:
            continue
        binding = _path_binding(analysis, s)
        if binding is None:
            break
        between.append(s)
        if binding & wanted:
            value = cst.ensure_type(cst.ensure_type(s, cst.SimpleStatementLine).body[0], cst.Assign).value
            wanted |= _names(value)
            texts.append(code(value))
    if start is None:
        return 0
    end = at + 1
    while end < len(body) and e.guards.get(id(body[end])) == test:
        end += 1  # the copy and the log line of the file, guarded with it
    group = body[start:end]
    n = 0
    for s in body[start:at]:
        if id(s) in e.guards:
            continue
        if s in between and _read_outside(analysis, _path_binding(analysis, s) or set(), group, s):
            e.hoist_before(s, body[start])
            continue
        e.guard(s, test)
        n += 1
    return n


def _literal_head(expr: cst.BaseExpression) -> str | None:
    """The text a path expression starts with, when it is written out: ``'./ckpt/a' + name`` ->
    ``./ckpt/a``, ``f"ckpt/{epoch}.pt"`` -> ``ckpt/``."""
    while isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
        expr = expr.left
    if isinstance(expr, cst.FormattedString):
        first = expr.parts[0] if expr.parts else None
        return first.value if isinstance(first, cst.FormattedStringText) else None
    return string_value(expr)


def _literally_inside(folder: cst.BaseExpression, path: cst.BaseExpression) -> bool:
    """Whether ``path`` is written out as a file inside the folder literal ``folder``."""
    d, head = string_value(folder), _literal_head(path)
    if not d or head is None or "/" not in head:
        return False
    norm, parent = posixpath.normpath(d), posixpath.normpath(head.rsplit("/", 1)[0])
    return norm != "." and (parent == norm or parent.startswith(norm + "/"))


def race_free_folders(
    analysis: Analysis,
    e: Edits,
    os_name: str,
    may_edit: Callable[[cst.CSTNode], bool],
    rank0: Callable[[cst.CSTNode], str],
) -> int:
    """Make the folder creations that every process of a converted program runs safe to run at once
    (after ``group_with_save``, which gives the folder of a guarded save its guard). Returns how many
    statements were changed."""
    n = 0
    done: set[int] = set()
    for s in walk(analysis.module, True):
        if not isinstance(s, (cst.If, cst.SimpleStatementLine)) or id(s) in done or id(s) in e.guards:
            continue
        folder = _folder_created(analysis, s)
        if folder is None:
            continue
        done.update(id(x) for x in walk(s, True))
        if (
            any(id(a) in e.guards for a in analysis.ancestors(s))
            or analysis.under_rank_guard(s)
            or analysis.only_called_on_rank(s)
            or not may_edit(s)
        ):
            continue
        if isinstance(s, cst.If):
            made = _checked_creation(analysis, s, folder, os_name)
            if made is not None:
                e.replace_statement(s, lambda _upd, made=made: [made])  # type: ignore[misc]  # mypy infers no lambda with a default
                n += 1
        elif not _exist_ok(cst.ensure_type(cst.ensure_type(s.body[0], cst.Expr).value, cst.Call)):
            e.guard(s, rank0(s))
            n += 1
    return n


def _exist_ok(c: cst.Call) -> bool:
    k = keyword(c, "exist_ok")
    return k is not None and not (isinstance(k.value, cst.Name) and k.value.value in ("False", "None"))


def _checked_creation(
    analysis: Analysis, s: cst.If, folder: cst.BaseExpression, os_name: str
) -> cst.SimpleStatementLine | None:
    """``if not os.path.isdir(d): os.mkdir(d)`` as one creation that tolerates the folder existing;
    None unless the test is exactly ``not`` an existence test of the folder created."""
    code = analysis.module.code_for_node
    t = s.test
    if not (
        isinstance(t, cst.UnaryOperation) and isinstance(t.operator, cst.Not) and isinstance(t.expression, cst.Call)
    ):
        return None
    probe = t.expression
    if not isinstance(probe.func, cst.Attribute) or probe.func.attr.value not in _EXISTS:
        return None
    q = analysis.call_name(probe)
    if q in ("os.path.exists", "os.path.isdir"):
        tested = probe.args[0].value if len(probe.args) == 1 else None
    elif q is None or not q.startswith("os."):
        tested = probe.func.value if not probe.args else None  # a pathlib path: ``p.exists()``
    else:
        return None
    body = cst.ensure_type(s.body, cst.IndentedBlock).body
    if tested is None or code(tested) != code(folder) or len(body) != 1:
        return None
    line = cst.ensure_type(body[0], cst.SimpleStatementLine)
    c = cst.ensure_type(cst.ensure_type(line.body[0], cst.Expr).value, cst.Call)
    if analysis.call_name(c) in _MKDIRS:
        c = c.with_changes(func=cst.parse_expression(f"{os_name}.makedirs"))
    made = set_kwarg(c, "exist_ok", cst.Name("True"))
    return line.with_changes(body=[cst.Expr(made)], leading_lines=s.leading_lines)


def _names(node: cst.CSTNode) -> set[str]:
    """The variables ``node`` reads (``os`` in ``os.path.join``, never the attribute ``path``)."""
    attrs = {id(x.attr) for x in walk(node, True) if isinstance(x, cst.Attribute)}
    return {x.value for x in walk(node, True) if isinstance(x, cst.Name) and id(x) not in attrs}


def _folder_created(analysis: Analysis, s: cst.CSTNode) -> cst.BaseExpression | None:
    """The folder ``s`` creates: ``os.mkdir(d)``, ``os.makedirs(d, ...)``, ``d.mkdir(...)`` (pathlib), or
    ``if not os.path.exists(d): <one of those>``."""
    if isinstance(s, cst.If) and s.orelse is None and isinstance(s.body, cst.IndentedBlock):
        text = analysis.module.code_for_node(s.test)
        inner = [_folder_created(analysis, x) for x in s.body.body]
        if inner and all(f is not None for f in inner) and any(w in text for w in _EXISTS):
            return inner[0]
        return None
    if not isinstance(s, cst.SimpleStatementLine) or len(s.body) != 1 or not isinstance(s.body[0], cst.Expr):
        return None
    c = s.body[0].value
    if not isinstance(c, cst.Call) or not isinstance(c.func, (cst.Name, cst.Attribute)):
        return None
    q = analysis.call_name(c)
    if q in _MKDIRS:
        first = next((a.value for a in c.args if a.keyword is None or a.keyword.value in ("path", "name")), None)
        return first
    if isinstance(c.func, cst.Attribute) and c.func.attr.value == "mkdir" and dotted(c.func.value) != "os":
        return c.func.value
    return None


def _path_binding(analysis: Analysis, s: cst.CSTNode) -> set[str] | None:
    """The names ``s`` binds when it only computes a path (``p = os.path.join(d, f"{epoch}.pt")``)."""
    if not isinstance(s, cst.SimpleStatementLine) or len(s.body) != 1 or not isinstance(s.body[0], cst.Assign):
        return None
    assign = s.body[0]
    targets = [t.target for t in assign.targets]
    if not all(isinstance(t, cst.Name) for t in targets):
        return None
    for c in calls(assign.value, True):
        q = analysis.call_name(c) if isinstance(c.func, (cst.Name, cst.Attribute)) else None
        method = c.func.attr.value if isinstance(c.func, cst.Attribute) else None
        if q in _PATH_CALLS or q in ("builtins.str", "str", "pathlib.Path") or method in _PATH_METHODS:
            continue
        if isinstance(c.func, cst.Name) and c.func.value in ("str", "Path"):
            continue
        return None
    return {cst.ensure_type(t, cst.Name).value for t in targets}


def _read_outside(analysis: Analysis, names: set[str], group: list[cst.BaseStatement], binding: cst.CSTNode) -> bool:
    """Whether a name of ``names`` is read in the function (or module) of ``binding`` outside ``group``."""
    owner = analysis.scope_owner(binding)
    inside = {id(x) for s in group for x in walk(s, True)}
    attrs = {id(x.attr) for x in walk(owner, True) if isinstance(x, cst.Attribute)}
    return any(
        isinstance(x, cst.Name) and x.value in names and id(x) not in inside and id(x) not in attrs
        for x in walk(owner, True)
    )
