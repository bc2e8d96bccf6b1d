"""TOP406 `ddp-checkpoint-prefix`: For a model bound to `DistributedDataParallel(...)`: saves its inner module,."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.checkpoints import round_trip
from torchopt.analysis.statement_edits import ApplyEdits, Edits
from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp.program_analysis import Analysis
from torchopt.codemods.ddp.program_analysis import DDP
from torchopt.codemods.ddp.program_analysis import calls
from torchopt.codemods.ddp.program_analysis import dotted
from torchopt.codemods.ddp.conversion_edits import checkpoint_edits
from torchopt.codemods.ddp.step_checks import _DEPS
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class CheckpointPortability(Rule):
    """## What it does
    For a model bound to `DistributedDataParallel(...)`: saves its inner module,
    `model.module.state_dict()` instead of `model.state_dict()`, so checkpoints have no `module.`
    prefix and load into the plain model; and before `model.load_state_dict(sd)` removes a
    `module.` prefix if the checkpoint has one (`consume_prefix_in_state_dict_if_present`) and
    loads into `model.module`, so both old (wrapper) and new checkpoints load.

    Only reads and loads that surely run on the wrapper are changed: after the wrapping statement
    in the same function, on every path (not a `state_dict()` taken before the model is wrapped,
    and not after a wrap that only happens under a condition). A checkpoint the program writes
    from the wrapper and reads back into the same wrapper itself (the resume checkpoint of a
    training script: the same `torch.save` and `torch.load` path) is left alone: its keys match.

    ## Why is this slow
    Not a speed problem: DDP (like DataParallel) prefixes every key with `module.`, so checkpoints
    saved from the wrapper do not load into an unwrapped model for evaluation or inference,
    and ones saved from the inner module do not load into the wrapper.

    ## Example
    ```python
    torch.save(model.state_dict(), "ckpt.pt")
    model.load_state_dict(torch.load("ckpt.pt"))
    ```

    ## Use instead
    ```python
    torch.save(model.module.state_dict(), "ckpt.pt")
    state_dict = torch.load("ckpt.pt")
    consume_prefix_in_state_dict_if_present(state_dict, "module.")
    model.module.load_state_dict(state_dict)
    ```

    ## Fix safety
    Loading: safe (the same tensors reach the same parameters; a checkpoint without the prefix now
    loads instead of raising). Saving: unsafe (semantics): the file's keys lose the `module.`
    prefix, which matters to other programs that load it into a wrapped model.
    """

    code = "TOP406"
    name = "ddp-checkpoint-prefix"
    family = FAMILY
    message = "checkpoint of a DDP model: `{what}` carries the wrapper's `module.` prefix"
    fix_title = "Use `{model}.module`"
    safety = Safety.SAFE
    prefilter = ("DistributedDataParallel",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, DDP)  # visit_Module: a.ddp

    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = DDP(nn.Linear(4, 2))
                torch.save(model.state_dict(), "ckpt.pt")
            """),
            after=dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = DDP(nn.Linear(4, 2))
                torch.save(model.module.state_dict(), "ckpt.pt")
            """),
            unsafe="semantics",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = DDP(nn.Linear(4, 2))
                model.load_state_dict(torch.load("ckpt.pt"))
            """),
            after=dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = DDP(nn.Linear(4, 2))
                state_dict = torch.load("ckpt.pt")
                # also load checkpoints saved from the wrapper
                consume_prefix_in_state_dict_if_present(state_dict, "module.")
                model.module.load_state_dict(state_dict)
            """),
        ),
        Valid(
            dedent("""\
                import torch
                import torch.distributed as dist
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = DDP(nn.Linear(4, 2))
                torch.save(model.module.state_dict(), "ckpt.pt")
            """)
        ),
        Valid(
            dedent("""\
                import os

                import torch
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                import utils

                model = DDP(nn.Linear(4, 2))
                start = {"epoch": 0}
                utils.restart_from_checkpoint(os.path.join(out_dir, "checkpoint.pth"), run_variables=start, state_dict=model)
                for epoch in range(start["epoch"], 10):
                    train_one_epoch(model)
                    torch.save({"epoch": epoch + 1, "state_dict": model.state_dict()}, os.path.join(out_dir, "checkpoint.pth"))
            """),
            note="the resume checkpoint: a helper of the project is given its path and the wrapper, and may load it back",
        ),
        Valid(
            dedent("""\
                import os

                import torch
                import torch.nn as nn
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = DDP(nn.Linear(4, 2))
                if os.path.isfile("resume.pt"):
                    ckpt = torch.load("resume.pt")
                    model.load_state_dict(ckpt["model"])
                for epoch in range(3):
                    state = dict(epoch=epoch, model=model.state_dict())
                    torch.save(state, "resume.pt")
            """),
            note="a resume checkpoint: written from the wrapper and read back into it by this program",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        models = {m for m in a.ddp if a.ddp_sure(m)}
        if not models:
            return
        for c in calls(a.module, True):
            if (
                isinstance(c.func, cst.Attribute)
                and c.func.attr.value == "state_dict"
                and (m := dotted(c.func.value)) in models
                and not c.args
                and a.wrapped_at(m, c)
                and not round_trip(self, c)
            ):
                new = c.with_changes(
                    func=c.func.with_changes(value=cst.Attribute(value=c.func.value, attr=cst.Name("module")))
                )
                self.report(
                    c,
                    fmt={"what": f"{m}.state_dict()", "model": m},
                    replacement=new,
                    tags=[Tag.SEMANTICS],
                    note="saved checkpoints lose the `module.` key prefix",
                )
        loads = [
            c
            for c in calls(a.module, True)
            if isinstance(c.func, cst.Attribute)
            and c.func.attr.value == "load_state_dict"
            and (m := dotted(c.func.value)) in models
            and a.wrapped_at(m, c)
        ]
        resumed = frozenset(id(c) for c in loads if round_trip(self, c))
        loads = [c for c in loads if id(c) not in resumed]
        if not loads:
            return
        found = a.import_name("torch.nn.modules.utils", "consume_prefix_in_state_dict_if_present")
        if found is None:
            return
        consume, imports = found
        e = Edits()
        _, n = checkpoint_edits(a, e, models, consume, saves=False, leave=resumed)
        if n:
            m = dotted(cst.ensure_type(loads[0].func, cst.Attribute).value) or ""  # (a model's name: in models)
            self.report(
                loads[0],
                fmt={"what": f"{m}.load_state_dict(...)", "model": m},
                replacement=a.module.visit(ApplyEdits(e)),
                target=a.module,
                imports=imports,
            )
