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
from torchopt.rewrite.metadata import ParentProvider
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
        if "for " in text and _HEADER_TEXT.search(text) is not None:
            return True
        return "Loss" in text and any(tok in text for tok in ("if ", "while ", "assert "))

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

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        scope = self._scope(node)
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

    def _scope(self, fn: cst.FunctionDef) -> _Scope | None:
        if "torch" not in self.ctx.text:
            return None  # names alone (`PairLoss`, `my_loss`) say nothing about tensors in a file without torch
        cls = self._enclosing_class(fn)
        name = fn.name.value
        if cls is not None and name in ("forward", "__call__"):
            module = self._is_torch_module(cls, 0)
            loss = cls.name.value.endswith("Loss")
            if (module and name == "forward") or loss:
                return _Scope(fn, f"`{cls.name.value}.{name}`", loss_module=loss)
        if any(word in name.lower() for word in ("loss", "criterion")):
            owner = f"{cls.name.value}." if cls is not None else ""
            return _Scope(fn, f"the loss function `{owner}{name}`", loss_module=False)
        return None

    def _enclosing_class(self, fn: cst.FunctionDef) -> cst.ClassDef | None:
        block = self.get_metadata(ParentProvider, fn, None)
        cls = self.get_metadata(ParentProvider, block, None) if block is not None else None
        return cls if isinstance(cls, cst.ClassDef) else None

    def _is_torch_module(self, cls: cst.ClassDef, depth: int) -> bool:
        """A subclass of a torch.nn class, directly or through classes of this file."""
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


# ---------------------------------------------------------------------------------- tensors


def _collect_tensors(rule: Rule, scope: _Scope) -> None:
    """Parameters (not `self`, not Python-typed or defaulted to a Python literal) and the locals
    computed from them with tensor operations; `sure` adds the evidence that they are tensors."""
    params = list(scope.fn.params.params) + list(scope.fn.params.kwonly_params)
    if _enclosing_is_class(rule, scope.fn) and params:
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


def _enclosing_is_class(rule: Rule, fn: cst.FunctionDef) -> bool:
    block = rule.get_metadata(ParentProvider, fn, None)
    return isinstance(rule.get_metadata(ParentProvider, block, None) if block is not None else None, cst.ClassDef)


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
        index, row = (e.value.value for e in target.elements)  # type: ignore[attr-defined]
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
    if len(reductions) == 1 and reductions[0] is outer and outer.func.attr.value == "sum":  # type: ignore[attr-defined]
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
