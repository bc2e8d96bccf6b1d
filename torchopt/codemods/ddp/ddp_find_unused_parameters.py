"""TOP407 `ddp-find-unused-parameters`: Flags `DistributedDataParallel(..., find_unused_parameters=True)`."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp.program_analysis import DDP
from torchopt.codemods.ddp.step_checks import _DEPS
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class FindUnusedParameters(Rule):
    """## What it does
    Flags `DistributedDataParallel(..., find_unused_parameters=True)`.

    ## Why is this slow
    With the flag, DDP traverses the autograd graph after every forward to find parameters that
    will get no gradient, and its buckets follow the order of the constructor (`__init__`), not
    the order of the backward pass, so all-reduces overlap less with computation (tuning guide).

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    ```

    ## Use instead
    ```python
    # every parameter gets a gradient each step:
    model = DDP(model, device_ids=[local_rank])
    # the set of used parameters is the same every step:
    model = DDP(model, device_ids=[local_rank], static_graph=True)
    ```
    `gradient_as_bucket_view=True` also saves the memory of one gradient copy.

    ## Fix safety
    Display-only: whether some parameters really go unused in some iterations (conditional
    branches, frozen heads) cannot be decided from the source; removing the flag when they do makes
    DDP raise at the next iteration.
    """

    code = "TOP407"
    name = "ddp-find-unused-parameters"
    family = FAMILY
    message = (
        "`find_unused_parameters=True` walks the autograd graph every iteration and buckets gradients in "
        "constructor order: drop it if every parameter gets a gradient, or use `static_graph=True` "
        "(and consider `gradient_as_bucket_view=True`)"
    )
    safety = Safety.DISPLAY
    prefilter = ("find_unused_parameters",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, DDP)  # visit_Call: a DDP call

    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP
                model = nn.Linear(4, 2)
                model = DDP(model, find_unused_parameters=True)
            """)
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP
                model = nn.Linear(4, 2)
                model = DDP(model, static_graph=True)
            """)
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP
                model = nn.Linear(4, 2)
                model = DDP(model, find_unused_parameters=False)
            """)
        ),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if not isinstance(node.func, (cst.Name, cst.Attribute)):
            return
        kw = keyword(node, "find_unused_parameters")
        if kw is None or not (isinstance(kw.value, cst.Name) and kw.value.value == "True"):
            return
        from torchopt.analysis.names import callee

        if callee(self, node) in DDP:
            self.report(kw)
