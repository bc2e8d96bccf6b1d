"""Gradient accumulation advice where a script shrinks its batch to fit in memory."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.analysis.names import dotted, torch_name
from torchopt.analysis.syntax import walk
from torchopt.codemods.mem import FAMILY
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid

OOM_ERRORS = ("torch.cuda.OutOfMemoryError", "torch.OutOfMemoryError", "torch.cuda.memory.OutOfMemoryError")
_GENERIC_ERRORS = ("RuntimeError", "Exception")
_SHRINK_OPS = (cst.FloorDivideAssign, cst.DivideAssign, cst.RightShiftAssign, cst.SubtractAssign)
_SHRINK_BINOPS = (cst.FloorDivide, cst.Divide, cst.RightShift, cst.Subtract)


def handles_oom(rule: Rule, handler: cst.ExceptHandler) -> bool:
    """An ``except`` for torch's out-of-memory error, or for RuntimeError/Exception whose body tests
    for "out of memory" (how OOM was caught before PyTorch 1.13 had its own exception)."""
    if handler.type is None:
        return False
    types = handler.type.elements if isinstance(handler.type, cst.Tuple) else [handler.type]
    for t in types:
        expr = t.value if isinstance(t, cst.Element) else t
        if torch_name(rule, expr) in OOM_ERRORS:
            return True
        if cst.helpers.get_full_name_for_node(
            expr
        ) in _GENERIC_ERRORS and "out of memory" in rule.ctx.module.code_for_node(handler.body):
            return True
    return False


def is_batch_size_name(name: str) -> bool:
    """``batch_size``, ``args.batch_size``, ``micro_batch``, ``bs``, ``train_bs``: names that hold a
    batch size by the usual spellings."""
    last = name.rsplit(".", 1)[-1].lower()
    return "batch" in last or last == "bs" or last.endswith("_bs")


def _shrinks(target: str, value: cst.BaseExpression) -> bool:
    """``x = x // 2``, ``x = max(1, x // 2)``, ``x = int(x / 2)``, ``x = x - step``."""
    for node in walk(value, cross_scopes=True):
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, _SHRINK_BINOPS):
            if dotted(node.left) == target:
                return True
    return False


class GradientAccumulation(Rule):
    """## What it does
    Reports a batch size lowered when the program runs out of memory: inside an
    `except torch.cuda.OutOfMemoryError` / `except torch.OutOfMemoryError` handler (or an
    `except RuntimeError` whose body tests for `"out of memory"`), an assignment that divides,
    shifts or subtracts a name that holds a batch size (`batch_size`, `args.batch_size`,
    `micro_batch`, `bs`, `*_bs`): `batch_size //= 2`, `bs = max(1, bs // 2)`. Display-only.

    The handler is how the program says that it lowers its batch to fit; a batch size that is simply
    set small is not reported (nothing in the source says that memory chose it).

    ## Why is this slow
    A smaller batch changes the optimisation (the gradient of fewer samples per step, with the
    learning rate tuned for the old batch), and halving it after an out-of-memory error also
    throws away the step that failed. Gradient accumulation keeps the effective batch: run
    `accum` micro-batches that each fit, sum their gradients, and step once. The tuning guide lists
    it with activation checkpointing and mixed precision as the ways to train a batch that does not
    fit.

    ## Example
    ```python
    try:
        train_epoch(model, loader(batch_size))
    except torch.cuda.OutOfMemoryError:
        batch_size //= 2
    ```

    ## Use instead
    ```python
    accum = 4  # micro-batches per optimizer step; micro_batch = batch_size // accum
    for i, (x, y) in enumerate(loader):  # the loader yields micro-batches
        loss = criterion(model(x), y) / accum
        loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    ```
    With DistributedDataParallel, run the first `accum - 1` micro-batches under `model.no_sync()`.

    ## Fix safety
    Display-only. Accumulation equals the large batch for a mean-reduced loss up to rounding, but
    not for layers that see the batch (BatchNorm statistics are per micro-batch), and a step count,
    a learning-rate schedule or logging tied to iterations must count optimizer steps instead; only
    the author can restructure the loop.
    """

    code = "TOP712"
    name = "gradient-accumulation"
    family = FAMILY
    message = (
        "batch size `{name}` is lowered after running out of memory: keep the batch and accumulate "
        "gradients over micro-batches (`loss / accum`, `optimizer.step()` every `accum` micro-batches)"
    )
    safety = Safety.DISPLAY
    prefilter = ("OutOfMemoryError", "out of memory")
    requires = ("torch",)
    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)
    examples = (
        Invalid(
            dedent("""\
            import torch

            batch_size = 256
            while True:
                try:
                    train(batch_size)
                    break
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    batch_size //= 2
        """)
        ),
        Invalid(
            dedent("""\
            import torch as T


            class Runner:
                def fit(self, data):
                    try:
                        self.epoch(data)
                    except T.OutOfMemoryError:
                        self.batch_size = max(1, self.batch_size // 2)
        """),
            note="in a method, `import torch as T`",
        ),
        Invalid(
            dedent("""\
            import torch


            def run(args):
                try:
                    step(args)
                except RuntimeError as e:
                    if "out of memory" not in str(e):
                        raise
                    args.micro_bs = int(args.micro_bs / 2)
        """),
            note="in a function, the error recognised by its text",
        ),
        Valid(
            dedent("""\
            import torch

            try:
                step(batch)
            except torch.cuda.OutOfMemoryError:
                skipped += 1
        """),
            note="the batch is skipped, not shrunk (activation checkpointing advice is another rule's)",
        ),
        Valid(
            dedent("""\
            import torch

            try:
                step(batch)
            except ValueError:
                batch_size //= 2
        """),
            note="not an out-of-memory handler",
        ),
        Valid(
            dedent("""\
            import torch

            try:
                step(batch)
            except torch.cuda.OutOfMemoryError:
                lr //= 2
        """),
            note="not a batch size",
        ),
    )

    def visit_ExceptHandler(self, node: cst.ExceptHandler) -> None:
        if not handles_oom(self, node):
            return
        for stmt in walk(node.body):
            if isinstance(stmt, cst.AugAssign) and isinstance(stmt.operator, _SHRINK_OPS):
                target = dotted(stmt.target)
                if target and is_batch_size_name(target):
                    self.report(stmt, fmt={"name": target})
            elif isinstance(stmt, cst.Assign) and len(stmt.targets) == 1:
                target = dotted(stmt.targets[0].target)
                if target and is_batch_size_name(target) and _shrinks(target, stmt.value):
                    self.report(stmt, fmt={"name": target})
