"""Shared analysis for the DDP rules: what a file holds (DataParallel/DDP models, data loaders,
samplers, side effects). Rules in this family edit statements with ``torchopt.analysis.statement_edits``
and build one whole-module replacement per fix."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import libcst as cst
from libcst.metadata import Assignment, PositionProvider

from torchopt.analysis.control import Guard, control_of
from torchopt.analysis.names import bindings_of, dotted, callee, qualified_names, reaching_values
from torchopt.analysis.file_targets import file_target
from torchopt.analysis.values import string_value
from torchopt.analysis.arguments import keyword, positional
from torchopt.analysis.models import nn_module_classes
from torchopt.analysis.project import Definition, index_of
from torchopt.analysis.syntax import SCOPE_NODES, walk
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import ImportSpec, Rule

DP = {"torch.nn.DataParallel", "torch.nn.parallel.DataParallel", "torch.nn.parallel.data_parallel.DataParallel"}
FUNCTIONAL_DP = {"torch.nn.parallel.data_parallel", "torch.nn.parallel.data_parallel.data_parallel"}
DDP = {
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
    "torch.nn.DistributedDataParallel",
}
LOADERS = {"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"}
DSAMPLERS = {"torch.utils.data.distributed.DistributedSampler", "torch.utils.data.DistributedSampler"}
INITS = {"torch.distributed.init_process_group", "torch.distributed.distributed_c10d.init_process_group"}
WRITERS = {
    "torch.utils.tensorboard.SummaryWriter",
    "torch.utils.tensorboard.writer.SummaryWriter",
    "tensorboardX.SummaryWriter",
}
TQDM = {"tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.std.tqdm", "tqdm.rich.tqdm"}
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "log", "exception"}
RANK_WORDS = re.compile(r"rank|is_main_process|is_master|main_process|master_process|local_master")
# Methods of nn.Module that reach the wrapped module through DDP too (TOP402 attribute check).
MODULE_METHODS = {
    "train",
    "eval",
    "parameters",
    "named_parameters",
    "state_dict",
    "load_state_dict",
    "to",
    "cuda",
    "cpu",
    "zero_grad",
    "modules",
    "named_modules",
    "children",
    "named_children",
    "buffers",
    "named_buffers",
    "apply",
    "requires_grad_",
    "module",
    "no_sync",
    "training",
    "register_forward_hook",
    "register_forward_pre_hook",
    "half",
    "float",
    "double",
    "bfloat16",
    "type",
}

LAUNCH_NOTE = (
    "launch with `torchrun --standalone --nproc_per_node=N {file}` on one machine, or on M "
    "machines `torchrun --nnodes=M --nproc_per_node=N --rdzv_id=JOB --rdzv_backend=c10d "
    "--rdzv_endpoint=HOST:29400 {file}`; plain `python {file}` still runs as one process; "
    "`batch_size` is now per process (B // world_size keeps the global batch B)"
)


def calls(node: cst.CSTNode, cross: bool = False) -> Iterable[cst.Call]:
    for n in walk(node, cross):
        if isinstance(n, cst.Call):
            yield n


def is_backward(c: cst.Call) -> bool:
    return isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward"


def has_backward(node: cst.CSTNode) -> bool:
    return any(is_backward(c) for c in calls(node))


def is_docstring(s: cst.CSTNode) -> bool:
    return (
        isinstance(s, cst.SimpleStatementLine)
        and len(s.body) == 1
        and isinstance(s.body[0], cst.Expr)
        and isinstance(s.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def is_import(s: cst.CSTNode) -> bool:
    return isinstance(s, cst.SimpleStatementLine) and all(isinstance(b, (cst.Import, cst.ImportFrom)) for b in s.body)


# --------------------------------------------------------------------------- the file


@dataclass
class Loop:
    node: cst.For | cst.Call  # the loop, or the call of a project function that runs it (another module)
    loader: str
    epoch: cst.For | cst.While | None  # the loop around it that runs once per epoch
    # A module-level function that iterates a global loader, called from the epoch loop: the
    # function and its parameter that receives the epoch (``def train(epoch):``).
    within: tuple[cst.FunctionDef, str] | None = None


class Analysis:
    @classmethod
    def of(cls, rule: Rule) -> "Analysis":
        """One analysis per parse, shared by the rules of the family that run in the same pass
        (metadata comes from the pass's shared MetadataWrapper, whichever rule asks)."""
        return rule.ctx.facts.about_node(("ddp analysis",), rule.ctx.module, lambda: cls(rule))

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.module = rule.ctx.module
        self.names: set[str] = set()
        self.functions: dict[str, cst.FunctionDef] = {}
        self.dp: list[tuple[cst.SimpleStatementLine, str, cst.Call]] = []  # X = nn.DataParallel(...)
        self.dp_other: list[cst.Call] = []  # DataParallel calls in any other form
        self.ddp: dict[str, list[bool]] = {}  # name -> per binding: surely DDP (True) / maybe (False)
        self.ddp_stmts: dict[str, list[cst.SimpleStatementLine]] = {}  # name -> statements binding a DDP
        self.ddp_calls: list[cst.Call] = []
        self.loaders: dict[str, list[tuple[cst.SimpleStatementLine, cst.Call]]] = {}
        self.samplers: dict[str, cst.Call] = {}
        self.inits: list[cst.Call] = []
        self.optimizers: dict[str, cst.SimpleStatementLine] = {}
        self.writers: set[str] = set()
        self.loggers: set[str] = set()
        self._logger_targets: set[int] = set()  # the names `x = logging.getLogger(...)` binds
        self.module_classes: set[str] = set()
        self.models: dict[str, cst.SimpleStatementLine] = {}
        self.bindings: dict[str, int] = {}
        self._collect()

    # -- metadata
    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.rule.get_metadata(ParentProvider, node, None)

    def pos(self, node: cst.CSTNode) -> tuple[int, int]:
        r = self.rule.get_metadata(PositionProvider, node)
        return (r.start.line, r.start.column)

    def statement(self, node: cst.CSTNode) -> cst.BaseStatement | None:
        cur: cst.CSTNode | None = node
        while cur is not None and not isinstance(cur, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            cur = self.parent(cur)
        return cur

    def scope_owner(self, node: cst.CSTNode) -> cst.CSTNode:
        cur = self.parent(node)
        while cur is not None and not isinstance(cur, SCOPE_NODES):
            cur = self.parent(cur)
        return cur if cur is not None else self.module

    def enclosing_loop(self, node: cst.CSTNode) -> cst.For | cst.While | None:
        cur = self.parent(node)
        while cur is not None and not isinstance(cur, SCOPE_NODES):
            if isinstance(cur, (cst.For, cst.While)):
                return cur
            cur = self.parent(cur)
        return None

    def ancestors(self, node: cst.CSTNode) -> Iterable[cst.CSTNode]:
        cur = self.parent(node)
        while cur is not None:
            yield cur
            cur = self.parent(cur)

    def q(self, node: cst.CSTNode) -> str | None:
        """Qualified name (from an import) of a Name/Attribute, torch or not."""
        if not isinstance(node, (cst.Name, cst.Attribute)):
            return None
        names = qualified_names(self.rule, node)
        return sorted(names)[0] if names else None

    def call_name(self, c: cst.Call) -> str | None:
        if isinstance(c.func, cst.Call):
            return None
        return callee(self.rule, c) or self.q(c.func)

    # -- collection
    def _collect(self) -> None:
        rule = self.rule
        attrs: set[int] = set()
        for n in walk(self.module, True):
            if isinstance(n, cst.Attribute):
                attrs.add(id(n.attr))
            elif isinstance(n, cst.Name) and id(n) not in attrs:
                self.names.add(n.value)
            elif isinstance(n, cst.FunctionDef):
                self.functions.setdefault(n.name.value, n)
        self.module_classes = set(nn_module_classes(rule))
        for n in walk(self.module, True):
            if isinstance(n, cst.Call) and isinstance(n.func, (cst.Name, cst.Attribute)):
                name = callee(rule, n)
                if name in INITS:
                    self.inits.append(n)
                elif name in DDP:
                    self.ddp_calls.append(n)
                elif name in DP:
                    stmt_ = self.statement(n)
                    small = (
                        stmt_.body[0] if isinstance(stmt_, cst.SimpleStatementLine) and len(stmt_.body) == 1 else None
                    )
                    if (
                        isinstance(small, cst.Assign)
                        and self._moved(n) is small.value
                        and len(small.targets) == 1
                        and isinstance(small.targets[0].target, cst.Name)
                    ):
                        self.dp.append(
                            (cst.ensure_type(stmt_, cst.SimpleStatementLine), small.targets[0].target.value, n)
                        )
                    else:
                        self.dp_other.append(n)
            if not isinstance(n, cst.SimpleStatementLine):
                continue
            for small in n.body:
                if isinstance(small, cst.Assign):
                    for t in small.targets:
                        for d in _target_names(t.target):
                            self.bindings[d] = self.bindings.get(d, 0) + 1
                    if len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
                        self._assign(n, small.targets[0].target.value, small.value)
                elif isinstance(small, (cst.AugAssign, cst.AnnAssign)):
                    for d in _target_names(small.target):
                        self.bindings[d] = self.bindings.get(d, 0) + 1

    def _moved(self, call: cst.Call) -> cst.BaseExpression:
        """``call`` followed by any ``.cuda(...)`` / ``.to(...)`` moves: the outermost of them."""
        node: cst.BaseExpression = call
        parent = self.parent(node)
        while isinstance(parent, cst.Attribute) and parent.value is node and parent.attr.value in ("cuda", "to"):
            grand = self.parent(parent)
            if not (isinstance(grand, cst.Call) and grand.func is parent):
                break
            node, parent = grand, self.parent(grand)
        return node

    def _assign(self, s: cst.SimpleStatementLine, target: str, value: cst.BaseExpression) -> None:
        base = value
        while (
            isinstance(base, cst.Call)
            and isinstance(base.func, cst.Attribute)
            and isinstance(base.func.value, cst.Call)
            and base.func.attr.value in ("to", "cuda", "train", "float")
        ):
            base = base.func.value
        if isinstance(value, cst.IfExp):
            for branch in (value.body, value.orelse):
                if isinstance(branch, cst.Call) and self.call_name(branch) in DDP:
                    self.ddp.setdefault(target, []).append(False)
            return
        if not isinstance(base, cst.Call):
            return
        # Only torch names and the writer/logger below matter here: resolving every other callee
        # (`self.x(...)`, helpers of other packages) would cost the whole file's scope analysis.
        q = callee(self.rule, base)
        if q is None and any(word in self.rule.ctx.text for word in ("SummaryWriter", "getLogger")):
            q = self.call_name(base)
        if q in DDP:
            self.ddp.setdefault(target, []).append(base is value)
            self.ddp_stmts.setdefault(target, []).append(s)
        elif q in LOADERS:
            self.loaders.setdefault(target, []).append((s, base))
        elif q in DSAMPLERS:
            self.samplers[target] = base
        elif q in WRITERS:
            self.writers.add(target)
        elif q == "logging.getLogger":
            self.loggers.add(target)
            for small in s.body:
                if isinstance(small, cst.Assign) and small.value is value:
                    self._logger_targets.add(id(small.targets[0].target))
        elif q and q.startswith("torch.optim.") and ".lr_scheduler" not in q and q.rsplit(".", 1)[1][:1].isupper():
            self.optimizers[target] = s
        elif (
            q
            and q.startswith("torch.nn.")
            and q.rsplit(".", 1)[1][:1].isupper()
            and "functional" not in q
            and not q.endswith("Loss")
            and q not in DP
        ) or (isinstance(base.func, cst.Name) and base.func.value in self.module_classes):
            self.models.setdefault(target, s)

    # -- queries
    def is_logger(self, recv: cst.BaseExpression) -> bool:
        """``recv`` is bound, where it is read, only by ``logging.getLogger(...)``: a local of the same
        name that another factory returns (a project's per-rank logger) is not this file's logger."""
        if not isinstance(recv, cst.Name) or recv.value not in self.loggers:
            return False
        bindings = bindings_of(self.rule, recv)
        return bool(bindings) and all(
            isinstance(b, Assignment) and id(b.node) in self._logger_targets for b in bindings or ()
        )

    def ddp_sure(self, name: str) -> bool:
        b = self.ddp.get(name) or []
        return bool(b) and all(b) and self.bindings.get(name, 0) <= len(b) + 2

    def wrapped_at(self, name: str, node: cst.CSTNode, wraps: Iterable[cst.CSTNode] | None = None) -> bool:
        """Whether ``name`` surely holds the wrapper where ``node`` runs: a wrapping statement (``wraps``,
        else the DDP bindings of ``name``) comes earlier in ``node``'s own function and every path to
        ``node`` passes it (its block encloses ``node``), or it sits unconditionally at module level
        and ``node`` is in a function. A ``state_dict()`` read before the wrap is the plain model's."""
        stmts = list(wraps) if wraps is not None else self.ddp_stmts.get(name, [])
        owner = self.scope_owner(node)
        for s in stmts:
            block = self.parent(s)
            if self.scope_owner(s) is owner:
                if self.pos(s) < self.pos(node) and any(anc is block for anc in self.ancestors(node)):
                    return True
            elif isinstance(block, cst.Module) and not isinstance(owner, cst.Module):
                return True
        return False

    def distributed(self) -> bool:
        return bool(self.inits or self.ddp_calls)

    def loader_of_iter(self, it: cst.BaseExpression, names: Iterable[str]) -> str | None:
        names = set(names)
        if isinstance(it, cst.Name):
            return it.value if it.value in names else None
        if isinstance(it, cst.Call) and isinstance(it.func, (cst.Name, cst.Attribute)):
            fn = dotted(it.func) or ""
            if fn.rsplit(".", 1)[-1] in ("enumerate", "tqdm", "iter") and it.args and not it.args[0].star:
                return self.loader_of_iter(it.args[0].value, names)
        return None

    def unknown_data_loop(self) -> tuple[cst.For, str] | None:
        """The first loop over data that is no DataLoader this file builds (``for i, (x, y) in
        enumerate(pbar)`` with ``pbar = tqdm(loaders[0])`` from another module): what it iterates is
        unknown here, so a refusal must not say that no loader loop exists."""
        for n in walk(self.module, True):
            if not isinstance(n, cst.For) or not isinstance(n.target, cst.Tuple):
                continue  # batches unpack (`x, y`, `i, (x, y)`); `for k in keys` is no data loop
            it = n.iter
            while isinstance(it, cst.Call) and (dotted(it.func) or "").rsplit(".", 1)[-1] in (
                "enumerate",
                "tqdm",
                "iter",
            ):
                if not it.args or it.args[0].star:
                    break
                it = it.args[0].value
            if isinstance(it, (cst.Name, cst.Subscript, cst.Attribute)) and dotted(it) not in self.loaders:
                return n, " ".join(self.module.code_for_node(n.iter).split())
        return None

    def training_loops(self) -> list[Loop]:
        """Loops over a data loader whose body runs `backward()`, directly or in a function of the file
        that the loader is passed to."""
        out: list[Loop] = []
        loaders = set(self.loaders)
        for n in walk(self.module, True):
            if isinstance(n, cst.For):
                name = self.loader_of_iter(n.iter, loaders)
                if name and has_backward(n.body):
                    out.extend(self._epochs_of(n, name))
        for fname, fn in self.functions.items():
            params = [p.name.value for p in fn.params.params]
            inner = [f for f in walk(fn.body) if isinstance(f, cst.For) and has_backward(f.body)]
            for f in inner:
                pname = self.loader_of_iter(f.iter, params)
                if pname is None:
                    continue
                idx = params.index(pname)
                for c in calls(self.module, True):
                    if not (isinstance(c.func, cst.Name) and c.func.value == fname):
                        continue
                    for i, arg in enumerate(c.args):
                        if arg.star:
                            break
                        hit = (arg.keyword is not None and arg.keyword.value == pname) or (
                            arg.keyword is None and i == idx
                        )
                        if hit and isinstance(arg.value, cst.Name) and arg.value.value in loaders:
                            out.append(Loop(f, arg.value.value, self.enclosing_loop(c)))
        return out + self._loops_elsewhere(loaders)

    def _epochs_of(self, loop: cst.For, loader: str) -> list[Loop]:
        """``loop`` with the loop around it; when it has none and sits in a module-level function that
        reads the loader as a global (``def train(epoch): for x, y in train_loader:``, the loader set
        under ``if __name__ == "__main__":``), once for each loop of the file that calls that function:
        that loop runs the epochs."""
        epoch = self.enclosing_loop(loop)
        fn = self.scope_owner(loop)
        if epoch is not None or not isinstance(fn, cst.FunctionDef) or self.functions.get(fn.name.value) is not fn:
            return [Loop(loop, loader, epoch)]
        bound = {
            n.value
            for t in walk(fn)
            if isinstance(t, (cst.AssignTarget, cst.Param))
            for n in walk(t)
            if isinstance(n, cst.Name)
        }
        if loader in bound:
            return [Loop(loop, loader, None)]
        callers = []
        params = [p.name.value for p in fn.params.params]
        for c in calls(self.module, True):
            epoch = self.enclosing_loop(c)
            if not (isinstance(c.func, cst.Name) and c.func.value == fn.name.value and epoch is not None):
                continue
            counter = epoch.target.value if isinstance(epoch, cst.For) and isinstance(epoch.target, cst.Name) else None
            given = [
                a.keyword.value if a.keyword is not None else (params[i] if i < len(params) else None)
                for i, a in enumerate(c.args)
                if not a.star and isinstance(a.value, cst.Name) and a.value.value == counter
            ]
            callers.append(Loop(loop, loader, epoch, (fn, given[0]) if given and given[0] else None))
        return callers or [Loop(loop, loader, None)]

    def is_global(self, name: str) -> bool:
        """``name`` is bound at module level (also under ``if __name__ == "__main__":``)."""
        for stmt in self.module.body:
            for t in walk(stmt):
                if isinstance(t, (cst.FunctionDef, cst.ClassDef)):
                    break
                if isinstance(t, cst.AssignTarget) and isinstance(t.target, cst.Name) and t.target.value == name:
                    return self.scope_owner(t) is self.module
        return False

    def _loops_elsewhere(self, loaders: set[str]) -> list[Loop]:
        """Calls of the project's own functions defined in other modules (``train_one_epoch(model,
        loader, optimizer, epoch)`` from ``engine.py``) that iterate the loader they are given and run
        ``backward()``: asked of the project index."""
        out: list[Loop] = []
        index = None
        for c in calls(self.module, True):
            written = dotted(c.func)
            passed = [a for a in c.args if isinstance(a.value, cst.Name) and a.value.value in loaders]
            if written is None or not passed or written in self.functions or any(a.star for a in c.args):
                continue
            index = index or index_of(self.rule)
            d = index.resolve(written)
            if not (isinstance(d, Definition) and d.kind == "function" and d.unit is not None and d.unit.steps):
                continue
            params = d.unit.params
            for i, a in enumerate(c.args):
                pname = a.keyword.value if a.keyword is not None else (params[i] if i < len(params) else None)
                if a in passed and pname in d.unit.iterates and isinstance(a.value, cst.Name):
                    out.append(Loop(c, a.value.value, self.enclosing_loop(c)))
        return out

    def set_epoch_called(self, sampler: str | None, loader: str | None) -> bool:
        for c in calls(self.module, True):
            if isinstance(c.func, cst.Attribute) and c.func.attr.value == "set_epoch":
                d = dotted(c.func.value)
                if d is not None and (d == sampler or d == f"{loader}.sampler" or d == loader):
                    return True
        return False

    def under_rank_guard(self, node: cst.CSTNode) -> bool:
        if Guard.RANK0 in control_of(self.rule).guards(node):  # `if RANK in {-1, 0}:`, an early return
            return True
        for anc in self.ancestors(node):
            if isinstance(anc, (cst.If, cst.IfExp)) and RANK_WORDS.search(self.module.code_for_node(anc.test)):
                return True
            if isinstance(anc, cst.FunctionDef) and RANK_WORDS.search(anc.name.value):
                return True
        return False

    def only_called_on_rank(self, node: cst.CSTNode) -> bool:
        """``node`` is in a module-level function of the file that is called, and every call of it
        sits under a rank condition: the caller already chose which processes run it (perhaps local
        rank 0 of every node), so a global rank-0 guard inside would change who writes."""
        fn = next((x for x in self.ancestors(node) if isinstance(x, cst.FunctionDef)), None)
        if fn is None or not isinstance(self.parent(fn), cst.Module):
            return False
        sites = [c for c in calls(self.module, True) if isinstance(c.func, cst.Name) and c.func.value == fn.name.value]
        return bool(sites) and all(self.under_rank_guard(c) for c in sites)

    def dist_alias(self) -> tuple[str, tuple[ImportSpec, ...]] | None:
        """How to name torch.distributed: an existing `import torch.distributed as X`, else `dist`."""
        for n in walk(self.module, True):
            if isinstance(n, cst.Import):
                for al in n.names:
                    if dotted(al.name) == "torch.distributed" and (alias := al.evaluated_alias) is not None:
                        return alias, ()
        if "dist" in self.names:
            return None
        return "dist", (ImportSpec("torch.distributed", None, "dist"),)

    def import_name(self, module: str, obj: str) -> tuple[str, tuple[ImportSpec, ...]] | None:
        """``obj`` from ``module``: the name the file already imports it as, else ``obj`` if free."""
        for n in walk(self.module, True):
            if (
                isinstance(n, cst.ImportFrom)
                and not isinstance(n.names, cst.ImportStar)
                and n.module is not None
                and dotted(n.module) == module
            ):
                for al in n.names:
                    if al.name.value == obj:
                        return (al.evaluated_alias or obj), ()
        if obj in self.names:
            return None
        return obj, (ImportSpec(module, obj),)

    def plain_import(self, module: str) -> tuple[str, tuple[ImportSpec, ...]] | None:
        for n in walk(self.module, True):
            if isinstance(n, cst.Import):
                for al in n.names:
                    if dotted(al.name) == module and al.asname is None:
                        return module, ()
        if module in self.names:
            return None
        return module, (ImportSpec(module),)


def _target_names(t: cst.BaseExpression) -> list[str]:
    if isinstance(t, (cst.Tuple, cst.List)):
        return [d for el in t.elements for d in _target_names(el.value)]
    if isinstance(t, cst.StarredElement):
        return _target_names(t.value)
    d = dotted(t)
    return [d] if d else []


# --------------------------------------------------------------------------- side effects


@dataclass
class SideEffect:
    stmt: cst.BaseStatement
    what: str
    path: cst.BaseExpression | None = None  # the file written, when known
    unknown: bool = False  # a save into a value not known to be a path (not guarded: see side_effects)


def collective_free(analysis: Analysis, node: cst.CSTNode, dist_name: str | None) -> str | None:
    """Why ``node`` may take part in a collective (None when it surely does not)."""
    for c in calls(node, True):
        if is_backward(c):
            return "backward()"
        d = dotted(c.func) or ""
        head = d.split(".")[0]
        nets = set(analysis.ddp) | set(analysis.models) | {name for _, name, _ in analysis.dp}
        if d in nets or (head in nets and d.endswith(".forward")):
            return f"`{d}` (a DDP forward is a collective)"
        if dist_name and head == dist_name:
            return f"`{d}`"
        q = analysis.call_name(c) or ""
        if q.startswith("torch.distributed"):
            return f"`{d}`"
        if isinstance(c.func, cst.Name) and c.func.value in analysis.functions:
            return f"`{d}` (a function of this file, which may run collectives)"
        if d.rsplit(".", 1)[-1] in ("all_reduce", "barrier", "all_gather", "broadcast", "reduce"):
            return f"`{d}`"
    return None


def side_effects(analysis: Analysis) -> list[SideEffect]:
    """Statements whose effect is output (prints, logs, files, checkpoints, TensorBoard, wandb)."""
    out: list[SideEffect] = []
    for n in walk(analysis.module, True):
        if isinstance(n, cst.SimpleStatementLine) and len(n.body) == 1:
            small = n.body[0]
            if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
                what = _effect_call(analysis, small.value)
                path = _saved_path(small.value) if what == "torch.save" else None
                target = file_target(analysis.rule, path) if what == "torch.save" else "path"
                # a save into a buffer (`io.BytesIO()`) or into `f` of `with open(...) as f:` (that
                # block is the write) is no file of its own; one into a value not known to be a path
                # is reported unknown, never guarded on a guess
                if what and _error_report(analysis, n, what):
                    continue  # each process reports its own failure before it ends
                if what == "print" and _per_process(analysis, small.value):
                    continue  # `print(f"using device: {device}")` with the device of this rank
                if what and target in ("path", "unknown"):
                    # a file per item of a loop over data (`torch.save(sample, pth_path)` with the path
                    # made from `image_path`): whether the ranks split those items is not known
                    item = what == "torch.save" and _per_item(analysis, n, path)
                    out.append(SideEffect(n, what, path, unknown=target == "unknown" or item))
        elif isinstance(n, cst.With) and len(n.items) == 1 and isinstance(n.items[0].item, cst.Call):
            c = n.items[0].item
            if (
                isinstance(c.func, cst.Name)
                and c.func.value == "open"
                and analysis.q(c.func) in (None, "builtins.open")
            ):
                mode = keyword(c, "mode")
                pos = positional(c)
                m = string_value(mode.value if mode else (pos[1].value if len(pos) > 1 else None)) or ""
                if any(ch in m for ch in "wax"):
                    out.append(SideEffect(n, "a file write", pos[0].value if pos else None))
    return out


def _error_report(analysis: Analysis, stmt: cst.CSTNode, what: str) -> bool:
    """A print or log line on an error path (an ``except`` handler, a branch that ends the program)."""
    output = what == "print" or what.rsplit(".", 1)[-1] in LOG_METHODS
    return output and Guard.EXCEPT in control_of(analysis.rule).guards(stmt)


def _per_item(analysis: Analysis, stmt: cst.CSTNode, path: cst.BaseExpression | None) -> bool:
    """The saved path depends on the item of an enclosing loop over something other than a range
    (directly, or through a name the file assigns once from it)."""
    items: set[str] = set()
    for anc in analysis.ancestors(stmt):
        if isinstance(anc, cst.For) and not (
            isinstance(anc.iter, cst.Call) and isinstance(anc.iter.func, cst.Name) and anc.iter.func.value == "range"
        ):
            items |= {n.value for n in walk(anc.target) if isinstance(n, cst.Name)}
    if not items or path is None:
        return False
    names = [n for n in walk(path) if isinstance(n, cst.Name)]
    if any(n.value in items for n in names):
        return True
    for n in names:
        values = reaching_values(analysis.rule, n) or []
        if any(v is not None and any(isinstance(m, cst.Name) and m.value in items for m in walk(v)) for v in values):
            return True
    return False


def _per_process(analysis: Analysis, c: cst.Call) -> bool:
    """A print of what differs from process to process: the rank itself, or a value the file computes
    from it (`device = f"cuda:{local_rank}"`): each process says its own part, on purpose."""
    for n in walk(c):
        if not isinstance(n, cst.Name) or n is c.func:
            continue
        if RANK_WORDS.search(n.value):
            return True
        values = reaching_values(analysis.rule, n) or []
        if values and all(
            v is not None and any(isinstance(m, cst.Name) and RANK_WORDS.search(m.value) for m in walk(v))
            for v in values
        ):
            return True
    return False


def _saved_path(c: cst.Call) -> cst.BaseExpression | None:
    """The file argument of ``torch.save(obj, f)``."""
    f = keyword(c, "f")
    pos = positional(c)
    return f.value if f is not None else (pos[1].value if len(pos) > 1 else None)


def _effect_call(analysis: Analysis, c: cst.Call) -> str | None:
    if isinstance(c.func, cst.Name) and c.func.value == "print" and "print" not in analysis.functions:
        if control_of(analysis.rule).prints_rank_aware():
            return None  # the program replaced `builtins.print`: it decides itself which ranks print
        if analysis.q(c.func) in (None, "builtins.print"):
            return "print"
    name = analysis.call_name(c) or ""
    if name == "torch.save":
        return "torch.save"
    if name.startswith("logging.") and name.rsplit(".", 1)[1] in LOG_METHODS:
        return name
    if name.startswith(("wandb.", "mlflow.")) and name.split(".")[1] in (
        "init",
        "log",
        "finish",
        "log_metric",
        "log_metrics",
        "log_param",
        "log_params",
        "log_artifact",
        "start_run",
        "end_run",
    ):
        return name
    if name in ("matplotlib.pyplot.savefig",):
        return name
    if isinstance(c.func, cst.Attribute):
        recv = dotted(c.func.value)
        meth = c.func.attr.value
        if meth in LOG_METHODS and analysis.is_logger(c.func.value):
            return f"{recv}.{meth}"
        if recv in analysis.writers and (meth.startswith("add_") or meth in ("flush", "close")):
            return f"{recv}.{meth}"
    return None
