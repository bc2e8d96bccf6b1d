"""TOP610 `python-loop-over-tensor`: Python loops over a tensor's rows in custom losses and modules."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.names import torch_name
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import source, walk
from torchopt.codemods.sync import FAMILY
from torchopt.codemods.sync.row_loop_prefilter import HEADER_TEXT, reports_possible
from torchopt.codemods.sync.row_loop_shapes import RowLoop, batched_sum, indexes_row, row_header, vectorised
from torchopt.codemods.sync.row_loop_tensors import FunctionScope, collect_tensors, tensor_valued, truth_of_tensor
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid


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
    message = (
        "`{loop}` runs Python once per row of `{tensor}` in {where}: every iteration launches its own "
        "small kernels and the GPU idles between them; {advice}"
    )
    sync_message = (
        "`{expr}` {verb} a tensor value once per row of `{tensor}` in {where}: each time it copies "
        "the value to the host and waits for the GPU; compute it for every row at once (a mask, "
        "`torch.where`) and read it once, if at all"
    )
    branch_message = (
        "`{expr}` branches on a tensor value in {where}: `bool()` of a tensor copies it to the host "
        "and waits for the GPU on every call; select on the device with `torch.where`, or check it "
        "outside the loss"
    )
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("forward", "loss", "Loss", "criterion")
    requires = ("torch",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # A row loop needs a header `row_header` can read; a loss module's branch an `if`, `while` or `assert`.
        if not super().could_match(text):
            return False
        if not ("for " in text and HEADER_TEXT.search(text) is not None) and not (
            "Loss" in text and any(tok in text for tok in ("if ", "while ", "assert "))
        ):
            return False
        return reports_possible(text)

    examples = (
        Invalid(
            dedent("""\
            import torch.nn as tnn


            class PairLoss(tnn.Module):
                def forward(self, a, b):
                    total = 0
                    for i in range(a.size(0)):
                        total = total + (a[i] - b[i]).pow(2).sum()
                    return total
            """),
            note="aliased `torch.nn`: the batched sum is given",
        ),
        Invalid(
            dedent("""\
            import torch
            from torch import nn as N


            class Scorer(N.Module):
                def forward(self, x: torch.Tensor):
                    out = []
                    for row in x:
                        out.append(self.score(row))
                    return torch.stack(out)
            """),
            note="`for row in x` over an annotated tensor: advice",
        ),
        Invalid(
            dedent("""\
            import torch


            def contrastive_loss(emb, labels):
                return sum((emb[i] * emb[i]).sum(-1) for i in range(emb.shape[0]))
            """),
            note="a loss function: `sum(...)` of per-row terms",
        ),
        Invalid(
            dedent("""\
            import torch
            import torch.nn as nn


            class Trainer:
                def criterion(self, logits, target):
                    total = 0.0
                    for i in range(len(target)):
                        if target[i] > 0:
                            total += logits[i].softmax(-1).max()
                    return total / target.size(0)
            """),
            note="in a method; the per-row `if` is reported too",
        ),
        Invalid(
            dedent("""\
            import torch
            import torch.nn as nn


            class RobustLoss(nn.Module):
                def forward(self, pred, target):
                    err = (pred - target).abs()
                    if err.max() > 1.0:
                        return (err ** 2).mean()
                    return err.mean()
            """),
            note="a branch on a tensor value in a loss module's forward",
        ),
        Invalid(
            dedent("""\
            import torch.nn as tnn


            class TopKLoss(tnn.Module):
                def forward(self, scores, target):
                    total = 0.0
                    for i in range(scores.size(0)):
                        total += scores[i, target[i]].item()
                    return total
            """),
            note="aliased `torch.nn`: a per-element `.item()` in a loss module's forward",
        ),
        Invalid(
            dedent("""\
            import torch as T
            from torch import nn


            class MarginLoss(nn.Module):
                def forward(self, pred, target):
                    gap = (pred - target).abs()
                    if T.max(gap) > 1.0:
                        return gap.square().mean()
                    return gap.mean()
            """),
            note="`import torch as T`: a branch on a tensor value in a loss module's forward",
        ),
        Valid(
            dedent("""\
            import torch.nn as nn


            class Net(nn.Module):
                def forward(self, x):
                    for blk in self.blocks:
                        x = blk(x)
                    return x
            """),
            note="a loop over layers",
        ),
        Valid(
            dedent("""\
            import torch.nn as nn


            class FPN(nn.Module):
                def forward(self, feats):
                    outs = []
                    for i in range(len(feats)):
                        outs.append(self.lateral[i](feats[i]))
                    return outs
            """),
            note="`feats` is a list of feature maps, not a tensor",
        ),
        Valid(
            dedent("""\
            import torch.nn as nn


            class Heads(nn.Module):
                def forward(self, x):
                    return [self.heads[i](x) for i in range(x.size(0))]


            def sample_loss(n):
                for i in range(n):
                    print(i)
            """),
            note="no row of a tensor is read per iteration",
        ),
        Valid(
            dedent("""\
            import torch.nn as nn


            class FocalLoss(nn.Module):
                def forward(self, logits, target, reduction: str = "mean"):
                    if reduction == "mean":
                        return logits.mean()
                    if target.dim() == 1:
                        target = target[:, None]
                    return logits.sum()
            """),
            note="branches on Python values (`reduction`, `dim()`)",
        ),
        Valid(
            dedent("""\
            import mylib.nn as nn


            class PairLoss(nn.Module):
                def forward(self, a, b):
                    for i in range(a.size(0)):
                        b = b + a[i]
                    return b
            """),
            note="not a torch module",
        ),
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
        nodes = list(walk(node.body))
        if not any(_could_report(n, scope.loss_module) for n in nodes):
            return  # no loop, `sum` or branch it could report on: which names hold tensors is not asked
        collect_tensors(self, scope)
        in_loops: set[int] = set()
        for n in nodes:
            if isinstance(n, cst.For):
                loop = self._row_loop(n, scope)
                if loop is not None:
                    self._report_loop(loop, scope)
                    in_loops |= self._report_syncs(loop, scope)
            elif isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value == "sum":
                self._report_sum(n, scope)
        if scope.loss_module:
            for n in nodes:
                test = n.test if isinstance(n, (cst.If, cst.While, cst.IfExp, cst.Assert)) else None
                if (
                    test is not None
                    and id(test) not in in_loops
                    and truth_of_tensor(self, test, scope)
                    and not self._in_step(test)
                ):
                    self.report(
                        test, message=self.branch_message, fmt={"expr": source(self, test), "where": scope.where}
                    )

    def _in_step(self, node: cst.CSTNode) -> bool:
        """Run by a training or evaluation step of this file: the step rules (TOP601, TOP605) report
        its host reads and branches already, with the step as context."""
        return hot_map(self).where(node) is not None

    # ------------------------------------------------------------------------------ where to look

    def _scope(self, fn: cst.FunctionDef, cls: cst.ClassDef | None) -> FunctionScope | None:
        """The function as a place the rule reads (``cls``: the class whose body defines it)."""
        if "torch" not in self.ctx.text:
            return None  # names alone (`PairLoss`, `my_loss`) say nothing about tensors in a file without torch
        name = fn.name.value
        method = cls is not None
        if cls is not None and name in ("forward", "__call__"):
            loss = cls.name.value.endswith("Loss")
            if loss or (name == "forward" and self._is_torch_module(cls, 0)):
                return FunctionScope(fn, f"`{cls.name.value}.{name}`", loss_module=loss, method=method)
        if any(word in name.lower() for word in ("loss", "criterion")):
            owner = f"{cls.name.value}." if cls is not None else ""
            return FunctionScope(fn, f"the loss function `{owner}{name}`", loss_module=False, method=method)
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
                local = next(
                    (
                        s
                        for s in self.ctx.module.body
                        if isinstance(s, cst.ClassDef) and s.name.value == base.value.value and s is not cls
                    ),
                    None,
                )
                if local is not None and self._is_torch_module(local, depth + 1):
                    return True
        return False

    # ------------------------------------------------------------------------------ row loops

    def _row_loop(self, loop: cst.For, scope: FunctionScope) -> RowLoop | None:
        header = row_header(self, loop.iter, loop.target, scope)
        if header is None:
            return None
        tensor, index, row = header
        body = list(walk(loop.body))
        if index is not None and not any(indexes_row(n, index, scope) for n in body):
            return None  # the index numbers something else (layers, heads): not a row of a tensor
        if row is not None and not any(isinstance(n, cst.Name) and n.value == row for n in body):
            return None
        return RowLoop(loop, tensor, index, row)

    def _report_loop(self, loop: RowLoop, scope: FunctionScope) -> None:
        header = f"for {source(self, loop.node.target)} in {source(self, loop.node.iter)}"
        batched = batched_sum(self, loop, scope)
        advice = (
            f"the same sum as one batched reduction over dim 0: `{batched}`"
            if batched
            else "write the per-row work as one batched operation over dim 0 (broadcasting, masks with "
            "`torch.where`, `gather`/`scatter_add_`, or `torch.vmap`)"
        )
        self.report(loop.node, fmt={"loop": header, "tensor": loop.tensor, "where": scope.where, "advice": advice})

    def _report_syncs(self, loop: RowLoop, scope: FunctionScope) -> set[int]:
        """`.item()` and branches on tensor values inside the loop; returns the tests reported."""
        seen: set[int] = set()
        for n in walk(loop.node.body):
            expr, verb = None, ""
            if isinstance(n, (cst.If, cst.While, cst.IfExp)) and truth_of_tensor(self, n.test, scope):
                expr, verb = n.test, "branches on"
            elif (
                isinstance(n, cst.Call)
                and isinstance(n.func, cst.Attribute)
                and n.func.attr.value == "item"
                and tensor_valued(self, n.func.value, scope)
            ):
                expr, verb = n, "reads"
            if expr is not None:
                seen.add(id(expr))
                if self._in_step(expr):
                    continue
                self.report(
                    expr,
                    message=self.sync_message,
                    fmt={"expr": source(self, expr), "verb": verb, "tensor": loop.tensor, "where": scope.where},
                )
        return seen

    def _report_sum(self, call: cst.Call, scope: FunctionScope) -> None:
        """`sum(f(x[i]) for i in range(x.size(0)))`: a per-row loop written as a generator."""
        if len(call.args) != 1 or not isinstance(call.args[0].value, cst.GeneratorExp):
            return
        gen = call.args[0].value
        if gen.for_in.inner_for_in is not None or gen.for_in.ifs:
            return
        header = row_header(self, gen.for_in.iter, gen.for_in.target, scope)
        if header is None:
            return
        tensor, index, row = header
        batched = vectorised(self, gen.elt, index, row, tensor, scope)
        if batched is None and not (index and any(indexes_row(n, index, scope) for n in walk(gen.elt))):
            return
        advice = (
            f"the same sum as one batched reduction over dim 0: `{batched}`"
            if batched
            else "write the per-row term as one batched operation over dim 0"
        )
        loop = f"for {source(self, gen.for_in.target)} in {source(self, gen.for_in.iter)}"
        self.report(call, fmt={"loop": loop, "tensor": tensor, "where": scope.where, "advice": advice})


def _could_report(node: cst.CSTNode, loss_module: bool) -> bool:
    """The nodes ``visit_FunctionDef`` reports on, by their shape alone (a superset, which names hold
    tensors aside): a loop or a `sum` of a generator whose header ``row_header`` could read, and in a
    loss module a branch or an assertion."""
    if isinstance(node, cst.For):
        return _row_header_shape(node.iter, node.target)
    if isinstance(node, cst.Call):
        return (
            isinstance(node.func, cst.Name)
            and node.func.value == "sum"
            and len(node.args) == 1
            and isinstance(node.args[0].value, cst.GeneratorExp)
            and _row_header_shape(node.args[0].value.for_in.iter, node.args[0].value.for_in.target)
        )
    return loss_module and isinstance(node, (cst.If, cst.While, cst.IfExp, cst.Assert))


def _row_header_shape(it: cst.BaseExpression, target: cst.BaseExpression) -> bool:
    """``row_header``'s patterns without its questions about tensors: `range(x.size(...))`,
    `range(x.shape[...])`, `range(len(x))`, a name, `enumerate(x)` into two names."""
    if isinstance(it, cst.Name):
        return isinstance(target, cst.Name)
    if not (isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and len(it.args) == 1):
        return False
    arg = it.args[0].value
    if it.func.value == "enumerate":
        return isinstance(arg, cst.Name) and isinstance(target, cst.Tuple)
    if it.func.value != "range" or not isinstance(target, cst.Name):
        return False
    if isinstance(arg, cst.Call) and isinstance(arg.func, cst.Attribute):
        return arg.func.attr.value == "size" and isinstance(arg.func.value, cst.Name)
    if isinstance(arg, cst.Call) and isinstance(arg.func, cst.Name):
        return arg.func.value == "len"
    return (
        isinstance(arg, cst.Subscript)
        and isinstance(arg.value, cst.Attribute)
        and arg.value.attr.value == "shape"
        and isinstance(arg.value.value, cst.Name)
    )
