"""What the DATA rules need to know about a `DataLoader(...)` call: its arguments by name, the kind of
dataset it wraps, the loops that iterate it (also through a function parameter), whether worker
processes could start safely under the `spawn`/`forkserver` start methods."""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import GlobalScope, PositionProvider, ScopeProvider

from torchopt.analysis.names import dotted, qualified_names, reaching_values
from torchopt.analysis.project import Unknown, index_of, project_files
from torchopt.analysis.arguments import has_star, keyword, positional
from torchopt.analysis.syntax import SCOPE_NODES, walk
from torchopt.analysis.transfers import DATALOADERS
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

_MAIN_GUARD = re.compile(r"^if\s+__name__\s*==\s*['\"]__main__['\"]", re.M)

# DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
#            pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator, *, ...)
POSITION = {
    "dataset": 0,
    "batch_size": 1,
    "shuffle": 2,
    "sampler": 3,
    "batch_sampler": 4,
    "num_workers": 5,
    "collate_fn": 6,
    "pin_memory": 7,
    "drop_last": 8,
    "timeout": 9,
    "worker_init_fn": 10,
    "multiprocessing_context": 11,
    "generator": 12,
}

_DATA = ("torch.utils.data.", "torch.utils.data.dataset.")
MAP_DATASETS = {p + n for p in _DATA for n in ("TensorDataset", "Subset", "ConcatDataset", "StackDataset")}
MAP_BASES = {p + "Dataset" for p in _DATA}
ITERABLE_BASES = {p + n for p in _DATA for n in ("IterableDataset", "IterDataPipe")} | {
    "torch.utils.data.datapipes.datapipe.IterDataPipe"
}
# Third-party map-style dataset namespaces (every class there implements __getitem__/__len__).
MAP_NAMESPACES = ("torchvision.datasets.",)
# Calls in a dataset's __init__ that open a handle a worker process cannot share or pickle.
HANDLE_OPENERS = {
    "open",
    "io.open",
    "h5py.File",
    "lmdb.open",
    "sqlite3.connect",
    "zipfile.ZipFile",
    "tarfile.open",
    "np.memmap",
    "numpy.memmap",
}


class DatasetKind(enum.Enum):
    MAP = "map-style"
    ITERABLE_SHARDED = "iterable, sharded with get_worker_info()"
    ITERABLE = "iterable, not sharded"
    UNKNOWN = "unknown"


def loader_arg(call: cst.Call, name: str) -> cst.Arg | None:
    """The argument bound to DataLoader parameter ``name`` (keyword or positional)."""
    kw = keyword(call, name)
    if kw is not None:
        return kw
    i = POSITION.get(name)
    pos = positional(call)
    if i is not None and i < len(pos):
        return pos[i]
    return None


def names_in(node: cst.CSTNode) -> set[str]:
    return {n.value for n in walk(node, cross_scopes=True) if isinstance(n, cst.Name)}


@dataclass
class Loop:
    """A `for` over a loader: the loop and the part of its target that receives the batches."""

    node: cst.For
    target: cst.BaseExpression
    via_parameter: bool = False  # the loader reached the loop as a function argument


@dataclass
class LoaderInfo:
    call: cst.Call
    binding: cst.Name | None  # `loader = DataLoader(...)`: the name bound
    loops: list[Loop] = field(default_factory=list)
    passed_to: list[cst.Call] = field(default_factory=list)  # calls that get the loader as an argument


def unwrap_iter(
    it: cst.BaseExpression, target: cst.BaseExpression
) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    """``loader`` and the batch target for ``for b in loader``, ``enumerate(loader)``, ``tqdm(loader)``."""
    for _ in range(4):
        if isinstance(it, cst.Name) or (isinstance(it, cst.Call) and not _wrapper_name(it)):
            return it, target
        if not isinstance(it, cst.Call) or has_star(it):
            return None
        args = positional(it)
        if not args:
            return None
        if _wrapper_name(it) == "enumerate":
            if not isinstance(target, (cst.Tuple, cst.List)) or len(target.elements) != 2:
                return None
            target = target.elements[1].value
        it = args[0].value
    return None


def _wrapper_name(call: cst.Call) -> str | None:
    if isinstance(call.func, cst.Name) and call.func.value == "enumerate":
        return "enumerate"
    name = (
        call.func.value
        if isinstance(call.func, cst.Name)
        else (call.func.attr.value if isinstance(call.func, cst.Attribute) else "")
    )
    return name if name in ("tqdm", "track", "progress_bar", "iter") else None


class LoaderRule(Rule):
    """Collects every `DataLoader(...)` call and every `for` loop; subclasses analyse them at the end
    of the module in :meth:`analyse`."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._calls: list[cst.Call] = []
        self._fors: list[cst.For] = []
        self._funcs: dict[str, cst.FunctionDef] = {}
        self._classes: dict[str, cst.ClassDef] = {}
        self._local_classes: set[str] = set()
        self._all_calls: list[cst.Call] = []

    def visit_Call(self, node: cst.Call) -> None:
        self._all_calls.append(node)
        if self._is_loader(node):
            self._calls.append(node)

    def _is_loader(self, node: cst.Call) -> bool:
        if isinstance(node.func, cst.Call):
            return False
        name = (
            node.func.value
            if isinstance(node.func, cst.Name)
            else (node.func.attr.value if isinstance(node.func, cst.Attribute) else "")
        )
        if name != "DataLoader":
            return False
        return bool(qualified_names(self, node.func) & DATALOADERS)

    def visit_For(self, node: cst.For) -> None:
        if node.asynchronous is None:
            self._fors.append(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if self._parent(node) is self.ctx.module:
            self._funcs[node.name.value] = node

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        if self._parent(node) is self.ctx.module:
            self._classes[node.name.value] = node
        elif self._enclosing_function(node) is not None:
            self._local_classes.add(node.name.value)

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self._calls:
            return
        infos = [self._info(c) for c in self._calls]
        self.analyse(infos)

    def analyse(self, infos: list[LoaderInfo]) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    # ------------------------------------------------------------------ structure

    def _parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        p = self.get_metadata(ParentProvider, node, None)
        while isinstance(p, (cst.IndentedBlock, cst.SimpleStatementSuite)):
            p = self.get_metadata(ParentProvider, p, None)
        return p

    def _enclosing_function(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        cur = self.get_metadata(ParentProvider, node, None)
        while cur is not None:
            if isinstance(cur, cst.FunctionDef):
                return cur
            cur = self.get_metadata(ParentProvider, cur, None)
        return None

    def top_level_def(self, node: cst.CSTNode) -> cst.FunctionDef | cst.ClassDef | None:
        """The module-level function or class that holds ``node`` (None at module level)."""
        cur: cst.CSTNode | None = node
        found = None
        while cur is not None:
            parent = self.get_metadata(ParentProvider, cur, None)
            if isinstance(cur, (cst.FunctionDef, cst.ClassDef)):
                found = cur
            cur = parent
        return found

    def pos(self, node: cst.CSTNode) -> tuple[int, int]:
        r = self.get_metadata(PositionProvider, node)
        return (r.start.line, r.start.column)

    def inside(self, node: cst.CSTNode, container: cst.CSTNode) -> bool:
        a = self.get_metadata(PositionProvider, node)
        b = self.get_metadata(PositionProvider, container)
        return (b.start.line, b.start.column) <= (a.start.line, a.start.column) and (a.end.line, a.end.column) <= (
            b.end.line,
            b.end.column,
        )

    def enclosing_loops(self, node: cst.CSTNode) -> list[cst.For | cst.While]:
        """Loops whose body holds ``node``, innermost first, within its function."""
        out = []
        cur: cst.CSTNode | None = node
        while cur is not None:
            parent = self.get_metadata(ParentProvider, cur, None)
            if isinstance(parent, SCOPE_NODES):
                break
            if isinstance(parent, (cst.For, cst.While)) and cur is parent.body:
                out.append(parent)
            cur = parent
        return out

    # ------------------------------------------------------------------ the loader's uses

    def _info(self, call: cst.Call) -> LoaderInfo:
        parent = self.get_metadata(ParentProvider, call, None)
        binding = None
        if (
            isinstance(parent, cst.Assign)
            and len(parent.targets) == 1
            and isinstance(parent.targets[0].target, cst.Name)
        ):
            binding = parent.targets[0].target
        elif isinstance(parent, cst.AnnAssign) and isinstance(parent.target, cst.Name):
            binding = parent.target
        info = LoaderInfo(call, binding)
        for loop in self._fors:
            un = unwrap_iter(loop.iter, loop.target)
            if un is None:
                continue
            it, target = un
            if it is call:
                info.loops.append(Loop(loop, target))
            elif binding is not None and isinstance(it, cst.Name) and self._refers_to(it, binding):
                info.loops.append(Loop(loop, target))
        if isinstance(parent, cst.Arg):  # `train(DataLoader(...))`
            outer = self.get_metadata(ParentProvider, parent, None)
            if isinstance(outer, cst.Call) and parent in outer.args:
                info.passed_to.append(outer)
                info.loops.extend(self._param_loops(outer, list(outer.args).index(parent), parent))
        if binding is not None:
            for c in self._all_calls:
                if c is call:
                    continue
                for i, a in enumerate(c.args):
                    if isinstance(a.value, cst.Name) and self._refers_to(a.value, binding):
                        info.passed_to.append(c)
                        info.loops.extend(self._param_loops(c, i, a))
        return info

    def _refers_to(self, name: cst.Name, binding: cst.Name) -> bool:
        """Whether every definition of ``name`` that reaches it is ``binding``."""
        if name.value != binding.value:
            return False
        try:
            scope = self.get_metadata(ScopeProvider, name)
        except KeyError:
            return False
        if scope is None or name.value not in scope:
            return False
        nodes = [getattr(a, "node", None) for a in scope[name.value]]
        return bool(nodes) and all(n is binding for n in nodes)

    def _param_loops(self, call: cst.Call, index: int, arg: cst.Arg) -> list[Loop]:
        """Loops over the parameter of a module-level function ``call`` passes the loader to."""
        if not isinstance(call.func, cst.Name) or has_star(call):
            return []
        fn = self._funcs.get(call.func.value)
        if fn is None:
            return []
        params = [p for p in fn.params.posonly_params] + [p for p in fn.params.params]
        pname = None
        if arg.keyword is not None:
            pname = arg.keyword.value
        else:
            npos = sum(1 for a in call.args[:index] if a.keyword is None)
            if npos < len(params):
                pname = params[npos].name.value
        if pname is None:
            return []
        out = []
        for loop in self._fors:
            if not self.inside(loop, fn):
                continue
            un = unwrap_iter(loop.iter, loop.target)
            if un is None or not isinstance(un[0], cst.Name) or un[0].value != pname:
                continue
            try:
                scope = self.get_metadata(ScopeProvider, un[0])
            except KeyError:
                continue
            if scope is None or pname not in scope:
                continue
            if all(isinstance(getattr(a, "node", None), cst.Param) for a in scope[pname]):
                out.append(Loop(loop, un[1], via_parameter=True))
        return out

    # ------------------------------------------------------------------ the dataset

    def dataset_kind(self, call: cst.Call) -> tuple[DatasetKind, cst.ClassDef | None]:
        arg = loader_arg(call, "dataset")
        return self._kind(arg.value if arg is not None else None, 0)

    def _kind(self, expr: cst.BaseExpression | None, depth: int) -> tuple[DatasetKind, cst.ClassDef | None]:
        if expr is None or depth > 3:
            return DatasetKind.UNKNOWN, None
        if isinstance(expr, cst.Name):
            values = reaching_values(self, expr)
            if not values or any(v is None for v in values):
                return DatasetKind.UNKNOWN, None
            kinds = [self._kind(v, depth + 1) for v in values]
            if len({k for k, _ in kinds}) == 1:
                return kinds[0]
            return DatasetKind.UNKNOWN, None
        if isinstance(expr, cst.Call) and isinstance(expr.func, (cst.Name, cst.Attribute)):
            q = qualified_names(self, expr.func)
            if q & MAP_DATASETS or any(n.startswith(MAP_NAMESPACES) for n in q):
                return DatasetKind.MAP, None
            if isinstance(expr.func, cst.Name) and expr.func.value in self._classes:
                cls = self._classes[expr.func.value]
                return self._class_kind(cls, 0), cls
        return DatasetKind.UNKNOWN, None

    def _class_kind(self, cls: cst.ClassDef, depth: int) -> DatasetKind:
        if depth > 4:
            return DatasetKind.UNKNOWN
        for base in cls.bases:
            q = qualified_names(self, base.value)
            if q & ITERABLE_BASES:
                return DatasetKind.ITERABLE_SHARDED if self._shards(cls) else DatasetKind.ITERABLE
            if q & MAP_BASES:
                return DatasetKind.MAP
            if isinstance(base.value, cst.Name) and base.value.value in self._classes:
                kind = self._class_kind(self._classes[base.value.value], depth + 1)
                if kind is DatasetKind.ITERABLE and self._shards(cls):
                    return DatasetKind.ITERABLE_SHARDED
                if kind is not DatasetKind.UNKNOWN:
                    return kind
        return DatasetKind.UNKNOWN

    def _shards(self, cls: cst.ClassDef) -> bool:
        return any(
            isinstance(n, cst.Name)
            and n.value == "get_worker_info"
            or isinstance(n, cst.Attribute)
            and n.attr.value == "get_worker_info"
            for n in walk(cls, cross_scopes=True)
        )

    # ------------------------------------------------------------------ can workers start?

    def worker_blockers(self, call: cst.Call, cls: cst.ClassDef | None) -> list[str]:
        """Why worker processes could fail to start or to receive the dataset (empty: none found)."""
        out = []
        for name in ("collate_fn", "worker_init_fn"):
            arg = loader_arg(call, name)
            if arg is not None and self._unpicklable(arg.value):
                out.append(
                    f"`{name}` is a lambda or a local function, which the `spawn`/`forkserver` "
                    "start methods cannot pickle"
                )
        ds = loader_arg(call, "dataset")
        ds_call = ds.value if ds is not None else None
        if isinstance(ds_call, cst.Name):
            vals = reaching_values(self, ds_call) or []
            ds_call = vals[0] if len(vals) == 1 else None
        if (
            isinstance(ds_call, cst.Call)
            and isinstance(ds_call.func, cst.Name)
            and ds_call.func.value in self._local_classes
            and ds_call.func.value not in self._classes
        ):
            out.append(
                f"the dataset class `{ds_call.func.value}` is defined inside a function and cannot be "
                "pickled for `spawn`/`forkserver` workers"
            )
        if ds is not None and self._on_device(ds.value, 0):
            out.append(
                "the dataset holds tensors on the device, which worker processes cannot use "
                "(CUDA cannot be re-initialised in a forked process)"
            )
        if cls is not None:
            opener = self._opens_handle(cls)
            if opener:
                out.append(
                    f"`{cls.name.value}.__init__` opens a handle (`{opener}(...)`) that every worker "
                    "would share; open it lazily in `__getitem__` or in a `worker_init_fn`"
                )
        if not self._main_guarded() and self._runs_at_import(call):
            out.append(
                'the script has no `if __name__ == "__main__":` guard, so a worker started with '
                "`spawn`/`forkserver` (macOS, Windows, Python 3.14 on Linux) would run it again"
            )
        elif not self._main_guarded():
            script = self._unguarded_importer(call)
            if script:
                out.append(
                    f'{script} imports this module and runs at import time, without an `if __name__ == "__main__":` '
                    "guard: a worker started with `spawn`/`forkserver` would run that script again"
                )
        return out

    def _unguarded_importer(self, call: cst.Call) -> str:
        """A file of the project that imports this module, has no main guard and names the function
        that builds the loader (`train_loader, test_loader = getData(...)` at the top of `train.py`)."""
        owner = self.top_level_def(call)
        index = index_of(self)
        if owner is None or index.path is None or index.unit is None or index.unit == index.path:
            return ""
        files = project_files(index.unit)
        if isinstance(files, Unknown):
            return ""
        stem = re.escape(os.path.splitext(os.path.basename(index.path))[0])
        imports = re.compile(rf"^\s*(from\s+[\w.]*\b{stem}\s+import|import\s+[\w.]*\b{stem}\b)", re.M)
        named = re.compile(rf"\b{re.escape(owner.name.value)}\b")
        for path in files:
            text = (index.scope.text(path) or "") if path != index.path else ""
            if imports.search(text) and named.search(text) and not _MAIN_GUARD.search(text):
                return f"`{index.shown(path)}`"
        return ""

    def _on_device(self, expr: cst.BaseExpression | None, depth: int) -> bool:
        """Whether ``expr`` (following names to their values) moves or creates tensors on a
        non-CPU device: `.cuda()`, `.to(<device>)`, `device=<device>`."""
        if expr is None or depth > 2:
            return False
        for n in walk(expr, cross_scopes=True):
            if isinstance(n, cst.Call):
                if isinstance(n.func, cst.Attribute) and n.func.attr.value == "cuda":
                    return True
                if isinstance(n.func, cst.Attribute) and n.func.attr.value == "to":
                    for a in n.args:
                        if a.keyword is None or a.keyword.value == "device":
                            if self._device_arg(a.value):
                                return True
                dev = keyword(n, "device")
                if dev is not None and self._device_arg(dev.value):
                    return True
            elif isinstance(n, cst.Name) and depth < 2:
                values = reaching_values(self, n) or []
                if any(self._on_device(v, depth + 1) for v in values if v is not None):
                    return True
        return False

    def _device_arg(self, expr: cst.BaseExpression) -> bool:
        from torchopt.analysis.values import classify_device

        dev = classify_device(self, expr)
        return dev.is_device and not dev.is_cpu and dev.text != "meta"

    def _unpicklable(self, expr: cst.BaseExpression) -> bool:
        if isinstance(expr, cst.Lambda):
            return True
        if not isinstance(expr, cst.Name):
            return False
        try:
            scope = self.get_metadata(ScopeProvider, expr)
        except KeyError:
            return False
        if scope is None or expr.value not in scope:
            return False
        for a in scope[expr.value]:
            node = getattr(a, "node", None)
            if isinstance(node, cst.FunctionDef) and not isinstance(a.scope, GlobalScope):
                return True
            if isinstance(node, cst.Name):
                parent = self.get_metadata(ParentProvider, node, None)
                stmt = self.get_metadata(ParentProvider, parent, None) if parent is not None else None
                if isinstance(stmt, cst.Assign) and isinstance(stmt.value, cst.Lambda):
                    return True
        return False

    def _opens_handle(self, cls: cst.ClassDef) -> str | None:
        for stmt in cls.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                for n in walk(stmt.body):
                    if isinstance(n, cst.Call):
                        d = dotted(n.func)
                        if d in HANDLE_OPENERS:
                            parent = self.get_metadata(ParentProvider, n, None)
                            if isinstance(parent, cst.WithItem):
                                continue  # closed again before the loader exists
                            return d
        return None

    def _main_guarded(self) -> bool:
        for stmt in self.ctx.module.body:
            if isinstance(stmt, cst.If):
                code = self.ctx.module.code_for_node(stmt.test)
                if "__name__" in code and "__main__" in code:
                    return True
        return False

    def _runs_at_import(self, call: cst.Call) -> bool:
        """Whether module-level code (outside functions and classes) reaches ``call``."""
        owner = self.top_level_def(call)
        if owner is None:
            return True
        return owner.name.value in self._reached_at_import()

    def _reached_at_import(self) -> set[str]:
        """Names module-level code calls, directly or through the file's top-level defs (once per parse)."""
        module = self.ctx.module
        hit = self.__dict__.get("_reached_memo")
        if hit is not None and hit[0] is module:
            return hit[1]
        called: dict[str, set[str]] = {}
        top: set[str] = set()
        for stmt in self.ctx.module.body:
            names = self._called_names(stmt)
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                called[stmt.name.value] = names
            else:
                top |= names
        seen: set[str] = set()
        todo = list(top)
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo.extend(called.get(n, ()))
        self._reached_memo = (module, seen)
        return seen

    def _called_names(self, node: cst.CSTNode) -> set[str]:
        out = set()
        for n in walk(node, cross_scopes=True):
            if isinstance(n, cst.Call):
                if isinstance(n.func, cst.Name):
                    out.add(n.func.value)
                elif isinstance(n.func, cst.Attribute):
                    out.add(n.func.attr.value)
        return out


# --------------------------------------------------------------------------- cheap pre-check
# ``could_match`` of the DATA rules: a ``DataLoader(...)`` call that resolves to torch's (through the
# file's imports, on CPython's ast: a superset of what QualifiedNameProvider resolves) and that the
# rule's own test on its arguments does not rule out.

_DATALOADERS = {"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"}


def loader_calls_possible(text: str, test, looped: bool = False, epoch: bool = False) -> bool:
    """Some torch DataLoader call without ``*`` arguments for which ``test(args)`` holds (the entries of
    a ``**`` dict literal included),
    ``args`` mapping each DataLoader parameter name given (by keyword or position) to its ast value.
    ``looped``: and LoaderRule._info could find a loop for it (``info.loops`` or a ``passed_to`` call
    in a loop): some loop holds the call or the name it is assigned to, or the call or that name is
    an argument of a call of a module-level function that has a ``for`` loop. True when the text
    does not parse. ``epoch``: and TransientWorkers._epoch_loop could find an epoch loop
    (_loader_epoch_looped)."""
    import ast

    from torchopt.analysis.precheck.torch_imports import ast_torch_names, torch_import_map
    from torchopt.analysis.precheck.tree import ast_index

    index = ast_index(text)
    if index is None:
        return True
    imports = torch_import_map(text)
    for c in index.get(ast.Call, ()):
        f = c.func
        last = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if last != "DataLoader":
            continue
        if imports is not None and not (ast_torch_names(imports, f) & _DATALOADERS):
            continue
        if any(isinstance(a, ast.Starred) for a in c.args):
            continue
        spread = _spread_dicts(index, c)
        if spread is None:
            continue
        args = {**spread, **{k.arg: k.value for k in c.keywords if k.arg is not None}}
        by_pos = {i: n for n, i in POSITION.items()}
        for i, a in enumerate(c.args):
            if i in by_pos:
                args.setdefault(by_pos[i], a)
        args["__positional__"] = len(c.args)
        if test(args) and (not looped or _loader_looped(index, c)) and (not epoch or _loader_epoch_looped(index, c)):
            return True
    return False


def _spread_dicts(index: dict, call) -> dict | None:
    """The entries of the ``**name`` dicts of ``call`` (loader_kwargs.loader_kwargs may follow them):
    a name assigned a ``dict(k=v)`` / ``{"k": v}`` literal gives its entries, one assigned anything
    else (a helper's result) gives none (any argument may be missing); None for a ``**`` of anything
    but a name."""
    import ast

    out: dict = {}
    for k in call.keywords:
        if k.arg is not None or isinstance(k.value, ast.Call):  # a helper's result: any entry may be missing
            continue
        if not isinstance(k.value, ast.Name):
            return None
        for n in index.get(ast.Assign, ()):
            if len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) and n.targets[0].id == k.value.id:
                v = n.value
                if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "dict":
                    out.update({kw.arg: kw.value for kw in v.keywords if kw.arg is not None})
                elif isinstance(v, ast.Dict):
                    out.update({key.value: val for key, val in zip(v.keys, v.values) if isinstance(key, ast.Constant)})
    return out


def _loader_epoch_looped(index: dict, call) -> bool:
    """TransientWorkers._epoch_loop may find a loop: the loader is assigned to a name, and some loop
    that does not hold the DataLoader call mentions that name in its body (the loop over the loader,
    or a call it is passed to, nested in an epoch loop)."""
    import ast

    name = None
    for n in [*index.get(ast.Assign, ()), *index.get(ast.AnnAssign, ())]:
        if n.value is call:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                name = targets[0].id
    if name is None:
        return False
    pos = (call.lineno, call.col_offset)
    for loop in [*index.get(ast.For, ()), *index.get(ast.AsyncFor, ()), *index.get(ast.While, ())]:
        if (loop.lineno, loop.col_offset) <= pos <= (loop.end_lineno, loop.end_col_offset):
            continue
        if any(isinstance(n, ast.Name) and n.id == name for st in loop.body for n in ast.walk(st)):
            return True
    return False


def _loader_looped(index: dict, call) -> bool:
    import ast

    name = None
    for n in [*index.get(ast.Assign, ()), *index.get(ast.AnnAssign, ())]:
        if n.value is call:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                name = targets[0].id

    def mentions(node) -> bool:
        return node is call or (name is not None and isinstance(node, ast.Name) and node.id == name)

    for loop in [*index.get(ast.For, ()), *index.get(ast.AsyncFor, ()), *index.get(ast.While, ())]:
        if any(mentions(n) for n in ast.walk(loop)):
            return True
    looping_fns = {
        f.name
        for f in [*index.get(ast.FunctionDef, ()), *index.get(ast.AsyncFunctionDef, ())]
        if any(isinstance(n, ast.For) for n in ast.walk(f))
    }
    for c in index.get(ast.Call, ()):
        if (
            isinstance(c.func, ast.Name)
            and c.func.id in looping_fns
            and any(mentions(a) for a in [*c.args, *(k.value for k in c.keywords)])
        ):
            return True
    return False
