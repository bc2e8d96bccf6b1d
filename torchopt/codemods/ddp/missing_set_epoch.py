"""TOP403 `missing-set-epoch`: Inserts `sampler.set_epoch(epoch)` as the first statement of the epoch loop around a training."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.analysis.statement_edits import ApplyEdits, Edits
from torchopt.codemods.ddp import FAMILY
from torchopt.codemods.ddp.program_analysis import Analysis
from torchopt.codemods.ddp.program_analysis import DSAMPLERS
from torchopt.codemods.ddp.program_analysis import LOADERS
from torchopt.codemods.ddp.conversion_edits import set_epoch_edits
from torchopt.codemods.ddp.step_checks import _DEPS
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class MissingSetEpoch(Rule):
    """## What it does
    Inserts `sampler.set_epoch(epoch)` as the first statement of the epoch loop around a training
    loop whose `DataLoader` takes a `DistributedSampler` (a name bound to one, or an inline
    `sampler=DistributedSampler(ds)`, then `loader.sampler.set_epoch(epoch)`), when the file never
    calls `set_epoch` on it. The epoch is the target of the `for epoch in ...` loop.

    The loop over the loader may sit in a function the epoch loop calls: `def train(epoch):` that
    reads the loader as a global (set under `if __name__ == "__main__":`) gets the call first in its
    body, with its own epoch parameter; a step imported from another module of the project
    (`train_one_epoch(model, loader, optimizer, epoch)` from `engine.py`, which iterates the loader
    it is given) gets it first in the epoch loop of this file, since a fix edits only the file it
    was found in.

    ## Why is this slow
    Not a speed problem but a training bug that DDP conversions often introduce: the sampler
    seeds its shuffle with `seed + epoch`, so without `set_epoch` every epoch visits the data in
    the same order (verified: same order twice without it, a new one after `set_epoch(1)`).

    ## Example
    ```python
    for epoch in range(epochs):
        for x, y in loader:
            ...
    ```

    ## Use instead
    ```python
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            ...
    ```

    ## Fix safety
    Unsafe (semantics): the data order of every epoch after the first changes (that is the point:
    the original repeated the first epoch's order). With a `while` epoch loop nothing is inserted
    and the diagnostic asks for a counter; when resuming, pass the resumed epoch.
    """

    code = "TOP403"
    name = "missing-set-epoch"
    family = FAMILY
    message = "`DistributedSampler` without `set_epoch(epoch)`: every epoch shuffles the data the same way"
    fix_title = "Call `set_epoch(epoch)` at the start of each epoch"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS,)
    prefilter = ("DistributedSampler",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        # visit_Module: a DataLoader (sampler=<a DistributedSampler>) bound to a name, looped over.
        return super().could_match(text) and may_call_torch(text, DSAMPLERS) and may_call_torch(text, LOADERS)

    METADATA_DEPENDENCIES = _DEPS
    examples = (
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader
                from torch.utils.data.distributed import DistributedSampler

                sampler = DistributedSampler(train_ds)
                loader = DataLoader(train_ds, batch_size=8, sampler=sampler)
                for epoch in range(3):
                    for x, y in loader:
                        loss = model(x).mean()
                        loss.backward()
                        optimizer.step()
            """),
            after=dedent("""\
                import torch
                from torch.utils.data import DataLoader
                from torch.utils.data.distributed import DistributedSampler

                sampler = DistributedSampler(train_ds)
                loader = DataLoader(train_ds, batch_size=8, sampler=sampler)
                for epoch in range(3):
                    sampler.set_epoch(epoch)  # a new shuffle every epoch
                    for x, y in loader:
                        loss = model(x).mean()
                        loss.backward()
                        optimizer.step()
            """),
            unsafe="semantics",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader
                from torch.utils.data.distributed import DistributedSampler


                def train(epoch):
                    net.train()
                    for x, y in train_loader:
                        optimizer.zero_grad()
                        net(x).mean().backward()
                        optimizer.step()


                if __name__ == "__main__":
                    train_sampler = DistributedSampler(train_ds)
                    train_loader = DataLoader(train_ds, batch_size=8, sampler=train_sampler)
                    net = build_model()
                    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
                    for epoch in range(start_epoch, 90):
                        train(epoch)
            """),
            after=dedent("""\
                import torch
                from torch.utils.data import DataLoader
                from torch.utils.data.distributed import DistributedSampler


                def train(epoch):
                    net.train()
                    train_sampler.set_epoch(epoch)  # a new shuffle every epoch
                    for x, y in train_loader:
                        optimizer.zero_grad()
                        net(x).mean().backward()
                        optimizer.step()


                if __name__ == "__main__":
                    train_sampler = DistributedSampler(train_ds)
                    train_loader = DataLoader(train_ds, batch_size=8, sampler=train_sampler)
                    net = build_model()
                    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
                    for epoch in range(start_epoch, 90):
                        train(epoch)
            """),
            unsafe="semantics",
            note="the loader, sampler, model and optimizer are globals set under `__main__` and read by "
            "`train(epoch)`: the epoch is the function's own parameter",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader
                from torch.utils.data.distributed import DistributedSampler

                sampler = DistributedSampler(train_ds)
                loader = DataLoader(train_ds, batch_size=8, sampler=sampler)
                for epoch in range(3):
                    sampler.set_epoch(epoch)  # a new shuffle every epoch
                    for x, y in loader:
                        loss = model(x).mean()
                        loss.backward()
                        optimizer.step()
            """)
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = Analysis.of(self)
        samplers: dict[str, str] = {}
        for L, binds in a.loaders.items():
            if len(binds) != 1:
                continue
            _, lc = binds[0]
            kw = keyword(lc, "sampler")
            if kw is None:
                continue
            v = kw.value
            if isinstance(v, cst.Name) and v.value in a.samplers:
                if not a.set_epoch_called(v.value, L):
                    samplers[L] = v.value
            elif isinstance(v, cst.Call) and a.call_name(v) in DSAMPLERS:
                if not a.set_epoch_called(None, L):
                    samplers[L] = f"{L}.sampler"
        if not samplers:
            return
        loops = [lp for lp in a.training_loops() if lp.loader in samplers and lp.epoch is not None]
        if not loops:
            return
        e = Edits()
        notes: list[str] = []
        n = set_epoch_edits(a, e, samplers, notes)
        if n == 0:
            why = "; ".join(notes) if notes else "no `for epoch in ...` loop: add a counter"
            self.report(loops[0].node, message=self.message + f" ({why})")
            return
        self.report(
            loops[0].node,
            replacement=a.module.visit(ApplyEdits(e)),
            target=a.module,
            tags=[Tag.SEMANTICS],
            note="the data order of each epoch after the first changes",
        )
