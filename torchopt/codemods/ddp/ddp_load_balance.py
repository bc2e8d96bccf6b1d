"""TOP408 `ddp-load-balance`: Flags padding of variable-length sequences (`pad_sequence`, `pack_padded_sequence`) in a."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp.program_analysis import Analysis
from torchopt.codemods.ddp.program_analysis import DDP
from torchopt.codemods.ddp.program_analysis import DP
from torchopt.codemods.ddp.program_analysis import calls
from torchopt.codemods.ddp.step_checks import _DEPS
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class LoadBalance(Rule):
    """## What it does
    Flags padding of variable-length sequences (`pad_sequence`, `pack_padded_sequence`) in a
    program that uses DistributedDataParallel or DataParallel.

    ## Why is this slow
    Every optimizer step waits for the slowest process. With variable-length data, a process
    that draws long sequences (or pads a batch to its longest member) holds all others at the
    gradient all-reduce (tuning guide, "Load-balance workload in a distributed setting").

    ## Example
    ```python
    batch = pad_sequence(seqs, batch_first=True)
    ```

    ## Use instead
    Batch by token count rather than by number of sequences, or bucket sequences of similar
    length (a length-grouped sampler per rank), so every process gets a similar amount of work.

    ## Fix safety
    Display-only: batching policy changes the data each step sees.
    """

    code = "TOP408"
    name = "ddp-load-balance"
    family = FAMILY
    message = (
        "variable-length batches under DDP: every step waits for the process with the longest sequences; "
        "batch by token count or bucket by length"
    )
    safety = Safety.DISPLAY
    prefilter = ("pad_sequence", "pack_padded_sequence")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return (
            super().could_match(text)
            and may_call_torch(text, DDP | DP)
            and may_call_torch(text, ("torch.nn.utils.rnn.pad_sequence", "torch.nn.utils.rnn.pack_padded_sequence"))
        )

    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP
                model = nn.Linear(4, 2)
                from torch.nn.utils.rnn import pad_sequence
                model = DDP(model)
                batch = pad_sequence(seqs, batch_first=True)
            """)
        ),
        Valid(
            dedent("""\
                import torch
                from torch.nn.utils.rnn import pad_sequence
                batch = pad_sequence(seqs)
            """)
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        if not (a.ddp_calls or a.dp or a.dp_other):
            return
        for c in calls(a.module, True):
            if isinstance(c.func, (cst.Name, cst.Attribute)) and a.call_name(c) in (
                "torch.nn.utils.rnn.pad_sequence",
                "torch.nn.utils.rnn.pack_padded_sequence",
            ):
                self.report(c)
