"""Automatic mixed precision inserted into training and inference loops (rules.md AMP-002, AMP-003,
AMP-005).

TOP202 rewrites a recognised training step into the canonical device-agnostic AMP form: forward and
loss under ``torch.autocast``, and (for float16) the loss scaled by one ``torch.amp.GradScaler``
with ``unscale_``/``step``/``update`` placed by the AMP-003 rules. The scaler is part of the same
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
from torchopt.codemods.amp import FAMILY
from torchopt.codemods.amp import _prefilter
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import ImportSpec, Invalid, Option, Rule, Safety, Tag, Valid

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
# BCE raises under CUDA autocast ("Prefer binary_cross_entropy_with_logits", AMP-002 "BCE").
_BCE_FUNCS = {"torch.nn.functional.binary_cross_entropy", "torch.binary_cross_entropy"}
_BCE_CLASSES = {"torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss", "torch.nn.modules.BCELoss"}
# Autocast state is thread-local; DataParallel runs the replicas in other threads (AMP-002).
_DATA_PARALLEL = {"torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
                  "torch.nn.parallel.data_parallel.DataParallel"}
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
        name, as the by-name analysis before it matched, so ``_prefilter.missing_autocast_possible``
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
    """Names assigned in the region and read anywhere else in their scope (E-29)."""
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
            raise Refusal(c, "the step calls `torch.autograd.grad` (a gradient penalty needs the AMP-006 "
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
                                  "training, AMP-004): autocast must not be combined with `.half()`")
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
                raise Refusal(stmts[j], "gradients are read on micro-batches that do not step "
                                        "(unscale_ there would be repeated before update())")
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
_HO = _H.replace("import torch.nn as nn\n", "import torch.nn as nn\nimport os\n", 1)
_SETUP = ('# Mixed precision (torchopt): TORCHOPT_AMP=0 turns it off, TORCHOPT_AMP_DTYPE overrides the dtype.\n'
          'use_amp = os.environ.get("TORCHOPT_AMP", "1") != "0"\n'
          'amp_device_type = torch.device(device).type\n'
          'amp_dtype = getattr(torch, os.environ.get("TORCHOPT_AMP_DTYPE", "float16" if amp_device_type == "cuda" '
          'else "bfloat16"))\n')
_SCALER = 'scaler = torch.amp.GradScaler(amp_device_type, enabled=use_amp and amp_dtype == torch.float16)\n'
_WITH = "with torch.autocast(device_type=amp_device_type, dtype=amp_dtype, enabled=use_amp):\n"
_STEP_SRC = _H + ("for x, y in batches:\n    optimizer.zero_grad()\n    out = model(x)\n"
                  "    loss = nn.functional.mse_loss(out, y)\n    loss.backward()\n    optimizer.step()\n")
_STEP_AFTER = _HO + _SETUP + _SCALER + (
    "for x, y in batches:\n    optimizer.zero_grad()\n    " + _WITH + "        out = model(x)\n"
    "        loss = nn.functional.mse_loss(out, y)\n    scaler.scale(loss).backward()\n"
    "    scaler.step(optimizer)\n    scaler.update()\n")
_CLIP_SRC = _H + ("for x, y in batches:\n    optimizer.zero_grad()\n    loss = nn.functional.mse_loss(model(x), y)\n"
                  "    loss.backward()\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
                  "    optimizer.step()\n")
_CLIP_AFTER = _HO + _SETUP + _SCALER + (
    "for x, y in batches:\n    optimizer.zero_grad()\n    " + _WITH
    + "        loss = nn.functional.mse_loss(model(x), y)\n    scaler.scale(loss).backward()\n"
    "    scaler.unscale_(optimizer)\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    "    scaler.step(optimizer)\n    scaler.update()\n")
_AMP_DONE = _H + ("scaler = torch.amp.GradScaler('cuda')\nfor x, y in batches:\n"
                  "    with torch.autocast('cuda', dtype=torch.float16):\n"
                  "        loss = nn.functional.mse_loss(model(x), y)\n    scaler.scale(loss).backward()\n"
                  "    scaler.step(optimizer)\n    scaler.update()\n")
_CLOSURE = _H + ("for x, y in batches:\n    loss = nn.functional.mse_loss(model(x), y)\n    loss.backward()\n"
                 "    optimizer.step(lambda: loss)\n")
_FP16_NO_SCALER = _H + ("for x, y in batches:\n    with torch.autocast('cuda', dtype=torch.float16):\n"
                        "        loss = nn.functional.mse_loss(model(x), y)\n    loss.backward()\n"
                        "    optimizer.step()\n")
_BCE_SRC = _H + ("for x, y in batches:\n    optimizer.zero_grad()\n    out = model(x)\n"
                 "    loss = nn.functional.binary_cross_entropy(torch.sigmoid(out), y)\n    loss.backward()\n"
                 "    optimizer.step()\n")
_DP_SRC = _H.replace("model = nn.Linear(4, 2).to(device)", "model = nn.DataParallel(nn.Linear(4, 2)).to(device)") \
    + _STEP_SRC[len(_H):]
_AUTOGRAD_SRC = _STEP_SRC.replace("    loss.backward()\n", "    torch.autograd.backward(loss)\n")
_AUTOGRAD_AFTER = _STEP_AFTER.replace("    scaler.scale(loss).backward()\n",
                                      "    torch.autograd.backward(scaler.scale(loss))\n")
_CKPT_SRC = _STEP_SRC + ('    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}\n'
                         '    torch.save(ckpt, "ckpt.pt")\n')
_CKPT_AFTER = _STEP_AFTER + ('    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), '
                             '"scaler": scaler.state_dict()}\n    torch.save(ckpt, "ckpt.pt")\n')
_BF16_AUTOCAST = _FP16_NO_SCALER.replace("torch.float16", "torch.bfloat16")
_INF_H = ("import torch\nimport torch.nn as nn\n\ndevice = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
          "model = nn.Linear(4, 2).to(device)\n")
_INF_SRC = _INF_H + ("with torch.no_grad():\n    for x in batches:\n        out = model(x)\n"
                     "        results.append(out.cpu())\n")
_INF_AFTER = _INF_H.replace("import torch.nn as nn\n", "import torch.nn as nn\nimport os\n", 1) + _SETUP + (
    "with torch.no_grad():\n    for x in batches:\n        " + _WITH + "            out = model(x)\n"
    "        out = out.float()\n        results.append(out.cpu())\n")
_TRAIN_WITH_EVAL = _STEP_AFTER + ("with torch.no_grad():\n    for x in batches:\n        out = model(x)\n")

# --------------------------------------------------------------------------- the rules


class _AmpBase(Rule):
    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)

    def _setup(self, a: _Analysis, anchor_scope: cst.CSTNode, models: Iterable[str], anchors: list[cst.CSTNode],
               loop: cst.CSTNode, scaler: bool, node: cst.CSTNode):
        """Names, setup statements and the statement to insert them after; raises Refusal."""
        ref = torch_ref(self)
        if ref is None:
            raise Refusal(node, "`torch` is bound to something else in this file")
        if "os" in a.names and not self._imports_os(a):
            raise Refusal(node, "`os` is bound to something other than the os module")
        dev = a.device_text(models)
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
        if a.pos(anchor) >= a.pos(loop):
            raise Refusal(node, "the optimizer (or device) is created after the training loop starts")
        owner = a.scope_owner(anchor)
        if not (isinstance(owner, cst.Module) or owner is anchor_scope):
            raise Refusal(node, "the step cannot see names created where the optimizer is created "
                                "(different functions)")
        taken = set(a.names)
        names = {k: _fresh(taken, k) for k in ("use_amp", "amp_device_type", "amp_dtype")}
        if scaler:
            names["scaler"] = _fresh(taken, "scaler")
        T = ref.name
        dtype_opt = self.option("dtype")
        lines = [
            f'{names["use_amp"]} = os.environ.get("TORCHOPT_AMP", "1") != "0"\n',
            f'{names["amp_device_type"]} = {dev_code.format(T=T)}\n',
        ]
        if dtype_opt == "bfloat16":
            lines.append(f'{names["amp_dtype"]} = {T}.bfloat16\n')
        else:
            lines.append(
                f'{names["amp_dtype"]} = getattr({T}, os.environ.get("TORCHOPT_AMP_DTYPE", "float16" if '
                f'{names["amp_device_type"]} == "cuda" else "bfloat16"))\n')
        if scaler:
            lines.append(f'{names["scaler"]} = {T}.amp.GradScaler({names["amp_device_type"]}, '
                         f'enabled={names["use_amp"]} and {names["amp_dtype"]} == {T}.float16)\n')
        stmts = [_stmt(s) for s in lines]
        comment = ("# Mixed precision (torchopt): TORCHOPT_AMP=0 turns it off, TORCHOPT_AMP_DTYPE overrides "
                   "the dtype." if dtype_opt != "bfloat16" else
                   "# Mixed precision (torchopt): TORCHOPT_AMP=0 turns it off.")
        stmts[0] = stmts[0].with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(comment))])
        item = cst.WithItem(item=cst.parse_expression(
            f'{T}.autocast(device_type={names["amp_device_type"]}, dtype={names["amp_dtype"]}, '
            f'enabled={names["use_amp"]})'))
        imports = tuple(ref.imports) + (ImportSpec("os"),)
        return names, stmts, anchor, item, imports

    def _imports_os(self, a: _Analysis) -> bool:
        hit = a.__dict__.get("_imports_os")
        if hit is None:
            hit = a._imports_os = any(dotted(al.name) == "os" and al.asname is None
                                      for n in a.all_nodes if isinstance(n, cst.Import)
                                      for al in n.names)
        return hit


class MissingAutocast(_AmpBase):
    """## What it does
    Rewrites a float32 training step into automatic mixed precision. A step is recognised in the
    body of a `for`/`while` loop, or in a function of the same file that a loop calls: a call of
    an `nn.Module` instance (a name bound to a `torch.nn` constructor or to a class deriving from
    `torch.nn.Module`, or whose `.parameters()` a `torch.optim` optimizer takes), a loss computed
    from its output, `loss.backward()`, and `optimizer.step()`. The forward and the loss (from the
    first statement that calls the model to the last statement the loss depends on) go under
    `torch.autocast`; with the default `dtype = "float16"` the same fix adds one
    `torch.amp.GradScaler` (AMP-003): `scaler.scale(loss).backward(...)` (also
    `scaler.scale(out).backward(grad)` and `torch.autograd.backward(scaler.scale(loss))`),
    `scaler.step(opt)`, one `scaler.update()` after the last step of the iteration,
    `scaler.unscale_(opt)` before the first gradient clipping or gradient read, and the scaler's
    state next to the optimizer's in `torch.save({...})` checkpoints (a dict literal passed
    directly or bound to a name first, `ckpt = {...}; torch.save(ckpt, f)`) and restored after
    `optimizer.load_state_dict(ckpt[...])`. Gradient accumulation (`if (i + 1) % k == 0:` guarding
    the step) keeps scaling every micro-batch and steps/updates under the condition. Several
    losses (each `backward()` scaled, `retain_graph=` kept), several models and optimizers (a GAN)
    share one scaler and one `update()`. Names are resolved the way Python resolves them in the
    step's function (its own `model`/`optimizer` first, then the module's), so each training
    function of a file gets the finding, and its own scaler, that it gets alone.

    The step is left alone, with a diagnostic saying why, when it takes `optimizer.step(closure)`,
    calls `torch.autograd.grad`, casts the model with `.half()`, interleaves optimizer or metric
    code with the forward, computes the loss with `F.binary_cross_entropy` / an `nn.BCELoss`
    instance (they raise under CUDA autocast: use `binary_cross_entropy_with_logits` on the
    logits), or runs a model wrapped in `nn.DataParallel` (autocast state is thread-local and the
    replicas run in other threads: convert to DDP, TOP401, or decorate `forward` with
    `@torch.autocast(...)`). A step already under autocast or using a scaler is not flagged.
    Option `dtype` (`[tool.torchopt.rules.TOP202]`): `"float16"` (default) or `"bfloat16"`
    (autocast only, no scaler). TOP203 is the same check for autocast that already exists.

    ## Why is this slow
    In float32 every matmul and convolution runs at a fraction of the Tensor Core rate and moves
    twice the bytes. Under autocast those ops run in float16/bfloat16 (typically 2-3x faster on
    recent NVIDIA GPUs) while reductions, losses and the weights stay in float32.

    ## Example
    ```python
    for x, y in loader:
        optimizer.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        optimizer.step()
    ```

    ## Use instead
    ```python
    use_amp = os.environ.get("TORCHOPT_AMP", "1") != "0"
    amp_device_type = torch.device(device).type
    amp_dtype = getattr(torch, os.environ.get("TORCHOPT_AMP_DTYPE", "float16" if amp_device_type == "cuda" else "bfloat16"))
    scaler = torch.amp.GradScaler(amp_device_type, enabled=use_amp and amp_dtype == torch.float16)
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast(device_type=amp_device_type, dtype=amp_dtype, enabled=use_amp):
            out = model(x)
            loss = loss_fn(out, y)
        out = out.float()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    ```

    ## Fix safety
    Unsafe (numerics): matmuls and convolutions in the region compute in float16 (on CUDA) or
    bfloat16 (elsewhere, e.g. on the CPU), so activations, logits and the loss lose precision
    (a 2-layer MLP forward differs from float32 by rel-L2 ~3.7e-4 in float16 and ~3.5e-3 in
    bfloat16, E-06) and training follows a slightly different trajectory (max relative loss
    difference over 50 steps 6e-6 fp16 + GradScaler, 4.8e-5 bf16, E-21). With float16 the scaler
    may skip the first steps while it calibrates its scale (their gradients overflow), so the
    number of optimizer updates can differ. Tensors assigned in the region and used after it are
    upcast with `.float()` so later float32 code keeps working (E-29). `torchopt validate` holds
    the result to the AMP rows of VAL-6: model outputs within rtol 1e-2 / atol 1e-3·max|ref| /
    rel-L2 1e-2 (float16) or 5e-2 / 1e-2·max|ref| / 5e-2 (bfloat16); losses within 1 % for the
    first 20 steps and 2 % after. On a CPU the rewritten program runs bfloat16 autocast with the
    scaler disabled; CPU autocast casts other ops than CUDA's (softmax, log_softmax and sum stay
    low precision on CPU), so a CPU validation is not representative of CUDA numerics.
    `TORCHOPT_AMP=0` turns autocast and the scaler off (bitwise the float32 program);
    `TORCHOPT_AMP_DTYPE=float16` exercises the float16 + GradScaler control flow anywhere.
    """

    code = "TOP202"
    min_torch = (2, 3)  # `torch.amp.GradScaler(device)`
    # Each step reads only what its scope sees (the keyed view of _Analysis): its function, the functions
    # and classes it names, and module-level statements it is linked with.
    locality = "component"
    name = "missing-autocast"
    family = FAMILY
    message = "training step runs in float32: wrap forward and loss in `torch.autocast`{extra}"
    refuse_message = "training step not rewritten to mixed precision: {reason}"
    fix_title = "Insert `torch.autocast`{extra}"
    safety = Safety.UNSAFE
    tags = (Tag.NUMERICS,)
    prefilter = ("backward",)
    requires = ("optim", "step")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and _prefilter.missing_autocast_possible(text)

    options = (OPTION_DTYPE,)
    examples = (
        Invalid(_STEP_SRC, after=_STEP_AFTER, unsafe="numerics"),
        Invalid(_CLIP_SRC, after=_CLIP_AFTER, unsafe="numerics",
                note="clipping reads true gradient magnitudes only after unscale_"),
        Invalid(_CLOSURE, after=None, note="optimizer.step(closure): refused with a diagnostic"),
        Invalid(_AUTOGRAD_SRC, after=_AUTOGRAD_AFTER, unsafe="numerics",
                note="torch.autograd.backward(loss) scales its tensors argument"),
        Invalid(_CKPT_SRC, after=_CKPT_AFTER, unsafe="numerics",
                note="a checkpoint dict bound to a name gains the scaler state"),
        Invalid(_BCE_SRC, after=None,
                note="binary_cross_entropy / BCELoss raise under CUDA autocast: refused, use the with_logits form"),
        Invalid(_DP_SRC, after=None,
                note="nn.DataParallel replicas run in other threads, outside a thread-local autocast: refused"),
        Valid(_AMP_DONE, note="already autocast + GradScaler"),
        Valid(_STEP_AFTER, note="the rewrite's own output is never flagged again"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = _Analysis(self)
        if not a.optimizers:
            return
        for site in _loop_sites(a):
            try:
                plan = analyse_step(a, site)
                if plan is None:
                    continue
                self._fix(a, plan)
            except Refusal as r:
                self.report(r.node, message=self.refuse_message.format(reason=r.reason))

    def _fix(self, a: _Analysis, plan: StepPlan) -> None:
        site = plan.site
        scaler = self.option("dtype") != "bfloat16"
        opts = []
        for _, o in plan.steps:
            if o not in opts:
                opts.append(o)
        file_opts = [_site_key(a, site, o) for o in opts]
        missing = [o for o in file_opts if o not in a.koptimizers]
        if missing:
            raise Refusal(plan.anchor_node, f"`{missing[0][0]}` is not created in this file")
        used = {_site_key(a, site, m) for s in site.stmts for m in a.model_of_stmt(s, site.models)}
        step_scope = site.owner if isinstance(site.owner, cst.FunctionDef) else a.scope_owner(site.owner)
        names, setup, anchor, item, imports = self._setup(
            a, step_scope, sorted(used), [a.koptimizers[o] for o in file_opts], site.trigger, scaler, plan.anchor_node)
        e = Edits()
        e.add_after(anchor, setup)
        for r in plan.regions:
            e.regions[id(r.stmts[0])] = r
            e.touched.append((r.stmts[0], True))
        if scaler:
            sc = names["scaler"]
            for c in plan.backwards:
                if _is_autograd_backward(c):  # torch.autograd.backward(loss) -> (scaler.scale(loss))
                    arg = _loss_arg(c)
                    assert arg is not None
                    scaled = cst.Call(func=cst.parse_expression(f"{sc}.scale"),
                                      args=[cst.Arg(arg.value.with_changes(lpar=[], rpar=[]))])
                    e.calls[id(c)] = c.with_changes(
                        args=[x.with_changes(value=scaled) if x is arg else x for x in c.args])
                    e.touched.append((c, False))
                    continue
                recv = c.func.value  # type: ignore[union-attr]
                recv = recv.with_changes(lpar=[], rpar=[])
                new_func = cst.Attribute(value=cst.Call(func=cst.parse_expression(f"{sc}.scale"), args=[cst.Arg(recv)]),
                                         attr=cst.Name("backward"))
                e.calls[id(c)] = c.with_changes(func=new_func)
                e.touched.append((c, False))
            for c, o in plan.steps:
                e.calls[id(c)] = cst.Call(func=cst.parse_expression(f"{sc}.step"),
                                          args=[cst.Arg(c.func.value)])  # type: ignore[union-attr]
                e.touched.append((c, False))
            last = max((a.statement(c) for c, _ in plan.steps), key=a.pos)
            e.add_after(last, [_stmt(f"{sc}.update()\n")])
            for s, os_ in plan.unscale_before:
                e.add_before(s, [_stmt(f"{sc}.unscale_({o})\n") for o in os_])
            self._checkpoints(a, e, file_opts, sc, anchor, step_scope)
        # The fix replaces the smallest top-level statement holding every edit (a training function),
        # so each step costs what its function costs and steps of different functions apply together.
        root = self._edit_root(a, e)
        new = root.visit(_Rewrite(e, item))
        extra = " and scale the loss with `torch.amp.GradScaler`" if scaler else " (bfloat16)"
        self.report(plan.anchor_node, fmt={"extra": extra}, replacement=new, target=root,
                    tags=[Tag.NUMERICS], imports=imports,
                    note="forward and loss run in float16 on CUDA / bfloat16 elsewhere (VAL-6 AMP rows)")

    @staticmethod
    def _edit_root(a: _Analysis, e: Edits) -> cst.CSTNode:
        """The top-level statement that holds every edit of ``e``, or the module."""
        root = None
        for node, in_list in e.touched:
            cur = a.parent(node) if in_list else node  # a statement added or wrapped: its block changes
            if cur is None or isinstance(cur, cst.Module):
                return a.module
            parent = a.parent(cur)
            while parent is not None and not isinstance(parent, cst.Module):
                cur, parent = parent, a.parent(parent)
            if parent is None or (root is not None and root is not cur):
                return a.module
            root = cur
        return root if root is not None else a.module

    def _named_dict(self, a: _Analysis, name: str, use: cst.CSTNode) -> cst.Dict | None:
        """The dict literal last bound to ``name`` by a plain assignment before ``use``, in its scope."""
        index = a.__dict__.get("_dict_assigns")
        if index is None:  # name -> `name = {...}` statements, one walk for the file
            index = {}
            for n in a.all_nodes:
                small = _single_small(n) if isinstance(n, cst.SimpleStatementLine) else None
                if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.value, cst.Dict) \
                        and isinstance(small.targets[0].target, cst.Name):
                    index.setdefault(small.targets[0].target.value, []).append(n)
            a._dict_assigns = index
        best = None
        scope = a.scope_owner(use)
        for n in index.get(name, ()):
            if a.pos(n) < a.pos(use) and a.scope_owner(n) is scope:
                if best is None or a.pos(n) > a.pos(best):
                    best = n
        return best.body[0].value if best is not None else None  # type: ignore[union-attr]

    def _checkpoint_calls(self, a: _Analysis) -> list[tuple[cst.Call, bool]]:
        """(call, is torch.save) for every `torch.save(x, ...)` and `x.load_state_dict(...)`, in walk order."""
        calls = a.__dict__.get("_ckpt_calls")
        if calls is None:
            calls = a._ckpt_calls = []
            for c in a.module_calls():
                if isinstance(c.func, cst.Attribute) and c.func.attr.value == "load_state_dict":
                    calls.append((c, False))
                elif isinstance(c.func, (cst.Name, cst.Attribute)) and c.args and callee(self, c) == "torch.save":
                    calls.append((c, True))
        return calls

    def _checkpoints(self, a: _Analysis, e: Edits, opts: list[Key], sc: str, anchor: cst.CSTNode,
                     step_scope: cst.CSTNode) -> None:
        anchor_scope = a.scope_owner(anchor)

        def visible(n: cst.CSTNode) -> bool:
            return a.pos(n) > a.pos(anchor) and (isinstance(anchor_scope, cst.Module)
                                                 or a.scope_owner(n) is anchor_scope)

        def is_opt(name: str | None, at: cst.CSTNode) -> bool:
            """``name`` read at ``at`` is one of the step's optimizers (also as the same-named parameter of
            a helper, `def save(model, optimizer)` called as `save(model, optimizer)`)."""
            k = a.param_alias(at).get(name) if name is not None else None
            return (k if k is not None else a.key(name, at)) in opts

        for c, is_save in self._checkpoint_calls(a):
            if is_save:
                d = c.args[0].value
                if isinstance(d, cst.Name):  # ckpt = {...}; torch.save(ckpt, f)
                    d = self._named_dict(a, d.value, c)
                if isinstance(d, cst.Dict) and visible(d) and visible(c):
                    keys = [string_value(el.key) for el in d.elements if isinstance(el, cst.DictElement)]
                    if "scaler" in keys:
                        continue
                    saves_opt = any(isinstance(el, cst.DictElement) and isinstance(el.value, cst.Call)
                                    and isinstance(el.value.func, cst.Attribute)
                                    and el.value.func.attr.value == "state_dict"
                                    and is_opt(dotted(el.value.func.value), el.value) for el in d.elements)
                    if saves_opt:
                        el = cst.DictElement(key=cst.SimpleString('"scaler"'),
                                             value=cst.parse_expression(f"{sc}.state_dict()"))
                        e.dicts[id(d)] = cst.Dict(elements=[el])
                        e.touched.append((d, False))
            elif is_opt(dotted(c.func.value), c) and len(c.args) == 1:  # type: ignore[union-attr]
                arg = c.args[0].value
                stmt = a.statement(c)
                if isinstance(arg, cst.Subscript) and isinstance(arg.value, cst.Name) and \
                        isinstance(stmt, cst.SimpleStatementLine) and visible(stmt):
                    k = arg.value.value
                    e.add_after(stmt, [_stmt(f'if "scaler" in {k}:\n    {sc}.load_state_dict({k}["scaler"])\n')])


class MissingGradScaler(_AmpBase):
    """## What it does
    Flags float16 autocast in a training step (a step with `backward()` and `optimizer.step()`)
    when the file creates no `GradScaler`: `torch.autocast("cuda")` without a dtype,
    `dtype=torch.float16`/`torch.half`, or the deprecated `torch.cuda.amp.autocast()`. Display-only:
    the scaler rewrite (AMP-003) is inserted by TOP202 together with autocast, so a float32 step
    never ends up half converted; this rule covers steps someone already put under autocast.

    ## Why is this slow
    Without loss scaling, small float16 gradients flush to zero and large ones overflow, so
    float16 training silently stalls or diverges; the usual workaround, training in float32,
    gives up the Tensor Core speed-up.

    ## Example
    ```python
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    ```

    ## Use instead
    ```python
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    ```

    ## Fix safety
    No automatic fix (display-only). Adding a scaler changes numerics: gradients are computed on a
    scaled loss and unscaled in float32 before the step, and steps whose gradients overflow are
    skipped, so the number of optimizer updates can differ from the unscaled program. The
    validator tolerance for such a change is the VAL-6 AMP float16 row.
    """

    code = "TOP203"
    name = "missing-grad-scaler"
    family = FAMILY
    message = "float16 autocast in a training step without a `GradScaler`: gradients can underflow"
    safety = Safety.DISPLAY
    tags = (Tag.NUMERICS,)
    prefilter = ("autocast",)
    requires = ("optim", "backward")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and _prefilter.missing_grad_scaler_possible(text)

    examples = (
        Invalid(_FP16_NO_SCALER, after=None),
        Valid(_AMP_DONE),
        Valid(_BF16_AUTOCAST, note="bfloat16 needs no scaler"),
        Valid(_STEP_AFTER.replace("scaler = torch.amp.GradScaler", "scaler = torch.amp.GradScaler")),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = _Analysis(self)
        if a.has_scaler() or not a.optimizers:
            return
        has_backward = any(_backward_call(s) is not None for s in a.all_nodes
                           if isinstance(s, cst.SimpleStatementLine))
        if not has_backward:
            return
        for n in a.all_nodes:
            if isinstance(n, cst.WithItem) and isinstance(n.item, cst.Call) and self._fp16(n.item):
                self.report(n.item)

    def _fp16(self, call: cst.Call) -> bool:
        q = callee(self, call)
        if q not in _AUTOCASTS or q == "torch.cpu.amp.autocast":
            return False
        kw = {x.keyword.value: x.value for x in call.args if x.keyword is not None}
        pos = [x.value for x in call.args if x.keyword is None and not x.star]
        if "enabled" in kw and isinstance(kw["enabled"], cst.Name) and kw["enabled"].value == "False":
            return False
        if "dtype" in kw:
            return dtype_of(self, kw["dtype"]) == "float16"
        if q == "torch.cuda.amp.autocast":
            return not pos or not (isinstance(pos[0], cst.Name) and pos[0].value == "False")
        dev = kw.get("device_type", pos[0] if pos else None)
        if len(pos) > 1:
            return dtype_of(self, pos[1]) == "float16"
        return string_value(dev) == "cuda"


class InferenceAutocast(_AmpBase):
    """## What it does
    In an inference-only script (no `backward()` anywhere in the file), wraps the model forward
    of a loop that runs under `torch.no_grad()` / `torch.inference_mode()` in `torch.autocast`
    (AMP-005), with the same `enabled=` switch and device-agnostic dtype as TOP202 and no scaler.
    Names assigned by the forward and used afterwards are upcast with `.float()` so metric code
    (`.numpy()`, matmuls with float32 tensors) keeps working. Evaluation loops in training
    scripts are left alone (the training rewrite is TOP202). Option `dtype` as for TOP202.

    ## Why is this slow
    The forward's matmuls and convolutions run in float32 instead of on float16/bfloat16 Tensor
    Cores, at a fraction of the throughput and twice the memory traffic.

    ## Example
    ```python
    with torch.no_grad():
        for x in batches:
            out = model(x)
            preds.append(out.argmax(1))
    ```

    ## Use instead
    ```python
    with torch.no_grad():
        for x in batches:
            with torch.autocast(device_type=amp_device_type, dtype=amp_dtype, enabled=use_amp):
                out = model(x)
            out = out.float()
            preds.append(out.argmax(1))
    ```

    ## Fix safety
    Unsafe (numerics): the forward computes in float16 (CUDA) or bfloat16 (elsewhere); outputs
    differ from float32 by about rel-L2 3.7e-4 (fp16) / 3.5e-3 (bf16) on a small MLP (E-06) and an
    `argmax` can flip on near ties. `torchopt validate` tolerates the VAL-6 AMP rows: rtol 1e-2,
    atol 1e-3·max|ref|, rel-L2 1e-2 for float16; rtol 5e-2, atol 1e-2·max|ref|, rel-L2 5e-2 for
    bfloat16. A CPU run uses bfloat16 CPU autocast, whose op lists differ from CUDA's.
    `TORCHOPT_AMP=0` restores the float32 program.
    """

    code = "TOP205"
    min_torch = (1, 10)  # `torch.autocast(device_type)`
    name = "inference-autocast"
    family = FAMILY
    message = "inference forward runs in float32: wrap it in `torch.autocast`"
    refuse_message = "inference forward not rewritten to mixed precision: {reason}"
    fix_title = "Insert `torch.autocast` around the forward"
    safety = Safety.UNSAFE
    tags = (Tag.NUMERICS,)
    prefilter = ("no_grad", "inference_mode")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and _prefilter.inference_autocast_possible(text)

    options = (OPTION_DTYPE,)
    examples = (
        Invalid(_INF_SRC, after=_INF_AFTER, unsafe="numerics"),
        Valid(_INF_AFTER, note="already under autocast"),
        Valid(_TRAIN_WITH_EVAL, note="eval loops of training scripts are left to the training rewrite"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = _Analysis(self)
        if not a.models:
            return
        for n in a.all_nodes:
            if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "backward":
                return
        if a.autocast_with(a.module):
            return
        e = Edits()
        first = None
        used: list[str] = []
        loops = []
        for n in a.all_nodes:
            if not isinstance(n, (cst.For, cst.While)):
                continue
            lists = []
            body = _body_list(n.body)
            if body is None:
                continue
            if self._under_no_grad(a, n):
                lists.append(body)
            for s in body:
                if isinstance(s, cst.With) and any(self._no_grad(i.item) for i in s.items):
                    inner = _body_list(s.body)
                    if inner:
                        lists.append(inner)
            for lst in lists:
                idx = [j for j, s in enumerate(lst) if a.calls_model(s, a.models)]
                if not idx:
                    continue
                j0 = idx[0]
                j1 = j0
                while j1 + 1 < len(lst) and a.calls_model(lst[j1 + 1], a.models):
                    j1 += 1
                region = list(lst[j0:j1 + 1])
                bad = [s for s in region if _excluded(s) or not isinstance(s, cst.SimpleStatementLine)]
                if bad:
                    self.report(bad[0], message=self.refuse_message.format(
                        reason="the forward shares its statement with metric or host-conversion code"))
                    continue
                r = Region(region)
                site = StepSite(lst, n, a.models, set(), {}, n)
                r.upcasts = _escapes(a, site, region, set())
                e.regions[id(region[0])] = r
                first = first or region[0]
                loops.append(n)
                for s in region:
                    used += [m for m in a.model_of_stmt(s, a.models) if m not in used]
        if first is None:
            return
        anchors = [a.model_stmt[m] for m in used if m in a.model_stmt]
        if not anchors:
            return
        try:
            names, setup, anchor, item, imports = self._setup(
                a, a.scope_owner(loops[0]), used, anchors, min(loops, key=a.pos), False, first)
        except Refusal as r:
            self.report(r.node, message=self.refuse_message.format(reason=r.reason))
            return
        # The model may be moved to its device by a later statement: set up after the last one.
        e.add_after(anchor, setup)
        new = a.module.visit(_Rewrite(e, item))
        self.report(first, replacement=new, target=a.module, tags=[Tag.NUMERICS], imports=imports,
                    note="the forward runs in float16 on CUDA / bfloat16 elsewhere (VAL-6 AMP rows)")

    def _no_grad(self, item: cst.BaseExpression) -> bool:
        return isinstance(item, cst.Call) and callee(self, item) in _NO_GRAD

    def _under_no_grad(self, a: _Analysis, node: cst.CSTNode) -> bool:
        cur = a.parent(node)
        while cur is not None and not isinstance(cur, SCOPE_NODES):
            if isinstance(cur, cst.With) and any(self._no_grad(i.item) for i in cur.items):
                return True
            cur = a.parent(cur)
        if isinstance(cur, cst.FunctionDef):
            for d in cur.decorators:
                dec = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
                if isinstance(dec, (cst.Name, cst.Attribute)) and torch_name(self, dec) in _NO_GRAD:
                    return True
        return False
