"""One model of a training program, shared by every rule family: what each name holds, where the
training and evaluation steps are, and how the file's functions call each other.

Families used to find "the model", "the optimizer", "the step" and "the device" each their own way;
this module answers those questions once per file. Build it with ``program_of(rule)``: the object is
made once per parsed module (``metadata.remembered``) and reached from any rule of the same pass.
Names are resolved through LibCST's scope analysis and qualified names, never by spelling alone.

Public API (everything else is private):

* ``program_of(rule) -> Program``.
* ``Program.functions``: ``{qualname: Function}`` for every ``def`` (``"train"``, ``"Trainer._run_batch"``,
  nested ones as ``"main.<locals>.step"``). ``Function.node``, ``.cls`` (class name or None),
  ``.params`` (names), ``.compiled`` (decorated with ``torch.compile``), ``.callers`` (``Edge`` list).
* ``Program.module_classes``: names of the file's ``nn.Module`` subclasses; ``Program.factories``:
  functions of the file that return a model (``def build(): return Net()``).
* ``Program.edges``: ``Edge(caller, callee, call, how)`` with ``caller``/``callee`` qualnames
  (``"<module>"`` for module level) and ``how`` in ``"call"``, ``"method"``, ``"constructor"``,
  ``"spawn"`` (``mp.spawn(worker, args=...)``: the callee receives the process index first),
  ``"alias"`` (``fn = [a, b][level]; fn(x)``: a call of a local name that holds one of the file's
  functions, an edge to each it may hold).
* ``Program.role_of(expr, at) -> Role | None``: what ``expr`` (a name, ``self.attr`` or ``obj.attr``)
  read at node ``at`` holds. ``Role.kind`` is one of ``KINDS`` ("model", "optimizer", "scheduler",
  "loader", "loss", "device", "scaler"); ``Role.origin`` is the node that creates it (a call, or a
  device expression); ``Role.binding`` the statement that binds it where it is created;
  ``Role.path`` the chain of names it travelled through (``["model", "train(model=...)"]``). A
  parameter takes the role of the argument *every* call site of the file passes (and none when
  the call sites disagree or there are none: the model cannot tell, it never guesses).
* ``Program.attribute_bindings(cls, attr)``: the statements ``self.attr = ...`` of class ``cls``.
* ``Program.roles(kind)``: every creation of that kind in the file (``Role`` list).
* ``Program.steps``: ``Step(kind, loop, function, body_function, backward)`` for each loop that runs
  a backward pass (``kind="training"``) or calls a model without one (``"evaluation"``), directly or
  through a function of the file it calls (``body_function``, e.g. ``Trainer._run_batch``).
* ``Program.device_at(at) -> cst.BaseExpression | None``: the device expression the code around
  ``at`` moves models or batches to (the function first, then its class's methods, then the
  module), e.g. ``device``, ``self.gpu_id``, ``torch.device(f"cuda:{rank}")``.
* ``Program.entry``: ``Entry(kind, node, workers, launcher)``; ``kind`` is ``"main-guard"`` or ``"module"``
  (no guard); ``workers`` the functions started once per process (``mp.spawn``) and ``launcher``
  ``"spawn"``, ``"torchrun"`` (the file reads ``LOCAL_RANK``/``RANK`` or calls
  ``init_process_group`` without spawning) or None.
* ``Program.runs_per_process(node) -> bool``: whether ``node`` runs in every process of a
  multi-process launch (a spawn worker and what it calls; the whole file under torchrun), as
  opposed to only in the launching ``__main__`` process.
* ``Program.unknowns``: sentences saying what the file does not tell (a trainer class whose model
  comes from another file, a worker launched elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import Assignment, ScopeProvider

from torchopt.analysis.names import callee, dotted, torch_name
from torchopt.analysis.models import nn_module_classes
from torchopt.analysis.syntax import picked_names, walk
from torchopt.analysis.values import classify_device, matches_device_name
from torchopt.rewrite.metadata import ParentProvider, children_of, remembered
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.facts import source_of

KINDS = ("model", "optimizer", "scheduler", "loader", "loss", "device", "scaler")
MODULE = "<module>"
_LOADERS = {"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"}
_SCALERS = {
    "torch.amp.GradScaler",
    "torch.cuda.amp.GradScaler",
    "torch.cpu.amp.GradScaler",
    "torch.amp.grad_scaler.GradScaler",
}
_SPAWNS = {"torch.multiprocessing.spawn", "torch.multiprocessing.spawn.spawn", "torch.multiprocessing.start_processes"}
# Module wrappers that share their module (its parameters, its mode): the model is the wrapped one.
MODULE_WRAPPERS = {
    "torch.compile",
    "torch.nn.DataParallel",
    "torch.nn.parallel.DataParallel",
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
}
_NOT_MODELS = {"Parameter", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict", "Identity", "Module"}
# Methods that return the module they are called on (`Net().to(device).train()`).
_SELF_RETURNING = {
    "to",
    "cuda",
    "cpu",
    "train",
    "eval",
    "float",
    "double",
    "half",
    "bfloat16",
    "requires_grad_",
    "share_memory",
    "to_empty",
}
_DEVICE_CALLS = {
    "torch.device",
    "torch.accelerator.current_accelerator",
    "torch.cuda.current_device",
    "torch.get_default_device",
}
_TORCHRUN_ENV = ("LOCAL_RANK", "WORLD_SIZE", "RANK")
_DEPTH = 16  # links followed through assignments, parameters and attributes


@dataclass
class Edge:
    caller: str
    callee: str
    call: cst.Call = field(repr=False)
    how: str = "call"


@dataclass
class Function:
    qualname: str
    node: cst.FunctionDef = field(repr=False)
    cls: str | None = None
    params: list[str] = field(default_factory=list)
    compiled: bool = False
    callers: list[Edge] = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        return self.node.name.value


@dataclass
class Role:
    kind: str
    origin: cst.CSTNode = field(repr=False)
    binding: cst.CSTNode | None = field(default=None, repr=False)
    path: list[str] = field(default_factory=list)


@dataclass
class Step:
    kind: str  # "training" | "evaluation"
    loop: cst.For | cst.While = field(repr=False)
    function: Function | None  # the function holding the loop (None: module level)
    body_function: Function | None = None  # the function of the file the loop calls that runs the step
    backward: cst.Call | None = field(default=None, repr=False)


@dataclass
class Entry:
    kind: str  # "main-guard" | "module"
    node: cst.CSTNode | None = field(default=None, repr=False)
    workers: list[Function] = field(default_factory=list)
    launcher: str | None = None  # "spawn" | "torchrun" | None


class Program:
    """See the module docstring."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.module = rule.ctx.module
        self.nodes = list(walk(self.module, True))
        self.functions: dict[str, Function] = {}
        self.classes: dict[str, cst.ClassDef] = {}
        self.module_classes: set[str] = set()
        self.factories: set[str] = set()
        self.edges: list[Edge] = []
        self.steps: list[Step] = []
        self.unknowns: list[str] = []
        self._fn_of_node: dict[int, Function] = {}
        self._attr_binds: dict[tuple[str, str], list[tuple[cst.CSTNode, cst.BaseExpression]]] = {}
        self._instances: dict[int, str] = {}
        # What each function returns (a role kind, or None: unknown), and the functions being worked
        # out right now: a recursive `unwrap(m)` would otherwise be re-entered once per `return`, at
        # every depth (exponential in the number of returns).
        self._returns: dict[int, str | None] = {}
        self._returns_pending: set[int] = set()
        self._collect_defs()
        self._collect_attrs()
        self._collect_edges()
        self._collect_factories()
        self.entry = self._find_entry()
        self._find_steps()
        self._note_unknowns()

    # ----------------------------------------------------------------- structure
    def parent(self, node: cst.CSTNode | None) -> cst.CSTNode | None:
        return self.rule.get_metadata(ParentProvider, node, None)

    def _collect_defs(self) -> None:
        for n in self.nodes:
            if isinstance(n, cst.ClassDef):
                self.classes.setdefault(n.name.value, n)
        self.module_classes = set(nn_module_classes(self.rule))
        for n in self.nodes:
            if isinstance(n, cst.FunctionDef):
                self._add_function(n)

    def _add_function(self, fn: cst.FunctionDef) -> None:
        parts: list[str] = [fn.name.value]
        cls = None
        cur = self.parent(fn)
        direct = True
        while cur is not None and not isinstance(cur, cst.Module):
            if isinstance(cur, cst.ClassDef):
                parts.append(cur.name.value)
                if direct:
                    cls = cur.name.value
                direct = False
            elif isinstance(cur, cst.FunctionDef):
                parts.append(cur.name.value + ".<locals>")
                direct = False
            cur = self.parent(cur)
        qual = ".".join(reversed(parts))
        params = [p.name.value for p in fn.params.params]
        compiled = any(
            torch_name(self.rule, d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator)
            == "torch.compile"
            for d in fn.decorators
            if isinstance(d.decorator, (cst.Name, cst.Attribute, cst.Call))
        )
        f = Function(qual, fn, cls, params, compiled)
        self.functions.setdefault(qual, f)
        self._fn_of_node[id(fn)] = self.functions[qual]

    def function_of(self, node: cst.CSTNode | None) -> Function | None:
        """The innermost function of the file that holds ``node`` (None at module level)."""
        cur: cst.CSTNode | None = node if isinstance(node, cst.FunctionDef) else self.parent(node)
        while cur is not None:
            if isinstance(cur, cst.FunctionDef):
                return self._fn_of_node.get(id(cur))
            cur = self.parent(cur)
        return None

    def _collect_attrs(self) -> None:
        """``self.x = value`` in a method of class C: (C, x) -> [(statement, value)]."""
        for n in self.nodes:
            if isinstance(n, cst.Assign):
                targets = [t.target for t in n.targets]
                value = n.value
            elif isinstance(n, cst.AnnAssign) and n.value is not None:
                targets, value = [n.target], n.value
            else:
                continue
            for t in targets:
                if isinstance(t, cst.Attribute) and isinstance(t.value, cst.Name) and t.value.value == "self":
                    fn = self.function_of(n)
                    if fn is not None and fn.cls is not None:
                        self._attr_binds.setdefault((fn.cls, t.attr.value), []).append((n, value))

    def resolve_callable(self, func: cst.BaseExpression, at: cst.CSTNode) -> tuple[Function | None, str]:
        """The file's function a call of ``func`` at ``at`` runs, and how (see ``Edge.how``)."""
        return self._resolve_callable(func, at)

    def _resolve_callable(self, func: cst.BaseExpression, at: cst.CSTNode) -> tuple[Function | None, str]:
        """The file's function a call of ``func`` runs, and how (see ``Edge.how``)."""
        if isinstance(func, cst.Name):
            for a in self._assignments(func):
                node = getattr(a, "node", None)
                if isinstance(node, cst.FunctionDef):
                    fn = self._fn_of_node.get(id(node))
                    if fn is not None and fn.cls is None:
                        return fn, "call"
                if isinstance(node, cst.ClassDef):
                    init = self.functions.get(f"{node.name.value}.__init__")
                    return init, "constructor"
            return None, "call"
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name):
            cls = None
            if func.value.value == "self":
                here = self.function_of(at)
                cls = here.cls if here is not None else None
            else:
                cls = self._instance_class(func.value)
            if cls is not None:
                return self.functions.get(f"{cls}.{func.attr.value}"), "method"
        return None, "call"

    def _instance_class(self, name: cst.Name) -> str | None:
        """The file's class ``name`` was built from (``trainer = Trainer(...)``), when every binding says so."""
        found: set[str] = set()
        for a in self._assignments(name):
            value = self._bound_value(a)
            if (
                not isinstance(value, cst.Call)
                or not isinstance(value.func, cst.Name)
                or value.func.value not in self.classes
            ):
                return None
            found.add(value.func.value)
        return found.pop() if len(found) == 1 else None

    def _collect_edges(self) -> None:
        for n in self.nodes:
            if not isinstance(n, cst.Call):
                continue
            here = self.function_of(n)
            caller = here.qualname if here is not None else MODULE
            target, how = self._resolve_callable(n.func, n)
            if target is None and isinstance(n.func, (cst.Name, cst.Attribute)) and callee(self.rule, n) in _SPAWNS:
                first = n.args[0].value if n.args else None
                if isinstance(first, cst.Name):
                    target, how = self._resolve_callable(first, n)[0], "spawn"
            targets = [target] if target is not None else []
            if not targets and isinstance(n.func, cst.Name):
                targets, how = self._picked_functions(n.func), "alias"
            for target in targets:
                edge = Edge(caller, target.qualname, n, how)
                self.edges.append(edge)
                target.callers.append(edge)

    def _picked_functions(self, name: cst.Name) -> list[Function]:
        """The file's plain functions a local name may hold when every binding of it picks one of them:
        ``fn = [infer_basic, infer_mirror][level]``, ``fn = a if flag else b``, ``fn = a``. A call of
        the name is a call of each (an ``Edge`` with ``how="alias"``); any other binding: none."""
        out: list[Function] = []
        found = self._assignments(name)
        for a in found:
            value = self._bound_value(a) if isinstance(a, Assignment) else None
            picks = picked_names(value) if value is not None else None
            if not picks:
                return []
            for pick in picks:
                fn, how = self._resolve_callable(pick, pick)
                if fn is None or how != "call":
                    return []
                if fn not in out:
                    out.append(fn)
        return out

    def _collect_factories(self) -> None:
        changed = True
        while changed:
            changed = False
            for fn in self.functions.values():
                if fn.qualname in self.factories:
                    continue
                rets = [r for r in walk(fn.node.body) if isinstance(r, cst.Return) and r.value is not None]
                if rets and all(self._kind_of_value(r.value, r, 0) == "model" for r in rets):
                    self.factories.add(fn.qualname)
                    changed = True

    # ----------------------------------------------------------------- roles
    def _assignments(self, name: cst.Name) -> list:
        try:
            scope = self.rule.get_metadata(ScopeProvider, name)
        except KeyError:
            return []
        if scope is None or name.value not in scope:
            return []
        return list(scope[name.value])

    def _bound_value(self, assignment: object) -> cst.BaseExpression | None:
        node = getattr(assignment, "node", None)
        if not isinstance(assignment, Assignment) or node is None:
            return None
        parent = self.parent(node)
        if isinstance(parent, cst.Element):
            return self._unpacked(parent)
        if isinstance(parent, cst.AssignTarget) and parent.target is node:
            stmt = self.parent(parent)
            return stmt.value if isinstance(stmt, cst.Assign) else None
        if isinstance(parent, cst.AnnAssign) and parent.target is node:
            return parent.value
        return None

    def _unpacked(self, element: cst.Element) -> cst.BaseExpression | None:
        """``a, b = f()`` where every ``return`` of the file's ``f`` is a tuple of that length: the
        element of the first return that lands in ``b`` (``dataset, model, opt = load_objs()``)."""
        tup = self.parent(element)
        target = self.parent(tup) if tup is not None else None
        stmt = self.parent(target) if target is not None else None
        if (
            not isinstance(tup, cst.Tuple)
            or not isinstance(target, cst.AssignTarget)
            or not isinstance(stmt, cst.Assign)
        ):
            return None
        index = next(i for i, e in enumerate(tup.elements) if e is element)
        value = stmt.value
        if isinstance(value, cst.Tuple) and len(value.elements) == len(tup.elements):
            return value.elements[index].value
        if not isinstance(value, cst.Call) or not isinstance(value.func, cst.Name):
            return None
        fn, how = self._resolve_callable(value.func, value)
        if fn is None or how != "call":
            return None
        rets = [r.value for r in walk(fn.node.body) if isinstance(r, cst.Return)]
        if not rets or not all(isinstance(r, cst.Tuple) and len(r.elements) == len(tup.elements) for r in rets):
            return None
        return cst.ensure_type(rets[0], cst.Tuple).elements[index].value  # (all of them are tuples)

    def _kind_of_value(self, value: cst.BaseExpression | None, at: cst.CSTNode, depth: int) -> str | None:
        role = self._role_of_value(value, at, depth)
        return role.kind if role is not None else None

    def _role_of_value(self, value: cst.BaseExpression | None, at: cst.CSTNode, depth: int) -> Role | None:
        """What a value expression creates or passes on."""
        if value is None or depth > _DEPTH:
            return None
        if isinstance(value, (cst.Name, cst.Attribute)):
            return self._role(value, at, depth + 1)
        if isinstance(value, cst.IfExp):
            body = self._role_of_value(value.body, at, depth + 1)
            other = self._role_of_value(value.orelse, at, depth + 1)
            if body is not None and other is not None and body.kind == other.kind:
                return Role(body.kind, value)
            if (
                {type(value.body), type(value.orelse)} & {cst.Integer}
                and (either := body or other) is not None
                and either.kind == "device"
            ):
                return Role("device", value)  # `0 if cuda else "cpu"`: a GPU index or a device
            return None
        if isinstance(value, cst.IfExp) or isinstance(value, cst.Integer):
            return None  # an index is a device only where a device is expected (see IfExp above)
        if isinstance(value, (cst.SimpleString, cst.FormattedString)):
            return (
                Role("device", value)
                if classify_device(self.rule, value).is_device
                or isinstance(value, cst.FormattedString)
                and _fstring_head(value) in ("cuda", "cpu")
                else None
            )
        if not isinstance(value, cst.Call):
            return None
        f = value.func
        if isinstance(f, cst.Attribute) and f.attr.value in _SELF_RETURNING:
            inner = self._role_of_value(f.value, at, depth + 1)
            if inner is not None and inner.kind == "model":
                return inner
        q = callee(self.rule, value) if isinstance(f, (cst.Name, cst.Attribute)) else None
        kind = _kind_of_torch(q) if q else None
        if q in MODULE_WRAPPERS and value.args:
            wrapped = self._role_of_value(value.args[0].value, at, depth + 1)
            return (
                Role("model", value, path=wrapped.path if wrapped else []) if wrapped or q != "torch.compile" else None
            )
        if kind is not None:
            return Role(kind, value)
        if isinstance(f, cst.Name) and f.value in self.module_classes:
            target = self._resolve_callable(f, at)
            if target[1] == "constructor" or f.value in self.classes:
                return Role("model", value)
        if isinstance(f, cst.Name):
            fn, how = self._resolve_callable(f, at)
            if fn is not None and how == "call" and fn.qualname in self.factories:
                return Role("model", value)
            if fn is not None and how == "call":
                return self._returned_role(fn, value, depth)
        return None

    def _returned_role(self, fn: Function, call: cst.Call, depth: int) -> Role | None:
        """``pick_device()``: what a function of the file returns, when every ``return`` agrees. A
        function that returns a call of itself is unknown: never a guess."""
        key = id(fn.node)
        if key in self._returns_pending:
            return None
        if key not in self._returns:
            self._returns_pending.add(key)
            try:
                rets = [r.value for r in walk(fn.node.body) if isinstance(r, cst.Return)]
                kind = None
                for r in rets:
                    role = self._role_of_value(r, r, depth + 1) if r is not None else None
                    if role is None or (kind is not None and role.kind != kind):
                        kind = None
                        break
                    kind = role.kind
            finally:
                self._returns_pending.discard(key)
            self._returns[key] = kind
        kind = self._returns[key]
        return Role(kind, call) if kind is not None else None

    def role_of(self, expr: cst.BaseExpression, at: cst.CSTNode | None = None) -> Role | None:
        """What ``expr`` holds where it is read (``at`` defaults to ``expr`` itself)."""
        return self._role(expr, at if at is not None else expr, 0)

    def _role(self, expr: cst.BaseExpression, at: cst.CSTNode, depth: int) -> Role | None:
        if depth > _DEPTH:
            return None
        if isinstance(expr, cst.Name):
            return self._name_role(expr, depth)
        if isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name):
            if expr.value.value == "self":
                here = self.function_of(at)
                cls = here.cls if here is not None else None
            else:
                cls = self._instance_class(expr.value)
            if cls is None:
                return None
            return self._attr_role(cls, expr.attr.value, depth)
        if isinstance(expr, (cst.Call, cst.IfExp, cst.SimpleString, cst.FormattedString, cst.Integer)):
            return self._role_of_value(expr, at, depth)
        return None

    def _name_role(self, name: cst.Name, depth: int) -> Role | None:
        roles: list[Role] = []
        for a in self._assignments(name):
            node = getattr(a, "node", None)
            if isinstance(node, cst.Param):
                role = self._param_role(node, depth)
            else:
                value = self._bound_value(a)
                role = self._role_of_value(value, node, depth + 1) if value is not None and node is not None else None
                if role is not None and role.binding is None:
                    role = Role(role.kind, role.origin, self._statement(node), role.path)
            if role is None:
                return None  # one binding we cannot see through: unknown, never a guess
            roles.append(role)
        if not roles or len({r.kind for r in roles}) != 1:
            return None
        first = roles[0]
        return Role(first.kind, first.origin, first.binding, first.path + [name.value])

    def _attr_role(self, cls: str, attr: str, depth: int) -> Role | None:
        binds = self._attr_binds.get((cls, attr), [])
        roles = [self._role_of_value(value, stmt, depth + 1) for stmt, value in binds]
        if not roles or any(r is None for r in roles) or len({r.kind for r in roles if r}) != 1:
            return None
        first = roles[0]
        assert first is not None
        binding = first.binding if first.binding is not None and first.origin is not binds[0][1] else None
        return Role(first.kind, first.origin, binding or self._statement(binds[0][0]), first.path + [f"self.{attr}"])

    def _param_role(self, param: cst.Param, depth: int) -> Role | None:
        fn_node = self.parent(self.parent(param))  # Param -> Parameters -> FunctionDef
        fn = self._fn_of_node.get(id(fn_node)) if isinstance(fn_node, cst.FunctionDef) else None
        if fn is None or not fn.callers:
            return None
        name = param.name.value
        idx = fn.params.index(name) if name in fn.params else -1
        roles: list[Role] = []
        for edge in fn.callers:
            offset = 1 if edge.how in ("method", "constructor", "spawn") else 0
            arg = _argument(edge, idx - offset, name)
            role = self._role(arg, edge.call, depth + 1) if arg is not None else None
            if role is None:
                return None
            roles.append(role)
        if len({r.kind for r in roles}) != 1 or len({id(r.origin) for r in roles}) != 1:
            return None
        first = roles[0]
        return Role(first.kind, first.origin, first.binding, first.path + [f"{fn.name}({name}=...)"])

    def attribute_bindings(self, cls: str, attr: str) -> list[cst.CSTNode]:
        """The statements ``self.attr = ...`` in the methods of the file's class ``cls``, in source order."""
        return [s for stmt, _ in self._attr_binds.get((cls, attr), []) if (s := self._statement(stmt)) is not None]

    def _statement(self, node: cst.CSTNode | None) -> cst.CSTNode | None:
        cur = node
        while cur is not None and not isinstance(cur, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            cur = self.parent(cur)
        return cur

    def roles(self, kind: str) -> list[Role]:
        """Every place the file creates something of ``kind`` (a binding by assignment)."""
        out: list[Role] = []
        for n in self.nodes:
            if isinstance(n, cst.Assign) and len(n.targets) == 1:
                target = n.targets[0].target
            elif isinstance(n, cst.AnnAssign) and n.value is not None:
                target = n.target
            else:
                continue
            if not isinstance(target, (cst.Name, cst.Attribute)) or n.value is None:
                continue
            role = self._role_of_value(n.value, n, 0)
            if role is not None and role.kind == kind and not isinstance(n.value, (cst.Name, cst.Attribute)):
                out.append(Role(kind, role.origin, self._statement(n), [dotted(target) or ""]))
        return out

    # ----------------------------------------------------------------- devices
    def device_at(self, at: cst.CSTNode) -> cst.BaseExpression | None:
        """The device expression code near ``at`` moves modules or tensors to: ``X.to(dev)``,
        ``X.cuda(dev)`` in the function of ``at``, then the other methods of its class, then the module."""
        here = self.function_of(at)
        regions: list[cst.CSTNode] = []
        if here is not None:
            regions.append(here.node)
            if here.cls is not None:
                regions.append(self.classes[here.cls])
        else:
            regions.append(self.module)
        for region in regions:
            for n in walk(region, cross_scopes=isinstance(region, cst.ClassDef)):
                if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute):
                    dev = self._moved_to(n, region)
                    if dev is not None and (not isinstance(region, cst.ClassDef) or _is_self_attr(dev)):
                        return dev
        return None

    def _moved_to(self, call: cst.Call, region: cst.CSTNode) -> cst.BaseExpression | None:
        if not isinstance(call.func, cst.Attribute):
            return None
        meth = call.func.attr.value
        if meth not in ("to", "cuda"):
            return None
        args = [a for a in call.args if not a.star and (a.keyword is None or a.keyword.value == "device")]
        if meth == "cuda":
            return args[0].value if args else cst.SimpleString('"cuda"')
        for a in args:
            value = a.value
            if isinstance(value, cst.Attribute) and isinstance(value.value, cst.Name) and value.value.value == "self":
                return value
            if isinstance(value, cst.Name):
                role = self._role(value, call, 0)
                param = any(isinstance(getattr(x, "node", None), cst.Param) for x in self._assignments(value))
                named = matches_device_name(value.value, self.rule.ctx.device_names)
                if (
                    (role is not None and role.kind == "device")
                    or (param or named)
                    and role is None
                    and isinstance(region, cst.FunctionDef)
                ):
                    return value
            elif self._role_of_value(value, call, 0) is not None:
                return value
        return None

    # ----------------------------------------------------------------- entry and processes
    def _find_entry(self) -> Entry:
        guard = None
        for stmt in self.module.body:
            if (
                isinstance(stmt, cst.If)
                and isinstance(stmt.test, cst.Comparison)
                and dotted(stmt.test.left) == "__name__"
            ):
                guard = stmt
        entry = Entry("main-guard" if guard is not None else "module", guard)
        spawned = [self.functions[e.callee] for e in self.edges if e.how == "spawn"]
        if spawned:
            entry.workers, entry.launcher = spawned, "spawn"
        elif any(tok in source_of(self.module) for tok in _TORCHRUN_ENV + ("init_process_group",)):
            entry.launcher = "torchrun"
        return entry

    def runs_per_process(self, node: cst.CSTNode) -> bool:
        """Whether ``node`` runs in every process of a multi-process launch."""
        if self.entry.launcher == "torchrun":
            return True
        if self.entry.launcher != "spawn":
            return False
        reached = {w.qualname for w in self.entry.workers}
        todo = list(reached)
        while todo:
            cur = todo.pop()
            for e in self.edges:
                if e.caller == cur and e.callee not in reached and e.how != "spawn":
                    reached.add(e.callee)
                    todo.append(e.callee)
        here = self.function_of(node)
        while here is not None:
            if here.qualname in reached:
                return True
            here = self.function_of(self.parent(here.node)) if self.parent(here.node) is not None else None
        return False

    # ----------------------------------------------------------------- steps
    def _find_steps(self) -> None:
        for n in self.nodes:
            if not isinstance(n, (cst.For, cst.While)):
                continue
            found = self._step_in(n.body, 0, set())
            if found is None:
                continue
            backward, body_fn, kind = found
            self.steps.append(Step(kind, n, self.function_of(n), body_fn, backward))

    def _step_in(self, body: cst.CSTNode, depth: int, seen: set[str]):
        """(backward call, the function holding it when reached through a call, kind) for a loop body;
        not inside a nested loop (an epoch loop is not a step loop)."""
        model_call = False
        for c in _calls_outside_loops(body):
            if isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward":
                return c, None, "training"
        for c in _calls_outside_loops(body):
            fn, _ = self._resolve_callable(c.func, c)
            if fn is not None and fn.qualname not in seen and depth < 3 and fn.node.name.value != "__init__":
                inner = self._step_in(fn.node.body, depth + 1, seen | {fn.qualname})
                if inner is not None and inner[2] == "training":
                    return inner[0], inner[1] or fn, "training"
            if isinstance(c.func, (cst.Name, cst.Attribute)) and not model_call:
                role = self._role(c.func, c, 0)
                model_call = role is not None and role.kind == "model"
        return (None, None, "evaluation") if model_call else None

    def step_of(self, node: cst.CSTNode) -> Step | None:
        """The training step whose loop body or body function holds ``node``."""
        here = self.function_of(node)
        for s in self.steps:
            if s.body_function is not None and here is s.body_function:
                return s
            cur: cst.CSTNode | None = node
            while cur is not None and cur is not s.loop:
                cur = self.parent(cur)
            if cur is s.loop:
                return s
        return None

    def _note_unknowns(self) -> None:
        for name, cls in self.classes.items():
            if name in self.module_classes:
                continue
            init = self.functions.get(f"{name}.__init__")
            if init is None:
                continue
            for (c, attr), binds in self._attr_binds.items():
                if c != name:
                    continue
                for stmt, value in binds:
                    if isinstance(value, cst.Name) and value.value in init.params and not init.callers:
                        self.unknowns.append(
                            f"`{name}` is built outside this file, so what `self.{attr}` holds "
                            "(model, optimizer, loader) comes from the script that builds it"
                        )
                        break
        for w in self.entry.workers:
            if not w.callers:
                self.unknowns.append(f"`{w.qualname}` is started outside this file")


def _is_self_attr(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name) and expr.value.value == "self"


def _fstring_head(value: cst.FormattedString) -> str:
    lead = value.parts[0] if value.parts else None
    return lead.value.split(":")[0] if isinstance(lead, cst.FormattedStringText) else ""


def _kind_of_torch(q: str) -> str | None:
    cls = q.rsplit(".", 1)[-1]
    if q in _SCALERS:
        return "scaler"
    if q in _LOADERS:
        return "loader"
    if q in _DEVICE_CALLS:
        return "device"
    if q.startswith("torch.optim.lr_scheduler."):
        return "scheduler" if cls[:1].isupper() else None
    if q.startswith("torch.optim.") and cls[:1].isupper() and q.count(".") <= 3:
        return "optimizer"
    if (
        q.startswith("torch.nn.")
        and not q.startswith(("torch.nn.functional", "torch.nn.init", "torch.nn.utils"))
        and cls[:1].isupper()
    ):
        if cls.endswith("Loss"):
            return "loss"
        return None if cls in _NOT_MODELS else "model"
    return None


def _argument(edge: Edge, index: int, name: str) -> cst.BaseExpression | None:
    """The argument a call passes for parameter ``name`` at position ``index`` (keyword first)."""
    call = edge.call
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a.value
    if edge.how == "spawn":
        args_kw = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "args"), None)
        if args_kw is None and len(call.args) > 1 and call.args[1].keyword is None:
            args_kw = call.args[1].value
        if isinstance(args_kw, cst.Tuple) and 0 <= index < len(args_kw.elements):
            el = args_kw.elements[index]
            return None if isinstance(el, cst.StarredElement) else el.value
        return None
    positional = [a for a in call.args if a.keyword is None]
    if any(a.star for a in positional[: index + 1]):
        return None
    return positional[index].value if 0 <= index < len(positional) else None


def _calls_outside_loops(body: cst.CSTNode):
    stack = [body]
    while stack:
        cur = stack.pop()
        if isinstance(cur, cst.Call):
            yield cur
        for child in reversed(children_of(cur)):  # not `children`: LibCST rebuilds that list per call
            if isinstance(child, (cst.FunctionDef, cst.ClassDef, cst.Lambda, cst.For, cst.While)):
                continue
            stack.append(child)


def program_of(rule: Rule) -> Program:
    """The file's program model, built once per parsed module and shared by every rule."""
    program = remembered(("program",), rule.ctx.module, lambda: Program(rule))
    program.rule = rule  # metadata is read through the rule that asks (the builder's pass may be over)
    return program
