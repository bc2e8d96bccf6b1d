"""TOP610 `python-loop-over-tensor`: Python loops over a tensor's rows in custom losses and modules."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from textwrap import dedent

import libcst as cst

from torchopt.analysis.names import callee, torch_name
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import source, walk
from torchopt.codemods.sync import FAMILY
from torchopt.codemods.sync.host_values import is_host_value
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid

# Tensor methods and attributes whose result is a Python value (no tensor, so no device work).
_HOST_METHODS = {"item", "tolist", "dim", "ndimension", "size", "numel", "nelement", "stride", "is_contiguous",
                 "is_floating_point", "is_complex", "get_device", "data_ptr", "element_size", "storage_offset"}
_HOST_ATTRS = {"shape", "ndim", "dtype", "device", "requires_grad", "is_cuda", "layout", "grad_fn", "names",
               "is_leaf", "is_sparse"}
# Methods only a tensor has: a name used with one of them holds a tensor (a list or dict has none).
_TENSOR_METHODS = {"size", "shape", "dim", "view", "reshape", "unsqueeze", "squeeze", "permute", "transpose",
                   "contiguous", "flatten", "float", "half", "long", "sum", "mean", "softmax", "log_softmax",
                   "exp", "log", "abs", "pow", "clamp", "sigmoid", "masked_fill", "gather", "norm", "detach",
                   "argmax", "new_zeros", "new_ones", "new_full", "numel", "dtype", "ndim"}
# torch functions that return no tensor, or a tuple of them.
_NOT_TENSOR = {"is_tensor", "numel", "is_floating_point", "is_complex", "is_grad_enabled", "split", "chunk",
               "unbind", "is_autocast_enabled", "is_nonzero"}
# Methods and torch functions that cut a tensor into a few pieces (not `unbind`, whose pieces are its rows).
_SPLITS = {"chunk", "split", "tensor_split", "hsplit", "vsplit", "dsplit"}
_NOT_TENSOR_ANNOTATION = re.compile(r"\b(int|float|bool|str|List|list|Tuple|tuple|Dict|dict|Sequence|Iterable|"
                                    r"Callable|Mapping|Module)\b")
# Reductions over every element: summing per-row terms of one is not the same reduction of the batch.
# What `_row_header` can match, on the raw text: `x.size(0)`, `x.shape[0]`, `len(x)`, `in x:`, `enumerate(x)`.
_HEADER_TEXT = re.compile(r"\.size\(\s*0\s*\)|\.shape\[\s*0\s*\]|\blen\(|\bin\s+\w+\s*[:)]|enumerate\(\s*\w+\s*\)")
_FULL_REDUCTIONS = {"sum", "mean", "max", "min", "norm", "prod", "std", "var", "all", "any", "amax", "amin"}


@dataclass
class _Scope:
    """One function the rule reads: where it is, and which of its names hold tensors."""

    fn: cst.FunctionDef
    where: str
    loss_module: bool
    method: bool = False  # defined directly in a class body: its first parameter is `self`
    tensors: set[str] = field(default_factory=set)  # names that may hold a tensor
    sure: set[str] = field(default_factory=set)  # names that surely hold one (annotated, used as one)


@dataclass(frozen=True)
class _RowLoop:
    """A loop that visits one row of `tensor` per iteration: `index` names the row number, `row` the row."""

    node: cst.For
    tensor: str
    index: str | None
    row: str | None


class PythonLoopOverTensor(Rule):
    """## What it does
    Flags Python loops over the rows of a tensor inside an `nn.Module.forward` or a loss function
    (a function whose name contains `loss` or `criterion`, or a module class whose name ends in
    `Loss`): `for i in range(x.size(0)): ... x[i] ...`, `for i in range(len(x))`, `for row in x:`.
    Inside such a loop it also flags what reads a tensor value on the host once per row
    (`x[i].item()`, `if y[i] > 0:`), and in the `forward` of a loss module it flags branches on
    tensor values (`if err.max() > 1.0:`). When the loop only accumulates a per-row term
    (`total = total + f(x[i])`, `total += ...`, `sum(f(x[i]) for i in range(n))`) the message
    gives the batched form, a reduction over dim 0; otherwise it gives advice. Host reads and
    branches that a training or evaluation step of the same file runs are left to TOP601 and
    TOP605, which report them with the step.

    A loop is reported only when the rule is sure it walks a tensor: the loop bound is
    `x.size(0)` / `x.shape[0]`, or `x` is annotated `Tensor` or used as one in the function (a list
    of tensors, a `ModuleList` or a dict of features is not a tensor). Loops over layers
    (`for blk in self.blocks`) are never reported.

    ## Why is this slow
    The tuning guide asks for "CUDA-efficient" code: every iteration of a Python loop over rows
    launches its own small kernels (each a few microseconds of CPU time, far more than the GPU needs
    for one row), so the GPU idles between launches and the loop costs `rows x kernels` launches
    instead of a few. A `.item()` or an `if` on a tensor value per row is worse: each one copies a
    value to the host and waits for every queued kernel, once per row.

    ## Example
    ```python
    class PairLoss(nn.Module):
        def forward(self, a, b):
            total = 0
            for i in range(a.size(0)):
                total = total + (a[i] - b[i]).pow(2).sum()
            return total
    ```

    ## Use instead
    ```python
    class PairLoss(nn.Module):
        def forward(self, a, b):
            total = 0
            total = total + (a - b).pow(2).sum()
            return total
    ```
    Per-row branches become masks (`torch.where(cond, a, b)`, boolean indexing), per-row
    gathers `index_select`/`gather`, per-row updates `scatter_add_`/`index_add_`, and per-row
    function calls `torch.vmap(f)(x)`.

    ## Fix safety
    Display-only: nothing is rewritten. The batched form is the same mathematics, but it sums in
    another order (results may differ by rounding) and it is only the same function when the
    per-row term treats each row on its own (elementwise operations, reductions over the other
    dimensions); the message says which form it assumes.
    """

    code = "TOP610"
    name = "python-loop-over-tensor"
    family = FAMILY
    message = ("`{loop}` runs Python once per row of `{tensor}` in {where}: every iteration launches its own "
               "small kernels and the GPU idles between them; {advice}")
    sync_message = ("`{expr}` {verb} a tensor value once per row of `{tensor}` in {where}: each time it copies "
                    "the value to the host and waits for the GPU; compute it for every row at once (a mask, "
                    "`torch.where`) and read it once, if at all")
    branch_message = ("`{expr}` branches on a tensor value in {where}: `bool()` of a tensor copies it to the host "
                      "and waits for the GPU on every call; select on the device with `torch.where`, or check it "
                      "outside the loss")
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("forward", "loss", "Loss", "criterion")
    requires = ("torch",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # A row loop needs a header `_row_header` can read; a loss module's branch an `if`, `while` or `assert`.
        if not super().could_match(text):
            return False
        if not ("for " in text and _HEADER_TEXT.search(text) is not None) and not (
                "Loss" in text and any(tok in text for tok in ("if ", "while ", "assert "))):
            return False
        return _reports_possible(text)

    examples = (
        Invalid(dedent("""\
            import torch.nn as tnn


            class PairLoss(tnn.Module):
                def forward(self, a, b):
                    total = 0
                    for i in range(a.size(0)):
                        total = total + (a[i] - b[i]).pow(2).sum()
                    return total
            """), note="aliased `torch.nn`: the batched sum is given"),
        Invalid(dedent("""\
            import torch
            from torch import nn as N


            class Scorer(N.Module):
                def forward(self, x: torch.Tensor):
                    out = []
                    for row in x:
                        out.append(self.score(row))
                    return torch.stack(out)
            """), note="`for row in x` over an annotated tensor: advice"),
        Invalid(dedent("""\
            import torch


            def contrastive_loss(emb, labels):
                return sum((emb[i] * emb[i]).sum(-1) for i in range(emb.shape[0]))
            """), note="a loss function: `sum(...)` of per-row terms"),
        Invalid(dedent("""\
            import torch
            import torch.nn as nn


            class Trainer:
                def criterion(self, logits, target):
                    total = 0.0
                    for i in range(len(target)):
                        if target[i] > 0:
                            total += logits[i].softmax(-1).max()
                    return total / target.size(0)
            """), note="in a method; the per-row `if` is reported too"),
        Invalid(dedent("""\
            import torch
            import torch.nn as nn


            class RobustLoss(nn.Module):
                def forward(self, pred, target):
                    err = (pred - target).abs()
                    if err.max() > 1.0:
                        return (err ** 2).mean()
                    return err.mean()
            """), note="a branch on a tensor value in a loss module's forward"),
        Invalid(dedent("""\
            import torch.nn as tnn


            class TopKLoss(tnn.Module):
                def forward(self, scores, target):
                    total = 0.0
                    for i in range(scores.size(0)):
                        total += scores[i, target[i]].item()
                    return total
            """), note="aliased `torch.nn`: a per-element `.item()` in a loss module's forward"),
        Invalid(dedent("""\
            import torch as T
            from torch import nn


            class MarginLoss(nn.Module):
                def forward(self, pred, target):
                    gap = (pred - target).abs()
                    if T.max(gap) > 1.0:
                        return gap.square().mean()
                    return gap.mean()
            """), note="`import torch as T`: a branch on a tensor value in a loss module's forward"),
        Valid(dedent("""\
            import torch.nn as nn


            class Net(nn.Module):
                def forward(self, x):
                    for blk in self.blocks:
                        x = blk(x)
                    return x
            """), note="a loop over layers"),
        Valid(dedent("""\
            import torch.nn as nn


            class FPN(nn.Module):
                def forward(self, feats):
                    outs = []
                    for i in range(len(feats)):
                        outs.append(self.lateral[i](feats[i]))
                    return outs
            """), note="`feats` is a list of feature maps, not a tensor"),
        Valid(dedent("""\
            import torch.nn as nn


            class Heads(nn.Module):
                def forward(self, x):
                    return [self.heads[i](x) for i in range(x.size(0))]


            def sample_loss(n):
                for i in range(n):
                    print(i)
            """), note="no row of a tensor is read per iteration"),
        Valid(dedent("""\
            import torch.nn as nn


            class FocalLoss(nn.Module):
                def forward(self, logits, target, reduction: str = "mean"):
                    if reduction == "mean":
                        return logits.mean()
                    if target.dim() == 1:
                        target = target[:, None]
                    return logits.sum()
            """), note="branches on Python values (`reduction`, `dim()`)"),
        Valid(dedent("""\
            import mylib.nn as nn


            class PairLoss(nn.Module):
                def forward(self, a, b):
                    for i in range(a.size(0)):
                        b = b + a[i]
                    return b
            """), note="not a torch module"),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        # Classes and functions the walk is inside, innermost last: the parent map would cost a
        # whole pass over the file just to tell a method from a function.
        self._defs: list[cst.ClassDef | cst.FunctionDef] = []
        self._torch_modules: dict[tuple[int, int], bool] = {}  # (id(ClassDef), depth) -> subclass of torch.nn

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._defs.append(node)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self._defs.pop()

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self._defs.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        outer = self._defs[-1] if self._defs else None
        self._defs.append(node)
        cls = outer if isinstance(outer, cst.ClassDef) and any(s is node for s in outer.body.body) else None
        scope = self._scope(node, cls)
        if scope is None:
            return
        _collect_tensors(self, scope)
        in_loops: set[int] = set()
        for n in walk(node.body):
            if isinstance(n, cst.For):
                loop = self._row_loop(n, scope)
                if loop is not None:
                    self._report_loop(loop, scope)
                    in_loops |= self._report_syncs(loop, scope)
            elif isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value == "sum":
                self._report_sum(n, scope)
        if scope.loss_module:
            for n in walk(node.body):
                test = n.test if isinstance(n, (cst.If, cst.While, cst.IfExp, cst.Assert)) else None
                if test is not None and id(test) not in in_loops and _truth_of_tensor(self, test, scope) \
                        and not self._in_step(test):
                    self.report(test, message=self.branch_message,
                                fmt={"expr": source(self, test), "where": scope.where})

    def _in_step(self, node: cst.CSTNode) -> bool:
        """Run by a training or evaluation step of this file: the step rules (TOP601, TOP605) report
        its host reads and branches already, with the step as context."""
        return hot_map(self).where(node) is not None

    # ------------------------------------------------------------------------------ where to look

    def _scope(self, fn: cst.FunctionDef, cls: cst.ClassDef | None) -> _Scope | None:
        """The function as a place the rule reads (``cls``: the class whose body defines it)."""
        if "torch" not in self.ctx.text:
            return None  # names alone (`PairLoss`, `my_loss`) say nothing about tensors in a file without torch
        name = fn.name.value
        method = cls is not None
        if cls is not None and name in ("forward", "__call__"):
            loss = cls.name.value.endswith("Loss")
            if loss or (name == "forward" and self._is_torch_module(cls, 0)):
                return _Scope(fn, f"`{cls.name.value}.{name}`", loss_module=loss, method=method)
        if any(word in name.lower() for word in ("loss", "criterion")):
            owner = f"{cls.name.value}." if cls is not None else ""
            return _Scope(fn, f"the loss function `{owner}{name}`", loss_module=False, method=method)
        return None

    def _is_torch_module(self, cls: cst.ClassDef, depth: int) -> bool:
        """A subclass of a torch.nn class, directly or through classes of this file (answered once
        per class: every `forward` of a file asks about the same few bases)."""
        key = (id(cls), depth)
        known = self._torch_modules.get(key)
        if known is None:
            known = self._torch_modules[key] = self._subclasses_torch_nn(cls, depth)
        return known

    def _subclasses_torch_nn(self, cls: cst.ClassDef, depth: int) -> bool:
        for base in cls.bases:
            qualified = torch_name(self, base.value)
            if qualified is not None and qualified.startswith("torch.nn."):
                return True
            if isinstance(base.value, cst.Name) and depth < 4:
                local = next((s for s in self.ctx.module.body if isinstance(s, cst.ClassDef)
                              and s.name.value == base.value.value and s is not cls), None)
                if local is not None and self._is_torch_module(local, depth + 1):
                    return True
        return False

    # ------------------------------------------------------------------------------ row loops

    def _row_loop(self, loop: cst.For, scope: _Scope) -> _RowLoop | None:
        header = _row_header(self, loop.iter, loop.target, scope)
        if header is None:
            return None
        tensor, index, row = header
        body = list(walk(loop.body))
        if index is not None and not any(_indexes_row(n, index, scope) for n in body):
            return None  # the index numbers something else (layers, heads): not a row of a tensor
        if row is not None and not any(isinstance(n, cst.Name) and n.value == row for n in body):
            return None
        return _RowLoop(loop, tensor, index, row)

    def _report_loop(self, loop: _RowLoop, scope: _Scope) -> None:
        header = f"for {source(self, loop.node.target)} in {source(self, loop.node.iter)}"
        batched = _batched_sum(self, loop, scope)
        advice = (f"the same sum as one batched reduction over dim 0: `{batched}`" if batched else
                  "write the per-row work as one batched operation over dim 0 (broadcasting, masks with "
                  "`torch.where`, `gather`/`scatter_add_`, or `torch.vmap`)")
        self.report(loop.node, fmt={"loop": header, "tensor": loop.tensor, "where": scope.where, "advice": advice})

    def _report_syncs(self, loop: _RowLoop, scope: _Scope) -> set[int]:
        """`.item()` and branches on tensor values inside the loop; returns the tests reported."""
        seen: set[int] = set()
        for n in walk(loop.node.body):
            expr, verb = None, ""
            if isinstance(n, (cst.If, cst.While, cst.IfExp)) and _truth_of_tensor(self, n.test, scope):
                expr, verb = n.test, "branches on"
            elif isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "item" \
                    and _tensor_valued(self, n.func.value, scope):
                expr, verb = n, "reads"
            if expr is not None:
                seen.add(id(expr))
                if self._in_step(expr):
                    continue
                self.report(expr, message=self.sync_message, fmt={
                    "expr": source(self, expr), "verb": verb, "tensor": loop.tensor, "where": scope.where})
        return seen

    def _report_sum(self, call: cst.Call, scope: _Scope) -> None:
        """`sum(f(x[i]) for i in range(x.size(0)))`: a per-row loop written as a generator."""
        if len(call.args) != 1 or not isinstance(call.args[0].value, cst.GeneratorExp):
            return
        gen = call.args[0].value
        if gen.for_in.inner_for_in is not None or gen.for_in.ifs:
            return
        header = _row_header(self, gen.for_in.iter, gen.for_in.target, scope)
        if header is None:
            return
        tensor, index, row = header
        batched = _vectorised(self, gen.elt, index, row, tensor, scope)
        if batched is None and not (index and any(_indexes_row(n, index, scope) for n in walk(gen.elt))):
            return
        advice = (f"the same sum as one batched reduction over dim 0: `{batched}`" if batched else
                  "write the per-row term as one batched operation over dim 0")
        loop = f"for {source(self, gen.for_in.target)} in {source(self, gen.for_in.iter)}"
        self.report(call, fmt={"loop": loop, "tensor": tensor, "where": scope.where, "advice": advice})


# ---------------------------------------------------------------------------------- prefilter


def _reports_possible(text: str) -> bool:
    """Cheap necessary condition on CPython's ast for a report: a function the rule reads (a
    `forward`/`__call__` defined in a class body, or a function named like a loss) that holds a loop
    or `sum(...)` generator with a row header `_row_header` could accept (a loop over a bare name
    also needs a sign that the name holds a tensor), or, in a `__call__`/`forward` of a class named
    `...Loss`, any branch. True when the text does not parse."""
    import ast

    from torchopt.analysis.precheck.tree import ast_index, nodes_of

    index = ast_index(text)
    if index is None:
        return True
    classes = index.get(ast.ClassDef, ())
    if not any(c.name.endswith("Loss") for c in classes):
        # First over the whole file, taking every name for a tensor: most files end here.
        sums = [c for c in index.get(ast.Call, ()) if isinstance(c.func, ast.Name) and c.func.id == "sum"
                and isinstance(_only_arg(c), ast.GeneratorExp)]
        if not any(_ast_row_header(n.iter, n.target, None, n.body) for n in nodes_of(index, ast.For, ast.AsyncFor)) \
                and not any(_ast_row_header(g.iter, g.target, None, None)
                            for g in (_only_arg(c).generators[0] for c in sums)):
            return False
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for cls in classes:
        for fn in cls.body:
            if isinstance(fn, funcs) and fn.name in ("forward", "__call__") and (
                    fn.name == "forward" or cls.name.endswith("Loss")) and \
                    _row_code_possible(fn, loss_module=cls.name.endswith("Loss")):
                return True
    return any(any(w in fn.name.lower() for w in ("loss", "criterion")) and _row_code_possible(fn, loss_module=False)
               for fn in nodes_of(index, *funcs))


def _row_code_possible(fn, loss_module: bool) -> bool:
    import ast

    nodes = list(ast.walk(fn))
    if loss_module and any(isinstance(n, (ast.If, ast.While, ast.IfExp, ast.Assert)) for n in nodes):
        return True
    # Names that may surely hold a tensor: annotated `Tensor`, assigned, or used with a tensor method.
    sure = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    sure |= {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg) and a.annotation is not None
             and "Tensor" in ast.unparse(a.annotation)}
    sure |= {n.value.id for n in nodes if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.attr in _TENSOR_METHODS}
    for n in nodes:
        if isinstance(n, (ast.For, ast.AsyncFor)):
            if _ast_row_header(n.iter, n.target, sure, n.body):
                return True
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "sum" \
                and isinstance(_only_arg(n), ast.GeneratorExp):
            gen = _only_arg(n).generators[0]
            if _ast_row_header(gen.iter, gen.target, sure, None):
                return True
    return False


def _only_arg(call):
    """The value of a call's one argument however it is passed (LibCST counts keywords and stars
    as arguments too), else None."""
    import ast

    if len(call.args) + len(call.keywords) != 1:
        return None
    value = call.args[0] if call.args else call.keywords[0].value
    return value.value if isinstance(value, ast.Starred) else value


def _ast_row_header(it, target, sure: set[str] | None, body) -> bool:
    """`_row_header` and `_row_loop` on CPython's ast, looser: no tensor facts beyond ``sure``
    (None: any name may hold a tensor)."""
    import ast

    def indexes(index: str) -> bool:  # `t[index]` / `t[index, ...]` in the loop body
        if body is None:
            return True
        for n in (x for stmt in body for x in ast.walk(stmt)):
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
                first = n.slice.elts[0] if isinstance(n.slice, ast.Tuple) and n.slice.elts else n.slice
                if isinstance(first, ast.Name) and first.id == index:
                    return True
        return False

    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range" \
            and _only_arg(it) is not None and isinstance(target, ast.Name):
        bound = _only_arg(it)
        sized = isinstance(bound, ast.Call) and isinstance(bound.func, ast.Attribute) and bound.func.attr == "size" \
            and isinstance(bound.func.value, ast.Name)
        shaped = isinstance(bound, ast.Subscript) and isinstance(bound.value, ast.Attribute) \
            and bound.value.attr == "shape" and isinstance(bound.value.value, ast.Name)
        counted = isinstance(bound, ast.Call) and isinstance(bound.func, ast.Name) and bound.func.id == "len" \
            and len(bound.args) == 1 and isinstance(bound.args[0], ast.Name) \
            and (sure is None or bound.args[0].id in sure)
        return (sized or shaped or counted) and indexes(target.id)
    if isinstance(it, ast.Name) and (sure is None or it.id in sure) and isinstance(target, ast.Name):
        return True
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" \
            and isinstance(_only_arg(it), ast.Name) and (sure is None or _only_arg(it).id in sure) \
            and isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) == 2:
        return True
    return False


# ---------------------------------------------------------------------------------- tensors


def _collect_tensors(rule: Rule, scope: _Scope) -> None:
    """Parameters (not `self`, not Python-typed or defaulted to a Python literal) and the locals
    computed from them with tensor operations; `sure` adds the evidence that they are tensors."""
    params = list(scope.fn.params.params) + list(scope.fn.params.kwonly_params)
    if scope.method and params:
        params = params[1:]
    for p in params:
        ann = rule.ctx.module.code_for_node(p.annotation.annotation) if p.annotation else ""
        if _NOT_TENSOR_ANNOTATION.search(ann) or (p.default is not None and not (
                isinstance(p.default, cst.Name) and p.default.value == "None")):
            continue
        scope.tensors.add(p.name.value)
        if "Tensor" in ann:
            scope.sure.add(p.name.value)
    body = list(walk(scope.fn.body))
    for _ in range(2):
        for n in body:
            if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.targets[0].target, cst.Name):
                name = n.targets[0].target.value
                if _tensor_valued(rule, n.value, scope):
                    scope.tensors.add(name)
                    scope.sure.add(name)
    for n in body:
        if isinstance(n, cst.Attribute) and isinstance(n.value, cst.Name) and n.attr.value in _TENSOR_METHODS \
                and n.value.value in scope.tensors:
            scope.sure.add(n.value.value)
    # A name rebound to the pieces of a split (`out = out.chunk(n)`) holds a tuple of tensors: a loop
    # over it visits a few pieces, each a whole batch, not the rows of one tensor.
    for n in body:
        if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.targets[0].target, cst.Name) \
                and isinstance(n.value, cst.Call) and isinstance(n.value.func, (cst.Attribute, cst.Name)) \
                and _called_name(n.value.func) in _SPLITS:
            scope.tensors.discard(n.targets[0].target.value)
            scope.sure.discard(n.targets[0].target.value)


def _called_name(func: cst.Attribute | cst.Name) -> str:
    return func.attr.value if isinstance(func, cst.Attribute) else func.value


def _tensor_valued(rule: Rule, e: cst.BaseExpression, scope: _Scope) -> bool:
    """Whether `e` computes a tensor from the function's tensors (so its truth or `.item()` syncs)."""
    if isinstance(e, cst.Name):
        return e.value in scope.tensors
    if isinstance(e, cst.Attribute):
        return e.attr.value in ("T", "data", "mT") and _tensor_valued(rule, e.value, scope)
    if isinstance(e, cst.Subscript):
        return _tensor_valued(rule, e.value, scope)
    if isinstance(e, cst.BinaryOperation):
        return _tensor_valued(rule, e.left, scope) or _tensor_valued(rule, e.right, scope)
    if isinstance(e, cst.UnaryOperation):
        return _tensor_valued(rule, e.expression, scope)
    if isinstance(e, cst.Call):
        if isinstance(e.func, cst.Attribute) and not is_host_value(rule, e):
            qualified = callee(rule, e)
            if qualified is None:
                return e.func.attr.value not in _HOST_METHODS and _tensor_valued(rule, e.func.value, scope)
        qualified = callee(rule, e)
        if qualified is not None and qualified.startswith("torch.") and qualified.rsplit(".", 1)[1] not in _NOT_TENSOR:
            return any(_tensor_valued(rule, a.value, scope) for a in e.args)
    return False


def _truth_of_tensor(rule: Rule, test: cst.BaseExpression, scope: _Scope) -> bool:
    """`bool()` of a tensor: a comparison of a tensor value, `t.any()`, `not t`..., never `x is None`."""
    if isinstance(test, cst.BooleanOperation):
        return _truth_of_tensor(rule, test.left, scope) or _truth_of_tensor(rule, test.right, scope)
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return _truth_of_tensor(rule, test.expression, scope)
    if isinstance(test, cst.Comparison):
        if any(isinstance(c.operator, (cst.Is, cst.IsNot, cst.In, cst.NotIn)) for c in test.comparisons):
            return False
        sides = [test.left, *(c.comparator for c in test.comparisons)]
        return any(_tensor_valued(rule, s, scope) for s in sides) and not all(is_host_value(rule, s) for s in sides)
    return isinstance(test, cst.Call) and _tensor_valued(rule, test, scope)


# ---------------------------------------------------------------------------------- loop shapes


def _row_header(rule: Rule, it: cst.BaseExpression, target: cst.BaseExpression,
                scope: _Scope) -> tuple[str, str | None, str | None] | None:
    """(tensor, index name, row name) of `range(x.size(0))`, `range(len(x))`, `x`, `enumerate(x)`."""
    if isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "range" \
            and len(it.args) == 1 and isinstance(target, cst.Name):
        tensor = _first_dim_of(it.args[0].value, scope)
        return (tensor, target.value, None) if tensor else None
    if isinstance(it, cst.Name) and it.value in scope.sure and isinstance(target, cst.Name):
        return it.value, None, target.value
    if isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "enumerate" \
            and len(it.args) == 1 and isinstance(it.args[0].value, cst.Name) and it.args[0].value.value in scope.sure \
            and isinstance(target, cst.Tuple) and len(target.elements) == 2 \
            and all(isinstance(e.value, cst.Name) for e in target.elements):
        index, row = (e.value.value for e in target.elements if isinstance(e.value, cst.Name))
        return it.args[0].value.value, index, row
    return None


def _first_dim_of(bound: cst.BaseExpression, scope: _Scope) -> str | None:
    """`x` for `x.size(0)`, `x.shape[0]`, `len(x)` (the last only for a name surely holding a tensor)."""
    if isinstance(bound, cst.Call) and isinstance(bound.func, cst.Attribute) and bound.func.attr.value == "size" \
            and len(bound.args) == 1 and isinstance(bound.args[0].value, cst.Integer) \
            and bound.args[0].value.value == "0" and isinstance(bound.func.value, cst.Name) \
            and bound.func.value.value in scope.tensors:
        return bound.func.value.value
    if isinstance(bound, cst.Subscript) and isinstance(bound.value, cst.Attribute) \
            and bound.value.attr.value == "shape" and isinstance(bound.value.value, cst.Name) \
            and bound.value.value.value in scope.tensors and len(bound.slice) == 1 \
            and isinstance(bound.slice[0].slice, cst.Index) and isinstance(bound.slice[0].slice.value, cst.Integer) \
            and bound.slice[0].slice.value.value == "0":
        return bound.value.value.value
    if isinstance(bound, cst.Call) and isinstance(bound.func, cst.Name) and bound.func.value == "len" \
            and len(bound.args) == 1 and isinstance(bound.args[0].value, cst.Name) \
            and bound.args[0].value.value in scope.sure:
        return bound.args[0].value.value
    return None


def _indexes_row(node: cst.CSTNode, index: str, scope: _Scope) -> bool:
    """`t[i]` (or `t[i, ...]`) for a tensor `t` of the function."""
    if not (isinstance(node, cst.Subscript) and isinstance(node.value, cst.Name) and node.value.value in scope.tensors
            and node.slice and isinstance(node.slice[0].slice, cst.Index)):
        return False
    first = node.slice[0].slice.value
    return isinstance(first, cst.Name) and first.value == index


def _batched_sum(rule: Rule, loop: _RowLoop, scope: _Scope) -> str | None:
    """`acc = acc + E` / `acc += E` as the loop's only statement: the batched form, or None."""
    body = loop.node.body
    if loop.node.orelse is not None or not isinstance(body, cst.IndentedBlock) or len(body.body) != 1:
        return None
    line = body.body[0]
    if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
        return None
    stmt = line.body[0]
    if isinstance(stmt, cst.AugAssign) and isinstance(stmt.operator, cst.AddAssign) \
            and isinstance(stmt.target, cst.Name):
        acc, term = stmt.target.value, stmt.value
    elif isinstance(stmt, cst.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0].target, cst.Name) \
            and isinstance(stmt.value, cst.BinaryOperation) and isinstance(stmt.value.operator, cst.Add) \
            and isinstance(stmt.value.left, cst.Name) and stmt.value.left.value == stmt.targets[0].target.value:
        acc, term = stmt.value.left.value, stmt.value.right
    else:
        return None
    batched = _vectorised(rule, term, loop.index, loop.row, loop.tensor, scope)
    if batched is None or any(isinstance(n, cst.Name) and n.value == acc for n in walk(term, cross_scopes=True)):
        return None
    return f"{acc} = {acc} + {batched}"


def _vectorised(rule: Rule, term: cst.BaseExpression, index: str | None, row: str | None, tensor: str,
                scope: _Scope) -> str | None:
    """The sum over rows of `term` as a batched expression: every `t[i]` (or the row) becomes the
    whole tensor, then a full `.sum()` already covers the rows and anything else gets `.sum(0)`."""
    replaced = term.visit(_WholeTensor(index, row, tensor, scope))
    assert isinstance(replaced, cst.BaseExpression)
    names = {n.value for n in walk(replaced, cross_scopes=True) if isinstance(n, cst.Name)}
    if replaced.deep_equals(term) or (index and index in names) or (row and row in names):
        return None  # the loop variable is used other than as a row
    text = rule.ctx.module.code_for_node(replaced)
    reductions = [n for n in walk(replaced, cross_scopes=True) if isinstance(n, cst.Call)
                  and isinstance(n.func, cst.Attribute) and n.func.attr.value in _FULL_REDUCTIONS and not n.args]
    if not reductions:
        atom = isinstance(replaced, (cst.Name, cst.Attribute, cst.Subscript, cst.Call)) and not replaced.lpar
        return f"{text}.sum(0)" if atom else f"({text}).sum(0)"
    outer = replaced
    if len(reductions) == 1 and reductions[0] is outer and isinstance(outer, cst.Call) \
            and isinstance(outer.func, cst.Attribute) and outer.func.attr.value == "sum":
        return text
    return None


class _WholeTensor(cst.CSTTransformer):
    """`t[i]` -> `t` for the loop index `i`, and the row name -> the tensor."""

    def __init__(self, index: str | None, row: str | None, tensor: str, scope: _Scope) -> None:
        super().__init__()
        self.index, self.row, self.tensor, self.scope = index, row, tensor, scope

    def leave_Subscript(self, original_node: cst.Subscript, updated_node: cst.Subscript) -> cst.BaseExpression:
        if self.index and len(original_node.slice) == 1 and _indexes_row(original_node, self.index, self.scope):
            return updated_node.value
        return updated_node

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        return cst.Name(self.tensor) if self.row and original_node.value == self.row else updated_node
