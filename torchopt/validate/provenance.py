"""Which module-level names of a script hold values that do not come from its data and model.

A training script keeps wall-clock readings (`t0 = time.time()`, `dt = t1 - t0`, an MFU estimate
computed from `dt`), process facts (`os.getpid()`, the host name), memory statistics and random
draws seeded from the operating system in globals. Two runs of the very same program disagree on them, so comparing them
would call any rewrite wrong. This module finds those names statically, by following assignments
from such sources through the script (a light taint analysis over `ast`): whatever is computed
from a tainted value is tainted too, including through functions that return one.

The result is conservative in the "do not compare" direction: a value computed from both a tensor
and a clock reading is not compared (the losses and parameters it came from still are).
"""

from __future__ import annotations

import ast
from typing import Iterable, Sequence

from torchopt.rewrite.pyast import dotted_name

# Dotted names whose values (called or not) say nothing about what the program computes.
_SOURCES = frozenset(
    {
        "time.time",
        "time.time_ns",
        "time.perf_counter",
        "time.perf_counter_ns",
        "time.monotonic",
        "time.monotonic_ns",
        "time.process_time",
        "time.process_time_ns",
        "time.thread_time",
        "time.thread_time_ns",
        "time.localtime",
        "time.gmtime",
        "time.ctime",
        "time.asctime",
        "time.strftime",
        "timeit.default_timer",
        "datetime.datetime.now",
        "datetime.datetime.utcnow",
        "datetime.datetime.today",
        "datetime.date.today",
        "os.getpid",
        "os.getppid",
        "os.times",
        "os.urandom",
        "os.getloadavg",
        "socket.gethostname",
        "platform.node",
        "uuid.uuid1",
        "uuid.uuid4",
        "resource.getrusage",
        "torch.cuda.max_memory_allocated",
        "torch.cuda.memory_allocated",
        "torch.cuda.memory_reserved",
        "torch.cuda.max_memory_reserved",
        "torch.cuda.memory_stats",
        "torch.cuda.mem_get_info",
        "torch.cuda.utilization",
        "torch.cuda.memory_summary",
    }
)
# Every attribute of these modules is a source (`secrets.token_hex()`, `psutil.cpu_percent()`).
_SOURCE_MODULES = ("secrets", "psutil")
# The harness seeds `random` and `numpy.random` before the program starts, so their draws are the
# same in both runs: they become sources only in a script that reseeds them from the operating
# system (`random.seed()` without a seed); these are those reseeding calls.
_OS_RESEEDS = {"random.seed": "random", "numpy.random.seed": "numpy.random"}
# Generators that seed themselves from the operating system when given no seed.
_UNSEEDED_GENERATORS = frozenset(
    {"random.Random", "numpy.random.default_rng", "numpy.random.RandomState", "numpy.random.SeedSequence"}
)
_ALWAYS_OS_RANDOM = frozenset({"random.SystemRandom"})
# Methods that read a clock whatever object they are called on (CUDA events).
_SOURCE_METHODS = frozenset({"elapsed_time"})
# Methods that put their arguments into the object they are called on.
_MUTATORS = frozenset({"append", "extend", "insert", "update", "add", "appendleft", "setdefault"})


class _Scan:
    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.aliases: dict[str, str] = {}  # local name -> the dotted name it imports
        self.tainted: set[str] = set()  # global names (and "name['key']" entries)
        self.functions: set[str] = set()  # functions whose return value is tainted
        self.source_modules: tuple[str, ...] = _SOURCE_MODULES  # plus those the script reseeds from the OS

    # -- what an expression depends on

    def _resolve(self, dotted: str) -> str:
        head, _, rest = dotted.partition(".")
        full = self.aliases.get(head, head)
        return f"{full}.{rest}" if rest else full

    def _is_source(self, dotted: str) -> bool:
        full = self._resolve(dotted)
        return (
            full in _SOURCES or full in _ALWAYS_OS_RANDOM or any(full.startswith(m + ".") for m in self.source_modules)
        )

    def _unseeded(self, call: ast.Call) -> bool:
        """A generator constructed without a seed (`np.random.default_rng()`): OS entropy."""
        dotted = dotted_name(call.func)
        return (
            dotted is not None and self._resolve(dotted) in _UNSEEDED_GENERATORS and not call.args and not call.keywords
        )

    def depends(self, node: ast.AST | None, local: set[str], shadow: frozenset[str] = frozenset()) -> bool:
        """Whether ``node`` reads a source or a tainted name; names in ``shadow`` are a function's
        own (parameters, locals) and are tainted only through ``local``."""
        if node is None:
            return False
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and self._unseeded(sub):
                return True
            if isinstance(sub, ast.Name) and (
                sub.id in local
                or (
                    sub.id not in shadow
                    and (sub.id in self.tainted or sub.id in self.functions or self._is_source(sub.id))
                )
            ):
                return True
            if isinstance(sub, ast.Attribute):
                dotted = dotted_name(sub)
                if dotted is not None and self._is_source(dotted):
                    return True
                if sub.attr in _SOURCE_METHODS:
                    return True
            if isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name):
                key = _key(sub)
                if key is not None and f"{sub.value.id}[{key}]" in self.tainted:
                    return True
        return False

    # -- what a statement taints

    def _targets(self, target: ast.AST) -> Iterable[str]:
        if isinstance(target, ast.Name):
            yield target.id
        elif isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                yield from self._targets(elt)
        elif isinstance(target, ast.Starred):
            yield from self._targets(target.value)
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and _key(target):
            yield f"{target.value.id}[{_key(target)}]"
        elif isinstance(target, (ast.Attribute, ast.Subscript)):
            base = target.value
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if isinstance(base, ast.Name):
                yield base.id

    def _assigned(self, stmt: ast.AST) -> list[tuple[Sequence[ast.AST], ast.AST | None]]:
        """(targets, value) pairs a statement binds."""
        if isinstance(stmt, ast.Assign):
            return [(stmt.targets, stmt.value)]
        if isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
            return [([stmt.target], stmt.value)]
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            return [([stmt.target], stmt.iter)]
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            return [([i.optional_vars], i.context_expr) for i in stmt.items if i.optional_vars is not None]
        if isinstance(stmt, ast.NamedExpr):
            return [([stmt.target], stmt.value)]
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            call = stmt.value
            if isinstance(call.func, ast.Attribute) and call.func.attr in _MUTATORS:
                return [([call.func.value], ast.Tuple(elts=[*call.args, *(k.value for k in call.keywords)]))]
        return []

    def _walk_body(
        self, body: list[ast.stmt], local: set[str] | None, declared: set[str], shadow: frozenset[str] = frozenset()
    ) -> bool:
        """Taint names bound in ``body`` (module level when ``local`` is None); True if anything changed."""
        changed = False
        for stmt in body:
            for node in _nodes(stmt):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    changed |= self._function(node) if local is None else False
                    continue
                for targets, value in self._assigned(node):
                    if not self.depends(value, local or set(), shadow):
                        continue
                    for t in targets:
                        for name in self._targets(t):
                            if local is not None and name.split("[")[0] not in declared:
                                if name not in local:
                                    local.add(name)
                                    changed = True
                            elif name not in self.tainted:
                                self.tainted.add(name)
                                changed = True
        return changed

    def _function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        declared = {n for node in ast.walk(fn) if isinstance(node, ast.Global) for n in node.names}
        args = fn.args
        params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}
        stored = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        shadow = frozenset((params | stored) - declared)
        local: set[str] = set()
        changed = False
        while self._walk_body(fn.body, local, declared, shadow):
            changed = True
        returns = [n.value for n in ast.walk(fn) if isinstance(n, (ast.Return, ast.Yield)) and n.value]
        if fn.name not in self.functions and any(self.depends(r, local, shadow) for r in returns):
            self.functions.add(fn.name)
            changed = True
        return changed

    def run(self) -> set[str]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        reseeded = {
            _OS_RESEEDS[self._resolve(d)]
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Call)
            and not node.args
            and not node.keywords
            and (d := dotted_name(node.func)) is not None
            and self._resolve(d) in _OS_RESEEDS
        }
        self.source_modules = _SOURCE_MODULES + tuple(sorted(reseeded))
        for _ in range(50):  # a fix-point; each round taints at least one more name
            if not self._walk_body(self.tree.body, None, set()):
                break
        return self.tainted | self.functions


def _nodes(stmt: ast.AST) -> Iterable[ast.AST]:
    """``stmt`` and what it contains, without entering function, class or lambda bodies (their
    names are not the scope being scanned); the function definitions themselves are yielded."""
    todo = [stmt]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)) and node is not stmt:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        todo.extend(reversed(list(ast.iter_child_nodes(node))))


def _key(sub: ast.Subscript) -> str | None:
    s = sub.slice
    if isinstance(s, ast.Constant) and isinstance(s.value, (str, int)):
        return repr(s.value)
    return None


def uncomputed_globals(source: str) -> set[str]:
    """Module-level names (or ``name['key']`` entries) of ``source`` that hold clock, process,
    memory-statistics values or random draws seeded from the operating system, or anything
    computed from them."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    return _Scan(tree).run()
