"""Automatic mixed precision inserted into training and inference loops.

TOP202 rewrites a recognised training step into the canonical device-agnostic AMP form: forward and
loss under ``torch.autocast``, and (for float16) the loss scaled by one ``torch.amp.GradScaler``
with ``unscale_``/``step``/``update`` placed where gradients are read and stepped. The scaler is part of the same
fix, never a separate one, so no selection of rules can produce a half-done float16 program.
TOP203 flags float16 autocast that already exists without a GradScaler (display-only). TOP205 wraps
the forward of inference-only scripts in autocast.

The analysis is intra-file (the file model here, the analysis of one step in ``step_analysis``):
models are names bound to ``torch.nn`` constructors or to instances of classes deriving from
``torch.nn.Module`` in the file, or whose ``.parameters()`` feed a
``torch.optim`` constructor; optimizers are names bound to ``torch.optim`` constructors; a step in a
function is resolved through the function's call sites inside loops of the same file. TOP202 resolves
each name in the scope that reads it (the function's own binding, then enclosing functions, then the
module), so every training function is analysed, and rewritten, as if it were alone in the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import builtins
from typing import Container, Iterable, Sequence

import libcst as cst
from libcst.metadata import PositionProvider, Scope, ScopeProvider

from torchopt.analysis.names import bindings_of, dotted, callee, torch_name, torch_ref
from torchopt.analysis.values import classify_device, dtype_of, string_value
from torchopt.analysis.models import nn_module_classes, project_module_class
from torchopt.analysis.program import Program, program_of
from torchopt.codemods.amp.setup_order import calls_follow
from torchopt.codemods.amp.module_kinds import parameter_free
from torchopt.codemods.amp.optimizer_wrappers import Wrapper, optimizer_wrapper
from torchopt.analysis.syntax import SCOPE_NODES, walk
from torchopt.analysis.statement_edits import Edits, Refusal, fresh_name, statement, with_statement
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Option, Rule

_AUTOCASTS = {
    "torch.autocast",
    "torch.amp.autocast",
    "torch.cuda.amp.autocast",
    "torch.cpu.amp.autocast",
    "torch.amp.autocast_mode.autocast",
}
_SCALERS = {
    "torch.amp.GradScaler",
    "torch.cuda.amp.GradScaler",
    "torch.cpu.amp.GradScaler",
    "torch.amp.grad_scaler.GradScaler",
}
_NO_GRAD = {"torch.no_grad", "torch.inference_mode"}
_GRAD_READERS = ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "get_total_norm", "clip_grads_with_norm_")
# Calls that must stay outside an autocast region (metrics, host conversions, optimizer traffic).
_EXCLUDED_METHODS = {
    "backward",
    "step",
    "zero_grad",
    "item",
    "cpu",
    "numpy",
    "tolist",
    "update",
    "unscale_",
    "append",
    "extend",
    "state_dict",
    "load_state_dict",
}
_EXCLUDED_FUNCS = {"float", "int", "bool", "print", "len", "list"}
_HALF_METHODS = {"half", "bfloat16"}
# BCE raises under CUDA autocast ("Prefer binary_cross_entropy_with_logits").
_BCE_FUNCS = {"torch.nn.functional.binary_cross_entropy", "torch.binary_cross_entropy"}
_BCE_CLASSES = {"torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss", "torch.nn.modules.BCELoss"}
# Autocast state is thread-local; DataParallel runs the replicas in other threads.
_DATA_PARALLEL = {
    "torch.nn.DataParallel",
    "torch.nn.parallel.DataParallel",
    "torch.nn.parallel.data_parallel.DataParallel",
}
# Calls that return the module they are given, ready to be called in its place.
_MODEL_WRAPPERS = {
    "torch.compile",
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
}
_MOVE_CHAIN = {"to", "cuda", "train", "eval", "float", "requires_grad_", "share_memory"}

OPTION_DTYPE = Option(
    "dtype",
    str,
    "float16",
    "autocast dtype on CUDA. float16 (default) also inserts a GradScaler; off CUDA the program picks "
    "bfloat16 at run time. bfloat16: autocast only, no scaler.",
    choices=("float16", "bfloat16"),
)

# --------------------------------------------------------------------------- small helpers


def _base_call(expr: cst.BaseExpression) -> tuple[cst.BaseExpression, list[cst.Call]]:
    """``Net(3).to(device).train()`` -> (``Net(3)``, [the .to call, the .train call]); a move of a
    name, ``model.to(device)``, -> (``model``, [the .to call]): ``model = model.to(device)`` moves the
    model bound before it (in the same cell of a notebook or in another)."""
    chain: list[cst.Call] = []
    while (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Attribute)
        and (isinstance(expr.func.value, cst.Call) or dotted(expr.func.value) is not None)
        and expr.func.attr.value in _MOVE_CHAIN | _HALF_METHODS
    ):
        chain.append(expr)
        expr = expr.func.value
    return expr, chain


def _targets(stmt: cst.CSTNode) -> list[cst.BaseExpression]:
    """Assignment targets of a simple statement line (tuples flattened)."""
    out: list[cst.BaseExpression] = []

    def add(t: cst.BaseExpression) -> None:
        if isinstance(t, (cst.Tuple, cst.List)):
            for el in t.elements:
                add(el.value)
        elif isinstance(t, cst.StarredElement):
            add(t.value)
        else:
            out.append(t)

    for n in walk(stmt):
        if isinstance(n, cst.Assign):
            for t in n.targets:
                add(t.target)
        elif isinstance(n, (cst.AugAssign, cst.AnnAssign)):
            add(n.target)
        elif isinstance(n, cst.For):
            add(n.target)
        elif isinstance(n, cst.NamedExpr):
            add(n.target)
        elif isinstance(n, cst.WithItem) and n.asname is not None:
            add(n.asname.name)
    return out


def _assigned_names(stmt: cst.CSTNode) -> set[str]:
    return {d for d in (dotted(t) for t in _targets(stmt)) if d}


def _read_names(stmt: cst.CSTNode) -> set[str]:
    """Names and dotted attribute chains read by ``stmt`` (a superset; targets of plain
    assignment are not reads, augmented-assignment targets are)."""
    out: set[str] = set()
    plain_targets = set()
    for n in walk(stmt):
        if isinstance(n, cst.Assign):
            for t in n.targets:
                if isinstance(t.target, (cst.Name, cst.Attribute)):
                    plain_targets.add(id(t.target))
                elif isinstance(t.target, (cst.Tuple, cst.List)):
                    for el in t.target.elements:
                        plain_targets.add(id(el.value))
    for n in walk(stmt):
        if id(n) in plain_targets:
            continue
        if isinstance(n, (cst.Name, cst.Attribute)):
            d = dotted(n)
            if d:
                out.add(d)
    return out


def _no_model_reason(analysis: "_Analysis", models: Container[str], feeding: Sequence[cst.CSTNode]) -> str:
    """Why no model call was found among the statements ``feeding`` the loss: a method of one of the
    step's ``models`` runs it (``agent.get_action_and_value(...)``: not a call of the model), or name
    the calls that do feed the loss, none of them known to be a module (a model built by
    `models.__dict__[name]()` or returned from another file is not). Calls known not to be models are
    not named: a loss or optimizer built in the file (the program model's roles), a builtin, a
    function of the file."""
    program = program_of(analysis.rule)
    methods: list[tuple[str, str]] = []
    names: set[str] = set()
    for stmt in feeding:
        for c in _calls(stmt):
            name = dotted(c.func)
            if not name:
                continue
            if isinstance(c.func, cst.Attribute):
                receiver = dotted(c.func.value)
                method = c.func.attr.value
                if receiver in models and method not in _MOVE_CHAIN | _HALF_METHODS and not method.startswith("_"):
                    methods.append((name, receiver or ""))
                if not (name.count(".") == 1 and name.startswith("self.")):
                    continue  # a method (`images.to(...)`), not an object called like a model
            if not _not_a_model(analysis, program, c):
                names.add(name)
    if methods:
        call, model = methods[0]
        return (
            f"the loss passed to `backward()` comes from `{call}(...)`, a method of the model `{model}` "
            "rather than a call of the model, and autocast is inserted around model calls only"
        )
    if not names:
        return "no call of a torch.nn.Module feeds the loss passed to `backward()`"
    shown = ", ".join(f"`{n}(...)`" for n in sorted(names)[:4])
    return (
        f"the loss passed to `backward()` comes from {shown}, none of which is known to be a torch.nn.Module "
        "(its class or factory is not visible in this file)"
    )


def _not_a_model(analysis: "_Analysis", program: Program, c: cst.Call) -> bool:
    """The callee of ``c`` is known not to be a model: a loss, optimizer, ... the file builds (its role
    in the program model), a builtin, or a function of the file."""
    role = program.role_of(c.func, c)
    if role is not None:
        return role.kind != "model"
    if not isinstance(c.func, cst.Name):
        return False
    found = bindings_of(analysis.rule, c.func)
    if found is None:
        return hasattr(builtins, c.func.value)
    return bool(found) and all(isinstance(getattr(b, "node", None), cst.FunctionDef) for b in found)


def _calls(node: cst.CSTNode) -> Iterable[cst.Call]:
    for n in walk(node):
        if isinstance(n, cst.Call):
            yield n


def _method_calls(node: cst.CSTNode, names: set[str] | Sequence[str]) -> Iterable[cst.Call]:
    for c in _calls(node):
        if isinstance(c.func, cst.Attribute) and c.func.attr.value in names:
            yield c


def method_receiver(call: cst.Call) -> cst.BaseExpression:
    """What a method call is called on (``opt`` in ``opt.step()``); only given calls known to be one."""
    return cst.ensure_type(call.func, cst.Attribute).value


def _single_small(stmt: cst.CSTNode) -> cst.BaseSmallStatement | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        return stmt.body[0]
    return None


# --------------------------------------------------------------------------- the plan


@dataclass
class Region:
    stmts: list[cst.BaseStatement]  # contiguous statements of one list, original nodes
    upcasts: list[str] = field(default_factory=list)


def wrap_region(e: Edits, region: Region, item: cst.WithItem) -> None:
    """Run ``region`` under the autocast ``item``; the names it assigns that later code reads are
    upcast back to float32 right after it."""
    e.wrap(region.stmts, with_statement([item]), [statement(f"{n} = {n}.float()\n") for n in region.upcasts])


def dict_with_entry(d: cst.Dict, entry: cst.DictElement) -> cst.Dict:
    """``d`` with ``entry`` added last, in the comma style the literal already uses (a trailing comma
    moves to the new entry)."""
    els = list(d.elements)
    last = els[-1]
    sep = (
        els[-2].comma
        if len(els) > 1 and isinstance(els[-2].comma, cst.Comma)
        else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    )
    els[-1] = last.with_changes(comma=sep)
    els.append(entry.with_changes(comma=last.comma) if isinstance(last.comma, cst.Comma) else entry)
    return d.with_changes(elements=els)


# --------------------------------------------------------------------------- file analysis


# A name as one scope sees it: (the name as written, ordinal of the scope that binds it). Attribute
# chains (`self.model`) have ordinal -1: they are tracked file-wide, by their text.
Key = tuple[str, int]


class _Analysis:
    """What one file holds: models, optimizers, their creation statements and devices.

    Two views of the same facts. By name (``models``, ``optimizers``, ``device_expr``, ...): every
    binding of the name anywhere in the file (TOP203 and TOP205 read these). By key (``kmodels``,
    ``koptimizers``, ``kdevice``, ...): a bare name is resolved the way Python resolves it where it
    is bound or read (the function's own binding, then enclosing functions, then the module), so
    ``model`` local to ``train_a`` and ``model`` local to ``train_b`` are two models. TOP202 reads
    the keyed view, so a training step sees only the models and optimizers visible from its scope.
    """

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.module = rule.ctx.module
        self.models: set[str] = set()
        self.model_stmt: dict[str, cst.BaseStatement] = {}
        self.optimizers: dict[str, cst.BaseStatement] = {}
        self.half_models: set[str] = set()
        self.bce_losses: set[str] = set()  # names bound to `nn.BCELoss(...)`
        self.data_parallel: set[str] = set()  # names bound to `nn.DataParallel(...)`
        self.device_expr: dict[str, cst.BaseExpression | str] = {}
        # The same facts keyed by binding scope (see Key).
        self.kmodels: set[Key] = set()
        self.koptimizers: dict[Key, cst.BaseStatement] = {}
        self.khalf: set[Key] = set()
        self.kbce: set[Key] = set()
        self.kdata_parallel: set[Key] = set()
        self.kdevice: dict[Key, cst.BaseExpression | str] = {}
        self.kwrappers: dict[Key, Wrapper] = {}  # optimizers held by a wrapper class of the file
        self._scope_ids: dict[object, int] = {}
        self._key_memo: dict[tuple[int, str], Key] = {}
        self.module_classes: set[str] = set()
        # Every node of the module in walk order, once: the analysis and the rules scan it many times.
        self.all_nodes: list[cst.CSTNode] = list(walk(self.module, True))
        self.names: set[str] = {n.value for n in self.all_nodes if isinstance(n, cst.Name)}
        self.functions: dict[str, cst.FunctionDef] = {}
        # `.to(...)` chains on calls not yet known to build a module: `model = Imported(...).to(device)`
        # becomes a model only once an optimizer takes its parameters.
        self._unknown_chains: list[tuple[str, Key, list[cst.Call]]] = []
        self._collect()

    # -- name resolution (Key)
    def scope_of(self, node: cst.CSTNode) -> Scope | None:
        """LibCST's scope of ``node`` (a function body's statements: the function's scope)."""
        return self.rule.get_metadata(ScopeProvider, node, None)

    def key_in(self, scope: Scope | None, name: str | None) -> Key | None:
        """The key of ``name`` read in ``scope``: bound there (or made global/nonlocal there), else in an
        enclosing function, else at module level (also for names bound nowhere)."""
        if name is None:
            return None
        if scope is None or "." in name:
            return (name, -1)
        memo = (id(scope), name)
        hit = self._key_memo.get(memo)
        if hit is None:
            found = scope[name]
            binding = next(iter(found)).scope if found else scope.globals
            hit = self._key_memo[memo] = (name, self._scope_ids.setdefault(binding, len(self._scope_ids)))
        return hit

    def key(self, name: str | None, at: cst.CSTNode) -> Key | None:
        """The key of ``name`` as read (or bound) at node ``at``."""
        return self.key_in(self.scope_of(at), name)

    # -- positions and scopes
    def pos(self, node: cst.CSTNode) -> tuple[int, int]:
        r = self.rule.get_metadata(PositionProvider, node)
        return (r.start.line, r.start.column)

    def end(self, node: cst.CSTNode) -> tuple[int, int]:
        r = self.rule.get_metadata(PositionProvider, node)
        return (r.end.line, r.end.column)

    def parent(self, node: cst.CSTNode | None) -> cst.CSTNode | None:
        return self.rule.get_metadata(ParentProvider, node, None)

    def statement(self, node: cst.CSTNode) -> cst.BaseStatement | None:
        cur: cst.CSTNode | None = node
        while cur is not None and not isinstance(cur, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            cur = self.parent(cur)
        return cur

    def scope_owner(self, node: cst.CSTNode) -> cst.CSTNode:
        """The function/class/lambda whose scope holds ``node``, or the module."""
        cur = self.parent(node)
        while cur is not None and not isinstance(cur, SCOPE_NODES):
            cur = self.parent(cur)
        return cur if cur is not None else self.module

    # -- collection
    def _collect(self) -> None:
        rule = self.rule
        self.module_classes = set(nn_module_classes(rule))
        for n in self.all_nodes:
            if isinstance(n, cst.FunctionDef):
                self.functions.setdefault(n.name.value, n)
            if not isinstance(n, cst.SimpleStatementLine):
                continue
            for small in n.body:
                if isinstance(small, cst.Assign) and len(small.targets) == 1:
                    t = small.targets[0].target
                    for bound, value in _pairs(t, small.value):
                        self._assignment(n, dotted(bound), value, bound)
                elif isinstance(small, cst.AnnAssign) and small.value is not None:
                    self._assignment(n, dotted(small.target), small.value, small.target)
                elif isinstance(small, cst.Expr):
                    self._expr_stmt(small.value)
        # Optimizer arguments name the models: `SGD(model.parameters())`, `[{"params": G.parameters()}]`.
        for name, stmt in self.optimizers.items():
            for c in _method_calls(stmt, ("parameters", "named_parameters")):
                d = dotted(method_receiver(c))
                if d:
                    self.models.add(d)
        for stmt in self.koptimizers.values():
            for c in _method_calls(stmt, ("parameters", "named_parameters")):
                d = dotted(method_receiver(c))
                if d:
                    self.kmodels.add(self.key(d, c))  # type: ignore[arg-type]  # a key is None only for a None name
        for target, k, chain in self._unknown_chains:
            if k in self.kmodels:
                self._chain(target, k, chain)

    def _assignment(
        self,
        stmt: cst.SimpleStatementLine,
        target: str | None,
        value: cst.BaseExpression,
        target_node: cst.CSTNode | None = None,
    ) -> None:
        if target is None:
            return
        k = self.key(target, target_node if target_node is not None else stmt)
        assert k is not None
        base, chain = _base_call(value)
        if isinstance(base, cst.Call):
            q = callee(self.rule, base)
            cls = q.rsplit(".", 1)[1] if q else ""
            if q and q.startswith("torch.optim.") and ".lr_scheduler" not in q and cls[:1].isupper():
                self.optimizers[target] = stmt
                self.koptimizers[k] = stmt
                return
            if q in _BCE_CLASSES:
                self.bce_losses.add(target)
                self.kbce.add(k)
                return
            if q in _DATA_PARALLEL:
                self.data_parallel.add(target)
                self.kdata_parallel.add(k)
            wrapper = (
                optimizer_wrapper(self.rule, base)
                if isinstance(base.func, cst.Name) and base.func.value not in self.module_classes and not chain
                else None
            )
            if wrapper is not None:  # `opt = ScheduledOptim(torch.optim.Adam(...), ...)`: keyed view only
                self.kwrappers[k] = wrapper
                self.koptimizers[k] = stmt
                return
            is_module = False
            if (
                q
                and q.startswith("torch.nn.")
                and not q.startswith("torch.nn.functional")
                and cls[:1].isupper()
                and not cls.endswith("Loss")
                and cls not in ("Parameter", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict", "Identity")
                and not parameter_free(q)
            ):
                is_module = True
            if isinstance(base.func, cst.Name) and base.func.value in self.module_classes:
                is_module = True
            elif not q and isinstance(base.func, (cst.Name, cst.Attribute)):
                is_module = project_module_class(self.rule, base.func)  # `Generator(...)` from model.py
            wrapped = dotted(base.args[0].value) if q in _MODEL_WRAPPERS and base.args else None
            inner = self.key(wrapped, base.args[0].value) if wrapped else None
            if inner is not None and inner in self.kmodels:  # `fast = torch.compile(net)`, `DDP(model)`
                if inner in self.kdevice:
                    self.kdevice.setdefault(k, self.kdevice[inner])
                    self.device_expr.setdefault(target, self.kdevice[inner])
                is_module = True
            if is_module:
                self.models.add(target)
                self.kmodels.add(k)
                self.model_stmt.setdefault(target, stmt)
                self._chain(target, k, chain)
                return
            if chain:
                self._unknown_chains.append((target, k, chain))
        d = dotted(base) if not isinstance(base, cst.Call) else None
        if d is not None and chain:  # model = model.to(device)
            self._chain(target if d in self.models else None, k if self.key(d, base) in self.kmodels else None, chain)

    def _expr_stmt(self, value: cst.BaseExpression) -> None:
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute):
            d = dotted(value.func.value)
            if d is not None:
                self._chain(d, self.key(d, value.func.value), [value])

    def _chain(self, target: str | None, k: Key | None, chain: list[cst.Call]) -> None:
        """Record what a `.to(...)` / `.cuda()` / `.half()` chain does to ``target`` (by name) and to
        ``k`` (by key); None skips that view."""
        for c in chain:
            meth = cst.ensure_type(c.func, cst.Attribute).attr.value
            if meth in _HALF_METHODS:
                if target is not None:
                    self.half_models.add(target)
                if k is not None:
                    self.khalf.add(k)
            elif meth == "cuda":
                if target is not None:
                    self.device_expr.setdefault(target, "cuda")
                if k is not None:
                    self.kdevice.setdefault(k, "cuda")
            elif meth == "to":
                for a in c.args:
                    if a.star:
                        continue
                    if dtype_of(self.rule, a.value) in ("float16", "bfloat16"):
                        if target is not None:
                            self.half_models.add(target)
                        if k is not None:
                            self.khalf.add(k)
                    elif a.keyword is None or a.keyword.value == "device":
                        dev = classify_device(self.rule, a.value)
                        if dev.is_device:
                            if target is not None:
                                self.device_expr.setdefault(target, a.value)
                            if k is not None:
                                self.kdevice.setdefault(k, a.value)

    # -- queries
    def calls_model(self, node: cst.CSTNode, models: Container[str]) -> bool:
        return any(dotted(c.func) in models for c in _calls(node))

    def model_of_stmt(self, node: cst.CSTNode, models: Container[str]) -> list[str]:
        return [d for d in (dotted(c.func) for c in _calls(node)) if d is not None and d in models]

    def autocast_with(self, node: cst.CSTNode) -> bool:
        for n in walk(node, True):
            if isinstance(n, cst.WithItem) and isinstance(n.item, cst.Call) and callee(self.rule, n.item) in _AUTOCASTS:
                return True
            if isinstance(n, cst.Decorator):
                d = n.decorator.func if isinstance(n.decorator, cst.Call) else n.decorator
                if isinstance(d, (cst.Name, cst.Attribute)) and torch_name(self.rule, d) in _AUTOCASTS:
                    return True
        return False

    def has_scaler(self) -> bool:
        """A GradScaler is made anywhere in the file: often in `main()`, handed to the step function."""
        for c in (n for n in walk(self.module, cross_scopes=True) if isinstance(n, cst.Call)):
            if isinstance(c.func, (cst.Name, cst.Attribute)) and callee(self.rule, c) in _SCALERS:
                return True
        return False

    def device_text(self, models: Iterable[str | Key]) -> tuple[str, cst.BaseExpression | None] | None:
        """The generated device-type expression and the device variable it reads (if any); ``models``
        are names (the by-name view) or Keys (the keyed view)."""
        for m in models:
            d = self.kdevice.get(m) if isinstance(m, tuple) else self.device_expr.get(m)
            if d is None:
                continue
            if isinstance(d, str):  # (the one string recorded is "cuda", for `.cuda()`)
                return '"cuda"', None
            dev = classify_device(self.rule, d)
            if dev.text:
                if dev.text.split(":")[0] == "cuda" and not isinstance(d, (cst.Name, cst.Attribute)):
                    return '"cuda"', None
                if dev.is_cpu:
                    return None
            if isinstance(d, (cst.Name, cst.Attribute)):
                return "{T}.device(" + self.module.code_for_node(d) + ").type", d
            s = string_value(d)
            if s is not None:
                return f'"{s.split(":")[0]}"', None
            return "{T}.device(" + self.module.code_for_node(d) + ").type", None
        return None

    def in_loop_call(self, fname: str) -> list[cst.Call]:
        """Calls of the file's function ``fname`` made inside a loop body."""
        index = self.__dict__.get("_loop_call_index")
        if index is None:  # one walk for every name (a loop nested in n loops lists its calls n times)
            index = {}
            for n in self.all_nodes:
                if isinstance(n, (cst.For, cst.While)):
                    for c in _calls(n.body):
                        if isinstance(c.func, cst.Name):
                            index.setdefault(c.func.value, []).append(c)
            self._loop_call_index = index
        return list(index.get(fname, ()))

    def param_alias(self, node: cst.CSTNode) -> dict[str, Key]:
        """For ``node`` in a (non-method) function ``f``: each parameter of ``f`` that ``f`` never rebinds and
        that a call ``f(...)`` in the file passes a model, optimizer or BCE loss *of the same name*,
        mapped to the key of that argument (the last such call wins): ``def train(model, opt)`` called
        as ``train(model, opt)`` from ``main()`` reads ``main``'s model and optimizer. Only the same
        name, as the by-name analysis before it matched, so ``prechecks.missing_autocast_possible``
        (which knows optimizers by name) stays a necessary condition."""
        fn = self.scope_owner(node)
        if not isinstance(fn, cst.FunctionDef):
            return {}
        cache = self.__dict__.setdefault("_param_alias", {})
        hit = cache.get(id(fn))
        if hit is not None:
            return hit
        alias: dict[str, Key] = {}
        cache[id(fn)] = alias
        block = self.parent(fn)
        if isinstance(self.parent(block) if block is not None else None, cst.ClassDef):
            return alias  # a method: called through an instance, not by its bare name
        index = self.__dict__.get("_call_index")
        if index is None:
            index = self.__dict__["_call_index"] = {}
            for c in self.module_calls():
                if isinstance(c.func, cst.Name):
                    index.setdefault(c.func.value, []).append(c)
        params = [p.name.value for p in fn.params.params]
        scope = self.scope_of(fn.body)
        for c in index.get(fn.name.value, ()):
            for i, arg in enumerate(c.args):
                if arg.star:
                    break
                pname = arg.keyword.value if arg.keyword is not None else (params[i] if i < len(params) else None)
                if (
                    pname is None
                    or pname not in params
                    or dotted(arg.value) != pname
                    or (scope is not None and len(scope[pname]) != 1)
                ):
                    continue  # not a parameter, another name, or rebound in the function
                k = self.key(dotted(arg.value), arg.value)
                if k and (k in self.kmodels or k in self.koptimizers or k in self.kbce):
                    alias[pname] = k
        return alias

    def assigning(self, name: str) -> list[cst.SimpleStatementLine]:
        """Simple statement lines whose assigned names include ``name``, in walk order."""
        index = self.__dict__.get("_assign_index")
        if index is None:
            index = {}
            for n in self.all_nodes:
                if isinstance(n, cst.SimpleStatementLine):
                    for d in _assigned_names(n):
                        index.setdefault(d, []).append(n)
            self._assign_index = index
        return index.get(name, [])

    def module_calls(self) -> list[cst.Call]:
        """Every call in the file, in walk order."""
        calls = self.__dict__.get("_module_calls")
        if calls is None:
            calls = self._module_calls = [n for n in self.all_nodes if isinstance(n, cst.Call)]
        return calls


# --------------------------------------------------------------------------- the rules


def _pairs(
    target: cst.BaseExpression, value: cst.BaseExpression
) -> list[tuple[cst.BaseExpression, cst.BaseExpression]]:
    """The name each value of an assignment binds: itself, or element by element for
    ``model, data = Net().to(device), data.to(device)`` (tuples of equal length, nothing starred)."""
    if isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)):
        names, values = target.elements, value.elements
        if len(names) == len(values) and not any(isinstance(e, cst.StarredElement) for e in (*names, *values)):
            return [(t.value, v.value) for t, v in zip(names, values)]
    return [(target, value)]


class _AmpBase(Rule):
    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)

    def _setup(
        self,
        analysis: _Analysis,
        anchor_scope: cst.CSTNode,
        models: Iterable[str | Key],
        anchors: list[cst.CSTNode],
        loop: cst.CSTNode,
        scaler: bool,
        node: cst.CSTNode,
        globals_follow: bool | None = None,
    ):
        """Names, setup statements and the statement to insert them after; raises Refusal. With
        ``globals_follow`` a step function that reads the optimizer as a module global built below it
        is accepted when every call of the function runs after that point (setup_order); False: the step
        reads it as a parameter a call of its function passes (None: not said)."""
        ref = torch_ref(self)
        if ref is None:
            raise Refusal(node, "`torch` is bound to something else in this file")
        dev = analysis.device_text(models)
        if dev is None:
            dev = _program_device(self, analysis, node)
        if dev is None:
            raise Refusal(
                node,
                "cannot tell which device the model runs on (no `.to(device)` / `.cuda()` "
                "on it); CPU training is not an AMP target",
            )
        dev_code, dev_var = dev
        anchors = list(anchors)
        if isinstance(dev_var, cst.Name):
            for n in analysis.assigning(dev_var.value):
                if analysis.scope_owner(n) is analysis.scope_owner(anchors[0]):
                    anchors.append(n)
                    break
        anchor = max(anchors, key=analysis.pos)
        owner = analysis.scope_owner(anchor)
        if not (isinstance(owner, cst.Module) or owner is anchor_scope):
            where = f"`{owner.name.value}`" if isinstance(owner, (cst.FunctionDef, cst.ClassDef)) else "another scope"
            how = (
                "is handed to the step's function as a parameter, but which optimizer that is stays unknown "
                "(a name bound more than once, or calls that pass different ones): no GradScaler can be set up beside it"
                if globals_follow is False  # the step reads the optimizer as a parameter
                else "this file does not show how it reaches the step's function (neither a parameter every "
                "caller fills nor an attribute)"
            )
            raise Refusal(node, f"the optimizer is created in {where}, and {how}")
        if analysis.pos(anchor) >= analysis.pos(loop) and (
            isinstance(owner, cst.Module) or analysis.scope_owner(loop) is owner
        ):
            fn = program_of(self).function_of(loop) if isinstance(owner, cst.Module) and globals_follow else None
            if fn is None or not calls_follow(program_of(self), fn, anchor, analysis.pos):
                what = " ".join(analysis.module.code_for_node(anchor).split())[:60]
                lf = program_of(self).function_of(loop) if isinstance(owner, cst.Module) else None
                if lf is None:
                    after = "which runs after the loop starts"
                elif fn is not None:
                    after = f"below `{lf.qualname}`, and not every call of `{lf.qualname}` is known to run after it"
                else:
                    after = f"below `{lf.qualname}`, whose calls this rule does not follow"
                raise Refusal(node, f"the set-up must follow `{what}` (line {analysis.pos(anchor)[0]}), {after}")
        taken = set(analysis.names)
        names = {k: fresh_name(taken, k) for k in ("amp_device_type", "amp_dtype")}
        if scaler:
            names["scaler"] = fresh_name(taken, "scaler")
        T = ref.name
        stmts = [statement(s) for s in amp_setup_lines(T, dev_code.format(T=T), names, self.option("dtype"), scaler)]
        item = cst.WithItem(
            item=cst.parse_expression(
                f"{T}.autocast(device_type={names['amp_device_type']}, dtype={names['amp_dtype']})"
            )
        )
        return names, stmts, anchor, item, tuple(ref.imports)


def amp_setup_lines(T: str, device_type: str, names: dict[str, str], dtype_option: str, scaler: bool) -> list[str]:
    """The statements that choose the autocast device type and dtype (float16 where CUDA runs it,
    bfloat16 elsewhere, or bfloat16 everywhere with the option) and create the scaler that float16 needs."""
    dev, dt = names["amp_device_type"], names["amp_dtype"]
    lines = [f"{dev} = {device_type}\n"]
    if dtype_option == "bfloat16":
        lines.append(f"{dt} = {T}.bfloat16\n")
    else:
        lines.append(f'{dt} = {T}.float16 if {dev} == "cuda" else {T}.bfloat16\n')
    if scaler:
        lines.append(f"{names['scaler']} = {T}.amp.GradScaler({dev}, enabled={dt} == {T}.float16)\n")
    return lines


def _program_device(rule: Rule, analysis: _Analysis, node: cst.CSTNode) -> tuple[str, cst.BaseExpression | None] | None:
    """The device the code around ``node`` moves its model or batches to, as the program model sees it
    (``DDP(model)`` of a moved model, a worker's ``torch.device(f"cuda:{rank}")``); None for the CPU."""
    from torchopt.analysis.program import program_of

    device = program_of(rule).device_at(node)
    if device is None or classify_device(rule, device).is_cpu:
        return None
    arg = analysis.parent(device)
    call = analysis.parent(arg) if isinstance(arg, cst.Arg) else None
    if isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value == "cuda":
        return '"cuda"', None  # `x.cuda(args.gpu)`: a CUDA device index, possibly None
    return "{T}.device(" + analysis.module.code_for_node(device) + ").type", device
