"""Recognising evaluation code (for the no-grad advice): functions named like evaluation, loops
over loaders named like validation data, model forwards, training steps, grad-mode contexts."""

from __future__ import annotations

import re

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import callee, dotted
from torchopt.analysis.arguments import has_star, positional
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider, remembered
from torchopt.analysis.entry_points import ProgramRule
from torchopt.analysis.conventions import EVAL_FUNCTION, MODEL_ACTION, MODEL_UNWRAP, eval_loader_name, model_name
from torchopt.analysis.lifecycle import lifecycle_of
from torchopt.analysis.module_modes import runs_without_grad

GRAD_OFF = {
    "torch.no_grad",
    "torch.inference_mode",
    "torch.autograd.grad_mode.no_grad",
    "torch.autograd.grad_mode.inference_mode",
    "torch.autograd.no_grad",
}
GRAD_ON = {
    "torch.enable_grad",
    "torch.set_grad_enabled",
    "torch.autograd.grad_mode.enable_grad",
    "torch.autograd.grad_mode.set_grad_enabled",
    "torch.autograd.grad",
    "torch.autograd.backward",
    "torch.func.grad",
    "torch.autograd.functional.jacobian",
}
_TRAIN_METHODS = {"backward", "step", "zero_grad", "requires_grad_", "retain_grad"}
# Routines that train by their name: `train_one_epoch(...)`, `trainer.fit(...)`, `train(model, ...)`.
_TRAINING_ROUTINE = re.compile(r"^_*(train|fit)(_\w+)?$|_train$|^finetune")


class EvalRule(ProgramRule):
    """Shared analysis; the subclasses decide what to report (never in a model module's self-test)."""

    def forward_calls(self, body: cst.CSTNode) -> list[tuple[cst.Call, str]]:
        """Calls of a model in ``body``: ``model(x)``, ``self.net(x)``, ``model.forward(x)``."""
        out = []
        for n in walk(body):
            if not isinstance(n, cst.Call):
                continue
            func = n.func
            if isinstance(func, cst.Attribute) and func.attr.value in ("forward", "generate"):
                func = func.value
            unwrapped = _unwrapped(func)
            if unwrapped is not None:
                out.append((n, unwrapped))
                continue
            d = dotted(func)
            if d is None or not model_name(d.rsplit(".", 1)[-1]) or callee(self, n) is not None:
                continue
            if MODEL_ACTION.match(d.rsplit(".", 1)[-1]):
                continue  # `accelerator.unwrap_model(m)`, `build_model(cfg)`: no model runs
            if isinstance(func, cst.Name) and self._is_function_name(func):
                continue
            root = func
            while isinstance(root, cst.Attribute):
                root = root.value
            if isinstance(root, cst.Name) and self._imported(root):
                continue
            out.append((n, d))
        return out

    def _imported(self, name: cst.Name) -> bool:
        """``name`` is bound only by imports: ``build_model(cfg)``, ``ModelRegistry(...)`` or
        ``clip.available_models()`` from another module builds or looks up something (a
        construction, in the model lifecycle), it runs no model."""
        try:
            scope = self.get_metadata(ScopeProvider, name)
        except KeyError:
            return False
        if scope is None or name.value not in scope:
            return False
        found = list(scope[name.value])
        return bool(found) and all(isinstance(getattr(a, "node", None), (cst.Import, cst.ImportFrom)) for a in found)

    def _is_function_name(self, name: cst.Name) -> bool:
        """``name`` is bound by a def or a class in the file (``build_model(...)`` is not a forward)."""
        defs = getattr(self, "_defs", None)
        if defs is None:
            defs = self._defs = {
                n.name.value
                for n in walk(self.ctx.module, cross_scopes=True)
                if isinstance(n, (cst.FunctionDef, cst.ClassDef))
            }
        return name.value in defs

    def trains(self, body: cst.CSTNode) -> cst.CSTNode | None:
        """The first node in ``body`` that computes or needs gradients (None: none)."""
        for n in walk(body):
            if isinstance(n, cst.Call):
                q = callee(self, n)
                if q in GRAD_ON:
                    return n
                if isinstance(n.func, cst.Attribute) and n.func.attr.value in _TRAIN_METHODS:
                    return n
            elif isinstance(n, cst.Attribute) and n.attr.value in ("requires_grad", "grad", "grad_fn"):
                return n
        return None

    def grad_off_call(self, expr: cst.BaseExpression) -> str | None:
        """``torch.no_grad()`` / ``torch.inference_mode()`` / ``torch.set_grad_enabled(False)``."""
        if not isinstance(expr, cst.Call):
            return None
        q = callee(self, expr)
        if q in GRAD_OFF:
            return q
        if q in ("torch.set_grad_enabled", "torch.autograd.grad_mode.set_grad_enabled"):
            args = positional(expr)
            if args and isinstance(args[0].value, cst.Name) and args[0].value.value == "False":
                return q
        return None

    def decorated_grad_off(self, fn: cst.FunctionDef) -> bool:
        for d in fn.decorators:
            if self.grad_off_call(d.decorator) is not None:
                return True
            if isinstance(d.decorator, (cst.Name, cst.Attribute)) and (dotted(d.decorator) or "").rsplit(".", 1)[
                -1
            ] in ("no_grad", "inference_mode"):
                return True
        return False

    def in_grad_off(self, node: cst.CSTNode) -> bool:
        """Whether ``node`` runs under no_grad/inference_mode (a `with` around it or a decorator), or
        in a nested function every call of which does (the lifecycle's ``grad_off``), or is a call of
        an object whose class of the project runs its ``__call__`` under no_grad (a pipeline)."""
        if (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Name)
            and runs_without_grad(self, node.func.value, node)
        ):
            return True
        cur = self.get_metadata(ParentProvider, node, None)
        while cur is not None:
            if isinstance(cur, cst.With) and any(self.grad_off_call(i.item) for i in cur.items):
                return True
            if isinstance(cur, cst.FunctionDef):
                if self.decorated_grad_off(cur):
                    return True
            cur = self.get_metadata(ParentProvider, cur, None)
        return lifecycle_of(self).grad_off(node)

    def is_method(self, fn: cst.FunctionDef) -> bool:
        """A function defined in a class body: a `predict` method of a module is part of its forward."""
        parent = self.get_metadata(ParentProvider, fn, None)
        while isinstance(parent, (cst.IndentedBlock, cst.SimpleStatementSuite)):
            parent = self.get_metadata(ParentProvider, parent, None)
        return isinstance(parent, cst.ClassDef)

    def is_module_method(self, fn: cst.FunctionDef) -> bool:
        """A method of a class that looks like a torch module (a ``forward`` method, or a base named
        like ``nn.Module``): part of a forward. A trainer's ``evaluate(self)`` is not."""
        parent = self.get_metadata(ParentProvider, fn, None)
        while isinstance(parent, (cst.IndentedBlock, cst.SimpleStatementSuite)):
            parent = self.get_metadata(ParentProvider, parent, None)
        if not isinstance(parent, cst.ClassDef):
            return False
        if any(isinstance(s, cst.FunctionDef) and s.name.value == "forward" for s in parent.body.body):
            return True
        return any(
            "Module" in (dotted(b.value) or "") or (dotted(b.value) or "").startswith(("nn.", "torch.nn."))
            for b in parent.bases
        )

    def trains_anywhere(self) -> bool:
        """Whether the file trains anything: a backward pass, an optimizer, gradients asked for, a
        model put in training mode, or a call of a training routine (``train_one_epoch(...)``,
        ``trainer.fit(...)``) whose body may live in another file. One answer per file, shared by
        the rules that ask."""
        module = self.ctx.module
        return remembered(("trains-anywhere",), module, lambda: self._trains_anywhere(module))

    def _trains_anywhere(self, module: cst.Module) -> bool:
        nodes = walk(module, cross_scopes=True)
        calls = []
        for n in nodes:  # the syntactic signs first: they need no name resolution
            if isinstance(n, cst.Call):
                calls.append(n)
                func = n.func
                if isinstance(func, cst.Attribute) and func.attr.value in (
                    "backward",
                    "requires_grad_",
                    "zero_grad",
                    "retain_grad",
                ):
                    return True
                if (
                    isinstance(func, cst.Attribute)
                    and func.attr.value == "train"
                    and not (n.args and isinstance(n.args[0].value, cst.Name) and n.args[0].value.value == "False")
                ):
                    return True
                last = (dotted(func) or "").rsplit(".", 1)[-1]
                if _TRAINING_ROUTINE.match(last):
                    return True
            elif isinstance(n, cst.Attribute) and n.attr.value in ("grad", "grad_fn"):
                return True
        # A call can only resolve to `torch.optim.*` or one of these if the text names them somewhere
        # (an import, or the dotted call itself): resolving every call of a model file costs more than the rest.
        if not any(tok in self.ctx.text for tok in ("optim", "autograd", "enable_grad", "set_grad_enabled")):
            return False
        for n in calls:
            q = callee(self, n)
            if q and (
                q.startswith("torch.optim.")
                or q
                in ("torch.autograd.grad", "torch.autograd.backward", "torch.enable_grad", "torch.set_grad_enabled")
            ):
                return True
        return False

    def called_from_training(self, fn: cst.FunctionDef) -> bool:
        """Some call of ``fn`` sits in a function that looks like a forward or a training step."""
        for call in self.calls_to(fn.name.value):
            outer = self.enclosing_function(call)
            if outer is None:
                continue
            name = outer.name.value.lower()
            if name in ("forward", "__call__", "step") or "train" in name or "loss" in name or "fit" in name:
                return True
        return False

    def enclosing_function(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        cur = self.get_metadata(ParentProvider, node, None)
        while cur is not None:
            if isinstance(cur, cst.FunctionDef):
                return cur
            if isinstance(cur, (cst.ClassDef, cst.Lambda)):
                return None
            cur = self.get_metadata(ParentProvider, cur, None)
        return None

    def scope_body(self, node: cst.CSTNode) -> cst.CSTNode:
        fn = self.enclosing_function(node)
        return fn.body if fn is not None else self.ctx.module

    def loop_iter_name(self, loop: cst.For) -> str | None:
        it = loop.iter
        for _ in range(3):
            if isinstance(it, cst.Call) and not has_star(it) and positional(it):
                name = dotted(it.func) or ""
                if name.rsplit(".", 1)[-1] in ("enumerate", "tqdm", "track", "iter", "zip"):
                    it = positional(it)[0].value
                    continue
            break
        d = dotted(it)
        return d.rsplit(".", 1)[-1] if d else None

    def functions(self) -> dict[str, cst.FunctionDef]:
        out: dict[str, cst.FunctionDef] = {}
        for n in walk(self.ctx.module, cross_scopes=True):
            if isinstance(n, cst.FunctionDef):
                out.setdefault(n.name.value, n)
        return out

    def calls_to(self, name: str) -> list[cst.Call]:
        """Calls ``name(...)`` and ``self.name(...)`` in the file, in walk order."""
        module = self.ctx.module
        hit = self.__dict__.get("_calls_to_memo")
        if hit is None or hit[0] is not module:  # one walk per parse, indexed by the called name
            index: dict[str, list[cst.Call]] = {}
            for n in walk(module, cross_scopes=True):
                if not isinstance(n, cst.Call):
                    continue
                if isinstance(n.func, cst.Name):
                    index.setdefault(n.func.value, []).append(n)
                elif (
                    isinstance(n.func, cst.Attribute)
                    and isinstance(n.func.value, cst.Name)
                    and n.func.value.value == "self"
                ):
                    index.setdefault(n.func.attr.value, []).append(n)
            hit = self._calls_to_memo = (module, index)
        return list(hit[1].get(name, ()))

    def statement_of(self, node: cst.CSTNode) -> cst.CSTNode:
        cur: cst.CSTNode | None = node
        while cur is not None and not isinstance(cur, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            cur = self.get_metadata(ParentProvider, cur, None)
        return cur if cur is not None else node

    def assigned_names(self, node: cst.CSTNode) -> set[str]:
        out = set()
        for n in walk(node):
            if isinstance(n, cst.AssignTarget):
                out |= {x.value for x in walk(n.target) if isinstance(x, cst.Name)}
            elif isinstance(n, (cst.AugAssign, cst.AnnAssign)) and isinstance(n.target, cst.Name):
                out.add(n.target.value)
            elif isinstance(n, cst.For):
                out |= {x.value for x in walk(n.target) if isinstance(x, cst.Name)}
        return out

    def backward_uses(self, scope: cst.CSTNode) -> set[str]:
        """Names that appear in a backward pass or `autograd.grad` call in ``scope``."""
        out: set[str] = set()
        for n in walk(scope):
            if isinstance(n, cst.Call):
                if isinstance(n.func, cst.Attribute) and n.func.attr.value == "backward":
                    out |= {x.value for x in walk(n, cross_scopes=True) if isinstance(x, cst.Name)}
                elif callee(self, n) in ("torch.autograd.grad", "torch.autograd.backward"):
                    out |= {x.value for x in walk(n, cross_scopes=True) if isinstance(x, cst.Name)}
        return out


def _unwrapped(func: cst.BaseExpression) -> str | None:
    """``model`` for the called ``accelerator.unwrap_model(model)``: the module it returns is ``model``."""
    if not (isinstance(func, cst.Call) and len(func.args) == 1 and func.args[0].keyword is None):
        return None
    name = dotted(func.func) or ""
    if name.rsplit(".", 1)[-1] not in MODEL_UNWRAP or func.args[0].star:
        return None
    inner = dotted(func.args[0].value)
    return inner if inner is not None and model_name(inner.rsplit(".", 1)[-1]) else None


def epoch_loop_possible(text: str) -> bool:
    """Cheap necessary condition for EvalTrainModeMismatch._epoch_loop on CPython's ast: a
    ``for``/``while`` loop whose body, or the body of a function of the file it calls by name, runs a
    backward pass (``.backward(...)``, or a call named ``grad``/``backward``: torch.autograd's), and
    whose body, or such a function's, switches a model to eval mode (``.eval()``,
    ``.train(False)``). True when the text does not parse."""
    import ast

    from torchopt.analysis.precheck.tree import ast_index

    index = ast_index(text)
    if index is None:
        return True
    loops = [*index.get(ast.For, ()), *index.get(ast.AsyncFor, ()), *index.get(ast.While, ())]
    if not loops:
        return False
    calls = index.get(ast.Call, ())

    def evals(c: ast.Call) -> bool:
        f = c.func
        if not isinstance(f, ast.Attribute):
            return False
        if f.attr == "eval" and not c.args and not c.keywords:
            return True
        first = c.args[0] if c.args else (c.keywords[0].value if c.keywords else None)
        return f.attr == "train" and isinstance(first, ast.Constant) and first.value is False

    grad_names = {"grad", "backward"}
    for imp in index.get(ast.ImportFrom, ()):
        for a in imp.names:
            if a.asname and a.name in ("grad", "backward"):
                grad_names.add(a.asname)

    def trains(c: ast.Call) -> bool:
        f = c.func
        if isinstance(f, ast.Attribute):
            return f.attr in grad_names
        return isinstance(f, ast.Name) and f.id in grad_names

    if not any(evals(c) for c in calls) or not any(trains(c) for c in calls):
        return False
    fn_flags: dict[str, list[bool]] = {}
    for fn in [*index.get(ast.FunctionDef, ()), *index.get(ast.AsyncFunctionDef, ())]:
        flags = fn_flags.setdefault(fn.name, [False, False])
        for n in ast.walk(fn):
            if isinstance(n, ast.Call):
                flags[0] = flags[0] or trains(n)
                flags[1] = flags[1] or evals(n)
    for loop in loops:
        t = e = False
        for stmt in loop.body:
            for n in ast.walk(stmt):
                if isinstance(n, ast.Call):
                    t = t or trains(n)
                    e = e or evals(n)
                    if isinstance(n.func, ast.Name) and n.func.id in fn_flags:
                        ft, fe = fn_flags[n.func.id]
                        t, e = t or ft, e or fe
            if t and e:
                return True
    return False


def _switches_to_eval(nodes) -> bool:
    """An ``.eval()`` or ``.train(False)`` call under ``nodes`` (EvalTrainModeMismatch._mode_calls)."""
    import ast

    stack = list(nodes)  # not into nested functions, classes or lambdas (walk without cross_scopes)
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(ast.iter_child_nodes(n))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr == "eval" and not n.args and not n.keywords:
                return True
            first = n.args[0] if n.args else (n.keywords[0].value if n.keywords else None)
            if n.func.attr == "train" and isinstance(first, ast.Constant) and first.value is False:
                return True
    return False


def eval_units_possible(text: str, *, asynchronous: bool, mode_calls: bool) -> bool:
    """Cheap necessary condition for the evaluation units of TOP801/TOP803, sharper than
    _torch.eval_sites_possible: a function named like evaluation (a method too: only methods of
    torch modules are left out, which this cheap test cannot tell) whose body calls something named like a model, or a ``for``
    loop over something named like held-out data whose body does, outside a function named like
    evaluation. ``asynchronous``: async defs and loops count (TOP803 visits them, TOP801 does not);
    ``mode_calls``: a function that itself calls ``.eval()``/``.train(False)`` does not count
    (TOP803). True when the text does not parse."""
    import ast

    from torchopt.analysis.precheck.patterns import ast_model_call
    from torchopt.analysis.precheck.tree import ast_tree

    tree = ast_tree(text)
    if tree is None:
        return True
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef) if asynchronous else (ast.FunctionDef,)
    loops = (ast.For, ast.AsyncFor) if asynchronous else (ast.For,)
    stack: list = [(tree, None, False)]  # (node, enclosing def name, node is a class)
    while stack:
        node, fname, is_class = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (
                    isinstance(child, funcs)
                    and EVAL_FUNCTION.match(child.name)
                    and ast_model_call(child.body)
                    and not (mode_calls and _switches_to_eval(child.body))
                ):
                    return True
                stack.append((child, child.name, False))
                continue
            if isinstance(child, ast.ClassDef):
                stack.append((child, None, True))  # enclosing_function stops at a class
                continue
            if isinstance(child, loops) and not (fname and EVAL_FUNCTION.match(fname)):
                names = [
                    x.id if isinstance(x, ast.Name) else x.attr
                    for x in ast.walk(child.iter)
                    if isinstance(x, (ast.Name, ast.Attribute))
                ]
                if any(eval_loader_name(x) for x in names) and ast_model_call(child.body):
                    return True
            stack.append((child, fname, False))
    return False
