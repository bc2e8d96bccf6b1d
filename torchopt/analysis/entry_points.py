"""Where a file's program runs, and which of its code is only a model module's self-test.

Per-step, evaluation and launcher rules give advice about a program that runs: a training or
evaluation loop, the process a launcher starts. A model-definition module (``models/resnet.py``:
``nn.Module`` classes, a factory or two) often ends with a smoke test that is no such program::

    def test():
        net = ResNet18()
        y = net(torch.randn(2, 3, 32, 32))
        print(y.size())


    if __name__ == "__main__":
        test()

This module says which code of a file is such a self-test, from CPython's ``ast`` of the file,
once per text (``SourceFacts.derived``), with names resolved through the file's imports and
definitions, never by their spelling:

* A **model class** is a top-level class whose base is a ``torch.nn`` module class
  (``nn.Module``, ``nn.Sequential``, ...) or another model class of the file; a **model factory**
  a top-level function whose every ``return`` returns a new model class or factory result.
* A **self-test helper** is a top-level, undecorated function that takes no required parameter,
  returns nothing, has no ``for``/``while`` loop, builds a model of the file (calls a model class or factory), and
  whose every call is *smoke-test work*: a model class or factory or another self-test helper of
  the file, a name bound in the function (``net(x)``), a method of a value (``y.size()``,
  ``net.eval()``), a builtin that prints or inspects (``print``, ``len``, ``sum``, ...) or a torch
  tensor factory (``torch.randn``, ``torch.zeros``, ``Variable(x)``, ...). It must also be used nowhere in the file
  except by the ``if __name__ == "__main__":`` block and other self-test helpers. A function that
  takes a model or a loader (``def test(net, loader):`` in ``train.py``), loops, loads data or
  weights, or is called by the file's own program is not one: it could be a step of a program.
* A **smoke-test guard** is an ``if __name__ == "__main__":`` block that builds a model of the
  file and does only smoke-test work (with the names it binds itself as its locals), without loops.
* A file **only defines models** when it has a model class and its top level is only imports,
  ``class``/``def`` statements, a docstring, assignments of values that call nothing (constants,
  ``__all__``), ``try:`` blocks of imports, and at most a smoke-test guard.

What a file's importers do with a helper is not read (each file is analysed on its own): the
verdict comes from the helper's own shape, which a training or evaluation step does not have.
Code the file cannot be parsed into is never called a self-test (the rules keep their findings).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

import libcst as cst
from libcst.metadata import PositionProvider

from torchopt.rewrite.facts import SourceFacts
from torchopt.rewrite.rule import Rule

_NN = "torch.nn."
# Tensor factories, and ``Variable(x)``: the pre-0.4 wrapper that smoke tests of that era put around inputs.
_TENSOR_FACTORIES = frozenset(["torch.autograd.Variable", "torch.autograd.variable.Variable"]) | frozenset(
    "torch." + name
    for name in (
        "randn rand randint randn_like rand_like randint_like zeros ones empty full arange linspace tensor "
        "zeros_like ones_like empty_like full_like manual_seed no_grad inference_mode Size"
    ).split()
)
_BUILTINS = frozenset(
    "print len sum type isinstance str repr int float round list tuple dict min max abs format id sorted zip "
    "enumerate range".split()
)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


@dataclass(frozen=True)
class Reach:
    """The self-test code of a file: ``spans`` are the (first, last) lines of its self-test helpers
    and, when the file only defines models, of its smoke-test guard."""

    spans: tuple[tuple[int, int], ...] = ()
    only_defines_models: bool = False

    def in_self_test(self, line: int) -> bool:
        return any(first <= line <= last for first, last in self.spans)


def reach_of(facts: SourceFacts) -> Reach:
    """The :class:`Reach` of the text ``facts`` describe, worked out once per text."""
    return facts.derived("entry-points", lambda: _reach(facts.python_ast))


class ProgramRule(Rule):
    """Base of the rules whose advice is about a running program (per-step, evaluation, launcher):
    a finding on a self-test helper or smoke-test guard (see the module docstring) is not reported."""

    def report(self, node: cst.CSTNode, **kwargs: Any) -> None:
        spans = reach_of(self.ctx.facts).spans
        if spans and reach_of(self.ctx.facts).in_self_test(self.get_metadata(PositionProvider, node).start.line):
            return
        super().report(node, **kwargs)


def _reach(tree: ast.Module | BaseException) -> Reach:
    if not isinstance(tree, ast.Module):
        return Reach()
    return _File(tree).reach()


def _is_main_guard(stmt: ast.stmt) -> bool:
    if not isinstance(stmt, ast.If) or not isinstance(stmt.test, ast.Compare) or len(stmt.test.ops) != 1:
        return False
    sides = [stmt.test.left, stmt.test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return isinstance(stmt.test.ops[0], ast.Eq) and len(names) == 1 and len(consts) == 1


def _bound_names(nodes: list[ast.stmt]) -> set[str]:
    """Names bound by assignment, ``with ... as`` and ``for`` targets in ``nodes`` (nested scopes included)."""
    out: set[str] = set()
    for stmt in nodes:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
    return out


def _span(node: ast.stmt) -> tuple[int, int]:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno or node.lineno


class _File:
    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.imports: dict[str, str] = {}  # local name -> qualified name
        self.defs: dict[str, ast.stmt] = {}
        for stmt in tree.body:
            if isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.asname:
                        self.imports[a.asname] = a.name
                    else:
                        root = a.name.split(".")[0]
                        self.imports[root] = root
            elif isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
                for a in stmt.names:
                    self.imports[a.asname or a.name] = f"{stmt.module}.{a.name}"
            elif isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                self.defs[stmt.name] = stmt
        self.models = self._model_classes()
        self.factories = self._factories()
        self.guard: ast.If | None = next((s for s in tree.body if isinstance(s, ast.If) and _is_main_guard(s)), None)

    def qualified(self, expr: ast.expr) -> str | None:
        """The dotted name ``expr`` spells, through the file's imports (None for a local or unknown root)."""
        parts: list[str] = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name) or expr.id not in self.imports:
            return None
        return ".".join([self.imports[expr.id], *reversed(parts)])

    def _model_classes(self) -> set[str]:
        found: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, node in self.defs.items():
                if name in found or not isinstance(node, ast.ClassDef):
                    continue
                for base in node.bases:
                    q = self.qualified(base) or ""
                    own = isinstance(base, ast.Name) and base.id in found and base.id not in self.imports
                    if own or (q.startswith(_NN) and q.rsplit(".", 1)[-1][:1].isupper()):
                        found.add(name)
                        changed = True
                        break
        return found

    def _factories(self) -> set[str]:
        found: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, node in self.defs.items():
                if name in found or not isinstance(node, ast.FunctionDef):
                    continue
                rets = [r for r in ast.walk(node) if isinstance(r, ast.Return)]
                if rets and all(self._builds_model(r.value, found) for r in rets):
                    found.add(name)
                    changed = True
        return found

    def _builds_model(self, expr: ast.expr | None, factories: set[str]) -> bool:
        return (
            isinstance(expr, ast.Call)
            and isinstance(expr.func, ast.Name)
            and expr.func.id not in self.imports
            and (expr.func.id in self.models or expr.func.id in factories)
        )

    # ------------------------------------------------------------ smoke tests
    def _smoke_work(self, body: list[ast.stmt], local: set[str], helpers: set[str]) -> bool:
        """Whether ``body`` builds a model of the file, has no loop, and every call in it is smoke-test work."""
        builds = False
        for stmt in body:
            for n in ast.walk(stmt):
                if isinstance(n, _LOOPS):
                    return False
                if not isinstance(n, ast.Call):
                    continue
                func = n.func
                if isinstance(func, ast.Name):
                    name = func.id
                    if name in local:
                        continue
                    if name in self.imports:
                        if self.imports[name] not in _TENSOR_FACTORIES:
                            return False
                    elif name in self.models or name in self.factories or name in helpers:
                        builds = True
                    elif name in self.defs or name not in _BUILTINS:
                        return False
                elif isinstance(func, ast.Attribute):
                    root: ast.expr = func
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if isinstance(root, ast.Name) and root.id not in local:
                        if self.qualified(func) not in _TENSOR_FACTORIES:
                            return False
                else:
                    return False
        return builds

    def _helper_shaped(self, fn: ast.stmt, helpers: set[str]) -> bool:
        if not isinstance(fn, ast.FunctionDef) or fn.decorator_list or fn.name in self.factories:
            return False
        if any(isinstance(r, ast.Return) and r.value is not None for r in ast.walk(fn)):
            return False
        args = fn.args
        required = len(args.posonlyargs) + len(args.args) - len(args.defaults)
        if required > 0 or any(d is None for d in args.kw_defaults):
            return False
        params = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
        params |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        return self._smoke_work(fn.body, params | _bound_names(fn.body), helpers)

    def _self_test_helpers(self) -> set[str]:
        helpers = {name for name, fn in self.defs.items() if isinstance(fn, ast.FunctionDef)}
        changed = True
        while changed:  # the largest set whose members each qualify, given the others do
            changed = False
            for name in sorted(helpers):
                if not self._helper_shaped(self.defs[name], helpers - {name}) or self._used_outside(name, helpers):
                    helpers.discard(name)
                    changed = True
        return helpers

    def _used_outside(self, name: str, helpers: set[str]) -> bool:
        """Whether ``name`` is read anywhere but the main guard and the self-test helpers ``helpers``."""
        for stmt in self.tree.body:
            if stmt is self.guard or (isinstance(stmt, ast.FunctionDef) and stmt.name in helpers):
                continue
            for n in ast.walk(stmt):
                if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load):
                    return True
                if isinstance(n, ast.Constant) and n.value == name:  # `__all__ = ["test"]`
                    return True
        return False

    def _defines_only(self, stmt: ast.stmt) -> bool:
        if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
        if isinstance(stmt, ast.Expr):
            return isinstance(stmt.value, ast.Constant)
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            return stmt.value is None or not any(isinstance(n, ast.Call) for n in ast.walk(stmt.value))
        if isinstance(stmt, ast.Try):
            blocks = [stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)]
            return all(self._defines_only(s) for block in blocks for s in block)
        return False

    def reach(self) -> Reach:
        helpers = self._self_test_helpers()
        spans = [_span(self.defs[name]) for name in sorted(helpers)]
        guard = self.guard
        smoke_guard = guard is not None and self._smoke_work(guard.body, _bound_names(guard.body), helpers)
        only_models = bool(self.models) and all(
            self._defines_only(s) or (s is guard and smoke_guard) for s in self.tree.body
        )
        if only_models and guard is not None and smoke_guard:
            spans.append(_span(guard))
        return Reach(tuple(spans), only_models)
