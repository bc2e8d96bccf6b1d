"""Which code runs once per training or evaluation step (where a host read costs every step).

A *step loop* is a ``for``/``while`` loop whose body runs a backward pass (training) or a forward
call of a module (evaluation) on every iteration: directly, or through a function or module of the
same file that it calls, but not only inside a nested loop (an epoch loop whose batches are iterated
by an inner loop is not itself a step loop, so per-epoch logging is not flagged). The *hot region*
is the body of every step loop (nested loops included) and every function of the file those bodies
call, transitively: plain functions, ``Class.forward`` of local ``nn.Module`` subclasses whose
instances are called, and methods called on ``self`` or on such instances.

The analysis is computed once per module and shared by every SYNC and MEM rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, cast

import libcst as cst
from libcst.metadata import Assignment, PositionProvider, ScopeProvider

from torchopt.analysis.names import (
    dotted,
    NOT_TENSOR,
    TENSOR_NAMESPACES,
    callee,
    param_annotation,
    plainly_assigned,
    reaching_values,
)
from torchopt.analysis.models import nn_module_classes
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider, children_of, remembered
from torchopt.rewrite.rule import Rule
from torchopt.analysis.conventions import CONVENTIONAL_MODEL_NAMES, MODULE_ONLY_METHODS, optimizer_step

SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)
LOOPS = (cst.For, cst.While)
_LOOP_TYPES = frozenset(LOOPS)
# The node types the whole-file scans of HotMap read; every other node is skipped by its exact type.
_COLLECTED_TYPES = frozenset(
    (*LOOPS, cst.FunctionDef, cst.ClassDef, cst.ImportFrom, cst.Assign, cst.AnnAssign, cst.Call)
)
# Tensor methods whose result is again a tensor (a conservative list for the strict analysis).
TENSOR_METHODS = {
    "mean",
    "sum",
    "float",
    "double",
    "half",
    "bfloat16",
    "detach",
    "clone",
    "to",
    "cuda",
    "cpu",
    "view",
    "reshape",
    "squeeze",
    "unsqueeze",
    "abs",
    "pow",
    "sqrt",
    "exp",
    "log",
    "argmax",
    "argmin",
    "softmax",
    "log_softmax",
    "mul",
    "add",
    "sub",
    "div",
    "masked_fill",
    "contiguous",
    "flatten",
    "t",
    "transpose",
    "permute",
    "norm",
    "std",
    "var",
    "prod",
    "all",
    "any",
    "eq",
    "ne",
    "gt",
    "lt",
    "ge",
    "le",
    "isnan",
    "isfinite",
    "isinf",
    "long",
    "int",
    "bool",
    "type_as",
    "expand",
    "expand_as",
    "repeat",
    "gather",
    "index_select",
    "cumsum",
    "matmul",
    "mm",
    "bmm",
    "relu",
    "sigmoid",
    "tanh",
    "clamp",
    "neg",
    "square",
    "logsumexp",
    "nansum",
    "nanmean",
    "max",
    "min",
    "view_as",
    "reshape_as",
    "squeeze_",
    "sign",
    "round",
    "floor",
    "ceil",
    "amax",
    "amin",
    "count_nonzero",
    "logical_not",
    "logical_and",
    "logical_or",
}
TUPLE_REDUCTIONS = {"max", "min"}  # with a dim they return (values, indices)
HOST_READS = {"item", "tolist", "numpy"}


def calls_in(node: cst.CSTNode, into_loops: bool = True) -> Iterable[cst.Call]:
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, cst.Call):
            yield cur
        for child in reversed(children_of(cur)):  # LibCST's `children` rebuilds the list on every call
            if isinstance(child, SCOPES):
                continue
            if not into_loops and isinstance(child, LOOPS):
                continue
            stack.append(child)


def is_backward(c: cst.Call) -> bool:
    if isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward":
        return True
    d = dotted(c.func)
    return d is not None and (d == "autograd.backward" or d.endswith(".autograd.backward"))


def is_optimizer_step(c: cst.Call) -> bool:
    """``optimizer.step()`` / ``scaler.step(optimizer)`` (by the optimizer's name): one parameter
    update, so the loop that runs it directly is a training step loop even when its backward passes
    run in a nested loop (gradient accumulation over micro-batches, sub-divided batches)."""
    f = c.func
    if not isinstance(f, cst.Attribute) or f.attr.value != "step":
        return False
    args = [dotted(a.value) for a in c.args[:1] if a.keyword is None]
    return optimizer_step(f.attr.value, dotted(f.value), args)


@dataclass(frozen=True, eq=False)
class HotLoop:
    """One step loop (one object per loop, so equal only to itself)."""

    # A loop; or a *step function*: a function that runs an optimizer step itself, outside its
    # loops, so that each call is one training step wherever it is called from (another module, a
    # closure a factory returns); its body is hot like a step loop's.
    node: cst.For | cst.While | cst.FunctionDef = field(repr=False)
    kind: str  # "training" (it runs a backward pass) | "forward-pass" (it calls a model, no backward:
    # evaluation, inference, or a per-sample loop in a loss such as a matcher)
    hot: "HotMap" = field(repr=False)

    @property
    def line(self) -> int:
        """Asked only for a message: positions cost a code generation of the whole file, which a
        file whose step loops hold nothing to report never needs."""
        return self.hot.line(self.node)

    @property
    def text(self) -> str:
        if isinstance(self.node, cst.FunctionDef):
            return f"the training step `{self.node.name.value}` (each call runs an optimizer step)"
        return f"the {self.kind} loop at line {self.line}"


@dataclass(frozen=True)
class Where:
    loop: HotLoop
    via: str | None = None  # the function the node is in, when reached through a call

    @property
    def text(self) -> str:
        if self.via:
            return f"in `{self.via}`, called from {self.loop.text}"
        return f"in {self.loop.text}"


@dataclass(repr=False)
class HotMap:
    rule: Rule
    functions: dict[str, cst.FunctionDef] = field(default_factory=dict)
    methods: dict[str, dict[str, cst.FunctionDef]] = field(default_factory=dict)  # class -> name -> def
    method_class: dict[int, str] = field(default_factory=dict)  # id(def) -> class name
    module_classes: set[str] = field(default_factory=set)
    instance_class: dict[str, str] = field(default_factory=dict)  # dotted name -> local class
    attr_class: dict[tuple[str, str], str] = field(default_factory=dict)  # (class, attr) -> local class
    modules: set[str] = field(default_factory=set)  # dotted names holding nn modules
    nn_class: dict[str, str] = field(default_factory=dict)  # dotted name -> torch.nn class it was built from
    step_loops: dict[int, HotLoop] = field(default_factory=dict)
    hot_funcs: dict[int, Where] = field(default_factory=dict)
    step_funcs: dict[int, Where] = field(default_factory=dict)  # id(def) -> its step (HotLoop.node)
    callers: dict[int, list[tuple[cst.Call, int]]] = field(default_factory=dict)  # id(def) -> (call, arg offset)
    batch_names: set[int] = field(default_factory=set)  # ids of Name nodes in step-loop targets
    _events: dict[int, set[str]] = field(default_factory=dict)

    # ----------------------------------------------------------------- construction
    def build(self) -> "HotMap":
        module = self.rule.ctx.module
        if not self._may_have_step_loops(module):
            return self  # no metadata computed: most files end here
        self._collect(module)
        for n in walk(module, True):
            # Exact types (parsed trees hold no subclasses): a negative isinstance on a LibCST class
            # goes through ABCMeta, and these loops visit every node of the file.
            if type(n) in _LOOP_TYPES and not (type(n) is cst.For and n.asynchronous is not None):
                node = cast("cst.For | cst.While", n)  # (the exact-type test above)
                ev = self._loop_events(node)
                if ev:
                    kind = "training" if ev & {"backward", "step"} else "forward-pass"
                    self.step_loops[id(n)] = HotLoop(node, kind, self)
        for loop in self.step_loops.values():  # found in pre-order: by position in the file
            self._spread(loop.node.body, loop, set())
            if isinstance(loop.node, cst.For):
                target: cst.BaseExpression = loop.node.target
                it = loop.node.iter
                if isinstance(it, cst.Call) and isinstance(it.func, cst.Name):
                    if it.func.value in ("range", "len") or _counts_down(it):
                        continue
                    if (
                        it.func.value == "enumerate"
                        and isinstance(target, (cst.Tuple, cst.List))
                        and len(target.elements) == 2
                    ):
                        target = target.elements[1].value
                self.batch_names |= {id(n) for n in walk(target) if isinstance(n, cst.Name)}
        self._step_functions()
        return self

    @property
    def any_hot(self) -> bool:
        """The file has a step loop or a step function."""
        return bool(self.step_loops or self.step_funcs)

    def _step_functions(self) -> None:
        """Functions that run an optimizer step outside their loops and that no step loop of the
        file calls: each call is a training step (HotLoop.node). Plain functions and closures only:
        a method's step is known to run only when a step loop of the file calls it (a model
        wrapper's `optimize_parameters` may belong to a training path the project never takes, and
        whether another module calls it is not known here)."""
        for fn in walk(self.rule.ctx.module, True):
            if type(fn) is not cst.FunctionDef or id(fn) in self.method_class:
                continue
            if id(fn) in self.hot_funcs or not any(is_optimizer_step(c) for c in calls_in(fn.body, into_loops=False)):
                continue
            step = HotLoop(fn, "training", self)
            self.step_funcs[id(fn)] = Where(step)
            self._spread(fn.body, step, {id(fn)}, self.method_class.get(id(fn)))

    def _may_have_step_loops(self, module: cst.Module) -> bool:
        """A cheap over-approximation without metadata: some loop calls ``.backward`` or something
        that may be a module (a name bound to ``SomeClass(...)``, a conventional model name), directly
        or through a function of the file."""
        loops: list[cst.For | cst.While] = []
        funcs: dict[str, cst.FunctionDef] = {}
        maybe_modules: set[str] = set()
        built: list[tuple[str, cst.Assign]] = []  # (callee's last name, assignment)
        class_aliases: set[str] = set()  # `from torch.nn import Linear as lin`: `lin` is a class too
        steps = False
        for n in walk(module, True):
            kind = type(n)
            if kind not in _COLLECTED_TYPES:
                continue
            if kind in _LOOP_TYPES:
                loops.append(cast("cst.For | cst.While", n))
            elif isinstance(n, cst.FunctionDef):
                funcs.setdefault(n.name.value, n)
            elif isinstance(n, cst.ImportFrom) and not isinstance(n.names, cst.ImportStar):
                for alias in n.names:
                    if (
                        alias.asname is not None
                        and isinstance(alias.asname.name, cst.Name)
                        and (dotted(alias.name) or "").rsplit(".", 1)[-1][:1].isupper()
                    ):
                        class_aliases.add(alias.asname.name.value)
            elif isinstance(n, cst.Assign) and isinstance(n.value, cst.Call):
                base = n.value
                while (
                    isinstance(base, cst.Call)
                    and isinstance(base.func, cst.Attribute)
                    and isinstance(base.func.value, cst.Call)
                ):
                    base = base.func.value
                name = dotted(base.func) if isinstance(base, cst.Call) else None
                built.append(((name or "").rsplit(".", 1)[-1], n))
            elif isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute):
                if n.func.attr.value in MODULE_ONLY_METHODS:
                    d = dotted(n.func.value)
                    if d:
                        maybe_modules.add(d)
                elif is_optimizer_step(n):
                    steps = True  # a step function (_step_functions) needs no loop
        for last, n in built:
            if last[:1].isupper() or last == "compile" or last in class_aliases:
                for t in n.targets:
                    d = dotted(t.target)
                    if d:
                        maybe_modules.add(d)
        if steps or not loops:
            return steps
        memo: dict[int, bool] = {}

        def hit(body: cst.CSTNode, depth: int) -> bool:
            for c in calls_in(body):
                if is_backward(c) or is_optimizer_step(c):
                    return True
                d = dotted(c.func)
                if d is None:
                    continue
                last = d.rsplit(".", 1)[-1]
                if d in maybe_modules or last in CONVENTIONAL_MODEL_NAMES or d == "self":
                    return True
                if d.startswith("self.") or "." not in d:
                    fn = funcs.get(last)
                    if fn is not None and depth < 6:
                        if id(fn) not in memo:
                            memo[id(fn)] = False
                            memo[id(fn)] = hit(fn.body, depth + 1)
                        if memo[id(fn)]:
                            return True
            return False

        return any(hit(loop.body, 0) for loop in loops)

    def line(self, node: cst.CSTNode) -> int:
        return self.rule.get_metadata(PositionProvider, node).start.line

    def parent(self, node: cst.CSTNode | None) -> cst.CSTNode | None:
        return self.rule.get_metadata(ParentProvider, node, None)

    def _collect(self, module: cst.Module) -> None:
        rule = self.rule
        nodes = [n for n in walk(module, True) if type(n) in _COLLECTED_TYPES]
        classes = [n for n in nodes if type(n) is cst.ClassDef]
        for c in classes:
            ms: dict[str, cst.FunctionDef] = {}
            if isinstance(c.body, cst.IndentedBlock):
                for s in c.body.body:
                    if isinstance(s, cst.FunctionDef):
                        ms[s.name.value] = s
                        self.method_class[id(s)] = c.name.value
            self.methods[c.name.value] = ms
        self.module_classes = set(nn_module_classes(rule))
        for n in nodes:
            if isinstance(n, cst.FunctionDef) and id(n) not in self.method_class:
                self.functions.setdefault(n.name.value, n)
        for n in nodes:
            if isinstance(n, cst.Assign) and len(n.targets) == 1:
                self._assignment(n, n.targets[0].target, n.value)
            elif isinstance(n, cst.AnnAssign) and n.value is not None:
                self._assignment(n, n.target, n.value)
            elif (
                isinstance(n, cst.Call)
                and isinstance(n.func, cst.Attribute)
                and n.func.attr.value in MODULE_ONLY_METHODS
            ):
                d = dotted(n.func.value)
                if d:
                    self.modules.add(d)

    def _assignment(self, stmt: cst.CSTNode, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        d = dotted(target)
        if d is None:
            return
        base = value
        while (
            isinstance(base, cst.Call)
            and isinstance(base.func, cst.Attribute)
            and isinstance(base.func.value, cst.Call)
            and base.func.attr.value in ("to", "cuda", "train", "eval", "float", "half", "double")
        ):
            base = base.func.value
        if not isinstance(base, cst.Call):
            return
        if isinstance(base.func, cst.Attribute) and not (
            base.func.attr.value[:1].isupper() or base.func.attr.value == "compile"
        ):
            return  # neither an nn class nor torch.compile: skip resolving the name (scope analysis)
        if isinstance(base.func, cst.Name) and base.func.value in self.methods:
            cls = base.func.value
            if d.startswith("self."):
                owner = self._enclosing_class(stmt)
                if owner:
                    self.attr_class[(owner, d[5:])] = cls
            else:
                self.instance_class[d] = cls
            if cls in self.module_classes:
                self.modules.add(d)
            return
        q = callee(self.rule, base)
        if not q:
            return
        cls = q.rsplit(".", 1)[1]
        if (
            q.startswith("torch.nn.")
            and not q.startswith("torch.nn.functional")
            and cls[:1].isupper()
            and cls not in ("Parameter", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict")
        ):
            self.modules.add(d)
            self.nn_class[d] = q
        elif q == "torch.compile" and base.args and dotted(base.args[0].value) in self.modules:
            self.modules.add(d)

    def _enclosing_class(self, node: cst.CSTNode) -> str | None:
        cur = self.parent(node)
        while cur is not None:
            if isinstance(cur, cst.ClassDef):
                return cur.name.value
            cur = self.parent(cur)
        return None

    def is_module_call(self, c: cst.Call) -> bool:
        d = dotted(c.func)
        if d is None:
            return False
        if d in self.modules or d in self.instance_class and self.instance_class[d] in self.module_classes:
            return True
        if isinstance(c.func, cst.Name) and c.func.value in self.functions:
            return False
        return d.rsplit(".", 1)[-1] in CONVENTIONAL_MODEL_NAMES

    def resolve(self, c: cst.Call, cls: str | None) -> list[tuple[cst.FunctionDef, str]]:
        """Function definitions of this file that the call runs, with a readable name."""
        out: list[tuple[cst.FunctionDef, str]] = []
        f = c.func
        if isinstance(f, cst.Name):
            fn = self.functions.get(f.value)
            if fn is not None:
                out.append((fn, f.value))
                return out
        d = dotted(f)
        target_cls = None
        if d is not None:
            if d in self.instance_class:
                target_cls = self.instance_class[d]
            elif d.startswith("self.") and cls and (cls, d[5:]) in self.attr_class:
                target_cls = self.attr_class[(cls, d[5:])]
        if target_cls is not None:
            for m in ("forward", "__call__"):
                fn = self.methods.get(target_cls, {}).get(m)
                if fn is not None:
                    out.append((fn, f"{target_cls}.{m}"))
                    break
            return out
        if isinstance(f, cst.Attribute):
            recv = dotted(f.value)
            meth = f.attr.value
            owner = None
            if recv == "self" and cls:
                owner = cls
            elif recv in self.instance_class:
                owner = self.instance_class[recv]
            elif recv and recv.startswith("self.") and cls and (cls, recv[5:]) in self.attr_class:
                owner = self.attr_class[(cls, recv[5:])]
            if owner is not None:
                fn = self.methods.get(owner, {}).get(meth)
                if fn is not None:
                    out.append((fn, f"{owner}.{meth}"))
        return out

    def _fn_events(self, fn: cst.FunctionDef, seen: set[int]) -> set[str]:
        if id(fn) in self._events:
            return self._events[id(fn)]
        if id(fn) in seen:
            return set()
        seen = seen | {id(fn)}
        ev = self._body_events(fn.body, self.method_class.get(id(fn)), seen)
        self._events[id(fn)] = ev
        return ev

    def _body_events(self, body: cst.CSTNode, cls: str | None, seen: set[int]) -> set[str]:
        ev: set[str] = set()
        for c in calls_in(body, into_loops=False):
            if is_backward(c):
                ev.add("backward")
            elif is_optimizer_step(c):
                ev.add("step")
            elif self.is_module_call(c):
                ev.add("forward")
            for fn, _ in self.resolve(c, cls):
                ev |= self._fn_events(fn, seen)
        return ev

    def _loop_events(self, loop: cst.For | cst.While) -> set[str]:
        cls = self._enclosing_class(loop)
        return self._body_events(loop.body, cls, set())

    def _spread(self, body: cst.CSTNode, loop: HotLoop, seen: set[int], cls: str | None = None) -> None:
        if cls is None:
            cls = self._enclosing_class(body)
        for c in calls_in(body):
            for fn, name in self.resolve(c, cls):
                offset = 1 if id(fn) in self.method_class and not isinstance(c.func, cst.Name) else 0
                calls = self.callers.setdefault(id(fn), [])
                if all(c is not k for k, _ in calls):
                    calls.append((c, offset))
                if id(fn) in self.hot_funcs or id(fn) in seen:
                    continue
                self.hot_funcs[id(fn)] = Where(loop, name)
                self._spread(fn.body, loop, seen | {id(fn)}, self.method_class.get(id(fn)))

    # ----------------------------------------------------------------- queries
    def where(self, node: cst.CSTNode) -> Where | None:
        """The step loop (and function) ``node`` runs in, or None outside every hot region."""
        cur = node
        while True:
            parent = self.parent(cur)
            if parent is None:
                return None
            if isinstance(parent, LOOPS) and cur is parent.body and id(parent) in self.step_loops:
                return Where(self.step_loops[id(parent)])
            if isinstance(parent, cst.FunctionDef):
                return self.hot_funcs.get(id(parent)) or self.step_funcs.get(id(parent))
            if isinstance(parent, cst.ClassDef):
                return None
            cur = parent

    def step_loop_of(self, node: cst.CSTNode) -> HotLoop | None:
        """The innermost step loop whose body holds ``node`` in the same scope."""
        cur = node
        while True:
            parent = self.parent(cur)
            if parent is None or isinstance(parent, SCOPES):
                return None
            if isinstance(parent, LOOPS) and cur is parent.body and id(parent) in self.step_loops:
                return self.step_loops[id(parent)]
            cur = parent


_BATCH = cst.Name("__batch__")  # marker: a value of a step loop's target


def hot_map(rule: Rule) -> HotMap:
    """The step-loop analysis of the rule's file, built once per analysis and shared by its rules."""
    hot = remembered(("hot-map",), rule.ctx.module, lambda: HotMap(rule).build())
    hot.rule = rule
    return hot


# --------------------------------------------------------------------------- tensor inference


def _counts_down(it: cst.Call) -> bool:
    """`reversed(range(n))`: the loop counts, it iterates no batch."""
    if not (isinstance(it.func, cst.Name) and it.func.value == "reversed" and len(it.args) == 1):
        return False
    inner = it.args[0].value
    return isinstance(inner, cst.Call) and isinstance(inner.func, cst.Name) and inner.func.value == "range"


class Tensors:
    """Whether an expression holds a tensor. ``strict``: proven from torch calls, torch.nn loss
    modules and functions of this file whose every return is proven (what a fix may rely on);
    otherwise also module calls and names that ``.backward()`` is called on (diagnostics only)."""

    def __init__(self, rule: Rule, hot: HotMap) -> None:
        self.rule = rule
        self.hot = hot
        self._backward_names: set[str] | None = None
        self._pending: set[tuple[int, bool]] = set()

    def backward_names(self) -> set[str]:
        if self._backward_names is None:
            out = set()
            for c in walk(self.rule.ctx.module, True):
                if isinstance(c, cst.Call) and isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward":
                    d = dotted(c.func.value)
                    if d:
                        out.add(d)
            self._backward_names = out
        return self._backward_names

    def number(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        """A Python int or float for sure (literals, len(), ``t.size(i)``/``t.shape[i]``)."""
        if isinstance(expr, (cst.Integer, cst.Float)):
            return True
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
            return self.number(expr.expression, depth)
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value == "len":
            return True
        # `t.size(i)` and `t.shape[i]` are taken to be ints (a documented assumption of TOP601).
        if (
            isinstance(expr, cst.Call)
            and isinstance(expr.func, cst.Attribute)
            and expr.func.attr.value == "size"
            and len(expr.args) == 1
            and isinstance(expr.args[0].value, cst.Integer)
        ):
            return True
        if (
            isinstance(expr, cst.Subscript)
            and isinstance(expr.value, cst.Attribute)
            and expr.value.attr.value == "shape"
            and len(expr.slice) == 1
            and isinstance(expr.slice[0].slice, cst.Index)
            and isinstance(expr.slice[0].slice.value, cst.Integer)
        ):
            return True
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Subtract, cst.Multiply)):
            return self.number(expr.left, depth) and self.number(expr.right, depth)
        if isinstance(expr, cst.Name) and depth < 3 and plainly_assigned(self.rule, expr):
            values = reaching_values(self.rule, expr) or []
            return bool(values) and all(v is not None and self.number(v, depth + 1) for v in values)
        return False

    def is_tensor(self, expr: cst.BaseExpression | None, strict: bool = False, depth: int = 0) -> bool:
        if expr is None or depth > 12:
            return False
        if isinstance(expr, cst.Name):
            key = (id(expr), strict)
            if key in self._pending:
                return True  # induction over the loop: `loss = loss.clamp(...)` keeps a tensor a tensor
            self._pending.add(key)
            try:
                return self._is_tensor(expr, strict, depth)
            finally:
                self._pending.discard(key)
        return self._is_tensor(expr, strict, depth)

    def _is_tensor(self, expr: cst.BaseExpression, strict: bool, depth: int) -> bool:
        rule = self.rule
        if isinstance(expr, cst.Call):
            f = expr.func
            q = callee(rule, expr) if isinstance(f, (cst.Name, cst.Attribute)) else None
            if q is not None:
                if any(q.startswith(ns) and "." not in q[len(ns) :] for ns in TENSOR_NAMESPACES):
                    return q.rsplit(".", 1)[1] not in NOT_TENSOR
                return False
            if isinstance(f, cst.Attribute) and f.attr.value in TENSOR_METHODS:
                if f.attr.value in TUPLE_REDUCTIONS and expr.args:
                    return False
                if dotted(f.value) in self.hot.modules:  # model.to(device) is a module
                    return False
                return self.is_tensor(f.value, strict, depth + 1)
            d = dotted(f)
            if d is not None and d in self.hot.nn_class and self.hot.nn_class[d].endswith("Loss"):
                if not strict:
                    return True
                if isinstance(f, cst.Name):
                    vals = self.values(f, True)
                    if vals and all(
                        isinstance(v, cst.Call)
                        and (callee(rule, v) or "").endswith("Loss")
                        and (callee(rule, v) or "").startswith("torch.nn.")
                        for v in vals
                    ):
                        return True
                return False
            cls = self.hot._enclosing_class(expr)
            fns = self.hot.resolve(expr, cls)
            if strict and not isinstance(f, cst.Name):
                fns = []  # instances and methods are matched by name only: not proof
            if fns:
                return all(self._returns_tensor(fn, strict, depth + 1) for fn, _ in fns)
            if not strict and self.hot.is_module_call(expr):
                return True
            return False
        if isinstance(expr, cst.BinaryOperation):
            if isinstance(expr.operator, cst.MatrixMultiply) and strict:
                return self.is_tensor(expr.left, strict, depth + 1) and self.is_tensor(expr.right, strict, depth + 1)
            # Arithmetic with a proven tensor gives a tensor (Tensor's __array_priority__ makes numpy defer),
            # unless the other operand is a literal that makes it fail.
            left = self.is_tensor(expr.left, strict, depth + 1)
            right = left or self.is_tensor(expr.right, strict, depth + 1)
            other = expr.right if left else expr.left
            if isinstance(
                other,
                (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString, cst.List, cst.Dict, cst.Set, cst.Tuple),
            ):
                return False
            return left or right
        if isinstance(expr, cst.UnaryOperation) and not isinstance(expr.operator, cst.Not):
            return self.is_tensor(expr.expression, strict, depth + 1)
        if isinstance(expr, cst.Comparison):
            operands = [expr.left] + [c.comparator for c in expr.comparisons]
            if len(operands) != 2 or any(
                isinstance(c.operator, (cst.Is, cst.IsNot, cst.In, cst.NotIn)) for c in expr.comparisons
            ):
                return False
            return any(self.is_tensor(o, strict, depth + 1) for o in operands)
        if isinstance(expr, cst.Subscript):
            return self.is_tensor(expr.value, strict, depth + 1)
        if isinstance(expr, cst.Attribute):
            if expr.attr.value in ("data", "T", "mT", "real", "imag"):
                return self.is_tensor(expr.value, strict, depth + 1)
            return False
        if isinstance(expr, cst.Name):
            if param_annotation(rule, expr) in ("torch.Tensor", "Tensor"):
                return True
            values = self.values(expr, strict)
            if values and all(v is not None and (v is _BATCH or self.is_tensor(v, strict, depth + 1)) for v in values):
                return True
            if not strict and expr.value in self.backward_names():
                return True
            return False
        return False

    def only_batch(self, name: cst.Name) -> bool:
        """``name`` holds only an element of what a step loop iterates (`vid_cap`): a tensor by assumption."""
        values = self.values(name, strict=False) or []
        return bool(values) and all(v is _BATCH for v in values)

    def values(self, name: cst.Name, strict: bool) -> list | None:
        """Like reaching_values, and also through ``a, b = x, y``; in the loose mode a step loop's
        target is a batch (``_BATCH``) and a parameter of a hot function takes its call sites' values."""
        try:
            scope = self.rule.get_metadata(ScopeProvider, name)
        except KeyError:
            return None
        if scope is None or name.value not in scope:
            return None
        out: list = []
        for a in scope[name.value]:
            node = getattr(a, "node", None)
            if not isinstance(a, Assignment) or node is None:
                out.append(None)
                continue
            if not strict and id(node) in self.hot.batch_names:
                out.append(_BATCH)
                continue
            if isinstance(node, cst.Param):
                out.append(None if strict else self._param_value(node))
                continue
            parent = self.hot.parent(node)
            if isinstance(parent, cst.AssignTarget) and parent.target is node:
                stmt = self.hot.parent(parent)
                out.append(stmt.value if isinstance(stmt, cst.Assign) else None)
                continue
            if isinstance(parent, cst.AnnAssign) and parent.target is node:
                out.append(parent.value)
                continue
            if isinstance(parent, cst.Element):
                tup = self.hot.parent(parent)
                at = self.hot.parent(tup) if tup is not None else None
                stmt = self.hot.parent(at) if at is not None else None
                if (
                    isinstance(tup, (cst.Tuple, cst.List))
                    and isinstance(at, cst.AssignTarget)
                    and isinstance(stmt, cst.Assign)
                    and isinstance(stmt.value, (cst.Tuple, cst.List))
                    and len(stmt.value.elements) == len(tup.elements)
                ):
                    i = next(k for k, e in enumerate(tup.elements) if e is parent)
                    el = stmt.value.elements[i]
                    out.append(None if isinstance(el, cst.StarredElement) else el.value)
                    continue
            out.append(None)
        return out

    def _param_value(self, param: cst.Param) -> cst.BaseExpression | None:
        fn = self.hot.parent(self.hot.parent(param))
        if not isinstance(fn, cst.FunctionDef):
            return None
        params = list(fn.params.params)
        if param not in params:
            return None
        idx = params.index(param)
        for call, offset in self.hot.callers.get(id(fn), []):
            pos = [a for a in call.args if a.keyword is None and not a.star]
            k = idx - offset
            if 0 <= k < len(pos):
                return pos[k].value
            for a in call.args:
                if a.keyword is not None and a.keyword.value == param.name.value:
                    return a.value
        return None

    def _returns_tensor(self, fn: cst.FunctionDef, strict: bool, depth: int) -> bool:
        returns = [n for n in walk(fn.body) if isinstance(n, cst.Return)]
        if not returns:
            return False
        return all(r.value is not None and self.is_tensor(r.value, strict, depth) for r in returns)
