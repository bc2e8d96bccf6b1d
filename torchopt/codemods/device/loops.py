"""Host→device copies in loops (rules.md DEV-004, DEV-005).

TOP104: a DataLoader whose batches are copied to the device: pin its batches and copy them
asynchronously. TOP105: diagnostics for device placement inside loops and legacy idioms."""
from __future__ import annotations

import ast as _ast
import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import Assignment, ScopeProvider

from torchopt.rewrite.metadata import ParentProvider

from torchopt.analysis.names import callee, is_tensor_name, method_call, torch_name, torch_ref
from torchopt.analysis.values import classify_device, string_value
from torchopt.analysis.arguments import has_star, keyword, positional, set_kwarg
from torchopt.analysis.syntax import in_loop, source
from torchopt.analysis.precheck.scopes import ast_loop_calls, ast_scope_chain
from torchopt.analysis.precheck.torch_imports import ast_torch_names, torch_calls_to, torch_import_map
from torchopt.analysis.precheck.tree import ast_index
from torchopt.analysis.names import NOT_TENSOR, TENSOR_NAMESPACES
from torchopt.analysis.values import DTYPES
from torchopt.codemods.device import FAMILY
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid
from torchopt.analysis.transfers import (
    loop_copies,
    DATALOADERS, end_of, move_device, mutated_names, start_of
)

_PIN_MEMORY_POSITION = 7  # DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory, ...)

# --------------------------------------------------------------------------- small analysis helpers


# --------------------------------------------------------------------------- TOP104


@dataclass
class _LoaderUse:
    call: cst.Call
    kinds: set[str] = field(default_factory=set)


class UnpinnedHostCopy(Rule):
    """## What it does
    Flags a `torch.utils.data.DataLoader` whose batches are copied to the device in a `for` loop
    (`for x, y in loader`, `for i, (x, y) in enumerate(loader)`, `for b in tqdm(loader)`) when
    the loader does not pin its batches or the copies are synchronous. Two findings, each with its
    own fix: `pin_memory=...` on the `DataLoader(...)` call, and `non_blocking=True` on each
    host→device copy (`x.cuda()`, `x.to(device)`) of a tensor that comes from the loop target.

    ## Why is this slow
    A copy from ordinary (pageable) host memory is staged through a pinned buffer by the driver
    and blocks the host until it is done, so the next kernels cannot be queued meanwhile. With
    `pin_memory=True` the loader's worker puts every batch in page-locked memory, and a copy with
    `non_blocking=True` from there is a true asynchronous DMA that overlaps with compute.

    ## Example
    ```python
    loader = DataLoader(ds, batch_size=64, num_workers=4)
    for x, y in loader:
        x, y = x.cuda(), y.cuda()
    ```

    ## Use instead
    ```python
    loader = DataLoader(ds, batch_size=64, num_workers=4, pin_memory=True)
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
    ```

    ## Fix safety
    Safe: the values are identical. A host→device copy with `non_blocking=True` is ordered before
    every later kernel on the same stream, and a DataLoader yields a fresh batch per iteration, so
    nothing mutates the source while the copy runs (copies of tensors mutated in place in the loop
    are left alone). `non_blocking` is never added to device→host copies (`.cpu()`, `.to('cpu')`),
    whose result the host may read before it arrives. `pin_memory=True` is used when the copies go
    to CUDA explicitly; when the device comes from a variable the fix writes
    `pin_memory=torch.cuda.is_available()`, so the script still runs without a GPU. A loader that
    already passes `pin_memory` (any value) or `**kwargs` keeps its arguments. The fix does not
    insert `.pin_memory()` calls, which are slower than a plain copy.
    """

    code = "TOP104"
    name = "unpinned-host-copy"
    family = FAMILY
    message = "`{move}` copies a DataLoader batch to the device synchronously"
    loader_message = "`{loader}` feeds host→device copies but does not pin its batches"
    fix_title = "Add `non_blocking=True`"
    loader_fix_title = "Add `pin_memory={value}`"
    safety = Safety.SAFE
    prefilter = ("DataLoader",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import torch_calls_to

        # visit_Call/leave_Module: `<name> = DataLoader(...)` and a `.cuda()`/`.to()` in a for loop.
        if not super().could_match(text):
            return False
        calls = torch_calls_to(text, DATALOADERS)
        if calls is None:
            return True
        if not calls:
            return False
        loop_calls = ast_loop_calls(text)
        return loop_calls is None or any(
            isinstance(c.func, _ast.Attribute) and c.func.attr in ("cuda", "to") for c, _ in loop_calls)

    _HEAD = "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n"
    _DS = "ds = TensorDataset(torch.arange(8.0).reshape(4, 2), torch.arange(4))\n"
    examples = (
        Invalid(
            _HEAD + _DS + "loader = DataLoader(ds, batch_size=2, num_workers=4)\n"
            "for x, y in loader:\n    x, y = x.cuda(), y.cuda()\n",
            after=_HEAD + _DS + "loader = DataLoader(ds, batch_size=2, num_workers=4, pin_memory=True)\n"
            "for x, y in loader:\n    x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)\n",
        ),
        Invalid(
            _HEAD + "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n" + _DS
            + "loader = DataLoader(ds, batch_size=2)\nseen = []\n"
            "for x, y in loader:\n    x, y = x.to(device), y.to(device)\n    seen.append(x.sum(0) + y)\n",
            after=_HEAD + "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n" + _DS
            + "loader = DataLoader(ds, batch_size=2, pin_memory=torch.cuda.is_available())\nseen = []\n"
            "for x, y in loader:\n    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)\n"
            "    seen.append(x.sum(0) + y)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\nfrom torch.utils.data import DataLoader\n\n"
            "def train(model, ds, device):\n"
            "    loader = DataLoader(ds, batch_size=32, shuffle=True)\n"
            "    for step, (images, labels) in enumerate(loader):\n"
            "        out = model(images.to(device))\n"
            "        loss = (out - labels.to(device, torch.float32)).pow(2).mean()\n",
            after="import torch\nfrom torch.utils.data import DataLoader\n\n"
            "def train(model, ds, device):\n"
            "    loader = DataLoader(ds, batch_size=32, shuffle=True, pin_memory=torch.cuda.is_available())\n"
            "    for step, (images, labels) in enumerate(loader):\n"
            "        out = model(images.to(device, non_blocking=True))\n"
            "        loss = (out - labels.to(device, torch.float32, non_blocking=True)).pow(2).mean()\n",
        ),
        Invalid(
            "import torch\n\nloader = torch.utils.data.DataLoader(ds, pin_memory=True)\n"
            "for batch in loader:\n    batch = batch.cuda()\n",
            after="import torch\n\nloader = torch.utils.data.DataLoader(ds, pin_memory=True)\n"
            "for batch in loader:\n    batch = batch.cuda(non_blocking=True)\n",
            note="the loader already pins: only the copy changes",
        ),
        Invalid(
            "from torch.utils.data import DataLoader\n\nloader = DataLoader(ds)\n"
            "for x, y in loader:\n    x = x.cuda(non_blocking=True)\n",
            after="from torch.utils.data import DataLoader\n\nloader = DataLoader(ds, pin_memory=True)\n"
            "for x, y in loader:\n    x = x.cuda(non_blocking=True)\n",
            note="the copies are already asynchronous: only the loader changes",
        ),
        Valid(
            _HEAD + _DS + "loader = DataLoader(ds, batch_size=2)\n"
            "for x, y in loader:\n    x = x.to('cpu')\n", runnable=True,
        ),
        Valid(
            "import torch\nfrom torch.utils.data import DataLoader\n\nloader = DataLoader(ds, pin_memory=False)\n"
            "for x, y in loader:\n    x = x.cuda(non_blocking=True)\n",
        ),
        Valid(
            "import torch\nfrom torch.utils.data import DataLoader\n\n"
            "def make(ds, **kw):\n    loader = DataLoader(ds, **kw)\n"
            "    for x, y in loader:\n        x = x.cuda(non_blocking=True)\n",
        ),
        Valid(
            "import torch\nfrom torch.utils.data import DataLoader\n\nloader = DataLoader(ds, pin_memory=True)\n"
            "for x, y in loader:\n    p = model(x.cuda(non_blocking=True)).cpu()\n    q = p.to('cpu')\n",
            note="device→host copies never get non_blocking",
        ),
        Valid(
            "import torch\nfrom torch.utils.data import DataLoader\n\nloader = DataLoader(ds)\n"
            "for x, y in loader:\n    x = x.to(other)\n",
            note="`other` may be a tensor or a dtype",
        ),
        Valid(
            "from torch.utils.data import DataLoader\n\ndef build(ds):\n    loader = DataLoader(ds)\n    return loader\n\n"
            "def train(loader):\n    for x, y in loader:\n        x = x.cuda()\n",
            note="the loop's loader is a parameter, not the DataLoader built elsewhere",
        ),
    )

    def __init__(self, ctx) -> None:  # type: ignore[no-untyped-def]
        super().__init__(ctx)
        self._loaders: dict[int, cst.Call] = {}  # id(binding Name) -> DataLoader call
        self._fors: list[cst.For] = []

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) not in DATALOADERS:
            return
        parent = self.get_metadata(ParentProvider, node, None)
        if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
            target = parent.targets[0].target
        elif isinstance(parent, cst.AnnAssign):
            target = parent.target
        else:
            return
        if isinstance(target, cst.Name):
            self._loaders[id(target)] = node

    def visit_For(self, node: cst.For) -> None:
        if node.asynchronous is None:
            self._fors.append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self._loaders:
            return
        uses: dict[int, _LoaderUse] = {}
        moves: dict[int, cst.Call] = {}
        for loop in self._fors:
            unwrapped = self._unwrap(loop.iter, loop.target)
            if unwrapped is None:
                continue
            name, target = unwrapped
            calls = self._loader_calls(name)
            if not calls:
                continue
            kinds, fixable = self._moves(loop, target)
            if not kinds:
                continue
            for call in calls:
                uses.setdefault(id(call), _LoaderUse(call)).kinds |= kinds
            for m in fixable:
                moves[id(m)] = m
        for m in moves.values():
            self.report(m, fmt={"move": source(self, m)},
                        replacement=set_kwarg(m, "non_blocking", cst.Name("True")))
        for use in uses.values():
            self._report_loader(use)

    def _report_loader(self, use: _LoaderUse) -> None:
        call = use.call
        if has_star(call) or keyword(call, "pin_memory") is not None:
            return
        if len(positional(call)) > _PIN_MEMORY_POSITION:
            return
        if use.kinds == {"cuda"}:
            value: cst.BaseExpression = cst.Name("True")
            imports = ()
        else:
            ref = torch_ref(self)
            if ref is None:
                return
            value = ref.attr("cuda.is_available()")
            imports = ref.imports
        text = cst.Module([]).code_for_node(value)
        fmt = {"loader": source(self, call.func) + "(...)", "value": text}
        self.report(call, fmt=fmt, message=self.loader_message, fix_title=self.loader_fix_title,
                    replacement=set_kwarg(call, "pin_memory", value), imports=imports)

    def _unwrap(self, it: cst.BaseExpression, target: cst.BaseExpression
                ) -> tuple[cst.Name, cst.BaseExpression] | None:
        """The loader name and the part of the target that receives its batches."""
        for _ in range(4):
            if isinstance(it, cst.Name):
                return it, target
            if not isinstance(it, cst.Call) or has_star(it):
                return None
            args = positional(it)
            if not args:
                return None
            fname = it.func.value if isinstance(it.func, cst.Name) else (
                it.func.attr.value if isinstance(it.func, cst.Attribute) else "")
            if fname == "enumerate" and isinstance(it.func, cst.Name):
                if not isinstance(target, (cst.Tuple, cst.List)) or len(target.elements) != 2:
                    return None
                target = target.elements[1].value
            elif fname in ("tqdm", "track", "progress_bar"):
                pass
            else:
                return None
            it = args[0].value
        return None

    def _loader_calls(self, name: cst.Name) -> list[cst.Call]:
        """The DataLoader calls ``name`` is bound to, if every binding it can see is one."""
        try:
            scope = self.get_metadata(ScopeProvider, name)
        except KeyError:
            return []
        if scope is None or name.value not in scope:
            return []
        out = []
        for a in scope[name.value]:
            call = self._loaders.get(id(getattr(a, "node", None)))
            if call is None:
                return []
            out.append(call)
        return out

    def _moves(self, loop: cst.For, target: cst.BaseExpression) -> tuple[set[str], list[cst.Call]]:
        return loop_copies(self, loop, target)


# --------------------------------------------------------------------------- TOP105


def _could_match(text: str) -> bool:
    """DevicePlacementHint's cheap necessary condition (True when the text does not parse)."""
    index = ast_index(text)
    imports = torch_import_map(text)
    if index is None or imports is None:
        return True
    calls = index.get(_ast.Call, ())
    # (iii) `.type(<one positional argument>)` naming a torch.cuda legacy type.
    for c in calls:
        if isinstance(c.func, _ast.Attribute) and c.func.attr == "type" and len(c.args) == 1 \
                and not c.keywords and not isinstance(c.args[0], _ast.Starred):
            arg = c.args[0]
            if isinstance(arg, _ast.Constant):
                v = arg.value
                if isinstance(v, str) and v.startswith("torch.cuda.") and v[len("torch.cuda."):] in _LEGACY_TYPES:
                    return True
            elif any(q.startswith("torch.cuda.") and q[len("torch.cuda."):] in _LEGACY_TYPES
                     for q in ast_torch_names(imports, arg)):
                return True
    loop_calls = ast_loop_calls(text) or []
    in_loop_ids = {id(c) for c, _ in loop_calls}
    # (ii)/(iv) torch.tensor(<data>, ...).
    tensors = torch_calls_to(text, ("torch.tensor",)) or []
    if tensors:
        moved = {id(c.func.value) for c in calls if isinstance(c.func, _ast.Attribute)
                 and c.func.attr in ("cuda", "to") and isinstance(c.func.value, _ast.Call)
                 and not _ast_star(c) and _ast_maybe_move(imports, c)}
        for c in tensors:
            if not c.args or _ast_star(c):
                continue
            data = c.args[0]
            if isinstance(data, _ast.Name) and _ast_maybe_tensor_name(index, imports, data.id):
                chain = ast_scope_chain(text, data)
                if _ast_tensor_bindings(chain[0] if chain else None, imports, data.id):
                    return True  # (iv) copy-construction
            host = isinstance(data, (_ast.Name, _ast.ListComp)) or (
                isinstance(data, (_ast.List, _ast.Tuple)) and bool(data.elts))  # _host_data
            dev = next((k.value for k in c.keywords if k.arg == "device"), None)
            if host and id(c) in in_loop_ids and (
                    id(c) in moved or (dev is not None and _ast_maybe_device(imports, dev))):
                return True  # (ii) built in a loop, on or moved to the device
    # (i) `<name>.cuda()` / `.to(<device>)` in a loop that neither rebinds nor mutates <name>.
    changed: dict[int, set[str]] = {}
    for c, loop in loop_calls:
        f = c.func
        if not (isinstance(f, _ast.Attribute) and f.attr in ("cuda", "to") and isinstance(f.value, _ast.Name)):
            continue
        if _ast_star(c) or not _ast_maybe_move(imports, c):
            continue
        if id(loop) not in changed:
            changed[id(loop)] = _ast_bound_in(loop) | _ast_mutated_names(loop)
        if f.value.id not in changed[id(loop)]:
            return True
    return False


def _ast_star(call: _ast.Call) -> bool:
    return any(isinstance(a, _ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)


_SCOPE_TYPES = (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.Lambda, _ast.ClassDef, _ast.ListComp, _ast.SetComp,
                _ast.DictComp, _ast.GeneratorExp)


def _ast_tensor_bindings(scope, imports: dict, name: str) -> bool:
    """is_tensor_name may hold for ``name`` read in ``scope``: mirrors reaching_values (every binding
    of the scope a plain assignment of a torch tensor call) and param_annotation. True when the
    scope does not bind ``name`` itself (it is looked up outside) or says ``global``/``nonlocal``."""
    if scope is None:
        return True
    params: list[_ast.arg] = []
    if isinstance(scope, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.Lambda)):
        a = scope.args
        params = [p for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p is not None and p.arg == name]
    stores: list[_ast.Name] = []
    parents: dict[int, _ast.AST] = {}
    stack = list(_ast.iter_child_nodes(scope)) if not isinstance(scope, _ast.Module) else list(scope.body)
    if isinstance(scope, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.Lambda)):
        stack = list(scope.body) if isinstance(scope.body, list) else [scope.body]
    while stack:
        cur = stack.pop()
        if isinstance(cur, (_ast.Global, _ast.Nonlocal)) and name in cur.names:
            return True
        if isinstance(cur, _ast.Name) and cur.id == name and isinstance(cur.ctx, _ast.Store):
            stores.append(cur)
        if isinstance(cur, (_ast.Import, _ast.ImportFrom)) and any(
                (al.asname or al.name.split(".")[0]) == name for al in cur.names):
            return False  # an import binding: reaching_values has None
        if isinstance(cur, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)) and cur.name == name:
            return False
        for child in _ast.iter_child_nodes(cur):
            if not isinstance(child, _SCOPE_TYPES):
                parents[id(child)] = cur
                stack.append(child)
            elif isinstance(child, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef)) and child.name == name:
                return False
    if not stores and not params:
        return True  # looked up in an enclosing scope: not followed here
    if params:
        if stores:
            return False
        return any(p.annotation is not None and any(
            (isinstance(x, _ast.Name) and x.id == "Tensor") or (isinstance(x, _ast.Attribute) and x.attr == "Tensor")
            or (isinstance(x, _ast.Constant) and isinstance(x.value, str) and "Tensor" in x.value)
            for x in _ast.walk(p.annotation)) for p in params)
    for st in stores:
        parent = parents.get(id(st))
        if isinstance(parent, _ast.Assign) and any(t is st for t in parent.targets):
            value = parent.value
        elif isinstance(parent, _ast.AnnAssign) and parent.target is st and parent.value is not None:
            value = parent.value
        else:
            return False
        if not _ast_torch_tensor_call(imports, value):
            return False
    return True


def _ast_torch_tensor_call(imports: dict, value) -> bool:
    base = value
    while isinstance(base, _ast.Call) and isinstance(base.func, _ast.Attribute) \
            and isinstance(base.func.value, _ast.Call):
        base = base.func.value
    if not isinstance(base, _ast.Call):
        return False
    return any(any(q.startswith(ns) and "." not in q[len(ns):] for ns in TENSOR_NAMESPACES)
               and q.rsplit(".", 1)[1] not in NOT_TENSOR for q in ast_torch_names(imports, base.func))


def _ast_maybe_tensor_name(index: dict, imports: dict, name: str) -> bool:
    """is_tensor_name may hold: ``name`` is a parameter annotated with something spelling
    ``Tensor``, or some plain assignment ``name = <torch call>[.<method>(...)...]`` binds it (every
    binding must be one for is_tensor_name, so one is necessary)."""
    for a in index.get(_ast.arg, ()):
        if a.arg == name and a.annotation is not None and any(
                (isinstance(x, _ast.Name) and x.id == "Tensor") or (isinstance(x, _ast.Attribute) and x.attr == "Tensor")
                or (isinstance(x, _ast.Constant) and isinstance(x.value, str) and "Tensor" in x.value)
                for x in _ast.walk(a.annotation)):
            return True
    for n in [*index.get(_ast.Assign, ()), *index.get(_ast.AnnAssign, ())]:
        targets = n.targets if isinstance(n, _ast.Assign) else [n.target]
        if n.value is None or not any(isinstance(t, _ast.Name) and t.id == name for t in targets):
            continue
        base = n.value
        while isinstance(base, _ast.Call) and isinstance(base.func, _ast.Attribute) \
                and isinstance(base.func.value, _ast.Call):
            base = base.func.value
        if not isinstance(base, _ast.Call):
            continue
        for q in ast_torch_names(imports, base.func):
            if any(q.startswith(ns) and "." not in q[len(ns):] for ns in TENSOR_NAMESPACES) \
                    and q.rsplit(".", 1)[1] not in NOT_TENSOR:
                return True
    return False


AST_SCOPES = (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef, _ast.Lambda)
_DEVICE_LITERAL = re.compile(r"^(cuda|mps|xpu|hpu|npu|xla|privateuseone)(:\d+)?$")


def _ast_maybe_device(imports: dict, expr: _ast.AST) -> bool:
    """classify_device may call ``expr`` a non-CPU, non-meta device (the device-name convention is
    configurable, so every name and attribute may be one unless it resolves to a torch dtype)."""
    if isinstance(expr, _ast.Constant):
        v = expr.value
        if isinstance(v, str):
            return bool(_DEVICE_LITERAL.match(v))
        # an int is a device index; True/False/None are names to LibCST (the convention may match)
        return isinstance(v, int) or v is None
    if isinstance(expr, _ast.IfExp):
        return _ast_maybe_device(imports, expr.body) and _ast_maybe_device(imports, expr.orelse)
    if isinstance(expr, _ast.Call):
        return "torch.device" in ast_torch_names(imports, expr.func)
    if isinstance(expr, (_ast.Name, _ast.Attribute)):
        names = ast_torch_names(imports, expr)
        return not names or not all(q.startswith("torch.") and q[len("torch."):] in DTYPES for q in names)
    return False


def _ast_maybe_move(imports: dict, call: _ast.Call) -> bool:
    """move_device may return a host→device move for ``call`` (``.cuda(...)``/``.to(...)``)."""
    pos = call.args
    if call.func.attr == "cuda":  # type: ignore[attr-defined]
        return len(pos) <= 1
    if len(pos) > 2:
        return False
    dev = next((k.value for k in call.keywords if k.arg == "device"), None)
    if dev is None:
        if not pos:
            return False
        dev = pos[0]
    return _ast_maybe_device(imports, dev)


def _ast_bound_in(loop: _ast.AST) -> set[str]:
    """Names a store in ``loop`` (its target included) binds in the loop's own scope."""
    out: set[str] = set()
    stack = [loop]
    while stack:
        cur = stack.pop()
        if isinstance(cur, _ast.Name) and isinstance(cur.ctx, _ast.Store):
            out.add(cur.id)
        for child in _ast.iter_child_nodes(cur):
            if not isinstance(child, (*AST_SCOPES, _ast.ListComp, _ast.SetComp, _ast.DictComp, _ast.GeneratorExp)):
                stack.append(child)
    return out


def _ast_base_name(expr: _ast.AST) -> str | None:
    while isinstance(expr, _ast.Subscript):
        expr = expr.value
    return expr.id if isinstance(expr, _ast.Name) else None


def _ast_mutated_names(loop: _ast.AST) -> set[str]:
    """mutated_names on CPython's ast (the same forms, so never more names)."""
    out: set[str] = set()
    stack = [loop]
    while stack:
        cur = stack.pop()
        b = None
        if isinstance(cur, _ast.Call) and isinstance(cur.func, _ast.Attribute):
            attr = cur.func.attr
            if attr.endswith("_") and not attr.startswith("_"):
                b = _ast_base_name(cur.func.value)
        elif isinstance(cur, _ast.AugAssign):
            t = cur.target
            b = _ast_base_name(t.value if isinstance(t, _ast.Attribute) else t)
        elif isinstance(cur, _ast.Assign):
            for t in cur.targets:
                if isinstance(t, (_ast.Subscript, _ast.Attribute)) and (n := _ast_base_name(t.value)):
                    out.add(n)
        if b is not None:
            out.add(b)
        for child in _ast.iter_child_nodes(cur):
            if not isinstance(child, AST_SCOPES):
                stack.append(child)
    return out


_LEGACY_TYPES = {
    "FloatTensor": "float32", "DoubleTensor": "float64", "HalfTensor": "float16",
    "BFloat16Tensor": "bfloat16", "LongTensor": "int64", "IntTensor": "int32",
    "ShortTensor": "int16", "CharTensor": "int8", "ByteTensor": "uint8", "BoolTensor": "bool",
}


class DevicePlacementHint(Rule):
    """## What it does
    Points at device placement that costs a copy where none is needed, with advice:

    * a tensor defined before a loop and moved with `.cuda()` / `.to(device)` inside it, although
      it is never reassigned in the loop;
    * `torch.tensor([...])` built inside a loop with `device=` or moved to the device right away;
    * the legacy `t.type(torch.cuda.FloatTensor)` (or the string `'torch.cuda.FloatTensor'`);
    * `torch.tensor(t)` where `t` is already a tensor.

    ## Why is this slow
    Each `.cuda()` / `.to(device)` of a host tensor is a host→device copy; in a loop it is paid on
    every iteration although the data does not change. A tensor built from a Python list is filled
    on the host and then copied, and the copy from pageable memory synchronises the host with the
    device. `torch.tensor(t)` copies `t` through a slow generic path and warns.

    ## Example
    ```python
    w = torch.randn(128, 128)
    for x in batches:
        y = x @ w.cuda()
        mask = torch.tensor([1.0, 0.0, 1.0]).cuda()
    ```

    ## Use instead
    ```python
    w = torch.randn(128, 128).cuda()
    mask = torch.tensor([1.0, 0.0, 1.0], device='cuda')
    for x in batches:
        y = x @ w
    ```

    ## Fix safety
    Display-only: there is no automatic fix. Hoisting a move out of a loop is only correct when
    nothing in the loop depends on the host copy and the tensor does not change, which a
    syntactic check cannot prove; the message says what to change by hand.
    """

    code = "TOP105"
    name = "device-placement-hint"
    family = FAMILY
    message = "`{name}` is moved to the device on every iteration; move it once before the loop"
    literal_message = (
        "`{call}` builds a host tensor and copies it to the device every iteration "
        "(a host→device copy and a sync); build it once before the loop, or on the device"
    )
    type_message = "`{call}` uses a legacy tensor type; use `{suggestion}`"
    copy_message = "`{call}` copy-constructs from a tensor (and warns); use `{suggestion}`"
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = (".cuda(", ".to(", ".type(", "tensor", "Tensor")

    @classmethod
    def could_match(cls, text: str) -> bool:
        # What visit_Call can report on (mirrored on CPython's ast): a `.type(<torch.cuda legacy
        # type>)`, a `torch.tensor(...)` copy-constructing from a name or built in a loop, or an
        # invariant `<name>.cuda()`/`.to(<device>)` in a loop.
        return super().could_match(text) and _could_match(text)

    examples = (
        Invalid(
            "import torch\n\ndef run(xs):\n    w = torch.randn(4, 4)\n    out = []\n"
            "    for x in xs:\n        out.append(x @ w.cuda())\n    return out\n",
            after=None,
        ),
        Invalid(
            "import torch\n\ndevice = 'cuda'\nmask = torch.ones(3)\ni = 0\n"
            "while i < 10:\n    m = mask.to(device)\n    i += 1\n",
            after=None,
        ),
        Invalid(
            "import torch\n\nfor step in range(10):\n    t = torch.tensor([1.0, 2.0, 3.0]).cuda()\n",
            after=None,
        ),
        Invalid(
            "import torch\n\ndef f(rows, device):\n    for r in rows:\n"
            "        t = torch.tensor([v * 2 for v in r], device=device)\n",
            after=None,
        ),
        Invalid("import torch\n\ndef f(t):\n    return t.type(torch.cuda.FloatTensor)\n", after=None),
        Invalid("def f(t):\n    return t.type('torch.cuda.HalfTensor')\n", after=None),
        Invalid(
            "import torch\n\na = torch.zeros(3)\nb = torch.tensor(a)\n",
            after=None,
            note="suggest a.detach().clone()",
        ),
        Valid(
            "import torch\n\ndef run(xs, device):\n    w = torch.randn(4, 4)\n"
            "    for x in xs:\n        w = w.to(device)\n        x = x @ w\n",
            note="`w` is reassigned in the loop",
        ),
        Valid(
            "import torch\n\ndef run(xs):\n    for x in xs:\n        x = x.cuda()\n",
            note="the loop target changes every iteration",
        ),
        Valid(
            "import torch\n\nw = torch.randn(3)\nfor i in range(3):\n    w.add_(1)\n    v = w.cuda()\n",
            note="`w` changes in the loop",
        ),
        Valid(
            "import torch\n\nw = torch.randn(3)\nfor i in range(3):\n    v = w.to('cpu')\n",
            runnable=True,
        ),
        Valid("import torch\n\nt = torch.tensor([1.0, 2.0]).cuda()\n", note="not in a loop"),
        Valid("import torch\n\nb = torch.tensor([1, 2])\nc = torch.tensor(b.tolist())\n", runnable=True),
        Valid("def f(t, kind):\n    return t.type(kind)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Attribute):
            attr = node.func.attr.value
            if attr == "type":
                self._legacy_type(node)
            elif attr in ("cuda", "to"):
                self._loop_move(node)
        name = callee(self, node)
        if name == "torch.tensor":
            self._tensor_call(node)

    # (i) and (ii, moved form)
    def _loop_move(self, node: cst.Call) -> None:
        mv = move_device(self, node)
        if mv is None:
            return
        recv = node.func.value  # type: ignore[union-attr]
        loop = None
        if isinstance(recv, cst.Name):
            loop = in_loop(self, node)
            if loop is not None and self._invariant(recv, loop):
                self.report(node, fmt={"name": recv.value})
            return
        mc = method_call(node, ("cuda", "to"))
        if mc is None:
            return
        inner = mc[0]
        if callee(self, inner) == "torch.tensor" and self._host_data(inner) and in_loop(self, node):
            self.report(node, message=self.literal_message, fmt={"call": source(self, node)})

    def _invariant(self, name: cst.Name, loop: cst.For | cst.While) -> bool:
        try:
            scope = self.get_metadata(ScopeProvider, name)
        except KeyError:
            return False
        if scope is None or name.value not in scope:
            return False
        assignments = list(scope[name.value])
        if not assignments:
            return False
        loop_start = start_of(self, loop)
        for a in assignments:
            if not isinstance(a, Assignment) or a.scope is not scope:
                return False
            try:
                if end_of(self, a.node) > loop_start:
                    return False
            except KeyError:
                return False
        return name.value not in mutated_names(loop)

    # (ii, device= form) and (iv)
    def _tensor_call(self, node: cst.Call) -> None:
        if has_star(node):
            return
        args = positional(node)
        if not args:
            return
        data = args[0].value
        parent = self.get_metadata(ParentProvider, node, None)
        grand = self.get_metadata(ParentProvider, parent, None) if parent is not None else None
        moved = isinstance(parent, cst.Attribute) and isinstance(grand, cst.Call) and grand.func is parent \
            and parent.attr.value in ("cuda", "to") and move_device(self, grand) is not None
        if isinstance(data, cst.Name) and is_tensor_name(self, data):
            dev = keyword(node, "device")
            dtype = keyword(node, "dtype")
            parts = []
            if dev is not None:
                parts.append(f"device={source(self, dev.value)}")
            elif moved:
                assert isinstance(grand, cst.Call)
                mv = move_device(self, grand)
                parts.append(source(self, mv[1]) if mv and mv[1] is not None else "'cuda'")
            if dtype is not None:
                parts.append(f"dtype={source(self, dtype.value)}")
            suggestion = f"{data.value}.detach().to({', '.join(parts)})" if parts else f"{data.value}.detach().clone()"
            self.report(node, message=self.copy_message, fmt={"call": source(self, node), "suggestion": suggestion})
            return
        if moved:
            return  # reported at the move
        dev = keyword(node, "device")
        if dev is None:
            return
        d = classify_device(self, dev.value)
        if not d.is_device or d.is_cpu or d.text == "meta":
            return
        if self._host_data(node) and in_loop(self, node):
            self.report(node, message=self.literal_message, fmt={"call": source(self, node)})

    def _host_data(self, call: cst.Call) -> bool:
        args = positional(call)
        if not args or has_star(call):
            return False
        data = args[0].value
        if isinstance(data, (cst.List, cst.Tuple)):
            return bool(data.elements)  # `torch.tensor([])` copies nothing
        if isinstance(data, cst.ListComp):
            return True
        return isinstance(data, cst.Name) and not is_tensor_name(self, data)

    # (iii)
    def _legacy_type(self, node: cst.Call) -> None:
        args = positional(node)
        if len(node.args) != 1 or len(args) != 1:
            return
        arg = args[0].value
        q = string_value(arg)
        if q is None:
            q = torch_name(self, arg)
        if not q or not q.startswith("torch.cuda."):
            return
        dtype = _LEGACY_TYPES.get(q[len("torch.cuda."):])
        if dtype is None:
            return
        recv = node.func.value  # type: ignore[union-attr]
        if torch_name(self, recv) is not None:  # torch.cuda.FloatTensor.type(...) etc.
            return
        ref = torch_ref(self)
        tname = ref.name if ref is not None else "torch"
        suggestion = f"{source(self, recv)}.to(device='cuda', dtype={tname}.{dtype})"
        self.report(node, message=self.type_message, fmt={"call": source(self, node), "suggestion": suggestion})
