"""Which code runs once per training or evaluation step (rules.md §7 "Detection scope").

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
from typing import Iterable

import libcst as cst
from libcst.metadata import Assignment, PositionProvider, ScopeProvider

from torchopt.analysis.names import (
    dotted, NOT_TENSOR, TENSOR_NAMESPACES, callee, param_annotation, reaching_values, torch_name
)
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule
from torchopt.analysis.conventions import CONVENTIONAL_MODEL_NAMES, MODULE_ONLY_METHODS

SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)
LOOPS = (cst.For, cst.While)
# Tensor methods whose result is again a tensor (a conservative list for the strict analysis).
TENSOR_METHODS = {
    "mean", "sum", "float", "double", "half", "bfloat16", "detach", "clone", "to", "cuda", "cpu", "view",
    "reshape", "squeeze", "unsqueeze", "abs", "pow", "sqrt", "exp", "log", "argmax", "argmin", "softmax",
    "log_softmax", "mul", "add", "sub", "div", "masked_fill", "contiguous", "flatten", "t", "transpose",
    "permute", "norm", "std", "var", "prod", "all", "any", "eq", "ne", "gt", "lt", "ge", "le", "isnan",
    "isfinite", "isinf", "long", "int", "bool", "type_as", "expand", "expand_as", "repeat", "gather",
    "index_select", "cumsum", "matmul", "mm", "bmm", "relu", "sigmoid", "tanh", "clamp", "neg", "square",
    "logsumexp", "nansum", "nanmean", "max", "min", "view_as", "reshape_as", "squeeze_", "sign", "round",
    "floor", "ceil", "amax", "amin", "count_nonzero", "logical_not", "logical_and", "logical_or",
}
_TUPLE_REDUCTIONS = {"max", "min"}  # with a dim they return (values, indices)
HOST_READS = {"item", "tolist", "numpy"}


def calls_in(node: cst.CSTNode, into_loops: bool = True) -> Iterable[cst.Call]:
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, cst.Call):
            yield cur
        for child in reversed(cur.children):
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


@dataclass(frozen=True)
class HotLoop:
    node: cst.CSTNode = field(repr=False, compare=False)
    kind: str  # "training" (it runs a backward pass) | "forward-pass" (it calls a model, no backward:
    # evaluation, inference, or a per-sample loop in a loss such as a matcher)
    line: int

    @property
    def text(self) -> str:
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
            if isinstance(n, LOOPS) and not (isinstance(n, cst.For) and n.asynchronous is not None):
                ev = self._loop_events(n)
                if ev:
                    kind = "training" if "backward" in ev else "forward-pass"
                    self.step_loops[id(n)] = HotLoop(n, kind, self.line(n))
        for loop in sorted(self.step_loops.values(), key=lambda h: h.line):
            self._spread(loop.node.body, loop, set())  # type: ignore[attr-defined]
            if isinstance(loop.node, cst.For):
                target, it = loop.node.target, loop.node.iter
                if isinstance(it, cst.Call) and isinstance(it.func, cst.Name):
                    if it.func.value in ("range", "len"):
                        continue
                    if it.func.value == "enumerate" and isinstance(target, (cst.Tuple, cst.List)) \
                            and len(target.elements) == 2:
                        target = target.elements[1].value
                self.batch_names |= {id(n) for n in walk(target) if isinstance(n, cst.Name)}
        return self

    def _may_have_step_loops(self, module: cst.Module) -> bool:
        """A cheap over-approximation without metadata: some loop calls ``.backward`` or something
        that may be a module (a name bound to ``SomeClass(...)``, a conventional model name), directly
        or through a function of the file."""
        loops, funcs = [], {}
        maybe_modules: set[str] = set()
        built: list[tuple[str, cst.Assign]] = []  # (callee's last name, assignment)
        class_aliases: set[str] = set()  # `from torch.nn import Linear as lin`: `lin` is a class too
        for n in walk(module, True):
            if isinstance(n, LOOPS):
                loops.append(n)
            elif isinstance(n, cst.FunctionDef):
                funcs.setdefault(n.name.value, n)
            elif isinstance(n, cst.ImportFrom) and not isinstance(n.names, cst.ImportStar):
                for alias in n.names:
                    if alias.asname is not None and isinstance(alias.asname.name, cst.Name) \
                            and (dotted(alias.name) or "").rsplit(".", 1)[-1][:1].isupper():
                        class_aliases.add(alias.asname.name.value)
            elif isinstance(n, cst.Assign) and isinstance(n.value, cst.Call):
                base = n.value
                while isinstance(base, cst.Call) and isinstance(base.func, cst.Attribute) \
                        and isinstance(base.func.value, cst.Call):
                    base = base.func.value
                name = dotted(base.func) if isinstance(base, cst.Call) else None
                built.append(((name or "").rsplit(".", 1)[-1], n))
            elif isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value in MODULE_ONLY_METHODS:
                d = dotted(n.func.value)
                if d:
                    maybe_modules.add(d)
        for last, n in built:
            if last[:1].isupper() or last == "compile" or last in class_aliases:
                for t in n.targets:
                    d = dotted(t.target)
                    if d:
                        maybe_modules.add(d)
        if not loops:
            return False
        memo: dict[int, bool] = {}

        def hit(body: cst.CSTNode, depth: int) -> bool:
            for c in calls_in(body):
                if is_backward(c):
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

        return any(hit(loop.body, 0) for loop in loops)  # type: ignore[attr-defined]

    def line(self, node: cst.CSTNode) -> int:
        return self.rule.get_metadata(PositionProvider, node).start.line

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.rule.get_metadata(ParentProvider, node, None)

    def _collect(self, module: cst.Module) -> None:
        rule = self.rule
        classes = [n for n in walk(module, True) if isinstance(n, cst.ClassDef)]
        for c in classes:
            ms: dict[str, cst.FunctionDef] = {}
            if isinstance(c.body, cst.IndentedBlock):
                for s in c.body.body:
                    if isinstance(s, cst.FunctionDef):
                        ms[s.name.value] = s
                        self.method_class[id(s)] = c.name.value
            self.methods[c.name.value] = ms
        changed = True
        while changed:
            changed = False
            for c in classes:
                if c.name.value in self.module_classes:
                    continue
                for b in c.bases:
                    q = torch_name(rule, b.value) if isinstance(b.value, (cst.Name, cst.Attribute)) else None
                    if (q and q.startswith("torch.nn.") and q.rsplit(".", 1)[1][:1].isupper()) or \
                            dotted(b.value) in self.module_classes:
                        self.module_classes.add(c.name.value)
                        changed = True
                        break
        for n in walk(module, True):
            if isinstance(n, cst.FunctionDef) and id(n) not in self.method_class:
                self.functions.setdefault(n.name.value, n)
        for n in walk(module, True):
            if isinstance(n, cst.Assign) and len(n.targets) == 1:
                self._assignment(n, n.targets[0].target, n.value)
            elif isinstance(n, cst.AnnAssign) and n.value is not None:
                self._assignment(n, n.target, n.value)
            elif isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) \
                    and n.func.attr.value in MODULE_ONLY_METHODS:
                d = dotted(n.func.value)
                if d:
                    self.modules.add(d)

    def _assignment(self, stmt: cst.CSTNode, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        d = dotted(target)
        if d is None:
            return
        base = value
        while isinstance(base, cst.Call) and isinstance(base.func, cst.Attribute) \
                and isinstance(base.func.value, cst.Call) and base.func.attr.value in ("to", "cuda", "train", "eval",
                                                                                      "float", "half", "double"):
            base = base.func.value
        if not isinstance(base, cst.Call):
            return
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
        if q.startswith("torch.nn.") and not q.startswith("torch.nn.functional") and cls[:1].isupper() \
                and cls not in ("Parameter", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict"):
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
                owner = self.instance_class[recv]  # type: ignore[index]
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
            elif self.is_module_call(c):
                ev.add("forward")
            for fn, _ in self.resolve(c, cls):
                ev |= self._fn_events(fn, seen)
        return ev

    def _loop_events(self, loop: cst.CSTNode) -> set[str]:
        cls = self._enclosing_class(loop)
        return self._body_events(loop.body, cls, set())  # type: ignore[attr-defined]

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
                return self.hot_funcs.get(id(parent))
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


_CACHE: dict[int, tuple[cst.Module, HotMap]] = {}
_BATCH = cst.Name("__batch__")  # marker: a value of a step loop's target


def hot_map(rule: Rule) -> HotMap:
    module = rule.ctx.module
    hit = _CACHE.get(id(module))
    if hit is not None and hit[0] is module:
        hit[1].rule = rule
        return hit[1]
    hm = HotMap(rule).build()
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[id(module)] = (module, hm)
    return hm


# --------------------------------------------------------------------------- tensor inference


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
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "size" \
                and len(expr.args) == 1 and isinstance(expr.args[0].value, cst.Integer):
            return True
        if isinstance(expr, cst.Subscript) and isinstance(expr.value, cst.Attribute) \
                and expr.value.attr.value == "shape" and len(expr.slice) == 1 \
                and isinstance(expr.slice[0].slice, cst.Index) and isinstance(expr.slice[0].slice.value, cst.Integer):
            return True
        if isinstance(expr, cst.BinaryOperation) and isinstance(
                expr.operator, (cst.Add, cst.Subtract, cst.Multiply)):
            return self.number(expr.left, depth) and self.number(expr.right, depth)
        if isinstance(expr, cst.Name) and depth < 3:
            values = reaching_values(self.rule, expr)
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
                if any(q.startswith(ns) and "." not in q[len(ns):] for ns in TENSOR_NAMESPACES):
                    return q.rsplit(".", 1)[1] not in NOT_TENSOR
                return False
            if isinstance(f, cst.Attribute) and f.attr.value in TENSOR_METHODS:
                if f.attr.value in _TUPLE_REDUCTIONS and expr.args:
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
                    if vals and all(isinstance(v, cst.Call) and (callee(rule, v) or "").endswith("Loss")
                                    and (callee(rule, v) or "").startswith("torch.nn.") for v in vals):
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
            if isinstance(other, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString, cst.List, cst.Dict,
                                  cst.Set, cst.Tuple)):
                return False
            return left or right
        if isinstance(expr, cst.UnaryOperation) and not isinstance(expr.operator, cst.Not):
            return self.is_tensor(expr.expression, strict, depth + 1)
        if isinstance(expr, cst.Comparison):
            operands = [expr.left] + [c.comparator for c in expr.comparisons]
            if len(operands) != 2 or any(isinstance(c.operator, (cst.Is, cst.IsNot, cst.In, cst.NotIn))
                                         for c in expr.comparisons):
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
            if values and all(v is not None and (v is _BATCH or self.is_tensor(v, strict, depth + 1))
                              for v in values):
                return True
            if not strict and expr.value in self.backward_names():
                return True
            return False
        return False

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
                if isinstance(tup, (cst.Tuple, cst.List)) and isinstance(at, cst.AssignTarget) \
                        and isinstance(stmt, cst.Assign) and isinstance(stmt.value, (cst.Tuple, cst.List)) \
                        and len(stmt.value.elements) == len(tup.elements):
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


# --------------------------------------------------------------------------- cheap pre-check on CPython's ast
# ``could_match`` of the SYNC and MEM rules: a superset of the hot region that HotMap computes,
# on CPython's ``ast`` (shared parse, no LibCST, no metadata), so that a rule's prefilter can ask
# "is one of my trigger nodes in a step?" instead of "does the file have a loop?". Every test here
# over-approximates HotMap (names are matched file-wide, every def of a name counts, classes are
# unioned by name), so a False answer is a proof that the rule cannot report.

import ast as _ast  # noqa: E402
from bisect import bisect_right  # noqa: E402

_AFUNCS = (_ast.FunctionDef, _ast.AsyncFunctionDef)
AST_SCOPES = (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef, _ast.Lambda)
_ALOOPS = (_ast.For, _ast.AsyncFor, _ast.While)


def _adotted(expr: _ast.AST | None) -> str | None:
    parts = []
    while isinstance(expr, _ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, _ast.Name):
        return None
    parts.append(expr.id)
    return ".".join(reversed(parts))


def _acalls(stmts: list, into_loops: bool) -> list[_ast.Call]:
    """calls_in on the ast: calls under ``stmts``, not in nested scopes (nor nested loops)."""
    out: list[_ast.Call] = []
    stack = list(stmts)
    while stack:
        cur = stack.pop()
        if isinstance(cur, AST_SCOPES) or (not into_loops and isinstance(cur, _ALOOPS)):
            continue
        if isinstance(cur, _ast.Call):
            out.append(cur)
        stack.extend(_ast.iter_child_nodes(cur))
    return out


class _Region:
    """A def, a class or a loop's body, as a span of source positions (CPython's (line, column)
    pairs), with the region around it."""

    __slots__ = ("kind", "node", "start", "end", "parent", "calls")

    def __init__(self, kind: str, node: _ast.AST, start: tuple, end: tuple, parent: "_Region | None") -> None:
        self.kind = kind  # "def" | "class" | "loop"
        self.node = node
        self.start = start
        self.end = end
        self.parent = parent
        self.calls: list = []  # the interesting calls whose innermost region this is


def _span(node: _ast.AST) -> tuple[tuple, tuple]:
    start = (node.lineno, node.col_offset)
    for d in getattr(node, "decorator_list", ()):
        start = min(start, (d.lineno, d.col_offset - 1))
    return start, (node.end_lineno, node.end_col_offset)


def _pos(node: _ast.AST) -> tuple:
    return (node.lineno, node.col_offset)


_STMT_LISTS = ("body", "orelse", "finalbody")


class AstHot:
    """The over-approximated hot region of one module (see the section comment). Built from the
    statements (defs, classes, loops, assignments) and the shared node index (``ast_index``); a node
    is placed by its source position in the innermost def, class or loop body around it."""

    def __init__(self, tree: _ast.Module, index: dict, imports: dict | None) -> None:
        self.tree = tree
        self.index = index
        self.imports = imports  # torch_import_map (None: a star import from torch)
        self.functions: dict[str, list] = {}  # non-method defs by name
        self.methods: dict[str, dict[str, list]] = {}  # class name -> method name -> defs
        self.method_names: set[str] = set()
        self.method_ids: set[int] = set()
        self.class_names: set[str] = set()
        self.region_of: dict[int, _Region] = {}  # id(def/class/loop node) -> its region
        self.regions: list[_Region] = []
        self.loops: list = []
        self.modules: set[str] = set()
        self.inst: dict[str, set[str]] = {}  # dotted name -> local classes it was built from
        self.backward_names: set[str] = set()
        self.step_loops: dict[int, _ast.AST] = {}
        self.training_loops: set[int] = set()
        self.hot_funcs: dict[int, _ast.AST] = {}
        self.callers: dict[int, list] = {}
        self.batch: set[tuple[int, str]] = set()  # (id(owner def) or 0, name) bound by a step loop target
        self._bindings: dict[int, dict[str, list]] = {}
        self._starts: list = []
        self._collect()
        if self.loops:
            self._find_step_loops()

    # ----------------------------------------------------------------- collection
    def _collect(self) -> None:
        assigns: list = []
        classdefs: list = []
        # Statements only (expressions are reached through the shared index).
        stack: list = [(self.tree.body, None, False)]
        while stack:
            stmts, region, in_class = stack.pop()
            for s in stmts:
                if isinstance(s, _ast.ClassDef):
                    self.class_names.add(s.name)
                    classdefs.append(s)
                    ms = self.methods.setdefault(s.name, {})
                    for m in s.body:
                        if isinstance(m, _AFUNCS):
                            ms.setdefault(m.name, []).append(m)
                            self.method_ids.add(id(m))
                            self.method_names.add(m.name)
                    r = self._region("class", s, *_span(s), region)
                    stack.append((s.body, r, True))
                    continue
                if isinstance(s, _AFUNCS):
                    if not in_class:
                        self.functions.setdefault(s.name, []).append(s)
                    r = self._region("def", s, *_span(s), region)
                    stack.append((s.body, r, False))
                    continue
                if isinstance(s, _ALOOPS):
                    if not isinstance(s, _ast.AsyncFor):
                        self.loops.append(s)
                    r = self._region("loop", s, _span(s.body[0])[0], (s.body[-1].end_lineno, s.body[-1].end_col_offset),
                                     region)
                    stack.append((s.body, r, False))
                    if s.orelse:
                        stack.append((s.orelse, region, False))
                    continue
                if isinstance(s, (_ast.Assign, _ast.AnnAssign)):
                    assigns.append(s)
                    continue
                for attr in _STMT_LISTS:
                    sub = getattr(s, attr, None)
                    if sub:
                        stack.append((sub, region, False))
                for h in getattr(s, "handlers", ()):
                    stack.append((h.body, region, False))
                for case in getattr(s, "cases", ()):
                    stack.append((case.body, region, False))
        self.regions.sort(key=lambda r: r.start)
        self._starts = [r.start for r in self.regions]
        for c in self.index.get(_ast.Call, ()):
            f = c.func
            if isinstance(f, _ast.Attribute):
                if f.attr in MODULE_ONLY_METHODS:
                    d = _adotted(f.value)
                    if d:
                        self.modules.add(d)
                elif f.attr == "backward":
                    d = _adotted(f.value)
                    if d:
                        self.backward_names.add(d)
        # Local nn.Module subclasses (HotMap._collect: a base resolving to torch.nn.<Class>, or a
        # local module class), matched by name.
        from torchopt.analysis.precheck.torch_imports import ast_torch_names

        module_classes: set[str] = set()
        changed = True
        while changed:
            changed = False
            for cd in classdefs:
                if cd.name in module_classes:
                    continue
                for b in cd.bases:
                    hit = self.imports is None or _adotted(b) in module_classes or any(
                        q.startswith("torch.nn.") and q.rsplit(".", 1)[1][:1].isupper()
                        for q in ast_torch_names(self.imports, b))
                    if hit:
                        module_classes.add(cd.name)
                        changed = True
                        break
        self.module_classes = module_classes
        for n in assigns:
            value = n.value
            if value is None:
                continue
            base = value
            while isinstance(base, _ast.Call) and isinstance(base.func, _ast.Attribute) \
                    and isinstance(base.func.value, _ast.Call):
                base = base.func.value
            if not isinstance(base, _ast.Call):
                continue
            targets = n.targets if isinstance(n, _ast.Assign) else [n.target]
            names = [d for d in (_adotted(t) for t in targets) if d]
            if not names:
                continue
            func = base.func
            if isinstance(func, _ast.Name) and func.id in self.class_names:
                for d in names:
                    self.inst.setdefault(d, set()).add(func.id)
                    if func.id in module_classes:
                        self.modules.add(d)
            # HotMap._assignment: a callee resolving to torch.nn.<Class> or torch.compile.
            if self.imports is None:
                self.modules.update(names)
                continue
            for q in ast_torch_names(self.imports, func):
                if q == "torch.compile" or (q.startswith("torch.nn.") and not q.startswith("torch.nn.functional")
                                            and q.rsplit(".", 1)[1][:1].isupper()):
                    self.modules.update(names)
                    break

    def _region(self, kind: str, node: _ast.AST, start: tuple, end: tuple, parent: _Region | None) -> _Region:
        r = _Region(kind, node, start, end, parent)
        self.regions.append(r)
        self.region_of[id(node)] = r
        return r

    def region(self, node: _ast.AST) -> _Region | None:
        """The innermost def, class or loop body holding ``node`` (None: the module level)."""
        p = (node.lineno, node.col_offset)
        i = bisect_right(self._starts, p) - 1
        if i < 0:
            return None
        r: _Region | None = self.regions[i]
        end = (getattr(node, "end_lineno", None) or node.lineno, getattr(node, "end_col_offset", None) or 0)
        while r is not None and not (r.start <= p and end <= r.end):
            r = r.parent
        if r is not None and r.node is node:
            r = r.parent  # a def/class/loop node itself is not inside its own region
        return r

    # ----------------------------------------------------------------- resolution (supersets of HotMap's)
    def is_module_call(self, c: _ast.Call) -> bool:
        d = _adotted(c.func)
        if d is None:
            return False
        if d in self.modules:
            return True
        if isinstance(c.func, _ast.Name) and c.func.id in self.functions:
            return False
        return d.rsplit(".", 1)[-1] in CONVENTIONAL_MODEL_NAMES

    def resolve(self, c: _ast.Call, cls: str | None) -> list:
        f = c.func
        out: list = []
        if isinstance(f, _ast.Name):
            out += self.functions.get(f.id, ())
        d = _adotted(f)
        if d is not None:
            for k in self.inst.get(d, ()):
                ms = self.methods.get(k, {})
                out += ms.get("forward") or ms.get("__call__") or ()
        if isinstance(f, _ast.Attribute) and f.attr in self.method_names:
            recv = _adotted(f.value)
            owners: set[str] = set()
            if recv == "self" and cls:
                owners.add(cls)
            elif recv is not None:
                owners |= self.inst.get(recv, set())
            for k in owners:
                out += self.methods.get(k, {}).get(f.attr, ())
        return out

    def _may_resolve(self, c: _ast.Call) -> bool:
        f = c.func
        if isinstance(f, _ast.Name):
            return f.id in self.functions or f.id in self.inst
        return isinstance(f, _ast.Attribute) and (f.attr in self.method_names or _adotted(f) in self.inst)

    @staticmethod
    def enclosing_class(r: _Region | None) -> str | None:
        while r is not None and r.kind != "class":
            r = r.parent
        return r.node.name if r is not None else None  # type: ignore[attr-defined]

    @staticmethod
    def scope_of(r: _Region | None) -> _Region | None:
        """The innermost def or class region at or around ``r``."""
        while r is not None and r.kind == "loop":
            r = r.parent
        return r

    def _find_step_loops(self) -> None:
        # The calls that can make an event or reach a function, in their innermost regions.
        interesting = []
        for c in self.index.get(_ast.Call, ()):
            f = c.func
            if (isinstance(f, _ast.Attribute) and f.attr == "backward") or self.is_module_call(c) or self._may_resolve(c):
                r = self.region(c)
                if r is not None:
                    r.calls.append(c)
                    interesting.append((c, r))
        self._interesting = interesting
        memo: dict[int, tuple[set[str], list]] = {}

        def direct(r: _Region) -> tuple[set[str], list]:
            hit = memo.get(id(r))
            if hit is None:
                ev: set[str] = set()
                fns: list = []
                cls = self.enclosing_class(r)
                for c in r.calls:
                    if isinstance(c.func, _ast.Attribute) and c.func.attr == "backward":
                        ev.add("backward")
                    elif self.is_module_call(c):
                        ev.add("forward")
                    fns += self.resolve(c, cls)
                hit = memo[id(r)] = (ev, fns)
            return hit

        # Events of every function: the least fixed point over the call graph (a superset of
        # HotMap._fn_events, which cuts cycles).
        defs = [d for ds in self.functions.values() for d in ds] + \
            [d for ms in self.methods.values() for ds in ms.values() for d in ds]
        ev = {id(fn): set(direct(self.region_of[id(fn)])[0]) for fn in defs}
        changed = True
        while changed:
            changed = False
            for fn in defs:
                cur = ev[id(fn)]
                for g in direct(self.region_of[id(fn)])[1]:
                    extra = ev.get(id(g), set()) - cur
                    if extra:
                        cur |= extra
                        changed = True
        for loop in self.loops:
            e, fns = direct(self.region_of[id(loop)])
            e = set(e)
            for g in fns:
                e |= ev.get(id(g), set())
            if e:
                self.step_loops[id(loop)] = loop
                if "backward" in e:
                    self.training_loops.add(id(loop))
        if not self.step_loops:
            return
        # Calls by the def/class they run in and the loop bodies between (calls_in into loops).
        by_scope: dict[int, list] = {}
        by_loop: dict[int, list] = {}
        for c, r in interesting:
            cur = r
            while cur is not None and cur.kind == "loop":
                by_loop.setdefault(id(cur.node), []).append(c)
                cur = cur.parent
            by_scope.setdefault(id(cur.node) if cur is not None else 0, []).append(c)
        work: list = []
        for loop in self.step_loops.values():
            work.append((by_loop.get(id(loop), ()), self.enclosing_class(self.region_of[id(loop)])))
            if isinstance(loop, _ast.For):
                # HotMap.build's batch names: not for range()/len() loops; enumerate's second element.
                target, it = loop.target, loop.iter
                if isinstance(it, _ast.Call) and isinstance(it.func, _ast.Name):
                    if it.func.id in ("range", "len"):
                        continue
                    if it.func.id == "enumerate" and isinstance(target, (_ast.Tuple, _ast.List)) \
                            and len(target.elts) == 2:
                        target = target.elts[1]
                owner = self.scope_of(self.region_of[id(loop)].parent)
                key = id(owner.node) if owner is not None and owner.kind == "def" else 0
                for n in _ast.walk(target):
                    if isinstance(n, _ast.Name):
                        self.batch.add((key, n.id))
        while work:
            calls, cls = work.pop()
            for c in calls:
                for fn in self.resolve(c, cls):
                    self.callers.setdefault(id(fn), []).append(c)
                    if id(fn) in self.hot_funcs:
                        continue
                    self.hot_funcs[id(fn)] = fn
                    work.append((by_scope.get(id(fn), ()), self.enclosing_class(self.region_of[id(fn)])))

    # ----------------------------------------------------------------- queries
    def in_step(self, node: _ast.AST) -> bool:
        """HotMap.where may place ``node`` in a step (a superset)."""
        r = self.region(node)
        while r is not None:
            if r.kind == "loop":
                if id(r.node) in self.step_loops:
                    return True
            elif r.kind == "def":
                return id(r.node) in self.hot_funcs
            else:
                return False
            r = r.parent
        return False

    def owner(self, node: _ast.AST):
        """The def ``node`` is in (None: the module; a class body counts as the module here)."""
        r = self.scope_of(self.region(node))
        return r.node if r is not None and r.kind == "def" else None

    def hot(self, *types: type) -> list:
        """The nodes of these types that may be in a step."""
        return [n for t in types for n in self.index.get(t, ()) if self.in_step(n)]

    # ----------------------------------------------------------------- tensors (a superset of Tensors, loose)
    def torch_rooted(self, func: _ast.AST) -> bool:
        if self.imports is None:
            return True
        while isinstance(func, _ast.Attribute):
            func = func.value
        return isinstance(func, _ast.Name) and func.id in self.imports

    def maybe_tensor(self, e: _ast.AST | None, own: _ast.AST | None, depth: int = 0,
                     pending: frozenset = frozenset()) -> bool:
        if e is None:
            return False
        if depth > 14:
            return True
        if isinstance(e, _ast.Call):
            f = e.func
            d = _adotted(f)
            if d is not None and self.torch_rooted(f):
                # Tensors._is_tensor: a torch function of a tensor namespace, not in NOT_TENSOR (when
                # the name does not resolve to torch after all, the tests below apply).
                if self.imports is None:
                    return True
                from torchopt.analysis.precheck.torch_imports import ast_torch_names

                for q in ast_torch_names(self.imports, f):
                    if any(q.startswith(ns) and "." not in q[len(ns):] for ns in TENSOR_NAMESPACES) \
                            and q.rsplit(".", 1)[1] not in NOT_TENSOR:
                        return True
            if isinstance(f, _ast.Attribute) and f.attr in TENSOR_METHODS:
                if not (f.attr in _TUPLE_REDUCTIONS and e.args) and self.maybe_tensor(f.value, own, depth + 1, pending):
                    return True
            if d is not None and d in self.modules:
                return True  # nn_class losses, module calls
            fns = self.resolve(e, self.enclosing_class(self.region(e)))
            if any(self._returns_maybe_tensor(fn, depth, pending) for fn in fns):
                return True
            return self.is_module_call(e)
        if isinstance(e, _ast.BinOp):
            lits = (_ast.JoinedStr, _ast.List, _ast.Dict, _ast.Set, _ast.Tuple)
            for o in (e.left, e.right):
                if isinstance(o, lits) or (isinstance(o, _ast.Constant) and isinstance(o.value, (str, bytes))):
                    return False
            return self.maybe_tensor(e.left, own, depth + 1, pending) or \
                self.maybe_tensor(e.right, own, depth + 1, pending)
        if isinstance(e, _ast.UnaryOp):
            return not isinstance(e.op, _ast.Not) and self.maybe_tensor(e.operand, own, depth + 1, pending)
        if isinstance(e, _ast.Compare):
            if len(e.ops) != 1 or isinstance(e.ops[0], (_ast.Is, _ast.IsNot, _ast.In, _ast.NotIn)):
                return False
            return self.maybe_tensor(e.left, own, depth + 1, pending) or \
                self.maybe_tensor(e.comparators[0], own, depth + 1, pending)
        if isinstance(e, _ast.Subscript):
            return self.maybe_tensor(e.value, own, depth + 1, pending)
        if isinstance(e, _ast.Attribute):
            return e.attr in ("data", "T", "mT", "real", "imag") and self.maybe_tensor(e.value, own, depth + 1, pending)
        if isinstance(e, _ast.Name):
            return self._maybe_tensor_name(e.id, own, depth, pending)
        return False

    def _returns_maybe_tensor(self, fn, depth: int, pending: frozenset) -> bool:
        """Tensors._returns_tensor may hold: some return, and every return's value may be a tensor."""
        key = ("returns", id(fn))
        if key in pending:
            return True
        pending = pending | {key}
        returns = []
        stack = list(fn.body)
        while stack:
            st = stack.pop()
            if isinstance(st, (*_AFUNCS, _ast.ClassDef)):
                continue
            if isinstance(st, _ast.Return):
                returns.append(st)
                continue
            for attr in _STMT_LISTS:
                sub = getattr(st, attr, None)
                if isinstance(sub, list):
                    stack += sub
            for h in getattr(st, "handlers", ()):
                stack += h.body
            for case in getattr(st, "cases", ()):
                stack += case.body
        return bool(returns) and all(r.value is not None and self.maybe_tensor(r.value, fn, depth + 1, pending)
                                     for r in returns)

    def bindings(self, name: str, own) -> tuple[object, list] | None:
        """(scope, bindings) of ``name`` seen from def ``own`` (None: the module): the innermost def
        around that binds it, else the module; None when nothing binds it."""
        scope = own
        while True:
            b = self._bindings_of(scope)
            if name in b:
                return scope, b[name]
            if scope is None:
                return None
            r = self.scope_of(self.region_of[id(scope)].parent)
            while r is not None and r.kind == "class":
                r = self.scope_of(r.parent)
            scope = r.node if r is not None else None

    def _bindings_of(self, scope) -> dict[str, list]:
        """name -> [(kind, value, extra)] for the bindings made directly in def ``scope`` (None: the
        module); kind: "value" (a plain assignment), "param", "for", "global" (a global/nonlocal
        statement: anything), "other" (a binding nobody sees through)."""
        key = id(scope) if scope is not None else 0
        hit = self._bindings.get(key)
        if hit is not None:
            return hit
        out: dict[str, list] = {}

        def add(name: str, kind: str, value=None, extra=None) -> None:
            out.setdefault(name, []).append((kind, value, extra))

        def stores(target: _ast.AST) -> None:
            for n in _ast.walk(target):
                if isinstance(n, _ast.Name):
                    add(n.id, "other")

        if scope is not None:
            a = scope.args
            for i, p in enumerate(a.args):
                add(p.arg, "param", scope, (i, p.annotation))
            for p in [*a.posonlyargs, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
                      *([a.kwarg] if a.kwarg else [])]:
                add(p.arg, "other", None, p.annotation)
        stack: list = list(scope.body if scope is not None else self.tree.body)
        while stack:
            s = stack.pop()
            if isinstance(s, (*_AFUNCS, _ast.ClassDef)):
                add(s.name, "other")
                continue
            if isinstance(s, _ast.Assign):
                for t in s.targets:
                    if isinstance(t, _ast.Name):
                        add(t.id, "value", s.value)
                    elif isinstance(t, (_ast.Tuple, _ast.List)):
                        same = isinstance(s.value, (_ast.Tuple, _ast.List)) and len(s.value.elts) == len(t.elts)
                        for i, el in enumerate(t.elts):
                            v = s.value.elts[i] if same else None
                            if isinstance(el, _ast.Name) and v is not None and not isinstance(v, _ast.Starred):
                                add(el.id, "value", v)
                            else:
                                stores(el)
            elif isinstance(s, _ast.AnnAssign):
                if isinstance(s.target, _ast.Name):
                    add(s.target.id, "value" if s.value is not None else "other", s.value)
            elif isinstance(s, _ast.AugAssign):
                stores(s.target)
            elif isinstance(s, (_ast.For, _ast.AsyncFor)):
                for n in _ast.walk(s.target):
                    if isinstance(n, _ast.Name):
                        add(n.id, "for", s)
            elif isinstance(s, (_ast.With, _ast.AsyncWith)):
                for item in s.items:
                    if item.optional_vars is not None:
                        stores(item.optional_vars)
            elif isinstance(s, (_ast.Global, _ast.Nonlocal)):
                for nm in s.names:
                    add(nm, "global")
            elif isinstance(s, (_ast.Import, _ast.ImportFrom)):
                for al in s.names:
                    add((al.asname or al.name).split(".")[0], "other")
            elif isinstance(s, _ast.Try) or type(s).__name__ == "TryStar":
                for h in s.handlers:
                    if h.name:
                        add(h.name, "other")
                    stack += h.body
            elif isinstance(s, _ast.Match):
                for case in s.cases:
                    for n in _ast.walk(case.pattern):
                        nm = getattr(n, "name", None) or getattr(n, "rest", None)
                        if isinstance(nm, str):
                            add(nm, "other")
                    stack += case.body
            for attr in _STMT_LISTS:
                sub = getattr(s, attr, None)
                if isinstance(sub, list):
                    stack += sub
        # Walrus targets bind in the def too (seen through by nobody).
        for w in self.index.get(_ast.NamedExpr, ()):
            if isinstance(w.target, _ast.Name) and self.owner(w) is scope:
                add(w.target.id, "other")
        self._bindings[key] = out
        return out

    def _maybe_tensor_name(self, name: str, own, depth: int, pending: frozenset) -> bool:
        if name in self.backward_names:
            return True
        found = self.bindings(name, own)
        if found is None:
            return False  # bound nowhere: a builtin or undefined
        scope, binds = found
        skey = id(scope) if scope is not None else 0
        if (skey, name) in pending:
            return True
        pending = pending | {(skey, name)}
        for kind, value, extra in binds:
            if kind == "global":
                return True
            if kind == "param" and extra[1] is not None and (_adotted(extra[1]) or "").rsplit(".", 1)[-1] == "Tensor":
                return True
        for kind, value, extra in binds:
            if kind == "value":
                if not self.maybe_tensor(value, scope, depth + 1, pending):
                    return False
            elif kind == "for":
                if (skey, name) not in self.batch:
                    return False
            elif kind == "param":
                if not self._param_maybe(value, extra[0], name, depth, pending):
                    return False
            else:
                return False
        return True

    def _param_maybe(self, fn, idx: int, name: str, depth: int, pending: frozenset) -> bool:
        for call in self.callers.get(id(fn), ()):
            if any(isinstance(a, _ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
                return True
            k = idx - (1 if id(fn) in self.method_ids and not isinstance(call.func, _ast.Name) else 0)
            cands = [call.args[k]] if 0 <= k < len(call.args) else []
            cands += [kw.value for kw in call.keywords if kw.arg == name]
            own = self.owner(call)
            if any(self.maybe_tensor(v, own, depth + 1, pending) for v in cands):
                return True
        return False


UNPARSED = object()  # ast_hot's answer for a text CPython cannot parse (a prefilter says True)
_AST_HOT_MEMO: list = [None, None]


def ast_hot(text: str):
    """The AstHot of ``text`` (memoised for the last text); None when HotMap cannot find a step loop
    in it; ``UNPARSED`` when CPython cannot parse it."""
    if _AST_HOT_MEMO[0] is text:
        return _AST_HOT_MEMO[1]
    from torchopt.analysis.precheck.torch_imports import torch_import_map
    from torchopt.analysis.precheck.tree import ast_index, ast_tree

    result = None
    if "for" in text or "while" in text:
        tree = ast_tree(text)
        if tree is None:
            result = UNPARSED
        else:
            hot = AstHot(tree, ast_index(text) or {}, torch_import_map(text))
            if hot.step_loops:
                result = hot
    _AST_HOT_MEMO[0], _AST_HOT_MEMO[1] = text, result
    return result


def hot_check(text: str, test) -> bool:
    """A prefilter over the hot region: False when no step loop is possible, True when the text does
    not parse, else ``test(AstHot)``."""
    hot = ast_hot(text)
    if hot is None:
        return False
    if hot is UNPARSED:
        return True
    return bool(test(hot))


# ----------------------------------------------------------------------- the rules' triggers in a step
# Each ``may_*`` says whether a rule's trigger can occur in the hot region of ``hot`` (AstHot): a
# superset of what the rule's visitor reports (see the rule for the exact test it mirrors).

def _args(c: _ast.Call) -> list:
    """The argument values cst's ``Call.args`` holds, without ``*``/``**`` ones."""
    return [a for a in c.args if not isinstance(a, _ast.Starred)] + [k.value for k in c.keywords if k.arg]


def _has_star(c: _ast.Call) -> bool:
    return any(isinstance(a, _ast.Starred) for a in c.args) or any(k.arg is None for k in c.keywords)


def _nargs(c: _ast.Call) -> int:
    return len(c.args) + len(c.keywords)


def _aliases(hot: AstHot, names: set[str]) -> set[str]:
    out = set(names)
    for n in hot.index.get(_ast.ImportFrom, ()):
        for a in n.names:
            if a.asname and a.name in names:
                out.add(a.asname)
    return out


def _last(func: _ast.AST) -> str | None:
    if isinstance(func, _ast.Attribute):
        return func.attr
    if isinstance(func, _ast.Name):
        return func.id
    return None


def _has_cpu_literal(hot: AstHot) -> bool:
    hit = hot.__dict__.get("_cpu_literal")
    if hit is None:
        hit = hot._cpu_literal = any(isinstance(n.value, str) and n.value.split(":")[0] == "cpu"
                                     for n in hot.index.get(_ast.Constant, ()))
    return hit


def may_host_read(hot: AstHot) -> bool:
    """TOP601: ``x.item()``/``.tolist()``/``.numpy()`` or ``float/int/bool(tensor)`` in a step."""
    for c in hot.index.get(_ast.Call, ()):
        f = c.func
        if isinstance(f, _ast.Attribute) and f.attr in HOST_READS and not _nargs(c):
            if hot.in_step(c):
                return True
        elif isinstance(f, _ast.Name) and f.id in ("float", "int", "bool") and len(c.args) == 1 and not c.keywords \
                and not isinstance(c.args[0], _ast.Starred) and hot.in_step(c) \
                and hot.maybe_tensor(c.args[0], hot.owner(c)):
            return True
    return False


def _text_of_tensor(hot: AstHot, a: _ast.AST, own) -> bool:
    if isinstance(a, _ast.JoinedStr):
        return any(isinstance(p, _ast.FormattedValue) and hot.maybe_tensor(p.value, own) for p in a.values)
    return hot.maybe_tensor(a, own)


def may_print_tensor(hot: AstHot) -> bool:
    """TOP602: print/str/repr/str.format/logger calls formatting a tensor in a step."""
    from torchopt.codemods.sync.reads import _LOG_METHODS, _LOGGERS

    for c in hot.index.get(_ast.Call, ()):
        f = c.func
        if not (isinstance(f, _ast.Name) and f.id in ("print", "str", "repr")) and not (
                isinstance(f, _ast.Attribute) and (f.attr == "format" or f.attr in _LOG_METHODS)):
            continue
        if not hot.in_step(c):
            continue
        own = hot.owner(c)
        if isinstance(f, _ast.Name) and f.id in ("print", "str", "repr"):
            if any(_text_of_tensor(hot, a, own) for a in _args(c)):
                return True
        elif isinstance(f, _ast.Attribute) and f.attr == "format" and isinstance(f.value, _ast.Constant) \
                and isinstance(f.value.value, (str, bytes)):
            if any(hot.maybe_tensor(a, own) for a in _args(c)):
                return True
        elif isinstance(f, _ast.Attribute) and f.attr in _LOG_METHODS and _adotted(f.value) in _LOGGERS:
            if any(_text_of_tensor(hot, a, own) for a in _args(c)):
                return True
    return False


def _maybe_cpu(hot: AstHot, e: _ast.AST | None, own=None, depth: int = 0) -> bool:
    """classify_device(e).is_cpu is possible: a "cpu" literal, ``torch.device("cpu")``, a conditional
    of those, or a name every binding of which is one."""
    if e is None or not _has_cpu_literal(hot):
        return False
    if isinstance(e, _ast.Constant):
        return isinstance(e.value, str) and e.value.split(":")[0] == "cpu"
    if isinstance(e, _ast.Call):
        first = e.args[0] if e.args else (e.keywords[0].value if e.keywords else None)
        return _last(e.func) == "device" and isinstance(first, _ast.Constant) and isinstance(first.value, str) \
            and first.value.split(":")[0] == "cpu"
    if isinstance(e, _ast.IfExp):
        return _maybe_cpu(hot, e.body, own, depth + 1) and _maybe_cpu(hot, e.orelse, own, depth + 1)
    if isinstance(e, _ast.Name):
        if depth >= 4:
            return True
        found = hot.bindings(e.id, own)
        if found is None:
            return False
        scope, binds = found
        for kind, value, _ in binds:
            if kind == "global":
                return True
            if kind != "value" or not _maybe_cpu(hot, value, scope, depth + 1):
                return False
        return True
    return False


def may_host_copy(hot: AstHot) -> bool:
    """TOP603: ``t.cpu()`` / ``t.to(<cpu>)`` in a step, not read by ``.item()/.tolist()/.numpy()``."""
    calls = hot.index.get(_ast.Call, ())
    reads = {id(c.func.value) for c in calls if isinstance(c.func, _ast.Attribute) and c.func.attr in HOST_READS}
    for c in calls:
        f = c.func
        if not isinstance(f, _ast.Attribute) or f.attr not in ("cpu", "to") or _has_star(c) or id(c) in reads \
                or not hot.in_step(c):
            continue
        if f.attr == "cpu" and not _nargs(c):
            return True
        if f.attr == "to" and _nargs(c):
            dev = [k.value for k in c.keywords if k.arg == "device"]
            own = hot.owner(c)
            if (c.args and _maybe_cpu(hot, c.args[0], own)) or (dev and _maybe_cpu(hot, dev[0], own)):
                return True
    return False


_SHAPE_CALLS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
_BOOL_FUNCS_AST = {"isnan", "isinf", "isfinite", "logical_not", "logical_and", "logical_or", "logical_xor", "eq",
                   "ne", "gt", "lt", "ge", "le", "isin", "isclose", "signbit"}


def _maybe_mask(hot: AstHot, e: _ast.AST, own, depth: int = 0) -> bool:
    if isinstance(e, _ast.Compare):
        return hot.maybe_tensor(e, own)
    if isinstance(e, _ast.UnaryOp) and isinstance(e.op, _ast.Invert):
        return _maybe_mask(hot, e.operand, own, depth)
    if isinstance(e, _ast.BinOp) and isinstance(e.op, (_ast.BitAnd, _ast.BitOr, _ast.BitXor)):
        return _maybe_mask(hot, e.left, own, depth) and _maybe_mask(hot, e.right, own, depth)
    if isinstance(e, _ast.Call):
        f = e.func
        if _last(f) in _BOOL_FUNCS_AST and (hot.torch_rooted(f) or isinstance(f, _ast.Name)):
            return True
        return isinstance(f, _ast.Attribute) and f.attr in _BOOL_FUNCS_AST | {"bool"} and hot.maybe_tensor(f.value, own)
    if isinstance(e, _ast.Name):
        if depth >= 3:
            return True
        found = hot.bindings(e.id, own)
        if found is None:
            return False
        scope, binds = found
        for kind, value, _ in binds:
            if kind == "global":
                return True
            if kind != "value" or not _maybe_mask(hot, value, scope, depth + 1):
                return False
        return True
    return False


def may_dynamic_shape(hot: AstHot) -> bool:
    """TOP604: nonzero/argwhere/masked_select/unique/one-argument where/repeat_interleave without
    ``output_size``, or indexing a tensor with a boolean mask, in a step."""
    wanted = _SHAPE_CALLS | {"where", "repeat_interleave"}
    alias = {}
    for n in hot.index.get(_ast.ImportFrom, ()):
        for a in n.names:
            if a.asname and a.name in wanted:
                alias[a.asname] = a.name
    stores = set()
    for n in hot.index.get(_ast.Assign, ()):
        stores |= {id(t) for t in n.targets}
    for n in hot.index.get(_ast.AugAssign, ()):
        stores.add(id(n.target))
    for n in [*hot.index.get(_ast.Call, ()), *hot.index.get(_ast.Subscript, ())]:
        if isinstance(n, _ast.Call):
            f = n.func
            last = _last(f)
            kinds = {k for k in (last, alias.get(last) if isinstance(f, _ast.Name) else None) if k in wanted}
            if not kinds or not hot.in_step(n):
                continue
            root = f
            while isinstance(root, _ast.Attribute):
                root = root.value
            if isinstance(f, _ast.Attribute) and isinstance(root, _ast.Name) and root.id in ("np", "numpy") \
                    and not hot.torch_rooted(f):
                continue
            if kinds & _SHAPE_CALLS:
                return True
            if "where" in kinds and _nargs(n) == 1:
                return True
            if "repeat_interleave" in kinds:
                if any(k.arg == "output_size" for k in n.keywords) or _has_star(n):
                    continue
                pos = n.args
                # torch.repeat_interleave(x, repeats) or x.repeat_interleave(repeats): an int literal
                # repeat count needs no sync (either reading may apply to an attribute call).
                forms = []
                if isinstance(f, _ast.Name) or hot.torch_rooted(f):
                    forms.append(pos[1] if len(pos) > 1 else None)
                if isinstance(f, _ast.Attribute):
                    forms.append(pos[0] if pos else None)
                if any(not (isinstance(r, _ast.Constant) and type(r.value) is int) for r in forms):
                    return True
        elif isinstance(n, _ast.Subscript) and id(n) not in stores:
            idx = n.slice
            if isinstance(idx, (_ast.Slice, _ast.Tuple, _ast.Constant)) or not hot.in_step(n):
                continue
            own = hot.owner(n)
            if _maybe_mask(hot, idx, own) and hot.maybe_tensor(n.value, own):
                return True
    return False


def _truth(hot: AstHot, e: _ast.AST, own) -> bool:
    if isinstance(e, _ast.BoolOp):
        return any(_truth(hot, v, own) for v in e.values)
    if isinstance(e, _ast.UnaryOp) and isinstance(e.op, _ast.Not):
        return _truth(hot, e.operand, own)
    return hot.maybe_tensor(e, own)


def may_tensor_branch(hot: AstHot) -> bool:
    """TOP605: ``if``/``while``/``x if c else y``/``assert`` on a tensor's truth value in a step."""
    for n in hot.hot(_ast.If, _ast.While, _ast.IfExp, _ast.Assert):
        if _truth(hot, n.test, hot.owner(n)):
            return True
    return False


def may_torch_call(hot: AstHot, qualified: set[str]) -> bool:
    """TOP606: a call in a step whose callee may resolve to one of ``qualified``."""
    from torchopt.analysis.precheck.torch_imports import ast_torch_names

    lasts = {q.rsplit(".", 1)[1] for q in qualified}
    for c in hot.index.get(_ast.Call, ()):
        if hot.imports is None:
            if _last(c.func) in lasts and hot.in_step(c):
                return True
        elif ast_torch_names(hot.imports, c.func) & qualified and hot.in_step(c):
            return True
    return False


_CLIP_AST = ("clip_grad_norm_", "clip_grad_norm", "get_total_norm")


def may_grad_norm_read(hot: AstHot) -> bool:
    """TOP607: clip_grad_norm_(..., error_if_nonfinite=...) or a host read of its result in a step."""
    norms = set()
    for n in hot.index.get(_ast.Assign, ()):
        if len(n.targets) == 1 and isinstance(n.value, _ast.Call) \
                and isinstance(n.targets[0], _ast.Name) and (_adotted(n.value.func) or "").rsplit(".", 1)[-1] in _CLIP_AST:
            norms.add(n.targets[0].id)
    for c in hot.hot(_ast.Call) if norms or "error_if_nonfinite" in {k.arg for c in hot.index.get(_ast.Call, ())
                                                                        for k in c.keywords} else ():
        f = c.func
        d = _adotted(f) or ""
        if d.rsplit(".", 1)[-1] in ("clip_grad_norm_", "clip_grad_norm"):
            if any(k.arg == "error_if_nonfinite" and not (isinstance(k.value, _ast.Constant) and k.value.value is False)
                   for k in c.keywords):
                return True
            continue
        if isinstance(f, _ast.Attribute) and _adotted(f.value) in norms and f.attr in HOST_READS and not _nargs(c):
            return True
        if isinstance(f, _ast.Name) and f.id in ("float", "print") and any(_adotted(a) in norms for a in _args(c)):
            return True
    return False


def may_scaler_sync(hot: AstHot) -> bool:
    """TOP608: ``scaler.get_scale()`` or ``scaler.step(opt)`` in a step, scaler a GradScaler."""
    names = _aliases(hot, {"GradScaler"})
    scalers = set()
    for n in hot.index.get(_ast.Assign, ()):
        if len(n.targets) == 1 and isinstance(n.value, _ast.Call) and _last(n.value.func) in names:
            d = _adotted(n.targets[0])
            if d:
                scalers.add(d)
    return any(isinstance(c.func, _ast.Attribute) and c.func.attr in ("get_scale", "step")
               and _adotted(c.func.value) in scalers and hot.in_step(c) for c in hot.index.get(_ast.Call, ()))


def _maybe_device(e: _ast.AST) -> bool:
    """classify_device(e).is_device and not cpu/meta is possible."""
    if isinstance(e, _ast.Constant):
        if type(e.value) is int:
            return True
        return isinstance(e.value, str) and bool(_DEVICE_RE.match(e.value)) and e.value.split(":")[0] not in ("cpu", "meta")
    return isinstance(e, (_ast.Call, _ast.IfExp, _ast.Name, _ast.Attribute))


def may_pageable_copy(hot: AstHot) -> bool:
    """TOP609: ``batch.cuda()`` / ``batch.to(device)`` without non_blocking on a step loop's target."""
    for loop in hot.step_loops.values():
        if not isinstance(loop, _ast.For):
            continue
        names = {n.id for n in _ast.walk(loop.target) if isinstance(n, _ast.Name)}
        for c in _acalls(loop.body, into_loops=True):
            f = c.func
            if not isinstance(f, _ast.Attribute) or _has_star(c) or not isinstance(f.value, _ast.Name) \
                    or f.value.id not in names or any(k.arg == "non_blocking" for k in c.keywords):
                continue
            if f.attr == "cuda" and not _nargs(c):
                return True
            if f.attr == "to" and c.args and _nargs(c) == 1 and _maybe_device(c.args[0]):
                return True
    return False


def may_pad_training_loop(hot: AstHot) -> bool:
    """TOP711: a training step loop ``for ... in <name>`` (through enumerate/tqdm)."""
    for loop in hot.step_loops.values():
        if id(loop) not in hot.training_loops or not isinstance(loop, _ast.For):
            continue
        it = loop.iter
        for _ in range(3):
            if isinstance(it, _ast.Call) and isinstance(it.func, _ast.Name) and it.func.id in ("enumerate", "tqdm") \
                    and (it.args or it.keywords):
                it = it.args[0] if it.args else it.keywords[0].value
        if isinstance(it, _ast.Name):
            return True
    return False


import re as _re  # noqa: E402

_DEVICE_RE = _re.compile(r"^(cuda|cpu|mps|xpu|meta|hpu|npu|xla|privateuseone)(:\d+)?$")
