"""Every rule's examples are whole programs written in the rule class, read from the source with ``ast``.

A reader who opens a rule module sees each example exactly as the rule is tested on it: a literal
(usually a ``dedent`` block) inside ``examples = (...)``, not a string put together from module-level
pieces with ``+``, ``.replace()``, ``.format()`` or an f-string, not a tuple filled in after the class,
and not text imported from another module."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = os.path.join(ROOT, "torchopt", "codemods")
# Names an example may call or name besides the class's own literal blocks.
BUILDERS = {"Valid", "Invalid", "dedent"}
SPLICING_METHODS = {"replace", "format", "join", "strip", "lstrip", "rstrip"}


def _rule_modules() -> dict[str, ast.Module]:
    out = {}
    for folder, _dirs, files in os.walk(RULES):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                out[os.path.relpath(path, ROOT)] = ast.parse(open(path, encoding="utf-8").read(), path)
    return out


def _is_literal_text(node: ast.expr) -> bool:
    """A string constant, or ``dedent`` of one: text that is read as written."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return True
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "dedent"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def _splicing(expr: ast.expr, block_names: set[str]) -> list[str]:
    """What in an examples expression builds or fetches text instead of writing it."""
    found = []
    for node in ast.walk(expr):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
            found.append(f"line {node.lineno}: text joined with an operator")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SPLICING_METHODS:
            found.append(f"line {node.lineno}: text built with .{node.func.attr}()")
        elif isinstance(node, ast.JoinedStr) and any(isinstance(v, ast.FormattedValue) for v in node.values):
            found.append(f"line {node.lineno}: text built with an f-string")
        elif isinstance(node, ast.Name) and node.id not in BUILDERS | block_names:
            found.append(f"line {node.lineno}: example text taken from {node.id!r}, defined outside the class")
    return found


def _problems(tree: ast.Module) -> list[str]:
    problems = []
    imported_from_rules = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchopt.codemods")
        for alias in node.names
    }
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "examples" for t in node.targets
        ):
            problems.append(f"line {node.lineno}: examples assigned after the class")
        if not isinstance(node, ast.ClassDef):
            continue
        block_names = set()
        for stmt in node.body:
            if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
                continue
            target = stmt.targets[0].id
            if target == "examples":
                problems += _splicing(stmt.value, block_names)
            elif _is_literal_text(stmt.value):
                block_names.add(target)
        for stmt in node.body:
            if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "examples" for t in stmt.targets
            ):
                problems += [
                    f"line {n.lineno}: example text {n.id!r} imported from another rule module"
                    for n in ast.walk(stmt.value)
                    if isinstance(n, ast.Name) and n.id in imported_from_rules
                ]
    return problems


def test_every_rule_writes_its_examples_whole_in_the_class():
    found = {path: problems for path, tree in _rule_modules().items() if (problems := _problems(tree))}
    assert found == {}


def test_the_check_sees_each_way_of_splicing_an_example():
    spliced = {
        "operator": 'class R:\n    examples = (Invalid("import torch\\n" + "x = 1\\n"),)\n',
        "replace": 'class R:\n    examples = (Valid(dedent("""\\\n        x = 1\n        """).replace("1", "2")),)\n',
        "module string": '_SRC = "x = 1\\n"\nclass R:\n    examples = (Valid(_SRC),)\n',
        "after the class": 'class R:\n    examples = ()\nR.examples = (Valid("x = 1\\n"),)\n',
        "imported": "from torchopt.codemods.pad.vocab_models import _GPT\nclass R:\n    examples = (Valid(_GPT),)\n",
    }
    for how, source in spliced.items():
        assert _problems(ast.parse(source)), how
    whole = 'class R:\n    _PROGRAM = dedent("""\\\n        x = 1\n        """)\n    examples = (Valid(_PROGRAM), Invalid("y = 2\\n", after=None))\n'
    assert _problems(ast.parse(whole)) == []
