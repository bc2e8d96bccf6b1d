"""TOP703 `transient-dataloader-workers`: Flags a `DataLoader(...)` with worker processes (`num_workers` > 0) that is iterated once per."""

from __future__ import annotations

import ast
from textwrap import dedent

import libcst as cst

from torchopt.analysis.control import control_of
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.data import FAMILY
from torchopt.codemods.data.loader_analysis import LoaderInfo
from torchopt.analysis.loader_kwargs import loader_kwargs
from torchopt.codemods.data.loader_analysis import LoaderRule
from torchopt.codemods.data.loader_analysis import loader_arg
from torchopt.codemods.data.loader_analysis import loader_calls_possible
from torchopt.codemods.data.loader_arguments import AUTO_WORKERS, AUTO_WORKERS_DISTRIBUTED, _loader_text
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class TransientWorkers(LoaderRule):
    """## What it does
    Flags a `DataLoader(...)` with worker processes (`num_workers` > 0) that is iterated once per
    epoch (a loop over it inside another loop, or the loader passed to a function called in a loop)
    and does not keep its workers: it adds `persistent_workers=True`.

    ## Why is this slow
    Without `persistent_workers` every `for batch in loader` starts `num_workers` new processes,
    each of which receives a copy of the dataset and re-runs its set-up (imports, file opening,
    `worker_init_fn`), and shuts them down at the end of the epoch. With large datasets or many
    workers that start-up is seconds per epoch during which the device waits.

    ## Example
    ```python
    loader = DataLoader(ds, batch_size=64, num_workers=4)
    for epoch in range(10):
        for x, y in loader:
            ...
    ```

    ## Use instead
    ```python
    loader = DataLoader(ds, batch_size=64, num_workers=4, persistent_workers=True)
    ```

    ## Fix safety
    Unsafe (**rng**), although the values look untouched at first sight: measured with torch 2.13, a new
    iterator draws the workers' base seed from the global torch generator, and persistent workers
    draw it once instead of once per epoch. From the second epoch on, the shuffled order, the
    workers' random augmentation, and every later draw from the global generator (dropout,
    initialisation) differ. The first epoch is identical. A `num_workers` given as a variable gets
    `persistent_workers=<it> > 0`, since `persistent_workers=True` with zero workers raises
    `ValueError`. When the epoch loop changes the dataset (`ds.set_epoch(e)`, a curriculum
    threshold, resampling) persistent workers would keep stale copies of it: that is reported at
    the change, without a fix.
    """

    code = "TOP703"
    name = "transient-dataloader-workers"
    family = FAMILY
    message = "`{loader}` starts and stops its {workers} every epoch"
    stale_message = (
        "`{change}` changes the dataset of `{loader}` every epoch: persistent workers would keep "
        "a stale copy; keep re-creating the workers, or make the change in the main process "
        "(e.g. in a sampler)"
    )
    fix_title = "Keep the workers between epochs: `persistent_workers={value}`"
    safety = Safety.UNSAFE
    tags = (Tag.RNG,)
    prefilter = ("DataLoader",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # _check: num_workers given, not a literal <= 0, no persistent_workers keyword, and an epoch
        # loop around the loader's loop or a call it is passed to.
        def test(keywords: dict) -> bool:
            nw = keywords.get("num_workers")
            if nw is None or "persistent_workers" in keywords:
                return False
            return not (isinstance(nw, ast.Constant) and type(nw.value) is int and nw.value <= 0)

        return super().could_match(text) and loader_calls_possible(text, test, epoch=True)

    examples = (
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))


                def main():
                    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2)
                    seen = []
                    for epoch in range(3):
                        for x, y in loader:
                            seen.append(y)
                    return seen


                if __name__ == "__main__":
                    seen = main()
            """),
            after=dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))


                def main():
                    loader = DataLoader(
                        ds, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True
                    )
                    seen = []
                    for epoch in range(3):
                        for x, y in loader:
                            seen.append(y)
                    return seen


                if __name__ == "__main__":
                    seen = main()
            """),
            unsafe="rng",
            runnable=True,
            note="the second epoch's shuffle order changes",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))


                def main():
                    loader_kwargs = dict(batch_size=4, num_workers=2)
                    loader = DataLoader(ds, **loader_kwargs)
                    seen = []
                    for epoch in range(3):
                        for x, y in loader:
                            seen.append(y)
                    return seen


                if __name__ == "__main__":
                    seen = main()
            """),
            after=dedent("""\
                import torch
                from torch.utils.data import DataLoader, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))


                def main():
                    loader_kwargs = dict(batch_size=4, num_workers=2, persistent_workers=True)
                    loader = DataLoader(ds, **loader_kwargs)
                    seen = []
                    for epoch in range(3):
                        for x, y in loader:
                            seen.append(y)
                    return seen


                if __name__ == "__main__":
                    seen = main()
            """),
            unsafe="rng",
            runnable=True,
            note="`num_workers` comes from a dict used only here: `persistent_workers` goes into it",
        ),
        Invalid(
            dedent("""\
                from torch.utils.data import DataLoader


                def fit(model, ds, args):
                    loader = DataLoader(ds, batch_size=32, num_workers=args.workers)
                    for epoch in range(args.epochs):
                        train_one_epoch(model, loader)
            """),
            after=dedent("""\
                from torch.utils.data import DataLoader


                def fit(model, ds, args):
                    loader = DataLoader(
                        ds, batch_size=32, num_workers=args.workers, persistent_workers=args.workers > 0
                    )
                    for epoch in range(args.epochs):
                        train_one_epoch(model, loader)
            """),
            unsafe="rng",
            note="a worker count from a variable: persistent only when it is positive",
        ),
        Invalid(
            dedent("""\
                from torch.utils.data import DataLoader


                def fit(ds):
                    loader = DataLoader(ds, batch_size=32, num_workers=4)
                    for epoch in range(10):
                        ds.set_epoch(epoch)
                        for batch in loader:
                            step(batch)
            """),
            note="the dataset changes between epochs: reported at `ds.set_epoch(epoch)`",
        ),
        Valid(
            dedent("""\
                from torch.utils.data import DataLoader

                loader = DataLoader(ds, num_workers=4)
                for batch in loader:
                    step(batch)
            """),
            note="one epoch",
        ),
        Valid(
            dedent("""\
                from torch.utils.data import DataLoader

                loader = DataLoader(ds)
                for epoch in range(3):
                    for batch in loader:
                        step(batch)
            """),
            note="no workers: TOP701's business",
        ),
        Valid(
            dedent("""\
                from torch.utils.data import DataLoader

                for epoch in range(3):
                    loader = DataLoader(ds, num_workers=4)
                    for batch in loader:
                        step(batch)
            """),
            note="a new loader every epoch",
        ),
        Valid(
            dedent("""\
                import argparse

                from torch.utils.data import DataLoader

                parser = argparse.ArgumentParser()
                parser.add_argument("--dataloader_num_workers", type=int, default=0)
                args = parser.parse_args()
                loader = DataLoader(ds, batch_size=8, num_workers=args.dataloader_num_workers)
                for epoch in range(10):
                    for batch in loader:
                        step(batch)
            """),
            note="the workers' option defaults to 0: by default there are no workers to keep",
        ),
        Valid(
            dedent("""\
                from torch.utils.data import DataLoader

                loader = DataLoader(ds, batch_size=4, num_workers=2)
                for epoch in range(2):
                    for batch in loader:
                        step(batch)
            """),
            note="two epochs: keeping the workers would save one start-up",
        ),
        Valid(
            dedent("""\
                from torch.utils.data import DataLoader

                loader = DataLoader(ds, num_workers=4, persistent_workers=False)
                for epoch in range(3):
                    for batch in loader:
                        step(batch)
            """)
        ),
    )

    def analyse(self, infos: list[LoaderInfo]) -> None:
        for info in infos:
            self._check(info)

    def _check(self, info: LoaderInfo) -> None:
        call = info.call
        kwargs = loader_kwargs(self, call)
        if kwargs is None or kwargs.value("persistent_workers") is not None:
            return
        v = kwargs.value("num_workers", loader_arg(call, "num_workers"))
        if v is None:
            return
        code = " ".join(self.ctx.module.code_for_node(v).split())
        if isinstance(v, cst.Integer):
            if int(v.evaluated_value) <= 0:
                return
            value: cst.BaseExpression = cst.Name("True")
            workers = f"{code} worker processes"
        elif code in (AUTO_WORKERS, AUTO_WORKERS_DISTRIBUTED):
            value, workers = cst.Name("True"), "worker processes"
        elif isinstance(v, (cst.Name, cst.Attribute)):
            if control_of(self).opts.left_at(v, "0"):
                return  # an option or parameter that defaults to no workers: nothing to keep by default
            value = cst.parse_expression(f"{code} > 0")
            workers = "worker processes"
        else:
            return
        epoch = self._epoch_loop(info)
        if epoch is None or _runs_at_most_twice(epoch):
            return  # (twice: persistent workers would save one start-up)
        fmt = {"loader": _loader_text(self, call), "workers": workers, "value": cst.Module([]).code_for_node(value)}
        change = self._dataset_change(info, epoch)
        if change is not None:
            self.report(change, message=self.stale_message, fmt={**fmt, "change": source(self, change)})
            return
        note = (
            "the workers' base seed is drawn once, not every epoch: from the second epoch on the shuffled "
            "order, worker-side random augmentation and later draws from the global torch generator change"
        )
        edit = kwargs.edit("persistent_workers", value)
        assert edit is not None  # the dict does not set it: there is always a place to write it
        self.report(call, fmt=fmt, replacement=edit[1], target=None if edit[0] is call else edit[0], note=note)

    def _epoch_loop(self, info: LoaderInfo) -> cst.For | cst.While | None:
        own = {id(lp.node) for lp in info.loops}
        for lp in info.loops:
            if lp.via_parameter:
                continue
            for outer in self.enclosing_loops(lp.node):
                if id(outer) not in own and not self.inside(info.call, outer):
                    return outer
        for c in info.passed_to:
            for outer in self.enclosing_loops(c):
                if id(outer) not in own and not self.inside(info.call, outer):
                    return outer
        return None

    def _dataset_change(self, info: LoaderInfo, epoch: cst.For | cst.While) -> cst.CSTNode | None:
        ds = loader_arg(info.call, "dataset")
        ds_name = ds.value.value if ds is not None and isinstance(ds.value, cst.Name) else None
        loader_name = info.binding.value if info.binding is not None else None

        def is_ds(expr: cst.BaseExpression) -> bool:
            while isinstance(expr, cst.Subscript):
                expr = expr.value
            if isinstance(expr, cst.Name):
                return expr.value == ds_name
            return (
                isinstance(expr, cst.Attribute)
                and expr.attr.value == "dataset"
                and isinstance(expr.value, cst.Name)
                and expr.value.value == loader_name
            )

        for n in walk(epoch.body):
            if isinstance(n, cst.Call):
                if isinstance(n.func, cst.Attribute) and is_ds(n.func.value):
                    return self._statement(n)
                if isinstance(n.func, cst.Name) and n.func.value in ("len", "print", "isinstance", "DataLoader"):
                    continue
                if any(is_ds(a.value) for a in n.args) and not any(a.value is info.binding for a in n.args):
                    if not self._loader_call(n):
                        return self._statement(n)
            elif isinstance(n, cst.AssignTarget) and isinstance(n.target, (cst.Attribute, cst.Subscript)):
                if is_ds(n.target.value):
                    return self._statement(n)
            elif isinstance(n, cst.AugAssign) and isinstance(n.target, (cst.Attribute, cst.Subscript)):
                if is_ds(n.target.value):
                    return n
        return None

    def _loader_call(self, call: cst.Call) -> bool:
        return self._is_loader(call)

    def _statement(self, node: cst.CSTNode) -> cst.CSTNode:
        cur = node
        while cur is not None and not isinstance(cur, cst.BaseSmallStatement):
            cur = self.get_metadata(ParentProvider, cur, None)
        return cur if cur is not None else node


def _runs_at_most_twice(loop: cst.For | cst.While) -> bool:
    """`for epoch in range(2):`: a loop whose trip count is a literal of at most 2."""
    it = loop.iter if isinstance(loop, cst.For) else None
    if not (isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value == "range"):
        return False
    if len(it.args) != 1 or not isinstance(it.args[0].value, cst.Integer):
        return False
    return int(it.args[0].value.evaluated_value) <= 2
