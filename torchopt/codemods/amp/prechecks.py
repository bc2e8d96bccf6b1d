"""Cheap pre-checks for the AMP rules' ``could_match`` (TOP201-TOP207), on CPython's ``ast``.

Each function is a necessary condition for its rule to report anything: it mirrors the rule's entry
conditions with names resolved through the file's imports (``torch_import_map``, a superset of what
QualifiedNameProvider resolves), and says True whenever it cannot tell (the text does not parse, a
``from torch... import *``). Never LibCST here.
"""

from __future__ import annotations

import ast
from typing import Iterable, TypeGuard

from torchopt.analysis.precheck.torch_imports import ast_torch_names, torch_import_map
from torchopt.analysis.precheck.tree import ast_calls, ast_dotted, ast_index
from torchopt.rewrite.facts import facts_for

_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_WITHS = (ast.With, ast.AsyncWith)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_PARAMS = ("parameters", "named_parameters")


class _Facts:
    """What the pre-checks of one file share (computed on demand)."""

    def __init__(self, index: dict[type, list], imports: dict[str, frozenset[str]]) -> None:
        self.index = index
        self.imports = imports
        self._optimizers: set[str] | None = None

    def names(self, expr: ast.AST | None) -> frozenset[str]:
        return ast_torch_names(self.imports, expr)

    def calls(self) -> list[ast.Call]:
        return self.index.get(ast.Call, [])

    def assignments(self) -> Iterable[tuple[str, ast.AST]]:
        """(dotted target, value) of single-target assignments (what amp.insert._Analysis reads)."""
        for n in self.index.get(ast.Assign, ()):
            if len(n.targets) == 1:
                d = ast_dotted(n.targets[0])
                if d:
                    yield d, n.value
        for n in self.index.get(ast.AnnAssign, ()):
            if n.value is not None:
                d = ast_dotted(n.target)
                if d:
                    yield d, n.value

    @staticmethod
    def base_call(value: ast.AST) -> ast.AST:
        """insert._base_call: ``Net(3).to(device).train()`` -> ``Net(3)``, ``model.to(device)`` -> ``model``."""
        from torchopt.codemods.amp.autocast_insertion import _HALF_METHODS, _MOVE_CHAIN

        chain = _MOVE_CHAIN | _HALF_METHODS
        while (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and (isinstance(value.func.value, ast.Call) or ast_dotted(value.func.value))
            and value.func.attr in chain
        ):
            value = value.func.value
        return value

    def optimizers(self) -> set[str]:
        """Targets that _Analysis may take for optimizers (bound to a ``torch.optim`` class)."""
        if self._optimizers is None:
            self._optimizers = set()
            for d, value in self.assignments():
                base = self.base_call(value)
                if isinstance(base, ast.Call) and any(optim_class(q) for q in self.names(base.func)):
                    self._optimizers.add(d)
        return self._optimizers

    def wrappers(self, imported: bool = False) -> set[str]:
        """Targets that _Analysis may take for an optimizer wrapper (optimizer_wrappers): bound to a call
        of a class of the file that is given a ``torch.optim`` optimizer (built there, or by name); with
        ``imported``, of a name the file imports instead (a wrapper of another module, foreign_wrappers)."""
        classes = _imported_names(self) if imported else {c.name for c in self.index.get(ast.ClassDef, ())}
        optimizers = self.optimizers()
        out = set()
        for d, value in self.assignments():
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in classes:
                args = [*value.args, *(k.value for k in value.keywords)]
                if any(
                    (isinstance(n, ast.Call) and any(optim_class(q) for q in self.names(n.func)))
                    or ast_dotted(n) in optimizers
                    for a in args
                    for n in ast.walk(a)
                ):
                    out.add(d)
        return out

    def module_classes(self) -> set[str]:
        """Classes of the file deriving (through the file's classes) from a ``torch.nn`` class."""
        classes = self.index.get(ast.ClassDef, ())
        out: set[str] = set()
        changed = True
        while changed:
            changed = False
            for c in classes:
                if c.name in out:
                    continue
                for b in c.bases:
                    if (
                        any(q.startswith("torch.nn.") and q.rsplit(".", 1)[1][:1].isupper() for q in self.names(b))
                        or ast_dotted(b) in out
                    ):
                        out.add(c.name)
                        changed = True
                        break
        return out

    def any_model(self, names: set[str]) -> bool:
        """Some name in ``names`` may be in _Analysis.models (a superset): bound to a ``torch.nn``
        module or an instance of a module class of the file, or (when the file binds an optimizer)
        the receiver of a ``.parameters()`` call."""
        from torchopt.codemods.amp.autocast_insertion import _DATA_PARALLEL

        classes: set[str] | None = None
        for d, value in self.assignments():
            if d not in names:
                continue
            base = self.base_call(value)
            if not isinstance(base, ast.Call):
                continue
            if isinstance(base.func, ast.Name):
                if classes is None:
                    classes = self.module_classes()
                if base.func.id in classes:
                    return True
            for q in self.names(base.func):
                cls = q.rsplit(".", 1)[1]
                if q in _DATA_PARALLEL or (
                    q.startswith("torch.nn.")
                    and not q.startswith("torch.nn.functional")
                    and cls[:1].isupper()
                    and not cls.endswith("Loss")
                    and cls
                    not in ("Parameter", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict", "Identity")
                ):
                    return True
        if any(_method(c, _PARAMS) and _receiver(c) in names for c in self.calls()):
            return bool(self.optimizers())
        return False


def facts(text: str) -> _Facts | None:
    """The shared facts of ``text`` (once per text, in its SourceFacts); None when the pre-checks
    cannot tell (no parse, star import)."""
    return facts_for(text).derived("amp prechecks", lambda: _facts(text))


def _facts(text: str) -> _Facts | None:
    index = ast_index(text)
    imports = torch_import_map(text) if index is not None else None
    return _Facts(index, imports) if index is not None and imports is not None else None


def optim_class(q: str) -> bool:
    """``torch.optim.SGD`` (an optimizer class, not a scheduler)."""
    return q.startswith("torch.optim.") and ".lr_scheduler" not in q and q.rsplit(".", 1)[1][:1].isupper()


def _method(c: ast.AST | None, names: Iterable[str] | str) -> TypeGuard[ast.Call]:
    if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)):
        return False
    return c.func.attr == names if isinstance(names, str) else c.func.attr in names


def _receiver(c: ast.AST | None) -> str:
    """The dotted receiver of a method call (``opt`` for ``opt.step()``); "" for anything else."""
    if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute):
        return ast_dotted(c.func.value) or ""
    return ""


def _is_false(expr: ast.AST | None) -> bool:
    return isinstance(expr, ast.Constant) and expr.value is False


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def amp_uses(f: _Facts, watch: frozenset[str], qualified: frozenset[str]) -> bool:
    """_AmpUses.uses: a Name/Attribute named in ``watch`` that resolves into ``qualified`` (or an
    import of such a name from torch, whose alias node LibCST also visits)."""
    for n in f.index.get(ast.Name, ()):
        if n.id in watch and f.names(n) & qualified:
            return True
    for n in f.index.get(ast.Attribute, ()):
        if n.attr in watch and f.names(n) & qualified:
            return True
    for imp in f.index.get(ast.ImportFrom, ()):
        if not imp.level and imp.module and imp.module.split(".")[0] == "torch":
            if any(a.name in watch and f"{imp.module}.{a.name}" in qualified for a in imp.names):
                return True
    return False


# --------------------------------------------------------------------------- TOP202 / TOP203


def _back_loss(stmt: ast.AST) -> tuple[bool, ast.AST | None]:
    """(is a backward statement, its loss expression when surely known)."""
    if not (isinstance(stmt, ast.Expr) and _method(stmt.value, "backward")):
        return False, None
    func = stmt.value.func
    d = ast_dotted(func)
    if d is not None and (d == "autograd.backward" or d.endswith(".autograd.backward")):
        return True, None  # torch.autograd.backward(loss): not worth pinning down
    return True, func.value if isinstance(func, ast.Attribute) else None  # (it is: _method checked)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    return {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs] if p is not None}


def _self_steps(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The ``self.`` attributes ``fn`` calls ``step()`` on."""
    return {d for d in (_receiver(c) for c in ast_calls(fn.body) if _method(c, "step")) if d and d.startswith("self.")}


def _imported_names(f: _Facts) -> set[str]:
    """Names the file's imports bind (``train_one_epoch`` of ``from engine import train_one_epoch``)."""
    out = set()
    for n in [*f.index.get(ast.Import, ()), *f.index.get(ast.ImportFrom, ())]:
        for a in n.names:
            out.add(a.asname or a.name.split(".")[0])
    return out


def _live_step(body: list, optimizers: set[str], wrappers: set[str] = frozenset()) -> bool:  # type: ignore[assignment]  # a frozenset default is read only
    """insert.analyse_step gets past its early returns: a backward statement and an optimizer
    ``step`` (or any method of an optimizer wrapper) in ``body`` (or in an ``if`` there) or a
    parameter update by hand, no scaled backward, no ``unscale_``."""
    backs = [_back_loss(s) for s in body]
    if not any(b for b, _ in backs):  # gradient accumulation over an inner loop (step_analysis._micro_batch_loop)
        inner = [s.body for s in body if isinstance(s, (ast.For, ast.While)) and not s.orelse]
        backs = [_back_loss(s) for lst in inner for s in lst]
        if not any(b for b, _ in backs):
            return False
    lists = [body] + [s.body for s in body if isinstance(s, ast.If)]
    if not any(
        isinstance(s, (ast.Expr, ast.Assign))
        and (
            (_method(s.value, "step") and _receiver(s.value) in optimizers)
            or (isinstance(s.value, ast.Call) and _receiver(s.value) in wrappers)
        )
        for lst in lists
        for s in lst
    ) and not _hand_update(body):
        return False
    if any(_method(loss, "scale") for b, loss in backs if b):
        return False  # already scaled: the step is left alone
    return not any(_method(c, "unscale_") for c in ast_calls(body))


def _hand_update(body: list) -> bool:
    """A ``for p in m.parameters():`` loop in ``body`` that reads ``.grad``: weights updated by hand."""
    for stmt in body:
        for n in ast.walk(stmt):
            if (
                isinstance(n, ast.For)
                and _method(n.iter, "parameters")
                and any(isinstance(x, ast.Attribute) and x.attr == "grad" for x in ast.walk(n))
            ):
                return True
    return False


def _zeroed_and_stepped(f: _Facts) -> set[str]:
    """Plain names the file calls both ``.zero_grad()`` and ``.step()`` on."""
    calls = f.calls()
    zeroed = {_receiver(c) for c in calls if _method(c, "zero_grad")}
    return {r for c in calls if _method(c, "step") and (r := _receiver(c)) in zeroed and "." not in r}


def missing_autocast_possible(text: str) -> bool:
    """TOP202 (MissingAutocast): an optimizer bound to a ``torch.optim`` class (or a ``.grad`` read),
    and a loop body, or the body of a function called by name in a loop, holding ``<x>.backward()``
    and ``<optimizer>.step()`` at its top level (the step possibly in an ``if``), or a
    ``for p in m.parameters():`` update by hand, that is not already scaled."""
    f = facts(text)
    if f is None:
        return True
    # An object of a library class stepped and zeroed like an optimizer: refused with the reason.
    optimizers = f.optimizers() | _zeroed_and_stepped(f)
    wrappers = f.wrappers()
    if not optimizers and not wrappers and ".grad" not in text:  # no optimizer, no hand-written update
        # An optimizer held by a class of another module: refused with the reason (foreign_wrappers).
        return bool(f.wrappers(imported=True)) and any(
            _live_step(fn.body, set(), _params(fn) | _self_steps(fn)) for t in _FUNCS for fn in f.index.get(t, ())
        )
    loops = [n for t in _LOOPS for n in f.index.get(t, ())]
    for loop in loops:
        if _live_step(loop.body, optimizers, wrappers):
            return True
        # A step imported from another module, handed an optimizer of this file (imported_steps).
        # (`train_one_epoch(...)` alone on its line, or its result assigned: `stats = train_one_epoch(...)`)
        if any(
            isinstance(s, (ast.Expr, ast.Assign))
            and isinstance(s.value, ast.Call)
            and (ast_dotted(s.value.func) or "").split(".")[0] in _imported_names(f)
            and any(ast_dotted(a) in optimizers for a in s.value.args)
            for s in loop.body
        ):
            return True
    # Functions called by name in a loop, with the keywords of those calls (insert._loop_sites maps
    # parameters, and keyword names, to the caller's optimizers).
    looped: dict[str, set[str]] = {}
    for loop in loops:
        for s in loop.body:
            for c in ast.walk(s):
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name):
                    looped.setdefault(c.func.id, set()).update(k.arg for k in c.keywords if k.arg)
    for fn in (n for t in _FUNCS for n in f.index.get(t, ())):
        if fn.name in looped:
            a = fn.args
            params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p is not None}
            if _live_step(fn.body, optimizers | params | looped[fn.name], wrappers | params | looped[fn.name]):
                return True
    # Steps whose optimizer arrives as a parameter or an attribute (remote_steps): any function body,
    # or loop in one, stepping a parameter or a `self.` attribute.
    for fn in (n for t in _FUNCS for n in f.index.get(t, ())):
        names = _params(fn) | _self_steps(fn)
        bodies = [fn.body] + [n.body for n in ast.walk(fn) if isinstance(n, _LOOPS)]
        if any(_live_step(body, optimizers | names, wrappers | names) for body in bodies):
            return True
    return False


def missing_grad_scaler_possible(text: str) -> bool:
    """TOP203 (MissingGradScaler): an optimizer bound to a ``torch.optim`` class, a
    ``<x>.backward()`` statement, and a ``with`` item calling a CUDA/device autocast that is not
    ``enabled=False``."""
    from torchopt.codemods.amp.autocast_insertion import _AUTOCASTS

    f = facts(text)
    if f is None:
        return True
    if not f.optimizers():
        return False
    if not any(isinstance(s, ast.Expr) and _method(s.value, "backward") for s in f.index.get(ast.Expr, ())):
        return False
    autocasts = _AUTOCASTS - {"torch.cpu.amp.autocast"}
    for w in (n for t in _WITHS for n in f.index.get(t, ())):
        for item in w.items:
            c = item.context_expr
            if isinstance(c, ast.Call) and f.names(c.func) & autocasts and not _is_false(_kw(c, "enabled")):
                return True
    return False


# --------------------------------------------------------------------------- TOP205


def _span(node: ast.AST) -> tuple[int, int]:
    return node.lineno, getattr(node, "end_lineno", None) or 1 << 30  # type: ignore[attr-defined]  # typeshed: positions are per node kind


def inference_autocast_possible(text: str) -> bool:
    """TOP205 (InferenceAutocast): no ``.backward(...)`` call in the file, and a loop under
    ``torch.no_grad()``/``torch.inference_mode()`` (a ``with`` up to its function, or the function's
    decorator), or holding such a ``with``, whose body calls a model of the file by name."""
    from torchopt.codemods.amp.autocast_insertion import _NO_GRAD

    f = facts(text)
    if f is None:
        return True
    loops = [n for t in _LOOPS for n in f.index.get(t, ())]
    if not loops:
        return False
    if "backward" in text and any(_method(c, "backward") for c in f.calls()):
        return False

    def no_grad(expr: ast.AST) -> bool:
        return isinstance(expr, ast.Call) and bool(f.names(expr.func) & _NO_GRAD)

    # Where loops run under no_grad: `with no_grad():` blocks and no_grad-decorated functions, by
    # line span (a superset: a loop in a function nested there counts too).
    spans = [_span(w) for t in _WITHS for w in f.index.get(t, ()) if any(no_grad(i.context_expr) for i in w.items)]
    spans += [
        _span(fn)
        for t in _FUNCS
        for fn in f.index.get(t, ())
        if fn.decorator_list
        and any(f.names(d.func if isinstance(d, ast.Call) else d) & _NO_GRAD for d in fn.decorator_list)
    ]
    if not spans:
        return False  # a loop holding such a `with` needs one too
    bodies = [loop.body for loop in loops if any(lo <= loop.lineno <= hi for lo, hi in spans)]
    bodies += [
        s.body
        for loop in loops
        for s in loop.body
        if isinstance(s, _WITHS) and any(no_grad(i.context_expr) for i in s.items)
    ]
    if not bodies:
        return False
    called = {
        d
        for body in bodies
        for s in body
        for c in ast.walk(s)
        if isinstance(c, ast.Call) and (d := ast_dotted(c.func)) is not None
    }
    return bool(called) and f.any_model(called)


# --------------------------------------------------------------------------- TOP201, TOP204, TOP206, TOP207


def deprecated_amp_possible(text: str) -> bool:
    """TOP201 (DeprecatedAmpApi): an attribute chain resolving to a member of ``torch.cuda.amp`` /
    ``torch.cpu.amp``, or an import of such a member that some name in the file reads."""
    from torchopt.codemods.amp.amp_api import AMP_MODULES, MEMBERS, deprecated_member

    f = facts(text)
    if f is None:
        return True
    for imp in f.index.get(ast.ImportFrom, ()):
        if imp.level or imp.module not in AMP_MODULES:
            continue
        bound = {a.asname or a.name for a in imp.names}
        if any(n.id in bound for n in f.index.get(ast.Name, ())):
            return True
    for n in f.index.get(ast.Attribute, ()):
        if n.attr in MEMBERS and any(deprecated_member(q) for q in f.names(n)):
            return True
    return False


def pure_fp16_possible(text: str) -> bool:
    """TOP204 (PureFp16Model): a ``<x>.half()`` / ``<x>.to(<maybe float16>)`` call whose receiver can
    be a module, in a file that trains (``.backward(...)``, ``torch.autograd.grad``, or a
    ``torch.optim`` optimizer)."""
    from torchopt.codemods.amp.amp_api import _SELF_RETURNING, nn_module_class

    if "backward" not in text and "optim" not in text and "autograd" not in text:
        return False  # cannot train: no `.backward(`, no torch.optim, no torch.autograd.grad
    f = facts(text)
    if f is None:
        return True
    casts = []
    for c in f.calls():
        if not isinstance(c.func, ast.Attribute):
            continue
        if c.func.attr == "half" and not c.args and not c.keywords:
            casts.append(c)
        elif (
            c.func.attr == "to"
            and not any(isinstance(a, ast.Starred) for a in c.args)
            and all(k.arg is not None for k in c.keywords)
            and any(
                (isinstance(v, ast.Attribute) and v.attr in ("float16", "half")) or isinstance(v, ast.Name)
                for v in [*c.args, *(k.value for k in c.keywords)]
            )
        ):
            casts.append(c)
    if not casts:
        return False
    optim = grad = False
    if "optim" in text or "autograd" in text:
        for c in f.calls():
            func = c.func
            last = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if last == "grad" or last[:1].isupper():
                for q in f.names(c.func):
                    parts = q.split(".")
                    if q == "torch.autograd.grad":
                        grad = True
                    elif (
                        parts[:2] == ["torch", "optim"]
                        and parts[-1][:1].isupper()
                        and "lr_scheduler" not in parts
                        and "swa_utils" not in parts
                    ):
                        optim = True
    if not (optim or grad or ("backward" in text and any(_method(c, "backward") for c in f.calls()))):
        return False  # the file does not train
    classes = {c.name for c in f.index.get(ast.ClassDef, ())}
    params = optim and any(_method(c, _PARAMS) for c in f.calls())
    values: dict[str, list[ast.AST]] | None = None

    def maybe_module(expr: ast.AST, seen: frozenset[str]) -> bool:
        """PureFp16Model._is_module can say True (a superset)."""
        nonlocal values
        while _method(expr, _SELF_RETURNING):
            expr = expr.func.value  # type: ignore[attr-defined]  # _method saw an attribute call
        if isinstance(expr, (ast.Name, ast.Attribute)) and params:
            return True  # may be a receiver of `.parameters()` given to the optimizer
        if isinstance(expr, ast.Attribute):
            return False
        if isinstance(expr, ast.Call):
            return (isinstance(expr.func, ast.Name) and expr.func.id in classes) or any(
                nn_module_class(q) for q in f.names(expr.func)
            )
        if isinstance(expr, ast.Name):
            if len(seen) > 6:
                return True
            if expr.id in seen:
                return False
            if values is None:  # the plain assignments of every name, any scope (reaching_values)
                values = {}
                for n in f.index.get(ast.Assign, ()):
                    for t in n.targets:
                        if isinstance(t, ast.Name):
                            values.setdefault(t.id, []).append(n.value)
                for n in f.index.get(ast.AnnAssign, ()):
                    if isinstance(n.target, ast.Name) and n.value is not None:
                        values.setdefault(n.target.id, []).append(n.value)
            return any(maybe_module(v, seen | {expr.id}) for v in values.get(expr.id, ()))
        return False

    return any(maybe_module(c.func.value, frozenset()) for c in casts)  # type: ignore[attr-defined]  # casts are method calls


def gradient_penalty_possible(text: str) -> bool:
    """TOP206 (GradientPenaltyAmp): ``torch.autograd.grad(..., create_graph=<not False/None>)`` of an
    unscaled output, in a file that references ``autocast`` or ``GradScaler`` from torch."""
    from torchopt.codemods.amp.amp_api import AUTOCAST_NAMES, SCALER_NAMES

    f = facts(text)
    if f is None:
        return True
    found = False
    for c in f.calls():
        if "torch.autograd.grad" not in f.names(c.func):
            continue
        pos = [a for a in c.args if not isinstance(a, ast.Starred)]
        value = _kw(c, "create_graph")
        if value is None and len(pos) > 4:
            value = pos[4]
        if value is None or (isinstance(value, ast.Constant) and (value.value is False or value.value is None)):
            continue  # create_graph=False / None
        first = _kw(c, "outputs")
        if first is None and pos:
            first = pos[0]
        if _method(first, "scale"):
            continue
        found = True
        break
    return found and amp_uses(f, frozenset({"autocast", "GradScaler"}), AUTOCAST_NAMES | SCALER_NAMES)


def custom_function_possible(text: str) -> bool:
    """TOP207 (CustomFunctionAmp): a class deriving (through the file's classes) from
    ``torch.autograd.Function`` with a ``forward`` and no ``setup_context``, in a file that
    references ``autocast`` from torch."""
    from torchopt.codemods.amp.amp_api import _FUNCTION_BASES, AUTOCAST_NAMES

    f = facts(text)
    if f is None:
        return True
    classes = f.index.get(ast.ClassDef, ())
    functions: set[str] = set()
    changed = True
    while changed:
        changed = False
        for c in classes:
            if c.name in functions:
                continue
            if any(f.names(b) & _FUNCTION_BASES or (isinstance(b, ast.Name) and b.id in functions) for b in c.bases):
                functions.add(c.name)
                changed = True
    if not functions:
        return False
    if not any(
        c.name in functions
        and any(isinstance(s, _FUNCS) and s.name == "forward" for s in c.body)
        and not any(isinstance(s, _FUNCS) and s.name == "setup_context" for s in c.body)
        for c in classes
    ):
        return False
    return amp_uses(f, frozenset({"autocast"}), AUTOCAST_NAMES)
