"""Automatic mixed precision inserted into training and inference loops.

TOP202 rewrites a recognised training step into the canonical device-agnostic AMP form: forward and
loss under ``torch.autocast``, and (for float16) the loss scaled by one ``torch.amp.GradScaler``
with ``unscale_``/``step``/``update`` placed where gradients are read and stepped. The scaler is part of the same
fix, never a separate one, so no selection of rules can produce a half-done float16 program.
TOP203 flags float16 autocast that already exists without a GradScaler (display-only). TOP205 wraps
the forward of inference-only scripts in autocast.

The analysis is intra-file: models are names bound to ``torch.nn`` constructors or to instances of
classes deriving from ``torch.nn.Module`` in the file, or whose ``.parameters()`` feed a
``torch.optim`` constructor; optimizers are names bound to ``torch.optim`` constructors; a step in a
function is resolved through the function's call sites inside loops of the same file. TOP202 resolves
each name in the scope that reads it (the function's own binding, then enclosing functions, then the
module), so every training function is analysed, and rewritten, as if it were alone in the file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.analysis.names import dotted, callee, torch_name, torch_ref
from torchopt.analysis.values import classify_device, dtype_of, string_value
from torchopt.analysis.syntax import SCOPE_NODES, walk
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Option, Rule

_AUTOCASTS = {"torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast",
              "torch.amp.autocast_mode.autocast"}
_SCALERS = {"torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.cpu.amp.GradScaler",
            "torch.amp.grad_scaler.GradScaler"}
_NO_GRAD = {"torch.no_grad", "torch.inference_mode"}
_GRAD_READERS = ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "get_total_norm", "clip_grads_with_norm_")
# Calls that must stay outside an autocast region (metrics, host conversions, optimizer traffic).
_EXCLUDED_METHODS = {"backward", "step", "zero_grad", "item", "cpu", "numpy", "tolist", "update", "unscale_",
                     "append", "extend", "state_dict", "load_state_dict"}
_EXCLUDED_FUNCS = {"float", "int", "bool", "print", "len", "list"}
_HALF_METHODS = {"half", "bfloat16"}
# BCE raises under CUDA autocast ("Prefer binary_cross_entropy_with_logits").
_BCE_FUNCS = {"torch.nn.functional.binary_cross_entropy", "torch.binary_cross_entropy"}
_BCE_CLASSES = {"torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss", "torch.nn.modules.BCELoss"}
# Autocast state is thread-local; DataParallel runs the replicas in other threads.
_DATA_PARALLEL = {"torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
                  "torch.nn.parallel.data_parallel.DataParallel"}
# Calls that return the module they are given, ready to be called in its place.
_MODEL_WRAPPERS = {"torch.compile", "torch.nn.parallel.DistributedDataParallel",
                   "torch.nn.parallel.distributed.DistributedDataParallel"}
_MOVE_CHAIN = {"to", "cuda", "train", "eval", "float", "requires_grad_", "share_memory"}

OPTION_DTYPE = Option(
    "dtype", str, "float16",
    "autocast dtype on CUDA. float16 (default) also inserts a GradScaler; off CUDA the program picks "
    "bfloat16 at run time. bfloat16: autocast only, no scaler.",
    choices=("float16", "bfloat16"),
)

# --------------------------------------------------------------------------- small helpers


def _base_call(expr: cst.BaseExpression) -> tuple[cst.BaseExpression, list[cst.Call]]:
    """``Net(3).to(device).train()`` -> (``Net(3)``, [the .to call, the .train call])."""
    chain: list[cst.Call] = []
    while (isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute)
           and isinstance(expr.func.value, cst.Call) and expr.func.attr.value in _MOVE_CHAIN | _HALF_METHODS):
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


def _calls(node: cst.CSTNode) -> Iterable[cst.Call]:
    for n in walk(node):
        if isinstance(n, cst.Call):
            yield n


def _method_calls(node: cst.CSTNode, names: set[str] | Sequence[str]) -> Iterable[cst.Call]:
    for c in _calls(node):
        if isinstance(c.func, cst.Attribute) and c.func.attr.value in names:
            yield c


def _body_list(block: cst.BaseSuite) -> Sequence[cst.BaseStatement] | None:
    return block.body if isinstance(block, cst.IndentedBlock) else None


def _single_small(stmt: cst.CSTNode) -> cst.BaseSmallStatement | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        return stmt.body[0]
    return None


def _stmt(text: str) -> cst.BaseStatement:
    return cst.parse_statement(text)


def _fresh(taken: set[str], base: str) -> str:
    if base not in taken:
        taken.add(base)
        return base
    i = 1
    while f"{base}_{i}" in taken:
        i += 1
    taken.add(f"{base}_{i}")
    return f"{base}_{i}"


# --------------------------------------------------------------------------- the plan


@dataclass
class Region:
    stmts: list[cst.BaseStatement]  # contiguous statements of one list, original nodes
    upcasts: list[str] = field(default_factory=list)


@dataclass
class Edits:
    """Edits to the original module, keyed by original node identity."""

    regions: dict[int, Region] = field(default_factory=dict)  # id(first stmt) -> region
    before: dict[int, list[cst.BaseStatement]] = field(default_factory=dict)
    after: dict[int, list[cst.BaseStatement]] = field(default_factory=dict)
    calls: dict[int, cst.BaseExpression] = field(default_factory=dict)
    dicts: dict[int, cst.Dict] = field(default_factory=dict)
    params: dict[int, cst.Parameters] = field(default_factory=dict)  # a function that receives the scaler
    # Every edited node, original: (node, True) when statements are added next to it or it is wrapped
    # (its block changes), (node, False) when the node itself is replaced.
    touched: list[tuple[cst.CSTNode, bool]] = field(default_factory=list)

    def add_before(self, stmt: cst.CSTNode, new: Sequence[cst.BaseStatement]) -> None:
        self.before.setdefault(id(stmt), []).extend(new)
        self.touched.append((stmt, True))

    def add_after(self, stmt: cst.CSTNode, new: Sequence[cst.BaseStatement]) -> None:
        self.after.setdefault(id(stmt), []).extend(new)
        self.touched.append((stmt, True))


class _Rewrite(cst.CSTTransformer):
    def __init__(self, edits: Edits, with_item: cst.WithItem) -> None:
        super().__init__()
        self.e = edits
        self.with_item = with_item

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        return self.e.calls.get(id(original_node), updated_node)

    def leave_Parameters(self, original_node: cst.Parameters, updated_node: cst.Parameters) -> cst.Parameters:
        return self.e.params.get(id(original_node), updated_node)

    def leave_Dict(self, original_node: cst.Dict, updated_node: cst.Dict) -> cst.BaseExpression:
        new = self.e.dicts.get(id(original_node))
        if new is None:
            return updated_node
        els = list(updated_node.elements)
        add = new.elements[0]
        last = els[-1]
        if isinstance(last.comma, cst.Comma):  # trailing comma: the new element takes it over
            sep = els[-2].comma if len(els) > 1 and isinstance(els[-2].comma, cst.Comma) else \
                cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            els[-1] = last.with_changes(comma=sep)
            els.append(add.with_changes(comma=last.comma))
        else:
            sep = els[-2].comma if len(els) > 1 and isinstance(els[-2].comma, cst.Comma) else \
                cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            els[-1] = last.with_changes(comma=sep)
            els.append(add)
        return updated_node.with_changes(elements=els)

    def _rebuild(self, orig: Sequence[cst.BaseStatement], upd: Sequence[cst.BaseStatement]) -> list:
        out: list[cst.BaseStatement] = []
        i = 0
        while i < len(orig):
            o = orig[i]
            region = self.e.regions.get(id(o))
            if region is not None:
                k = len(region.stmts)
                inner = list(upd[i:i + k])
                lead = inner[0].leading_lines
                inner[0] = inner[0].with_changes(leading_lines=())
                out.extend(self.e.before.get(id(o), []))
                out.append(cst.With(items=[self.with_item], body=cst.IndentedBlock(body=inner), leading_lines=lead))
                out.extend(_stmt(f"{n} = {n}.float()\n") for n in region.upcasts)
                for j in range(i, i + k):
                    out.extend(self.e.after.get(id(orig[j]), []))
                i += k
                continue
            out.extend(self.e.before.get(id(o), []))
            out.append(upd[i])
            out.extend(self.e.after.get(id(o), []))
            i += 1
        return out

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock):
        return updated_node.with_changes(body=self._rebuild(original_node.body, updated_node.body))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module):
        return updated_node.with_changes(body=self._rebuild(original_node.body, updated_node.body))


class Refusal(Exception):
    def __init__(self, node: cst.CSTNode, reason: str) -> None:
        super().__init__(reason)
        self.node = node
        self.reason = reason


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
        self._scope_ids: dict[object, int] = {}
        self._key_memo: dict[tuple[int, str], Key] = {}
        self.module_classes: set[str] = set()
        # Every node of the module in walk order, once: the analysis and the rules scan it many times.
        self.all_nodes: list[cst.CSTNode] = list(walk(self.module, True))
        self.names: set[str] = {n.value for n in self.all_nodes if isinstance(n, cst.Name)}
        self.functions: dict[str, cst.FunctionDef] = {}
        self._collect()

    # -- name resolution (Key)
    def scope_of(self, node: cst.CSTNode) -> object | None:
        """LibCST's scope of ``node`` (a function body's statements: the function's scope)."""
        return self.rule.get_metadata(ScopeProvider, node, None)

    def key_in(self, scope: object | None, name: str | None) -> Key | None:
        """The key of ``name`` read in ``scope``: bound there (or made global/nonlocal there), else in an
        enclosing function, else at module level (also for names bound nowhere)."""
        if name is None:
            return None
        if scope is None or "." in name:
            return (name, -1)
        memo = (id(scope), name)
        hit = self._key_memo.get(memo)
        if hit is None:
            found = scope[name]  # type: ignore[index]
            binding = next(iter(found)).scope if found else scope.globals  # type: ignore[attr-defined]
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

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.rule.get_metadata(ParentProvider, node, None)

    def statement(self, node: cst.CSTNode) -> cst.BaseStatement | None:
        cur: cst.CSTNode | None = node
        while cur is not None and not isinstance(cur, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            cur = self.parent(cur)
        return cur  # type: ignore[return-value]

    def scope_owner(self, node: cst.CSTNode) -> cst.CSTNode:
        """The function/class/lambda whose scope holds ``node``, or the module."""
        cur = self.parent(node)
        while cur is not None and not isinstance(cur, SCOPE_NODES):
            cur = self.parent(cur)
        return cur if cur is not None else self.module

    # -- collection
    def _collect(self) -> None:
        rule = self.rule
        classes = [n for n in self.all_nodes if isinstance(n, cst.ClassDef)]
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
        for n in self.all_nodes:
            if isinstance(n, cst.FunctionDef):
                self.functions.setdefault(n.name.value, n)
            if not isinstance(n, cst.SimpleStatementLine):
                continue
            for small in n.body:
                if isinstance(small, cst.Assign) and len(small.targets) == 1:
                    t = small.targets[0].target
                    self._assignment(n, dotted(t), small.value, t)
                elif isinstance(small, cst.AnnAssign) and small.value is not None:
                    self._assignment(n, dotted(small.target), small.value, small.target)
                elif isinstance(small, cst.Expr):
                    self._expr_stmt(small.value)
        # Optimizer arguments name the models: `SGD(model.parameters())`, `[{"params": G.parameters()}]`.
        for name, stmt in self.optimizers.items():
            for c in _method_calls(stmt, ("parameters", "named_parameters")):
                d = dotted(c.func.value)  # type: ignore[union-attr]
                if d:
                    self.models.add(d)
        for stmt in self.koptimizers.values():
            for c in _method_calls(stmt, ("parameters", "named_parameters")):
                d = dotted(c.func.value)  # type: ignore[union-attr]
                if d:
                    self.kmodels.add(self.key(d, c))  # type: ignore[arg-type]

    def _assignment(self, stmt: cst.SimpleStatementLine, target: str | None, value: cst.BaseExpression,
                    target_node: cst.CSTNode | None = None) -> None:
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
            is_module = False
            if q and q.startswith("torch.nn.") and not q.startswith("torch.nn.functional") and cls[:1].isupper() \
                    and not cls.endswith("Loss") and cls not in ("Parameter", "ModuleList", "ModuleDict",
                                                                 "ParameterList", "ParameterDict", "Identity"):
                is_module = True
            if isinstance(base.func, cst.Name) and base.func.value in self.module_classes:
                is_module = True
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
        d = dotted(base) if not isinstance(base, cst.Call) else None
        if d is not None and chain:  # model = model.to(device)
            self._chain(target if d in self.models else None, k if self.key(d, base) in self.kmodels else None,
                        chain)

    def _expr_stmt(self, value: cst.BaseExpression) -> None:
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute):
            d = dotted(value.func.value)
            if d is not None:
                self._chain(d, self.key(d, value.func.value), [value])

    def _chain(self, target: str | None, k: Key | None, chain: list[cst.Call]) -> None:
        """Record what a `.to(...)` / `.cuda()` / `.half()` chain does to ``target`` (by name) and to
        ``k`` (by key); None skips that view."""
        for c in chain:
            meth = c.func.attr.value  # type: ignore[union-attr]
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
    def calls_model(self, node: cst.CSTNode, models: set[str]) -> bool:
        return any(dotted(c.func) in models for c in _calls(node))

    def model_of_stmt(self, node: cst.CSTNode, models: set[str]) -> list[str]:
        return [d for d in (dotted(c.func) for c in _calls(node)) if d in models]

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
        for c in _calls(self.module):
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
            if d == "cuda":
                return '"cuda"', None
            dev = classify_device(self.rule, d)  # type: ignore[arg-type]
            if dev.text:
                if dev.text.split(":")[0] == "cuda" and not isinstance(d, (cst.Name, cst.Attribute)):
                    return '"cuda"', None
                if dev.is_cpu:
                    return None
            if isinstance(d, (cst.Name, cst.Attribute)):
                return "{T}.device(" + self.module.code_for_node(d) + ").type", d
            s = string_value(d)  # type: ignore[arg-type]
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
            index = self._call_index = {}
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
                if pname is None or pname not in params or dotted(arg.value) != pname or \
                        (scope is not None and len(scope[pname]) != 1):
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


# --------------------------------------------------------------------------- step analysis


@dataclass
class StepSite:
    stmts: Sequence[cst.BaseStatement]
    owner: cst.CSTNode  # the loop or function whose body this is
    models: "set[str] | _Visible"  # names (as written in the step) that are models
    optimizers: "set[str] | _Visible"
    alias: dict[str, Key]  # local (parameter) name -> the key of the caller's argument
    trigger: cst.CSTNode  # the loop that runs the step (for ordering)
    scope: object | None = None  # LibCST scope of the step's statements (TOP202's keyed view)


class _Visible:
    """The names that, read in ``scope``, are one of ``keys`` (a parameter listed in ``alias`` stands for
    its caller's argument). Supports ``name in visible`` only."""

    def __init__(self, a: _Analysis, scope: object | None, keys: "set[Key] | dict[Key, object]",
                 alias: dict[str, Key]) -> None:
        self.a, self.scope, self.keys, self.alias = a, scope, keys, alias

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        k = self.alias.get(name)
        return (k if k is not None else self.a.key_in(self.scope, name)) in self.keys


def _site_key(a: _Analysis, site: StepSite, name: str) -> Key:
    """The key of ``name`` as the step reads it."""
    k = site.alias.get(name)
    return k if k is not None else a.key_in(site.scope, name)  # type: ignore[return-value]


def _loop_sites(a: _Analysis) -> list[StepSite]:
    sites = []
    for n in a.all_nodes:
        if isinstance(n, (cst.For, cst.While)):
            body = _body_list(n.body)
            if body:
                scope = a.scope_of(n)
                alias = a.param_alias(n)
                sites.append(StepSite(body, n, _Visible(a, scope, a.kmodels, alias),
                                      _Visible(a, scope, a.koptimizers, alias), alias, n, scope))
    for fname, fn in a.functions.items():
        body = _body_list(fn.body)
        if not body:
            continue
        calls = a.in_loop_call(fname)
        if not calls:
            continue
        params = [p.name.value for p in fn.params.params]
        alias: dict[str, Key] = {}
        for c in calls:
            for i, arg in enumerate(c.args):
                if arg.star:
                    continue
                pname = arg.keyword.value if arg.keyword is not None else (params[i] if i < len(params) else None)
                k = a.key(dotted(arg.value), arg.value)
                if pname and k and (k in a.kmodels or k in a.koptimizers or k in a.kbce):
                    alias[pname] = k
        scope = a.scope_of(fn.body)
        models = _Visible(a, scope, a.kmodels, alias)
        opts = _Visible(a, scope, a.koptimizers, alias)
        loop = None
        cur: cst.CSTNode | None = calls[0]
        while cur is not None and not isinstance(cur, (cst.For, cst.While)):
            cur = a.parent(cur)
        loop = cur or calls[0]
        sites.append(StepSite(body, fn, models, opts, alias, loop, scope))
    return sites


def _is_autograd_backward(c: cst.Call) -> bool:
    """``torch.autograd.backward(...)`` (any alias of torch), not a ``tensor.backward(...)``."""
    d = dotted(c.func)
    return d is not None and (d == "autograd.backward" or d.endswith(".autograd.backward"))


def _loss_arg(c: cst.Call) -> cst.Arg | None:
    """The argument holding the tensors of ``torch.autograd.backward(tensors, ...)``."""
    for arg in c.args:
        if arg.star:
            return None
        if arg.keyword is None or arg.keyword.value == "tensors":
            return arg
    return None


def _loss_expr(c: cst.Call) -> cst.BaseExpression:
    """What a backward call differentiates: ``loss`` in ``loss.backward()`` and in
    ``torch.autograd.backward(loss)``."""
    if _is_autograd_backward(c):
        arg = _loss_arg(c)
        assert arg is not None
        return arg.value
    return c.func.value  # type: ignore[union-attr]


def _backward_call(stmt: cst.CSTNode) -> cst.Call | None:
    small = _single_small(stmt)
    if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
        c = small.value
        if isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward":
            if _is_autograd_backward(c) and _loss_arg(c) is None:
                return None
            return c
    return None


def _is_scale_call(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "scale"


def _bce_call(a: "_Analysis", site: "StepSite", node: cst.CSTNode, depth: int = 0) -> cst.Call | None:
    """A call of ``F.binary_cross_entropy`` / an ``nn.BCELoss`` instance in ``node`` (one level into the
    file's own functions called there)."""
    for c in _calls(node):
        if isinstance(c.func, cst.Call):
            if isinstance(c.func.func, (cst.Name, cst.Attribute)) and callee(a.rule, c.func) in _BCE_CLASSES:
                return c
            continue
        d = dotted(c.func)
        if d is None:
            continue
        k = _site_key(a, site, d) if depth == 0 else a.key(d, c)  # one level in: that function's scope
        if k in a.kbce or callee(a.rule, c) in _BCE_FUNCS:
            return c
        fn = a.functions.get(d)
        if fn is not None and depth == 0 and fn is not site.owner:
            inner = _bce_call(a, site, fn.body, 1)
            if inner is not None:
                return c
    return None


def _step_call(stmt: cst.CSTNode, optimizers: "set[str] | _Visible") -> cst.Call | None:
    small = _single_small(stmt)
    value = None
    if isinstance(small, cst.Expr):
        value = small.value
    elif isinstance(small, cst.Assign):
        value = small.value
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value == "step" \
            and dotted(value.func.value) in optimizers:
        return value
    return None


def _reads_grads(stmt: cst.CSTNode) -> bool:
    for n in walk(stmt):
        if isinstance(n, cst.Attribute) and n.attr.value == "grad":
            return True
        if isinstance(n, cst.Call):
            d = dotted(n.func) or ""
            if d.rsplit(".", 1)[-1] in _GRAD_READERS:
                return True
    return False


def _excluded(stmt: cst.CSTNode) -> bool:
    for c in _calls(stmt):
        if isinstance(c.func, cst.Attribute) and c.func.attr.value in _EXCLUDED_METHODS:
            return True
        if isinstance(c.func, cst.Name) and c.func.value in _EXCLUDED_FUNCS:
            return True
    return isinstance(stmt, (cst.Return,)) or any(isinstance(n, (cst.Return, cst.Yield, cst.Break, cst.Continue))
                                                  for n in walk(stmt))


@dataclass
class StepPlan:
    site: StepSite
    regions: list[Region]
    backwards: list[cst.Call]
    steps: list[tuple[cst.Call, str]]  # (call, optimizer name as written)
    step_list: Sequence[cst.BaseStatement]
    unscale_before: list[tuple[cst.BaseStatement, list[str]]]
    anchor_node: cst.CSTNode  # first region statement (where the diagnostic points)


def _escapes(a: _Analysis, site: StepSite, region: list[cst.BaseStatement], exclude: set[str]) -> list[str]:
    """Names assigned in the region and read anywhere else in their scope."""
    names: list[str] = []
    for s in region:
        for t in _targets(s):
            if isinstance(t, cst.Name) and t.value not in exclude and t.value not in names:
                names.append(t.value)
    if not names:
        return []
    lo, hi = a.pos(region[0]), a.end(region[-1])
    pending = set(names)
    found: set[str] = set()
    scope_node = a.scope_owner(region[0])
    for n in (walk(scope_node, True) if not isinstance(scope_node, cst.Module) else a.all_nodes):  # one walk for all
        if isinstance(n, cst.Name) and n.value in pending:
            p = a.pos(n)
            if lo <= p <= hi:
                continue
            parent = a.parent(n)
            if isinstance(parent, cst.AssignTarget) or (isinstance(parent, cst.Attribute) and parent.attr is n):
                continue
            if isinstance(parent, (cst.Param, cst.FunctionDef, cst.ClassDef, cst.Arg)) and \
                    getattr(parent, "keyword", None) is n:
                continue
            if isinstance(parent, (cst.Param, cst.FunctionDef, cst.ClassDef)):
                continue
            found.add(n.value)
            pending.discard(n.value)
            if not pending:
                break
    return [name for name in names if name in found]


def analyse_step(a: _Analysis, site: StepSite) -> StepPlan | None:
    stmts = list(site.stmts)
    backs = [(i, c) for i, s in enumerate(stmts) if (c := _backward_call(s)) is not None]
    if not backs:
        return None
    # Step statements: at the top level of the body, or directly in an `if` there (accumulation).
    lists: list[Sequence[cst.BaseStatement]] = [stmts]
    for s in stmts:
        if isinstance(s, cst.If):
            body = _body_list(s.body)
            if body:
                lists.append(body)
    steps: list[tuple[Sequence[cst.BaseStatement], int, cst.Call, str]] = []
    for lst in lists:
        for j, s in enumerate(lst):
            c = _step_call(s, site.optimizers)
            if c is not None:
                steps.append((lst, j, c, dotted(c.func.value) or ""))  # type: ignore[union-attr]
    if not steps:
        return None
    body_node = cst.IndentedBlock(body=stmts)  # only for walking
    # Already mixed precision (idempotence): autocast anywhere in the step, or a scaled backward.
    if a.autocast_with(body_node):
        return None
    for _, c in backs:
        if _is_scale_call(_loss_expr(c)):
            return None
    if any(isinstance(c.func, cst.Attribute) and c.func.attr.value in ("unscale_",) for c in _calls(body_node)):
        return None
    first_back = backs[0][1]
    for _, _, c, opt in steps:
        if c.args:
            raise Refusal(c, f"`{opt}.step(...)` takes a closure, which GradScaler does not support "
                             "(`GradScaler.step` raises \"Closure use is not currently supported\")")
    for c in _calls(body_node):
        if isinstance(c.func, (cst.Name, cst.Attribute)) and callee(a.rule, c) == "torch.autograd.grad":
            raise Refusal(c, "the step calls `torch.autograd.grad` (a gradient penalty needs the AMP "
                             "template: scale the inputs of autograd.grad and unscale its outputs)")
    step_lists = {id(lst) for lst, _, _, _ in steps}
    if len(step_lists) != 1:
        raise Refusal(first_back, "optimizer steps sit in different blocks, so no single `scaler.update()` "
                                  "placement runs once per iteration after all of them")
    used_models = {m for s in stmts for m in a.model_of_stmt(s, site.models)}
    fmodels = {_site_key(a, site, m) for m in used_models}
    dp = fmodels & a.kdata_parallel
    if dp:
        raise Refusal(first_back, f"`{sorted(dp)[0][0]}` is wrapped in `torch.nn.DataParallel`, whose replicas run in "
                                  "other threads while autocast state is thread-local, so an autocast block in the "
                                  "step would not reach them: convert to DistributedDataParallel (TOP401) or "
                                  "decorate the model's `forward` with `@torch.autocast(...)`")
    half = fmodels & a.khalf
    if half:
        raise Refusal(first_back, f"`{sorted(half)[0][0]}` is cast to float16/bfloat16 (pure low-precision "
                                  "training): autocast must not be combined with `.half()`")
    # Regions: one per group of consecutive backward calls.
    regions: list[Region] = []
    prev = -1
    groups: list[list[int]] = []
    for i, _ in backs:
        if groups and groups[-1][-1] == i - 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    loss_names: set[str] = set()
    for g in groups:
        needed: set[str] = set()
        for i in g:
            recv = _loss_expr(stmts[i].body[0].value)  # type: ignore[attr-defined]
            needed |= _read_names(recv) if not isinstance(recv, (cst.Name, cst.Attribute)) else {dotted(recv) or ""}
            loss_names |= {n for n in needed if "." not in n}
        in_slice: list[int] = []
        for j in range(g[0] - 1, prev, -1):
            assigned = _assigned_names(stmts[j])
            if assigned & needed:
                in_slice.append(j)
                needed |= _read_names(stmts[j])
        model_stmts = [j for j in in_slice if a.calls_model(stmts[j], site.models)]
        if not model_stmts:
            if not regions:
                raise Refusal(stmts[g[0]], "no call of a torch.nn.Module feeds the loss passed to `backward()`")
            prev = g[-1]
            continue
        start, end = min(model_stmts), max(in_slice)
        region = stmts[start:end + 1]
        for s in region:
            bce = _bce_call(a, site, s)
            if bce is not None:
                raise Refusal(bce, "the loss is `binary_cross_entropy` / `nn.BCELoss`, which raises under CUDA "
                                   "autocast: compute it from the logits with `binary_cross_entropy_with_logits` "
                                   "(`nn.BCEWithLogitsLoss`) instead of sigmoid + BCE")
            if _excluded(s) or a.autocast_with(s):
                raise Refusal(s, "a statement between the forward and the loss ("
                              + " ".join(a.module.code_for_node(s).split())[:50]
                              + ") cannot run under autocast (optimizer, metric or host conversion)")
        regions.append(Region(list(region)))
        prev = g[-1]
    for r in regions:
        r.upcasts = _escapes(a, site, r.stmts, loss_names)
    # Gradient readers between the first backward and the steps: unscale_ once per optimizer.
    step_list = steps[0][0]
    step_idx = sorted(j for _, j, _, _ in steps)
    unscale: list[tuple[cst.BaseStatement, list[str]]] = []
    done: set[str] = set()
    opt_at = {j: o for _, j, _, o in steps}
    if step_list is stmts:
        candidates = [(j, stmts[j]) for j in range(backs[0][0] + 1, step_idx[-1])]
    else:
        host = next(s for s in stmts if isinstance(s, cst.If) and _body_list(s.body) is step_list)
        hi = stmts.index(host)
        for j in range(backs[0][0] + 1, hi):
            if _reads_grads(stmts[j]):
                test = " ".join(a.module.code_for_node(host.test).split())  # type: ignore[attr-defined]
                if "%" in test:
                    raise Refusal(stmts[j], "gradients are read on micro-batches that do not step "
                                            "(unscale_ there would be repeated before update())")
                raise Refusal(stmts[j], f"gradients are read before the step, which runs only `if {test}:`, so "
                                        "`unscale_` would run on iterations that do not step (move the gradient "
                                        "read under the same condition)")
        candidates = [(j, step_list[j]) for j in range(0, step_idx[-1])]
    for j, s in candidates:
        if j in opt_at or not _reads_grads(s):
            continue
        nxt = [k for k in step_idx if k > j]
        run = []
        for k in nxt:
            if run and k != run[-1] + 1:
                break
            run.append(k)
        opts = [opt_at[k] for k in run if opt_at[k] not in done]
        if opts:
            done.update(opts)
            unscale.append((s, opts))
    return StepPlan(site, regions, [c for _, c in backs], [(c, o) for _, _, c, o in steps], step_list, unscale,
                    regions[0].stmts[0] if regions else stmts[backs[0][0]])


# --------------------------------------------------------------------------- rule examples

_H = ("import torch\nimport torch.nn as nn\n\ndevice = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
      "model = nn.Linear(4, 2).to(device)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n")
_HO = _H
_SETUP = ('amp_device_type = torch.device(device).type\n'
          'amp_dtype = torch.float16 if amp_device_type == "cuda" else torch.bfloat16\n')
_SCALER = 'scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)\n'
_WITH = "with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):\n"
_STEP_SRC = _H + ("for x, y in batches:\n    optimizer.zero_grad()\n    out = model(x)\n"
                  "    loss = nn.functional.mse_loss(out, y)\n    loss.backward()\n    optimizer.step()\n")
_STEP_AFTER = _HO + _SETUP + _SCALER + (
    "for x, y in batches:\n    optimizer.zero_grad()\n    " + _WITH + "        out = model(x)\n"
    "        loss = nn.functional.mse_loss(out, y)\n    scaler.scale(loss).backward()\n"
    "    scaler.step(optimizer)\n    scaler.update()\n")
_AMP_DONE = _H + ("scaler = torch.amp.GradScaler('cuda')\nfor x, y in batches:\n"
                  "    with torch.autocast('cuda', dtype=torch.float16):\n"
                  "        loss = nn.functional.mse_loss(model(x), y)\n    scaler.scale(loss).backward()\n"
                  "    scaler.step(optimizer)\n    scaler.update()\n")
_FP16_NO_SCALER = _H + ("for x, y in batches:\n    with torch.autocast('cuda', dtype=torch.float16):\n"
                        "        loss = nn.functional.mse_loss(model(x), y)\n    loss.backward()\n"
                        "    optimizer.step()\n")
_INF_H = ("import torch\nimport torch.nn as nn\n\ndevice = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
          "model = nn.Linear(4, 2).to(device)\n")

# --------------------------------------------------------------------------- the rules


class _AmpBase(Rule):
    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)

    def _setup(self, a: _Analysis, anchor_scope: cst.CSTNode, models: Iterable[str], anchors: list[cst.CSTNode],
               loop: cst.CSTNode, scaler: bool, node: cst.CSTNode):
        """Names, setup statements and the statement to insert them after; raises Refusal."""
        ref = torch_ref(self)
        if ref is None:
            raise Refusal(node, "`torch` is bound to something else in this file")
        dev = a.device_text(models)
        if dev is None:
            dev = _program_device(self, a, node)
        if dev is None:
            raise Refusal(node, "cannot tell which device the model runs on (no `.to(device)` / `.cuda()` "
                                "on it); CPU training is not an AMP target")
        dev_code, dev_var = dev
        anchors = list(anchors)
        if isinstance(dev_var, cst.Name):
            for n in a.assigning(dev_var.value):
                if a.scope_owner(n) is a.scope_owner(anchors[0]):
                    anchors.append(n)
                    break
        anchor = max(anchors, key=a.pos)
        owner = a.scope_owner(anchor)
        if not (isinstance(owner, cst.Module) or owner is anchor_scope):
            where = f"`{owner.name.value}`" if isinstance(owner, (cst.FunctionDef, cst.ClassDef)) else "another scope"
            raise Refusal(node, f"the optimizer is created in {where}, and this file does not show how it "
                                "reaches the step's function (neither a parameter every caller fills nor an attribute)")
        if a.pos(anchor) >= a.pos(loop) and (isinstance(owner, cst.Module) or a.scope_owner(loop) is owner):
            raise Refusal(node, "the optimizer (or device) is created after the training loop starts")
        taken = set(a.names)
        names = {k: _fresh(taken, k) for k in ("amp_device_type", "amp_dtype")}
        if scaler:
            names["scaler"] = _fresh(taken, "scaler")
        T = ref.name
        stmts = [_stmt(s) for s in amp_setup_lines(T, dev_code.format(T=T), names, self.option("dtype"), scaler)]
        item = cst.WithItem(item=cst.parse_expression(
            f'{T}.autocast(device_type={names["amp_device_type"]}, dtype={names["amp_dtype"]})'))
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


def _program_device(rule: Rule, a: _Analysis, node: cst.CSTNode) -> tuple[str, cst.BaseExpression | None] | None:
    """The device the code around ``node`` moves its model or batches to, as the program model sees it
    (``DDP(model)`` of a moved model, a worker's ``torch.device(f"cuda:{rank}")``); None for the CPU."""
    from torchopt.analysis.program import program_of

    device = program_of(rule).device_at(node)
    if device is None or classify_device(rule, device).is_cpu:
        return None
    return "{T}.device(" + a.module.code_for_node(device) + ").type", device
