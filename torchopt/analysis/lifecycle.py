"""The life of each model of a file: where it is built, where its weights are loaded, where it trains,
evaluates and is exported, and which mode (``train``/``eval``) it is in at each statement.

Rules used to answer "is this evaluation code?" and "was ``model.eval()`` called?" from the text
around one statement; this module answers them once per file from the program's own order of
statements, and says UNKNOWN when the file does not tell. Build it with ``lifecycle_of(rule)``: the
object is made once per parsed text and kept in that text's facts (``metadata.remembered``).

A *module object* is a name bound to an ``nn.Module`` (``ModuleObject``): a ``torch.nn`` class or a
file-local ``nn.Module`` subclass called (what ``program.Program`` calls a model role), a factory of the
file that returns one, ``timm.create_model``, ``torchvision.models.X(...)``, ``torch.hub.load``,
``X.from_pretrained(...)``, ``copy.deepcopy`` of a module object, or any other call whose result the
file then uses as a module (``m = build_model(cfg)`` followed by ``m.load_state_dict(...)``,
``m.eval()``, ``m.parameters()``; a whole model read back by ``torch.load`` is one of those).

Its events (``Event``), in statement order, have a ``Phase``:

* CONSTRUCTION: the binding statement;
* LOADING: ``m.load_state_dict(...)`` (also through a function of the file that receives ``m``),
  ``from_pretrained``, ``torch.load`` of the whole model, ``pretrained=True``/``weights=`` factories;
* TRAINING: ``m.train()``, an optimizer built over ``m.parameters()``, a call of ``m`` in a training
  step (``Program.steps``: a loop that runs ``backward``);
* EVALUATION: a call of ``m`` under ``no_grad``/``inference_mode``, in an evaluation step, or while
  ``m`` is in eval mode, with no backward in that loop;
* EXPORT: ``torch.onnx.export``, ``torch.jit.trace``/``script``, ``torch.save`` of ``m`` or of its
  state dict.

Modes: ``modes_at(expr, node)`` is the set of modes the module ``expr`` (a name, ``self.attr``) may be
in when ``node`` runs, following the statements of its function in order (branches and loops join
their possibilities, a function of the file called with it applies what that function does to its
parameter, a parameter starts in the modes its call sites pass). ``Mode.UNKNOWN`` in the set means
one way in is not established (a parameter of a function nobody in the file calls, a whole model read
by ``torch.load``, a factory from another file). Mode changes on a *part* of a module
(``model.backbone.eval()``, ``for m in model.modules(): if isinstance(m, nn.BatchNorm2d): m.eval()``,
``model.apply(freeze_bn)``) are events with ``part`` set: they do not change the mode of the whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import callee, dotted, qualified_names, torch_name
from torchopt.analysis.program import MODULE_WRAPPERS, Program, program_of
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider, children_of, remembered
from torchopt.rewrite.rule import Rule


class Phase(str, Enum):
    CONSTRUCTION = "construction"
    LOADING = "loading"
    TRAINING = "training"
    EVALUATION = "evaluation"
    EXPORT = "export"


class Mode(str, Enum):
    TRAIN = "train"
    EVAL = "eval"
    UNKNOWN = "unknown"


Modes = frozenset  # of Mode: the modes a module may be in at a point
_TRAIN: Modes = frozenset({Mode.TRAIN})
_EVAL: Modes = frozenset({Mode.EVAL})
_UNKNOWN: Modes = frozenset({Mode.UNKNOWN})
_SAME: Modes = frozenset()  # in a function's summary: the parameter keeps the mode it came in with

_SELF_RETURNING = {"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "requires_grad_", "share_memory"}
_MODULE_USES = {
    "load_state_dict",
    "eval",
    "train",
    "parameters",
    "named_parameters",
    "modules",
    "named_modules",
    "state_dict",
    "children",
    "named_children",
    "apply",
}
_SUBMODULE_ITERS = {"modules", "named_modules", "children", "named_children"}
_EXPORTS = {"torch.onnx.export", "torch.jit.trace", "torch.jit.script", "torch.export.export", "torch.save"}
_GRAD_OFF = {
    "torch.no_grad",
    "torch.inference_mode",
    "torch.autograd.no_grad",
    "torch.autograd.grad_mode.no_grad",
    "torch.autograd.grad_mode.inference_mode",
}
# The part of a wrapper that is the wrapped module itself: ``ddp_model.module.eval()`` is the whole.
_WRAPPED = ("module", "_orig_mod")


@dataclass
class Event:
    phase: Phase | None  # None: a mode change only
    node: cst.CSTNode = field(repr=False)  # the call (or the binding's value)
    statement: cst.CSTNode = field(repr=False)
    mode: Mode | None = None  # the mode it sets, if any
    part: str = ""  # "" for the whole module, else which part ("backbone", "the layers `m` of `model.modules()`")


@dataclass
class ModuleObject:
    name: str
    binding: cst.CSTNode = field(repr=False)  # the statement that binds it
    origin: str  # "constructor" | "factory" | "load" | "copy" | "use"
    modes: Modes  # when bound
    events: list[Event] = field(default_factory=list)

    @property
    def unknown_why(self) -> str | None:
        if Mode.UNKNOWN not in self.modes:
            return None
        if self.origin == "load":
            return f"`{self.name}` is read back whole by `torch.load`, in the mode it was saved in"
        return f"`{self.name}` comes from a call this file does not define, which may set its mode"


@dataclass
class _Summary:
    """What a function of the file does to each parameter that is a module."""

    modes: dict[str, Modes] = field(default_factory=dict)  # the mode each parameter leaves with (_SAME: unchanged)
    parts: dict[str, list[str]] = field(default_factory=dict)  # parts whose mode it sets
    loads: set[str] = field(default_factory=set)  # parameters whose weights it loads
    returns: Modes | None = None  # the mode of the module it returns, when it returns one


def _join(a: Modes, b: Modes) -> Modes:
    """Either way; a parameter kept as it came in (``_SAME``) on one way is not established."""
    if a == b:
        return a
    if not a or not b:
        return frozenset((a or b) | _UNKNOWN)
    return frozenset(a | b)


class Lifecycle:
    """See the module docstring."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.module = rule.ctx.module
        self.program: Program = program_of(rule)
        self.objects: list[ModuleObject] = []
        self._objects_by_stmt: dict[int, ModuleObject] = {}
        self._phases: dict[int, set[Phase]] = {}  # id(statement) -> the phases of the events it holds
        self._before: dict[int, dict[str, Modes]] = {}  # id(statement) -> modes of its scope's modules
        self._summaries: dict[int, _Summary | None] = {}
        self._entry_pending: set[int] = set()
        self._entry: dict[tuple[int, str], Modes] = {}
        self._done: set[int] = set()
        self._module_uses: dict[int, set[str]] = {}  # id(scope) -> what it calls module-only methods on
        self._grad_off_fns: dict[int, bool] = {}  # id(nested def) -> every call of it runs with autograd off
        self._run_scope(self.module)

    # ----------------------------------------------------------------- public
    def modes_at(self, expr: cst.BaseExpression | str, node: cst.CSTNode) -> Modes:
        """The modes the whole module ``expr`` (a name or ``self.attr``) may be in when ``node`` runs."""
        key = expr if isinstance(expr, str) else dotted(expr)
        if not key:
            return _UNKNOWN
        key = _whole(key)
        stmt = self._statement(node)
        scope = self._scope_of(stmt) if stmt is not None else None
        if stmt is None or scope is None:
            return _UNKNOWN
        self._ensure(scope)
        state = self._before.get(id(stmt))
        if state is None:
            return _UNKNOWN
        return state.get(key) or self._initial(key, scope)

    def mode_at(self, expr: cst.BaseExpression | str, node: cst.CSTNode) -> Mode:
        """TRAIN or EVAL when every way to ``node`` agrees, else UNKNOWN."""
        modes = self.modes_at(expr, node)
        return next(iter(modes)) if len(modes) == 1 else Mode.UNKNOWN

    def phases_in(self, node: cst.CSTNode) -> set[Phase]:
        """The phases of the events held by ``node`` (a statement or any subtree of the file)."""
        scope = self._scope_of(node) or self.module
        self._ensure(scope)
        out: set[Phase] = set()
        stack: list[cst.CSTNode] = [node]
        while stack:
            cur = stack.pop()
            if isinstance(cur, cst.FunctionDef):
                self._ensure(cur)
            out |= self._phases.get(id(cur), set())
            stack.extend(children_of(cur))
        return out

    def argument_modes(self, fn: cst.FunctionDef, param: str) -> list[Modes] | None:
        """For each call of the file's function ``fn``, the modes of the module it passes as
        ``param`` (None when ``fn`` is not a plain function or method of the file)."""
        func = self.program.function_of(fn.body)
        if func is None or func.node is not fn or param not in func.params:
            return None
        out: list[Modes] = []
        idx = func.params.index(param)
        for edge in func.callers:
            offset = 1 if edge.how in ("method", "constructor", "spawn") else 0
            arg = _argument(edge.call, idx - offset, param)
            key = dotted(arg) if arg is not None else None
            out.append(self.modes_at(key, edge.call) if key else _UNKNOWN)
        return out

    def builds_or_loads(self, node: cst.CSTNode) -> bool:
        """Whether ``node`` builds a module or loads weights into one."""
        return bool(self.phases_in(node) & {Phase.CONSTRUCTION, Phase.LOADING})

    def mode_event(self, call: cst.Call) -> Event | None:
        """The mode change ``call`` makes (``model.eval()``, ``model.backbone.eval()``, ``m.eval()``
        in a loop over ``model.modules()``, ``set_bn_eval(model)`` of a function of the file), or None."""
        return self._mode_event(call, self._statement(call) or call)

    def sets_whole_mode(self, call: cst.Call, mode: Mode) -> bool:
        """Whether ``call`` switches a whole module (not one of its parts) to ``mode``: directly, or
        by calling a function of the file that does so, unconditionally, to the module it is given."""
        ev = self.mode_event(call)
        if ev is not None and ev.part == "" and ev.mode is mode:
            return True
        summary, args = self._callee_summary(call)
        return summary is not None and any(summary.modes.get(p) == frozenset({mode}) for p in args)

    # ----------------------------------------------------------------- scopes
    def _scope_of(self, node: cst.CSTNode | None) -> cst.Module | cst.FunctionDef | None:
        cur = self._parent(node) if node is not None else None
        while cur is not None:
            if isinstance(cur, (cst.FunctionDef, cst.Module)):
                return cur
            if isinstance(cur, (cst.Lambda, cst.ClassDef)):
                return None
            cur = self._parent(cur)
        return None

    def _parent(self, node: cst.CSTNode | None) -> cst.CSTNode | None:
        return self.rule.get_metadata(ParentProvider, node, None) if node is not None else None

    def _statement(self, node: cst.CSTNode) -> cst.CSTNode | None:
        cur: cst.CSTNode | None = node
        while cur is not None and not isinstance(cur, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            cur = self._parent(cur)
        return cur

    def _ensure(self, scope: cst.Module | cst.FunctionDef) -> None:
        if id(scope) in self._done:
            return
        if isinstance(scope, cst.FunctionDef):
            self._summary(scope)
        else:
            self._run_scope(scope)

    def _run_scope(self, scope: cst.Module) -> None:
        self._done.add(id(scope))
        self._run(list(scope.body), {}, scope)

    def _initial(self, key: str, scope: cst.CSTNode) -> Modes:
        """The modes a name has before its scope binds it: a parameter's come from its call sites, a
        name a nested function reads from the function around it (``model`` in a ``run_validate``
        defined in ``validate``) from the modes it has where each call of the nested function runs."""
        if not isinstance(scope, cst.FunctionDef) or "." in key:
            return _UNKNOWN
        if (id(scope), key) in self._entry or id(scope) in self._entry_pending:
            return self._entry.get((id(scope), key), _UNKNOWN)
        params = [p.name.value for p in scope.params.params]
        return self._entry_modes(scope, key) if key in params else self._closure_modes(scope, key)

    def _closure_modes(self, fn: cst.FunctionDef, key: str) -> Modes:
        """``key`` read, not bound, by the nested function ``fn``: every use of ``fn``'s name is a
        call in the enclosing function (as ``grad_off`` asks), and the modes are those at the calls."""
        if not isinstance(self._scope_of(fn), cst.FunctionDef):
            return _UNKNOWN
        try:
            inner = self.rule.get_metadata(ScopeProvider, fn.body.body[0]) if fn.body.body else None
        except KeyError:
            inner = None
        if inner is None or key not in inner or any(a.scope is inner for a in inner[key]):
            return _UNKNOWN  # bound in the nested function itself (or not bound anywhere)
        calls = self._uses_as_calls(fn.name)
        if not calls or any(isinstance(n, (cst.Yield, cst.Await)) for n in walk(fn.body)):
            return _UNKNOWN
        return self._joined(fn, (id(fn), key), [(key, call) for call in calls])

    def _entry_modes(self, fn: cst.FunctionDef, param: str) -> Modes:
        func = self.program.function_of(fn.body)
        if func is None or func.node is not fn or not func.callers:
            return _UNKNOWN
        idx = func.params.index(param)
        passed = []
        for edge in func.callers:
            arg = _argument(edge.call, idx - (1 if edge.how in ("method", "constructor", "spawn") else 0), param)
            passed.append((dotted(arg) if arg is not None else None, edge.call))
        return self._joined(fn, (id(fn), param), passed)

    def _joined(self, fn: cst.FunctionDef, memo: tuple[int, str], at: list[tuple[str | None, cst.Call]]) -> Modes:
        """The modes of the modules ``key`` at each call ``call`` of ``fn`` (``at``), joined and kept."""
        self._entry_pending.add(id(fn))
        try:
            modes: Modes | None = None
            for key, call in at:
                here = self.modes_at(key, call) if key else _UNKNOWN
                modes = here if modes is None else _join(modes, here)
        finally:
            self._entry_pending.discard(id(fn))
        self._entry[memo] = modes or _UNKNOWN
        return self._entry[memo]

    # ----------------------------------------------------------------- running statements in order
    def _run(self, stmts: list, state: dict[str, Modes], scope: cst.CSTNode) -> dict[str, Modes]:
        for stmt in stmts:
            self._before[id(stmt)] = dict(state)
            state = self._step(stmt, state, scope)
        return state

    def _step(self, stmt: cst.CSTNode, state: dict[str, Modes], scope: cst.CSTNode) -> dict[str, Modes]:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            return state
        if isinstance(stmt, cst.SimpleStatementLine):
            return self._simple(stmt, state, scope)
        if isinstance(stmt, cst.If):
            self._header(stmt.test, stmt, state, scope)
            after = self._run(list(stmt.body.body), dict(state), scope)
            other = self._step(stmt.orelse, dict(state), scope) if stmt.orelse is not None else state
            return _merge(after, other)
        if isinstance(stmt, cst.Else):
            return self._run(list(stmt.body.body), state, scope)
        if isinstance(stmt, (cst.For, cst.While)):
            first = self._run(list(stmt.body.body), dict(state), scope)
            out = state
            if first != state:  # the body switches modes: the later iterations start from either
                entry = _merge(state, first)
                out = _merge(entry, self._run(list(stmt.body.body), dict(entry), scope))
            return self._step(stmt.orelse, out, scope) if stmt.orelse is not None else out
        if isinstance(stmt, cst.With):
            for item in stmt.items:
                self._header(item.item, stmt, state, scope)
            return self._run(list(stmt.body.body), state, scope)
        if isinstance(stmt, cst.Try):
            body = self._run(list(stmt.body.body), dict(state), scope)
            out = _merge(state, body)
            for h in stmt.handlers:
                out = _merge(out, self._run(list(h.body.body), dict(out), scope))
            if stmt.orelse is not None:
                out = _merge(out, self._run(list(stmt.orelse.body.body), dict(body), scope))
            if stmt.finalbody is not None:
                out = self._run(list(stmt.finalbody.body.body), out, scope)
            return out
        block = getattr(stmt, "body", None)
        if isinstance(block, cst.IndentedBlock):  # match and the rest: any branch may run
            return _merge(state, self._run(list(block.body), dict(state), scope))
        return state

    def _header(self, expr: cst.CSTNode, stmt: cst.CSTNode, state: dict[str, Modes], scope: cst.CSTNode) -> None:
        for n in walk(expr):
            if isinstance(n, cst.Call):
                self._apply_call(n, stmt, state, scope)

    def _simple(self, stmt: cst.SimpleStatementLine, state: dict[str, Modes], scope: cst.CSTNode) -> dict[str, Modes]:
        for small in stmt.body:
            calls = [n for n in walk(small) if isinstance(n, cst.Call)]
            for c in reversed(calls):  # inner calls first: `Net().eval()` builds, then switches
                self._apply_call(c, stmt, state, scope)
            if isinstance(small, (cst.Assign, cst.AnnAssign)) and small.value is not None:
                targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
                for t in targets:
                    key = dotted(t)
                    if key is not None:
                        self._bind(key, small.value, stmt, state, scope)
        return state

    # ----------------------------------------------------------------- bindings
    def _bind(
        self, key: str, value: cst.BaseExpression, stmt: cst.CSTNode, state: dict[str, Modes], scope: cst.CSTNode
    ) -> None:
        chain: list[cst.Call] = []
        base = value
        while (
            isinstance(base, cst.Call)
            and isinstance(base.func, cst.Attribute)
            and (base.func.attr.value in _SELF_RETURNING or base.func.attr.value in ("eval", "train"))
        ):
            chain.append(base)
            base = base.func.value
        if isinstance(base, cst.Call) and callee(self.rule, base) in MODULE_WRAPPERS and base.args:
            base = base.args[0].value
        src = dotted(base)
        if src is not None and src in state:  # an alias or a wrapper: the same module
            modes = state[src]
        else:
            made = self._objects_by_stmt.get(id(stmt)) or self._made(key, base, stmt, scope, state)
            if made is None:
                state.pop(key, None)
                return
            modes = made.modes
            if id(stmt) not in self._objects_by_stmt:
                self.objects.append(made)
                self._objects_by_stmt[id(stmt)] = made
            self._phase(stmt, Phase.CONSTRUCTION)
            if made.origin in ("load",) or _loads_weights(base):
                self._phase(stmt, Phase.LOADING)
        for c in reversed(chain):
            mode = _mode_of_call(c)
            if mode is not None:
                modes = frozenset({mode})
        state[key] = modes

    def _made(
        self, key: str, value: cst.BaseExpression, stmt: cst.CSTNode, scope: cst.CSTNode, state: dict[str, Modes]
    ) -> ModuleObject | None:
        """The module object ``key = value`` creates, if ``value`` builds a module."""
        if not isinstance(value, cst.Call) or not isinstance(value.func, (cst.Name, cst.Attribute)):
            return None
        names = qualified_names(self.rule, value.func)
        q = callee(self.rule, value) or next(iter(sorted(names)), "")
        if q in ("copy.deepcopy", "copy.copy") and value.args:
            src = dotted(value.args[0].value)
            if src is not None and src in state:
                return ModuleObject(key, stmt, "copy", state[src])
            return None
        if isinstance(value.func, cst.Attribute) and value.func.attr.value == "from_pretrained":
            modes = _EVAL if q.startswith("transformers.") else _UNKNOWN  # transformers returns it in eval mode
            return ModuleObject(key, stmt, "load", modes)
        if q.startswith("timm.") and q.endswith("create_model") or _torchvision_builder(q):
            return ModuleObject(key, stmt, "factory", _TRAIN)
        role = self.program.role_of(value, value)
        if role is not None and role.kind == "model":
            fn = self._file_function(value)
            summary = self._summary(fn) if fn is not None else None
            if summary is not None and summary.returns:
                return ModuleObject(key, stmt, "factory", summary.returns)
            return ModuleObject(key, stmt, "constructor", _TRAIN)
        fn = self._file_function(value)
        summary = self._summary(fn) if fn is not None else None
        if summary is not None and summary.returns:
            return ModuleObject(key, stmt, "factory", summary.returns)
        if not self._used_as_module(key, stmt, scope):
            return None
        return ModuleObject(key, stmt, "load" if q in ("torch.load", "torch.hub.load") else "use", _UNKNOWN)

    def _used_as_module(self, key: str, stmt: cst.CSTNode, scope: cst.CSTNode) -> bool:
        """``key`` is used in its scope as only a module is: ``key.eval()``, ``key.load_state_dict(...)``..."""
        uses = self._module_uses.get(id(scope))
        if uses is None:
            uses = self._module_uses[id(scope)] = {
                d
                for n in walk(scope.body if isinstance(scope, cst.FunctionDef) else scope)
                if isinstance(n, cst.Call)
                and isinstance(n.func, cst.Attribute)
                and n.func.attr.value in _MODULE_USES
                and (d := dotted(n.func.value)) is not None
            }
        return key in uses

    def _file_function(self, call: cst.Call) -> cst.FunctionDef | None:
        if not isinstance(call.func, cst.Name):
            return None
        fn = self.program.functions.get(call.func.value)
        return fn.node if fn is not None and fn.cls is None else None

    # ----------------------------------------------------------------- events
    def _phase(self, stmt: cst.CSTNode, phase: Phase) -> None:
        self._phases.setdefault(id(stmt), set()).add(phase)

    def _apply_call(self, call: cst.Call, stmt: cst.CSTNode, state: dict[str, Modes], scope: cst.CSTNode) -> None:
        ev = self._mode_event(call, stmt)
        if ev is not None and isinstance(call.func, cst.Attribute):
            key = _whole(dotted(call.func.value) or "")
            if ev.part == "" and ev.mode is not None and key:
                state[key] = frozenset({ev.mode})
            if ev.mode is Mode.TRAIN and ev.part == "":
                self._phase(stmt, Phase.TRAINING)
            return
        if isinstance(call.func, cst.Attribute):
            recv = dotted(call.func.value)
            meth = call.func.attr.value
            if recv is not None and meth == "load_state_dict":
                role = self.program.role_of(call.func.value, call)
                if role is None or role.kind == "model":  # an optimizer's state is no weight
                    self._phase(stmt, Phase.LOADING)
                return
        q = callee(self.rule, call)
        if q in _EXPORTS and call.args:
            arg = call.args[0].value
            if (
                isinstance(arg, cst.Call)
                and isinstance(arg.func, cst.Attribute)
                and arg.func.attr.value == "state_dict"
            ):
                arg = arg.func.value
            if dotted(arg) in state:
                self._phase(stmt, Phase.EXPORT)
            return
        if q is not None and q.startswith("torch.optim.") and call.args:
            first = call.args[0].value
            if (
                isinstance(first, cst.Call)
                and isinstance(first.func, cst.Attribute)
                and first.func.attr.value in ("parameters", "named_parameters")
                and dotted(first.func.value) in state
            ):
                self._phase(stmt, Phase.TRAINING)
            return
        called = dotted(call.func)
        if called is not None and called in state:
            self._forward(call, called, stmt, state)
            return
        summary, args = self._callee_summary(call)
        if summary is None:
            return
        for param, key in args.items():
            if param in summary.loads:
                self._phase(stmt, Phase.LOADING)
            after = summary.modes.get(param)
            if after:
                state[key] = after

    def _forward(self, call: cst.Call, key: str, stmt: cst.CSTNode, state: dict[str, Modes]) -> None:
        step = self.program.step_of(call)
        if step is not None and step.kind == "training":
            self._phase(stmt, Phase.TRAINING)
        elif step is not None or state.get(key) == _EVAL or self.grad_off(call):
            self._phase(stmt, Phase.EVALUATION)

    def grad_off(self, node: cst.CSTNode) -> bool:
        """Whether ``node`` runs with autograd off: inside ``with torch.no_grad():`` (``inference_mode``,
        ``set_grad_enabled(False)``), in a function decorated so, or in a nested function (a def in a
        function, not a generator) that inherits it: every use of its name is a call that runs with
        autograd off, directly, from another such nested function, or through a local name that picks
        it (``fn = [basic, mirror][level]``). Any other use (returned, passed on, stored) leaves it unknown: False."""
        cur: cst.CSTNode | None = node
        while cur is not None:
            if isinstance(cur, cst.With):
                found = {self._grad_off_item(i.item) for i in cur.items} - {None}
                if found:
                    return found == {True}
            if isinstance(cur, cst.FunctionDef):
                found = {self._grad_off_item(d.decorator) for d in cur.decorators} - {None}
                if found:
                    return found == {True}
                return self._inherits_grad_off(cur)
            if isinstance(cur, cst.ClassDef):
                return False
            cur = self._parent(cur)
        return False

    def _grad_off_item(self, expr: cst.BaseExpression) -> bool | None:
        """True: it turns autograd off; False: on (``enable_grad``, ``set_grad_enabled(x)``); None: neither."""
        q = callee(self.rule, expr) if isinstance(expr, cst.Call) else None
        if q is None and isinstance(expr, (cst.Name, cst.Attribute)):
            q = torch_name(self.rule, expr)
        if q in ("torch.set_grad_enabled", "torch.autograd.grad_mode.set_grad_enabled"):
            first = _argument(expr, 0, "mode") if isinstance(expr, cst.Call) else None
            return isinstance(first, cst.Name) and first.value == "False"
        if q in ("torch.enable_grad", "torch.autograd.grad_mode.enable_grad"):
            return False
        return True if q in _GRAD_OFF else None

    def _inherits_grad_off(self, fn: cst.FunctionDef) -> bool:
        if id(fn) in self._grad_off_fns:
            return self._grad_off_fns[id(fn)]
        self._grad_off_fns[id(fn)] = False  # a recursive use is not established
        nested = isinstance(self._scope_of(fn), cst.FunctionDef)
        generator = any(isinstance(n, (cst.Yield, cst.Await)) for n in walk(fn.body))
        calls = self._uses_as_calls(fn.name) if nested and not generator else None
        out = bool(calls) and all(self.grad_off(c) for c in calls or ())
        self._grad_off_fns[id(fn)] = out
        return out

    def _uses_as_calls(self, name: cst.Name, depth: int = 0) -> list[cst.Call] | None:
        """The calls that run what ``name`` binds, when every use of it is one: ``name(...)``, or a
        call of a local name whose every binding picks it (None: some use is not a call)."""
        try:
            scope = self.rule.get_metadata(ScopeProvider, name)
        except KeyError:
            return None
        if scope is None or name.value not in scope or depth > 2:
            return None
        bindings = list(scope[name.value])
        if len(bindings) != 1:
            return None
        out: list[cst.Call] = []
        for access in getattr(bindings[0], "references", ()):
            use = access.node
            parent = self._parent(use)
            if isinstance(parent, cst.Call) and parent.func is use:
                out.append(parent)
                continue
            alias = self._picked_into(use)
            more = self._uses_as_calls(alias, depth + 1) if alias is not None else None
            if more is None:
                return None
            out += more
        return out

    def _picked_into(self, use: cst.CSTNode) -> cst.Name | None:
        """``alias`` of ``alias = use``, ``alias = [.., use, ..][i]``, ``alias = use if c else other``."""
        cur = self._parent(use)
        while isinstance(cur, (cst.Element, cst.List, cst.Tuple, cst.IfExp, cst.Subscript)):
            if isinstance(cur, cst.Subscript) and not isinstance(cur.value, (cst.List, cst.Tuple)):
                return None
            if isinstance(cur, cst.IfExp) and cur.test is use:
                return None
            use, cur = cur, self._parent(cur)
        if isinstance(cur, cst.Assign) and cur.value is use and len(cur.targets) == 1:
            target = cur.targets[0].target
            return target if isinstance(target, cst.Name) else None
        return None

    def _mode_event(self, call: cst.Call, stmt: cst.CSTNode) -> Event | None:
        mode = _mode_of_call(call)
        if mode is None or not isinstance(call.func, cst.Attribute):
            if isinstance(call.func, cst.Attribute) and call.func.attr.value == "apply" and call.args:
                return self._apply_event(call, stmt)
            return None
        recv = dotted(call.func.value)
        if recv is None:
            return None
        loop = self._submodule_of(call.func.value)
        if loop is not None:
            return Event(None, call, stmt, mode, f"the layers `{recv}` of `{loop}`")
        parts = recv.split(".")
        rest = [p for p in parts[1:] if p not in _WRAPPED]
        if parts[0] == "self" and len(parts) > 1:
            rest = [p for p in parts[2:] if p not in _WRAPPED]
        return Event(None, call, stmt, mode, ".".join(rest))

    def _apply_event(self, call: cst.Call, stmt: cst.CSTNode) -> Event | None:
        """``model.apply(set_bn_eval)``: a function of the file that switches the layers it is given."""
        fn = call.args[0].value
        if not isinstance(fn, cst.Name):
            return None
        target = self.program.functions.get(fn.value)
        if target is None:
            return None
        for n in walk(target.node.body):
            if isinstance(n, cst.Call) and (mode := _mode_of_call(n)) is not None:
                return Event(None, call, stmt, mode, f"the layers `{fn.value}` picks")
        return None

    def _submodule_of(self, expr: cst.BaseExpression) -> str | None:
        """``m`` bound by ``for m in model.modules():`` (or ``named_modules``, ``children``): the loop's iterable."""
        if not isinstance(expr, cst.Name):
            return None
        try:
            scope = self.rule.get_metadata(ScopeProvider, expr)
        except KeyError:
            return None
        if scope is None or expr.value not in scope:
            return None
        for a in scope[expr.value]:
            node = getattr(a, "node", None)
            cur = self._parent(node)
            while isinstance(cur, (cst.Tuple, cst.Element, cst.List)):
                cur = self._parent(cur)
            if isinstance(cur, (cst.For, cst.CompFor)):
                it = cur.iter
                if (
                    isinstance(it, cst.Call)
                    and isinstance(it.func, cst.Attribute)
                    and it.func.attr.value in _SUBMODULE_ITERS
                ):
                    return cst.Module([]).code_for_node(it)
        return None

    # ----------------------------------------------------------------- functions of the file
    def _callee_summary(self, call: cst.Call) -> tuple[_Summary | None, dict[str, str]]:
        """The summary of the file's function ``call`` runs, and which module each parameter gets."""
        if not isinstance(call.func, (cst.Name, cst.Attribute)):
            return None, {}
        fn, how = self.program.resolve_callable(call.func, call)
        if fn is None or how not in ("call", "method"):
            return None, {}
        summary = self._summary(fn.node)
        if summary is None:
            return None, {}
        offset = 1 if how == "method" else 0
        args: dict[str, str] = {}
        for i, param in enumerate(fn.params):
            arg = _argument(call, i - offset, param)
            key = dotted(arg) if arg is not None else None
            if key is not None:
                args[param] = _whole(key)
        return summary, args

    def _summary(self, fn: cst.FunctionDef) -> _Summary | None:
        if id(fn) in self._summaries:
            return self._summaries[id(fn)]
        self._summaries[id(fn)] = None  # a recursive call is unknown
        self._done.add(id(fn))
        params = [p.name.value for p in fn.params.params]
        state: dict[str, Modes] = {p: _SAME for p in params}
        end = self._run(list(fn.body.body), state, fn)
        s = _Summary()
        for p in params:
            if end.get(p):
                s.modes[p] = end[p]
        for n in walk(fn.body):
            if not isinstance(n, cst.Call) or not isinstance(n.func, cst.Attribute):
                continue
            root = (dotted(n.func.value) or "").split(".")[0]
            if root not in params:
                continue
            if n.func.attr.value == "load_state_dict":
                s.loads.add(root)
        returns: Modes | None = None
        for r in walk(fn.body):
            if isinstance(r, cst.Return):
                key = dotted(r.value) if r.value is not None else None
                before = self._before.get(id(self._statement(r)), {})
                if key is None or key not in before or not before[key]:
                    returns = None
                    break
                returns = before[key] if returns is None else _join(returns, before[key])
        s.returns = returns
        self._summaries[id(fn)] = s
        return s


def _merge(a: dict[str, Modes], b: dict[str, Modes]) -> dict[str, Modes]:
    """The modes after two ways that meet (the branches of an ``if``, a loop run or not)."""
    out: dict[str, Modes] = {}
    for key in a.keys() | b.keys():
        if key in a and key in b:
            out[key] = _join(a[key], b[key])
        else:  # bound (or known to be a module) on one way only
            out[key] = frozenset((a.get(key) or b.get(key) or _SAME) | _UNKNOWN)
    return out


def _whole(key: str) -> str:
    """``model.module`` is ``model``: a wrapper's inner module shares its mode."""
    parts = key.split(".")
    while len(parts) > 1 and parts[-1] in _WRAPPED:
        parts.pop()
    return ".".join(parts)


def _mode_of_call(call: cst.Call) -> Mode | None:
    """``.eval()``/``.train(False)``: EVAL; ``.train()``/``.train(True)``: TRAIN; ``.train(x)``: UNKNOWN."""
    if not isinstance(call.func, cst.Attribute):
        return None
    meth = call.func.attr.value
    if meth == "eval" and not call.args:
        return Mode.EVAL
    if meth != "train" or len(call.args) > 1:
        return None
    if not call.args:
        return Mode.TRAIN
    arg = call.args[0]
    if arg.keyword is not None and arg.keyword.value != "mode":
        return None
    if isinstance(arg.value, cst.Name) and arg.value.value in ("True", "False"):
        return Mode.TRAIN if arg.value.value == "True" else Mode.EVAL
    return Mode.UNKNOWN


def _loads_weights(value: cst.BaseExpression) -> bool:
    """``resnet50(weights=...)``, ``create_model(..., pretrained=True)``."""
    if not isinstance(value, cst.Call):
        return False
    for a in value.args:
        if a.keyword is not None and a.keyword.value in ("weights", "pretrained", "checkpoint_path"):
            return not (isinstance(a.value, cst.Name) and a.value.value in ("None", "False"))
    return False


def _torchvision_builder(q: str) -> bool:
    """``torchvision.models.resnet18`` and the other builder functions (lower-case names)."""
    if not q.startswith("torchvision.models."):
        return False
    last = q.rsplit(".", 1)[-1]
    return last[:1].islower() and last not in ("get_weight", "list_models", "get_model_weights")


def _argument(call: cst.Call, index: int, name: str) -> cst.BaseExpression | None:
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a.value
    positional = [a for a in call.args if a.keyword is None]
    if any(a.star for a in positional[: index + 1]):
        return None
    return positional[index].value if 0 <= index < len(positional) else None


def lifecycle_of(rule: Rule) -> Lifecycle:
    """The file's model lifecycle, built once per parsed text and shared by every rule that asks."""
    lc = remembered(("lifecycle",), rule.ctx.module, lambda: Lifecycle(rule))
    lc.rule = rule  # metadata is read through the rule that asks (the builder's pass may be over)
    lc.program.rule = rule
    return lc
