"""Which code runs once per step, on CPython's ast: a superset of the hot region that
``analysis.step_loops.HotMap`` computes (names are matched file-wide, every def of a name counts,
classes are unioned by name), so a rule's pre-check can ask "is one of my trigger nodes in a step?"
without LibCST; a False answer is a proof that the rule cannot report."""

from __future__ import annotations

from bisect import bisect_right
import ast as _ast

from torchopt.analysis.conventions import CONVENTIONAL_MODEL_NAMES, MODULE_ONLY_METHODS, optimizer_step
from torchopt.analysis.names import NOT_TENSOR, TENSOR_NAMESPACES
from torchopt.analysis.precheck.tree import ast_dotted
from torchopt.analysis.step_loops import TENSOR_METHODS, TUPLE_REDUCTIONS
from torchopt.rewrite.facts import facts_for


_AFUNCS = (_ast.FunctionDef, _ast.AsyncFunctionDef)


AST_SCOPES = (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef, _ast.Lambda)


_ALOOPS = (_ast.For, _ast.AsyncFor, _ast.While)


def calls_in_step(stmts: list, into_loops: bool) -> list[_ast.Call]:
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


def _ast_optimizer_step(c: _ast.Call) -> bool:
    """is_optimizer_step of analysis.step_loops, on the ast."""
    f = c.func
    if not isinstance(f, _ast.Attribute) or f.attr != "step":
        return False
    args = [ast_dotted(a) for a in c.args[:1] if not isinstance(a, _ast.Starred)]
    return optimizer_step(f.attr, ast_dotted(f.value), args)


def _span(node: _ast.stmt) -> tuple[tuple, tuple]:
    start = (node.lineno, node.col_offset)
    for d in getattr(node, "decorator_list", ()):
        start = min(start, (d.lineno, d.col_offset - 1))
    return start, (node.end_lineno, node.end_col_offset)


def _pos(node: _ast.stmt | _ast.expr) -> tuple:
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
                    r = self._region(
                        "loop", s, _span(s.body[0])[0], (s.body[-1].end_lineno, s.body[-1].end_col_offset), region
                    )
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
                    d = ast_dotted(f.value)
                    if d:
                        self.modules.add(d)
                elif f.attr == "backward":
                    d = ast_dotted(f.value)
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
                    hit = (
                        self.imports is None
                        or ast_dotted(b) in module_classes
                        or any(
                            q.startswith("torch.nn.") and q.rsplit(".", 1)[1][:1].isupper()
                            for q in ast_torch_names(self.imports, b)
                        )
                    )
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
            while (
                isinstance(base, _ast.Call)
                and isinstance(base.func, _ast.Attribute)
                and isinstance(base.func.value, _ast.Call)
            ):
                base = base.func.value
            if not isinstance(base, _ast.Call):
                continue
            targets = n.targets if isinstance(n, _ast.Assign) else [n.target]
            names = [d for d in (ast_dotted(t) for t in targets) if d]
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
                if q == "torch.compile" or (
                    q.startswith("torch.nn.")
                    and not q.startswith("torch.nn.functional")
                    and q.rsplit(".", 1)[1][:1].isupper()
                ):
                    self.modules.update(names)
                    break

    def _region(self, kind: str, node: _ast.AST, start: tuple, end: tuple, parent: _Region | None) -> _Region:
        r = _Region(kind, node, start, end, parent)
        self.regions.append(r)
        self.region_of[id(node)] = r
        return r

    def region(self, node: _ast.AST) -> _Region | None:
        """The innermost def, class or loop body holding ``node`` (None: the module level)."""
        p = (node.lineno, node.col_offset)  # type: ignore[attr-defined]  # typeshed: positions are per node kind
        i = bisect_right(self._starts, p) - 1
        if i < 0:
            return None
        r: _Region | None = self.regions[i]
        end = (getattr(node, "end_lineno", None) or node.lineno, getattr(node, "end_col_offset", None) or 0)  # type: ignore[attr-defined]  # typeshed: positions are per node kind
        while r is not None and not (r.start <= p and end <= r.end):
            r = r.parent
        if r is not None and r.node is node:
            r = r.parent  # a def/class/loop node itself is not inside its own region
        return r

    # ----------------------------------------------------------------- resolution (supersets of HotMap's)
    def is_module_call(self, c: _ast.Call) -> bool:
        d = ast_dotted(c.func)
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
        d = ast_dotted(f)
        if d is not None:
            for k in self.inst.get(d, ()):
                ms = self.methods.get(k, {})
                out += ms.get("forward") or ms.get("__call__") or ()
        if isinstance(f, _ast.Attribute) and f.attr in self.method_names:
            recv = ast_dotted(f.value)
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
        return isinstance(f, _ast.Attribute) and (f.attr in self.method_names or ast_dotted(f) in self.inst)

    @staticmethod
    def enclosing_class(r: _Region | None) -> str | None:
        while r is not None and r.kind != "class":
            r = r.parent
        return r.node.name if r is not None and isinstance(r.node, _ast.ClassDef) else None  # (a class region's node)

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
            if (
                (isinstance(f, _ast.Attribute) and f.attr == "backward")
                or _ast_optimizer_step(c)
                or self.is_module_call(c)
                or self._may_resolve(c)
            ):
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
                    elif _ast_optimizer_step(c):
                        ev.add("step")
                    elif self.is_module_call(c):
                        ev.add("forward")
                    fns += self.resolve(c, cls)
                hit = memo[id(r)] = (ev, fns)
            return hit

        # Events of every function: the least fixed point over the call graph (a superset of
        # HotMap._fn_events, which cuts cycles).
        defs = [d for ds in self.functions.values() for d in ds] + [
            d for ms in self.methods.values() for ds in ms.values() for d in ds
        ]
        ev = {id(fn): set(direct(self.region_of[id(fn)])[0]) for fn in defs}
        changed = True
        while changed:
            changed = False
            for fn in defs:
                known = ev[id(fn)]
                for g in direct(self.region_of[id(fn)])[1]:
                    extra = ev.get(id(g), set()) - known
                    if extra:
                        known |= extra
                        changed = True
        for loop in self.loops:
            e, fns = direct(self.region_of[id(loop)])
            e = set(e)
            for g in fns:
                e |= ev.get(id(g), set())
            if e:
                self.step_loops[id(loop)] = loop
                if e & {"backward", "step"}:
                    self.training_loops.add(id(loop))
        # HotMap._step_functions: a def that runs an optimizer step outside its loops.
        step_fns = [fn for fn in defs if "step" in direct(self.region_of[id(fn)])[0]]
        if not self.step_loops and not step_fns:
            return
        # Calls by the def/class they run in and the loop bodies between (calls_in into loops).
        by_scope: dict[int, list] = {}
        by_loop: dict[int, list] = {}
        for c, r in interesting:
            cur: _Region | None = r
            while cur is not None and cur.kind == "loop":
                by_loop.setdefault(id(cur.node), []).append(c)
                cur = cur.parent
            by_scope.setdefault(id(cur.node) if cur is not None else 0, []).append(c)
        work: list = []
        for loop in self.step_loops.values():
            work.append((by_loop.get(id(loop), ()), self.enclosing_class(self.region_of[id(loop)])))
            if isinstance(loop, _ast.For):
                self._batch_names(loop)
        for fn in step_fns:
            if id(fn) not in self.hot_funcs:
                self.hot_funcs[id(fn)] = fn
                work.append((by_scope.get(id(fn), ()), self.enclosing_class(self.region_of[id(fn)])))
        while work:
            calls, cls = work.pop()
            for c in calls:
                for fn in self.resolve(c, cls):
                    self.callers.setdefault(id(fn), []).append(c)
                    if id(fn) in self.hot_funcs:
                        continue
                    self.hot_funcs[id(fn)] = fn
                    work.append((by_scope.get(id(fn), ()), self.enclosing_class(self.region_of[id(fn)])))

    def _batch_names(self, loop: _ast.For) -> None:
        """HotMap.build's batch names: not for range()/len() loops; enumerate's second element."""
        target, it = loop.target, loop.iter
        if isinstance(it, _ast.Call) and isinstance(it.func, _ast.Name):
            if it.func.id in ("range", "len"):
                return
            if it.func.id == "enumerate" and isinstance(target, (_ast.Tuple, _ast.List)) and len(target.elts) == 2:
                target = target.elts[1]
        owner = self.scope_of(self.region_of[id(loop)].parent)
        key = id(owner.node) if owner is not None and owner.kind == "def" else 0
        for n in _ast.walk(target):
            if isinstance(n, _ast.Name):
                self.batch.add((key, n.id))

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

    def maybe_tensor(
        self, e: _ast.AST | None, own: _ast.AST | None, depth: int = 0, pending: frozenset = frozenset()
    ) -> bool:
        if e is None:
            return False
        if depth > 14:
            return True
        if isinstance(e, _ast.Call):
            f = e.func
            d = ast_dotted(f)
            if d is not None and self.torch_rooted(f):
                # Tensors._is_tensor: a torch function of a tensor namespace, not in NOT_TENSOR (when
                # the name does not resolve to torch after all, the tests below apply).
                if self.imports is None:
                    return True
                from torchopt.analysis.precheck.torch_imports import ast_torch_names

                for q in ast_torch_names(self.imports, f):
                    if (
                        any(q.startswith(ns) and "." not in q[len(ns) :] for ns in TENSOR_NAMESPACES)
                        and q.rsplit(".", 1)[1] not in NOT_TENSOR
                    ):
                        return True
            if isinstance(f, _ast.Attribute) and f.attr in TENSOR_METHODS:
                if not (f.attr in TUPLE_REDUCTIONS and e.args) and self.maybe_tensor(f.value, own, depth + 1, pending):
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
            return self.maybe_tensor(e.left, own, depth + 1, pending) or self.maybe_tensor(
                e.right, own, depth + 1, pending
            )
        if isinstance(e, _ast.UnaryOp):
            return not isinstance(e.op, _ast.Not) and self.maybe_tensor(e.operand, own, depth + 1, pending)
        if isinstance(e, _ast.Compare):
            if len(e.ops) != 1 or isinstance(e.ops[0], (_ast.Is, _ast.IsNot, _ast.In, _ast.NotIn)):
                return False
            return self.maybe_tensor(e.left, own, depth + 1, pending) or self.maybe_tensor(
                e.comparators[0], own, depth + 1, pending
            )
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
        return bool(returns) and all(
            r.value is not None and self.maybe_tensor(r.value, fn, depth + 1, pending) for r in returns
        )

    def bindings(self, name: str, own) -> tuple[_ast.AST | None, list] | None:
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
            for p in [
                *a.posonlyargs,
                *a.kwonlyargs,
                *([a.vararg] if a.vararg else []),
                *([a.kwarg] if a.kwarg else []),
            ]:
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
                            v = s.value.elts[i] if same and isinstance(s.value, (_ast.Tuple, _ast.List)) else None
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
                        bound = getattr(n, "name", None) or getattr(n, "rest", None)
                        if isinstance(bound, str):
                            add(bound, "other")
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
            if kind == "param" and extra[1] is not None and (ast_dotted(extra[1]) or "").rsplit(".", 1)[-1] == "Tensor":
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


def ast_hot(text: str):
    """The AstHot of ``text`` (once per text, in its SourceFacts); None when HotMap cannot find a step
    loop in it; ``UNPARSED`` when CPython cannot parse it."""
    if "for" not in text and "while" not in text and ".step(" not in text:
        return None  # no loop and no optimizer step (a step function)
    return facts_for(text).derived("ast hot", lambda: _ast_hot(text))


def _ast_hot(text: str):
    from torchopt.analysis.precheck.torch_imports import torch_import_map
    from torchopt.analysis.precheck.tree import ast_index, ast_tree

    tree = ast_tree(text)
    if tree is None:
        return UNPARSED
    hot = AstHot(tree, ast_index(text) or {}, torch_import_map(text))
    return hot if hot.step_loops or hot.hot_funcs else None


def hot_check(text: str, test) -> bool:
    """A prefilter over the hot region: False when no step loop is possible, True when the text does
    not parse, else ``test(AstHot)``."""
    hot = ast_hot(text)
    if hot is None:
        return False
    if hot is UNPARSED:
        return True
    return bool(test(hot))
