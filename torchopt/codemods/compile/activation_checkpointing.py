"""TOP931: activation checkpointing advice where a script copes with running out
of memory. Display-only: never inserted automatically."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import torch_name
from torchopt.codemods.compile import FAMILY
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid

_OOM = ("torch.cuda.OutOfMemoryError", "torch.OutOfMemoryError", "torch.cuda.memory.OutOfMemoryError")


class ActivationCheckpointing(Rule):
    """## What it does
    Suggests activation checkpointing where a script handles out-of-memory errors.

    Reports an `except torch.cuda.OutOfMemoryError` / `except torch.OutOfMemoryError` handler, or
    an `except RuntimeError` whose body tests for `"out of memory"`: a script that shrinks its batch
    or skips a step when memory runs out. It suggests activation checkpointing instead.
    Display-only.

    ## Why is this slow
    A smaller batch (or skipped steps) under-uses the GPU. Activation checkpointing keeps only some
    activations and recomputes the rest during the backward pass: it trades about one extra forward
    pass of compute for memory, so a larger batch fits (tuning guide, "Checkpoint intermediate
    buffers").

    ## Example
    ```python
    try:
        loss = model(x).loss
    except torch.cuda.OutOfMemoryError:
        batch_size //= 2
    ```

    ## Use instead
    ```python
    from torch.utils.checkpoint import checkpoint

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x
    ```
    (or `torch.utils.checkpoint.checkpoint_sequential(self.blocks, segments, x, use_reentrant=False)`;
    TOP827 explains `use_reentrant`.)

    ## Fix safety
    Display-only: never inserted. Where to checkpoint is a model-design choice (which blocks, how
    many segments), it costs compute, and blocks with random ops recompute under a restored RNG
    state (`preserve_rng_state=True`, the default), which has its own cost.
    """

    code = "TOP931"
    name = "activation-checkpointing"
    family = FAMILY
    message = (
        "out-of-memory handling: activation checkpointing (`torch.utils.checkpoint.checkpoint(block, x, "
        "use_reentrant=False)`) trades one extra forward of compute for memory, so the batch can stay large"
    )
    safety = Safety.DISPLAY
    prefilter = ("OutOfMemoryError", "out of memory")
    requires = ("torch",)
    examples = (
        Invalid("import torch\n\ntry:\n    step(batch)\nexcept torch.cuda.OutOfMemoryError:\n    bs //= 2\n"),
        Invalid(
            "import torch\n\ntry:\n    step(batch)\nexcept RuntimeError as e:\n    if 'out of memory' in str(e):\n"
            "        torch.cuda.empty_cache()\n    else:\n        raise\n"
        ),
        Valid("import torch\n\ntry:\n    step(batch)\nexcept RuntimeError:\n    raise\n"),
        Valid(
            "class OutOfMemoryError(Exception):\n    pass\n\ntry:\n    f()\nexcept OutOfMemoryError:\n    pass\n",
            note="not torch's",
        ),
    )

    def visit_ExceptHandler(self, node: cst.ExceptHandler) -> None:
        if node.type is None:
            return
        types = node.type.elements if isinstance(node.type, cst.Tuple) else [node.type]
        for t in types:
            expr = t.value if isinstance(t, cst.Element) else t
            if torch_name(self, expr) in _OOM:
                self.report(node)
                return
            name = cst.helpers.get_full_name_for_node(expr)
            if name == "RuntimeError" and "out of memory" in self.ctx.module.code_for_node(node.body):
                self.report(node)
                return
