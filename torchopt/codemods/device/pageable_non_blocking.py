"""TOP106 `pageable-non-blocking`: `non_blocking=True` copies that cannot overlap, or whose result is read too early."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst
from libcst.metadata import Assignment, PositionProvider, ScopeProvider

from torchopt.analysis.arguments import drop_kwarg
from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.analysis.names import reaching_values
from torchopt.analysis.transfers import DATALOADERS
from torchopt.analysis.transfers import inside
from torchopt.analysis.transfers import move_device
from torchopt.analysis.values import DeviceKind
from torchopt.analysis.values import classify_device
from torchopt.codemods.device import FAMILY
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid

# Calls that always return a tensor in ordinary (pageable) host memory.
_HOST_COPIES = {"torch.from_numpy", "torch.frombuffer", "torch.from_file"}
# Calls that return a host tensor unless told otherwise (``device=`` or ``pin_memory=True``).
_HOST_FACTORIES = {
    "torch.tensor",
    "torch.as_tensor",
    "torch.zeros",
    "torch.ones",
    "torch.empty",
    "torch.full",
    "torch.rand",
    "torch.randn",
    "torch.randint",
    "torch.randperm",
    "torch.arange",
    "torch.linspace",
}
# Methods whose result lives in the same memory as (or a new pageable copy of) their receiver.
_SAME_MEMORY_METHODS = {
    "float",
    "double",
    "half",
    "bfloat16",
    "long",
    "int",
    "short",
    "bool",
    "byte",
    "view",
    "reshape",
    "contiguous",
    "clone",
    "permute",
    "unsqueeze",
    "squeeze",
    "transpose",
    "t",
    "flatten",
    "detach",
}
# Host reads of a tensor: the copy must have arrived.
_HOST_READ_METHODS = {"numpy", "tolist", "item", "__array__"}
_HOST_READ_FUNCTIONS = {"print", "float", "int", "bool", "str", "list", "len", "repr", "format"}
# Methods of a host tensor that touch only its metadata or make a view, or queue a copy back to a
# device behind the pending one on the same stream: calling them on an unfinished copy reads nothing.
# Any other method (`.sum()`, `.argmax()`, `.clone()`) computes on the host at once from its data.
_NO_READ_METHODS = {
    "to",
    "cuda",
    "view",
    "reshape",
    "unsqueeze",
    "squeeze",
    "permute",
    "transpose",
    "t",
    "flatten",
    "detach",
    "size",
    "dim",
    "numel",
    "element_size",
    "is_contiguous",
    "requires_grad_",
}
# Calls that wait for the queued device work (the copy included) before returning.
_WAITS = {"synchronize", "item", "tolist", "cpu"}
# Marker for a name met again while following its own assignments (``x = x.float()``).
_CYCLE = ""


class PageableNonBlocking(Rule):
    """## What it does
    Reports copies marked `non_blocking=True` that cannot run asynchronously or are read too early:
    - a host→device copy (`x.cuda(non_blocking=True)`, `x.to(device, non_blocking=True)`) whose
      source was made in ordinary, pageable host memory: by `torch.from_numpy`, `torch.tensor`,
      `torch.as_tensor`, a factory such as `torch.randn` without `device=` or `pin_memory=True`,
      a view or cast of such a tensor, or a batch of a `DataLoader(..., pin_memory=False)`. The
      source is followed through the assignments of the same function (or method).
    - a device→host copy (`y = x.to("cpu", non_blocking=True)`) whose result is read (`y.numpy()`,
      `print(y)`, any use of `y`) before anything waits for the device (`torch.cuda.synchronize()`,
      an event's or stream's `synchronize()`, `.item()`, `.cpu()`).

    ## Why is this slow
    Only page-locked (pinned) memory can be copied by DMA while the host goes on. From pageable
    memory the driver first stages the data through a pinned buffer, so `non_blocking=True` gains
    nothing: the copy is as synchronous as without it. Pin the source where it is made
    (`torch.from_numpy(a).pin_memory()` once, outside the loop; `DataLoader(..., pin_memory=True)`)
    to make the flag work. A device→host copy with `non_blocking=True` returns at once, before the
    data has arrived: reading the result without waiting reads whatever the buffer held before
    (zeros, stale values), a silent correctness bug on a GPU.

    ## Example
    ```python
    x = torch.from_numpy(features)
    x = x.to(device, non_blocking=True)
    preds = model(x).to("cpu", non_blocking=True)
    print(preds.numpy())
    ```

    ## Use instead
    ```python
    x = torch.from_numpy(features).pin_memory()
    x = x.to(device, non_blocking=True)
    preds = model(x).to("cpu")
    print(preds.numpy())
    ```

    ## Fix safety
    The device→host finding has a safe fix: `non_blocking=True` is removed, so the copy finishes
    before the next line reads it. Where the original happened to read a finished copy the values
    are the same; where it did not, the original read garbage, which is the bug. Nothing else
    changes (the result, its dtype and device are the same). The host→device finding has no
    automatic fix: removing the flag changes nothing measurable, and inserting `.pin_memory()` at
    the copy adds a host copy into a freshly pinned buffer on every call, which is slower than the
    plain copy it replaces. Pinning pays only where the tensor is made once and copied many times,
    or in the loader's worker, which is a decision about the program's structure.
    """

    code = "TOP106"
    name = "pageable-non-blocking"
    family = FAMILY
    message = "`{move}`: `{src}` is in pageable host memory ({origin}), so `non_blocking=True` cannot overlap this copy"
    early_read_message = (
        "`{move}` copies to the host asynchronously and `{name}` is read on line {line} "
        "before anything waits for it: it may hold stale data"
    )
    fix_title = "Remove `non_blocking=True` (copy synchronously)"
    safety = Safety.SAFE
    prefilter = ("non_blocking",)

    examples = (
        Invalid(
            dedent("""\
            import numpy as np
            import torch

            def predict(model, features, device):
                x = torch.from_numpy(features)
                x = x.float()
                return model(x.to(device, non_blocking=True))
            """),
            after=None,
            note="followed through two assignments of the same function",
        ),
        Invalid(
            dedent("""\
            import torch as T

            class Runner:
                def step(self, batch):
                    ids = T.tensor(batch, dtype=T.long)
                    return self.model(ids.cuda(non_blocking=True))
            """),
            after=None,
            note="an aliased import, in a method",
        ),
        Invalid(
            dedent("""\
            import torch
            from torch.utils.data import DataLoader

            loader = DataLoader(ds, batch_size=8, pin_memory=False)
            for x, y in loader:
                x = x.cuda(non_blocking=True)
            """),
            after=None,
            note="the loader does not pin its batches",
        ),
        Invalid(
            dedent("""\
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            x = torch.arange(6.0, device=device)
            y = (x * 2).to("cpu", non_blocking=True)
            total = y.numpy().sum()
            """),
            after=dedent("""\
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            x = torch.arange(6.0, device=device)
            y = (x * 2).to("cpu")
            total = y.numpy().sum()
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
            import torch as T

            class Evaluator:
                def scores(self, x):
                    out = self.model(x).to(T.device("cpu"), non_blocking=True)
                    return out.tolist()
            """),
            after=dedent("""\
            import torch as T

            class Evaluator:
                def scores(self, x):
                    out = self.model(x).to(T.device("cpu"))
                    return out.tolist()
            """),
            note="device→host, read on the next line, in a method",
        ),
        Invalid(
            dedent("""\
            import torch

            def show(t):
                print(t.to("cpu", non_blocking=True).numpy())
            """),
            after=dedent("""\
            import torch

            def show(t):
                print(t.to("cpu").numpy())
            """),
            note="read in the same expression",
        ),
        Invalid(
            dedent("""\
            import torch as T

            class Meter:
                def update(self, logits):
                    self.total += float(logits.to(T.device("cpu"), non_blocking=True).sum())
            """),
            after=dedent("""\
            import torch as T

            class Meter:
                def update(self, logits):
                    self.total += float(logits.to(T.device("cpu")).sum())
            """),
            note="an aliased import, in a method: a reduction computed on the host at once",
        ),
        Valid(
            dedent("""\
            import torch

            def fetch(t):
                return t.to("cpu", non_blocking=True).view(-1)
            """),
            note="a view of the copy reads nothing: whoever reads it must wait",
        ),
        Valid(
            dedent("""\
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            x = torch.from_numpy(__import__("numpy").ones(4)).pin_memory() if torch.cuda.is_available() \\
                else torch.ones(4, dtype=torch.float64)
            y = x.to(device, non_blocking=True)
            """),
            note="pinned where it is made (or a CPU run)",
        ),
        Valid(
            dedent("""\
            import torch

            buf = torch.empty(8, pin_memory=True)
            y = buf.cuda(non_blocking=True)
            """),
            note="allocated pinned",
        ),
        Valid(
            dedent("""\
            import torch

            def fetch(t):
                y = t.to("cpu", non_blocking=True)
                torch.cuda.synchronize()
                return y.numpy()
            """),
            note="waits before reading",
        ),
        Valid(
            dedent("""\
            import torch
            from torch.utils.data import DataLoader

            loader = DataLoader(ds, batch_size=8, pin_memory=True)
            for x, y in loader:
                x = x.cuda(non_blocking=True)
            """),
            note="pinned batches",
        ),
        Valid(
            dedent("""\
            import torch

            def move(batch, device):
                return batch.to(device, non_blocking=True)
            """),
            note="the source is a parameter: where it was made is not known",
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._copy: cst.Call | None = None  # the copy whose source is being followed

    def visit_Call(self, node: cst.Call) -> None:
        if not isinstance(node.func, cst.Attribute) or node.func.attr.value not in ("to", "cuda"):
            return
        flag = keyword(node, "non_blocking")
        if flag is None or not (isinstance(flag.value, cst.Name) and flag.value.value == "True"):
            return
        if self._to_host(node):
            self._check_early_read(node)
            return
        if move_device(self, node) is None:
            return
        src = node.func.value
        self._copy = node
        try:
            origin = self._pageable(src, set(), 0)
        finally:
            self._copy = None
        if origin:
            self.report(node, fmt={"move": source(self, node), "src": source(self, src), "origin": origin})

    # ------------------------------------------------------------------ host→device from pageable memory

    def _pageable(self, expr: cst.BaseExpression, seen: set[str], depth: int) -> str | None:
        """Why ``expr`` surely lives in pageable host memory ("made by `torch.tensor`"), _CYCLE for a
        name met again while following it, None when it may be pinned or on a device."""
        if depth > 8:
            return None
        if isinstance(expr, cst.Subscript):
            return self._pageable(expr.value, seen, depth + 1)
        if isinstance(expr, cst.Call):
            return self._pageable_call(expr, seen, depth)
        if isinstance(expr, cst.Name):
            if expr.value in seen:
                return _CYCLE
            return self._pageable_name(expr, seen | {expr.value}, depth)
        return None

    def _pageable_name(self, name: cst.Name, seen: set[str], depth: int) -> str | None:
        """Every definition of ``name`` in its scope makes a pageable tensor. A definition in the
        statement of the copy itself (``x = x.cuda(non_blocking=True)``) comes after the copy."""
        try:
            scope = self.get_metadata(ScopeProvider, name)
        except KeyError:
            return None
        if scope is None or name.value not in scope:
            return None
        origins: list[str] = []
        for a in scope[name.value]:
            if not isinstance(a, Assignment):
                return None
            parent = self.get_metadata(ParentProvider, a.node, None)
            stmt = self.get_metadata(ParentProvider, parent, None) if isinstance(parent, cst.AssignTarget) else parent
            if (
                isinstance(stmt, (cst.Assign, cst.AnnAssign))
                and stmt.value is not None
                and (
                    isinstance(parent, cst.AssignTarget) or (isinstance(stmt, cst.AnnAssign) and stmt.target is a.node)
                )
            ):
                if self._copy is not None and inside(self, self._copy, stmt):
                    continue
                origin = self._pageable(stmt.value, seen, depth + 1)
            else:
                origin = self._loader_batch(a.node)
            if origin is None:
                return None
            origins.append(origin)
        return next((o for o in origins if o), _CYCLE if origins else None)

    def _pageable_call(self, call: cst.Call, seen: set[str], depth: int) -> str | None:
        if has_star(call):
            return None
        if (
            isinstance(call.func, cst.Attribute)
            and call.func.attr.value in _SAME_MEMORY_METHODS
            and callee(self, call) is None
        ):
            if call.func.attr.value in ("int", "float", "long") and positional(call):
                return None
            return self._pageable(call.func.value, seen, depth + 1)
        name = callee(self, call)
        if name in _HOST_COPIES:
            return f"made by `{name}`"
        if name in _HOST_FACTORIES:
            if keyword(call, "device") is not None:
                return None
            pin = keyword(call, "pin_memory")
            if pin is not None and not (isinstance(pin.value, cst.Name) and pin.value.value == "False"):
                return None
            return f"made by `{name}` on the host"
        return None

    def _loader_batch(self, target: cst.CSTNode) -> str | None:
        """A description when ``target`` is (part of) the target of ``for ... in loader`` (possibly
        through ``enumerate``/``tqdm``) and ``loader`` is bound only to ``DataLoader(...,
        pin_memory=False)``; otherwise None."""
        cur: cst.CSTNode | None = target
        while isinstance(cur, (cst.Name, cst.Tuple, cst.List, cst.Element, cst.StarredElement)):
            parent = self.get_metadata(ParentProvider, cur, None)
            if isinstance(parent, cst.For) and parent.target is cur:
                return self._unpinned_loader(parent.iter)
            cur = parent
        return None

    def _unpinned_loader(self, it: cst.BaseExpression) -> str | None:
        for _ in range(3):
            if (
                isinstance(it, cst.Call)
                and isinstance(it.func, cst.Name)
                and it.func.value in ("enumerate", "tqdm")
                and positional(it)
            ):
                it = positional(it)[0].value
        if not isinstance(it, cst.Name):
            return None
        values = reaching_values(self, it)
        if not values:
            return None
        for v in values:
            if not (isinstance(v, cst.Call) and callee(self, v) in DATALOADERS) or has_star(v):
                return None
            pin = keyword(v, "pin_memory")
            if pin is None or not (isinstance(pin.value, cst.Name) and pin.value.value == "False"):
                return None
        return "a batch of a DataLoader with `pin_memory=False`"

    # ------------------------------------------------------------------ device→host read too early

    def _to_host(self, call: cst.Call) -> bool:
        if not isinstance(call.func, cst.Attribute) or call.func.attr.value != "to" or has_star(call):
            return False
        dev = keyword(call, "device")
        pos = positional(call)
        expr = dev.value if dev is not None else (pos[0].value if pos else None)
        d = classify_device(self, expr)
        return d.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and d.is_cpu

    def _check_early_read(self, call: cst.Call) -> None:
        parent = self.get_metadata(ParentProvider, call, None)
        fmt = {"move": source(self, call)}
        if self._read_in_place(call, parent):
            line = self._line(call)
            self.report(
                call,
                fmt={**fmt, "name": source(self, call), "line": str(line)},
                message=self.early_read_message,
                replacement=drop_kwarg(call, "non_blocking"),
            )
            return
        if not (
            isinstance(parent, cst.Assign)
            and len(parent.targets) == 1
            and isinstance(parent.targets[0].target, cst.Name)
        ):
            return
        name = parent.targets[0].target.value
        read = self._first_read_before_wait(parent, name)
        if read is not None:
            self.report(
                call,
                fmt={**fmt, "name": name, "line": str(self._line(read))},
                message=self.early_read_message,
                replacement=drop_kwarg(call, "non_blocking"),
            )

    def _read_in_place(self, call: cst.Call, parent: cst.CSTNode | None) -> bool:
        """``t.to("cpu", non_blocking=True).numpy()``, ``.sum()`` or ``print(t.to(...))``: read at once."""
        if isinstance(parent, cst.Attribute) and parent.value is call:
            if parent.attr.value in _HOST_READ_METHODS:
                return True
            method_call = self.get_metadata(ParentProvider, parent, None)
            return (
                isinstance(method_call, cst.Call)
                and method_call.func is parent
                and parent.attr.value not in _NO_READ_METHODS
            )
        if isinstance(parent, cst.Arg):
            outer = self.get_metadata(ParentProvider, parent, None)
            return (
                isinstance(outer, cst.Call)
                and isinstance(outer.func, cst.Name)
                and outer.func.value in _HOST_READ_FUNCTIONS
            )
        return False

    def _first_read_before_wait(self, assign: cst.Assign, name: str) -> cst.Name | None:
        """The first use of ``name`` after ``assign`` in the same block, unless a wait comes first."""
        line = self.get_metadata(ParentProvider, assign, None)
        block = self.get_metadata(ParentProvider, line, None) if line is not None else None
        if not isinstance(line, cst.SimpleStatementLine) or block is None:
            return None
        body = list(getattr(block, "body", ()))
        if not any(s is line for s in body):
            return None
        at = next(i for i, s in enumerate(body) if s is line)
        rest_small = list(line.body)[list(line.body).index(assign) + 1 :]
        for stmt in [*rest_small, *body[at + 1 :]]:
            for n in walk(stmt):
                if isinstance(n, cst.Call) and isinstance(n.func, (cst.Attribute, cst.Name)):
                    fname = n.func.attr.value if isinstance(n.func, cst.Attribute) else n.func.value
                    receiver = n.func.value if isinstance(n.func, cst.Attribute) else None
                    reads_it = receiver is not None and any(
                        isinstance(r, cst.Name) and r.value == name for r in walk(receiver)
                    )
                    if fname in _WAITS and not reads_it:  # `y.item()` on the host copy waits for nothing
                        return None
                if isinstance(n, cst.Name) and n.value == name:
                    return n
        return None

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line
