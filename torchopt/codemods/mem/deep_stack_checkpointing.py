"""Activation checkpointing advice for deep stacks of identical blocks in a training script."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst
from libcst.metadata import Assignment, PositionProvider, ScopeProvider

from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee, dotted
from torchopt.analysis.syntax import walk
from torchopt.codemods.mem import FAMILY
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Option, Rule, Safety, Valid
from torchopt.rewrite.facts import source_of

_CONTAINERS = {
    "torch.nn.Sequential": "nn.Sequential",
    "torch.nn.ModuleList": "nn.ModuleList",
    "torch.nn.modules.container.Sequential": "nn.Sequential",
    "torch.nn.modules.container.ModuleList": "nn.ModuleList",
}


class DeepStackCheckpointing(Rule):
    """## What it does
    In a script that trains (it calls `backward()`), reports a deep stack of identical blocks built
    in one go: `nn.Sequential(*[Block(...) for _ in range(N)])`, or `nn.ModuleList([...])` of the
    same form whose blocks `forward` runs one after the other (`for blk in self.blocks: x = blk(x)`),
    with `N` at least `min-blocks` (8): an integer literal, a name assigned one, or a parameter
    whose default is one. Nothing is reported when the file already uses `checkpoint` or when `N`
    cannot be read (a config attribute): the depth would be a guess. Display-only.

    (Advice on out-of-memory handlers is TOP931's; this rule is about where checkpointing pays.)

    ## Why is this slow
    Training keeps every block's activations until the backward pass, so memory grows with depth,
    and the batch (or sequence length) has to shrink to fit, which under-uses the GPU. Checkpointing
    each block keeps only its input and recomputes its inside during the backward pass: about one
    extra forward of compute for activation memory that no longer grows with the block's internals,
    so a larger batch fits (tuning guide, "Checkpoint intermediate buffers").

    ## Example
    ```python
    class Encoder(nn.Module):
        def __init__(self, dim=512, depth=24):
            super().__init__()
            self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])

        def forward(self, x):
            for blk in self.blocks:
                x = blk(x)
            return x
    ```

    ## Use instead
    ```python
    from torch.utils.checkpoint import checkpoint

        def forward(self, x):
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=False) if self.training else blk(x)
            return x
    ```
    For an `nn.Sequential`: `torch.utils.checkpoint.checkpoint_sequential(self.blocks, segments, x,
    use_reentrant=False)`.

    ## Fix safety
    Display-only: it trades compute for memory, which pays only when memory limits the batch; which
    blocks to checkpoint is a design choice. Blocks with dropout recompute under the saved RNG state
    (`preserve_rng_state=True`, the default: same masks, at a cost), and BatchNorm in a checkpointed
    block updates its running statistics twice per step.
    """

    code = "TOP713"
    name = "deep-stack-checkpointing"
    family = FAMILY
    message = (
        "{n} identical blocks in one `{container}` of a training script: activation checkpointing "
        "(`torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)` per block) keeps only block "
        "inputs for the backward pass, so a larger batch fits"
    )
    safety = Safety.DISPLAY
    prefilter = ("Sequential", "ModuleList")
    requires = ("torch", "backward", "range")
    locality = "file"  # whether the file trains, and whether it checkpoints already
    options = (Option("min-blocks", int, 8, "report stacks of at least this many identical blocks"),)
    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and "checkpoint" not in text

    examples = (
        Invalid(
            dedent("""\
            import torch
            from torch import nn


            class Block(nn.Module):
                def __init__(self, dim):
                    super().__init__()
                    self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

                def forward(self, x):
                    return x + self.ff(x)


            class Encoder(nn.Module):
                def __init__(self, dim=64, depth=12):
                    super().__init__()
                    self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])

                def forward(self, x):
                    for blk in self.blocks:
                        x = blk(x)
                    return x


            model = Encoder()
            model(torch.randn(2, 64)).sum().backward()
        """),
            note="in a method: a ModuleList run block after block",
        ),
        Invalid(
            dedent("""\
            import torch.nn as N
            import torch

            LAYERS = 16
            net = N.Sequential(*[N.Linear(32, 32) for _ in range(LAYERS)])
            net(torch.randn(4, 32)).sum().backward()
        """),
            note="`import torch.nn as N`, the depth from a module constant",
        ),
        Valid(
            dedent("""\
            import torch
            from torch import nn

            net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
            net(torch.randn(4, 32)).sum().backward()
        """),
            note="shallow",
        ),
        Valid(
            dedent("""\
            import torch
            from torch import nn

            net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(24)])
            with torch.no_grad():
                out = net(torch.randn(4, 32))
        """),
            note="inference only: no activations are kept",
        ),
        Valid(
            dedent("""\
            import torch
            from torch import nn
            from torch.utils.checkpoint import checkpoint_sequential

            net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(24)])
            x = torch.randn(4, 32, requires_grad=True)
            checkpoint_sequential(net, 4, x, use_reentrant=False).sum().backward()
        """),
            note="already checkpointed",
        ),
        Valid(
            dedent("""\
            import torch
            from torch import nn


            class Heads(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.heads = nn.ModuleList([nn.Linear(8, 1) for _ in range(16)])

                def forward(self, x):
                    return torch.cat([h(x) for h in self.heads], dim=-1)


            Heads()(torch.randn(2, 8)).sum().backward()
        """),
            note="parallel heads, not a stack",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        code = source_of(node)
        self._trains = ".backward(" in code and "checkpoint" not in code

    def visit_Call(self, node: cst.Call) -> None:
        if not self._trains:
            return
        container = _CONTAINERS.get(callee(self, node) or "")
        if container is None or len(node.args) != 1:
            return
        arg = node.args[0]
        if container == "nn.Sequential" and arg.star != "*":
            return
        if container == "nn.ModuleList" and arg.star:
            return
        comp = arg.value
        if not isinstance(comp, (cst.ListComp, cst.GeneratorExp)) or comp.for_in.inner_for_in is not None:
            return
        if comp.for_in.ifs or not isinstance(comp.elt, cst.Call):
            return
        depth = self._range_length(comp.for_in.iter)
        if depth is None or depth < self.option("min-blocks"):
            return
        if container == "nn.ModuleList" and not self._run_in_sequence(node):
            return
        self.report(node, fmt={"n": str(depth), "container": container})

    def _range_length(self, it: cst.BaseExpression) -> int | None:
        if not (isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "range"):
            return None
        args = positional(it)
        if len(args) != 1 or len(it.args) != 1:
            return None
        return self._int(args[0].value)

    def _int(self, expr: cst.BaseExpression) -> int | None:
        """An integer literal, or a name whose every definition is one (a parameter: its default)."""
        if isinstance(expr, cst.Integer):
            return int(expr.evaluated_value)
        if not isinstance(expr, cst.Name):
            return None
        scope = self.get_metadata(ScopeProvider, expr, None)
        if scope is None or expr.value not in scope:
            return None
        values = set()
        for a in scope[expr.value]:
            if not isinstance(a, Assignment):
                return None
            node = a.node
            parent = self.get_metadata(ParentProvider, node, None)
            if isinstance(node, cst.Param):
                value = node.default
            elif isinstance(parent, cst.AssignTarget):
                stmt = self.get_metadata(ParentProvider, parent, None)
                value = stmt.value if isinstance(stmt, cst.Assign) else None
            else:
                value = None
            if not isinstance(value, cst.Integer):
                return None
            values.add(int(value.evaluated_value))
        return min(values) if values else None

    def _run_in_sequence(self, call: cst.Call) -> bool:
        """``self.blocks = nn.ModuleList(...)`` and, in the class, ``for b in self.blocks: x = b(x)``."""
        assign = self.get_metadata(ParentProvider, call, None)
        if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
            return False
        name = dotted(assign.targets[0].target)
        owner: cst.CSTNode | None = assign
        while owner is not None and not isinstance(owner, (cst.ClassDef, cst.Module)):
            owner = self.get_metadata(ParentProvider, owner, None)
        if owner is None or name is None:
            return False
        for loop in walk(owner, cross_scopes=True):
            if not (isinstance(loop, cst.For) and dotted(loop.iter) == name and isinstance(loop.target, cst.Name)):
                continue
            blk = loop.target.value
            for stmt in walk(loop.body):
                if (
                    isinstance(stmt, cst.Assign)
                    and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0].target, cst.Name)
                    and isinstance(stmt.value, cst.Call)
                    and isinstance(stmt.value.func, cst.Name)
                    and stmt.value.func.value == blk
                ):
                    fed = [a.value for a in stmt.value.args]
                    if any(isinstance(v, cst.Name) and v.value == stmt.targets[0].target.value for v in fed):
                        return True
        return False
