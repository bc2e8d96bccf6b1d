"""TOP701 `dataloader-without-workers`: Flags a `torch.utils.data.DataLoader(...)` without worker processes (`num_workers` missing or."""

from __future__ import annotations

import ast
from textwrap import dedent

from libcst.metadata import ScopeProvider
import libcst as cst

from torchopt.analysis.loader_kwargs import loader_kwargs
from torchopt.codemods.data import FAMILY
from torchopt.codemods.data.loader_analysis import DatasetKind
from torchopt.codemods.data.loader_analysis import LoaderInfo
from torchopt.codemods.data.loader_analysis import LoaderRule
from torchopt.codemods.data.loader_analysis import loader_arg
from torchopt.codemods.data.loader_analysis import loader_calls_possible
from torchopt.codemods.data.loader_arguments import AUTO_WORKERS, AUTO_WORKERS_DISTRIBUTED, _loader_text, _replace_arg
from torchopt.analysis.names import bindings_of, callee, reaching_values
from torchopt.analysis.step_loops import TENSOR_METHODS
from torchopt.analysis.syntax import walk
from torchopt.analysis.values import DeviceKind, classify_device
from torchopt.rewrite.rule import ImportSpec
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Option
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid
from torchopt.rewrite.facts import source_of


# Calls an item made from in-memory tensors may use: builtins that compute an index.
_INDEX_BUILTINS = {"int", "len", "min", "max", "slice", "range", "abs"}


def _dataset_class(rule: Rule, call: cst.Call) -> cst.ClassDef | None:
    """The class of this file (module level or local) whose instance is the loader's dataset."""
    arg = loader_arg(call, "dataset")
    expr = arg.value if arg is not None else None
    if isinstance(expr, cst.Name):
        values = reaching_values(rule, expr) or []
        expr = values[0] if len(values) == 1 else None
    if not (isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name)):
        return None
    bindings = bindings_of(rule, expr.func) or []
    nodes = [getattr(b, "node", None) for b in bindings]
    return nodes[0] if len(nodes) == 1 and isinstance(nodes[0], cst.ClassDef) else None


def _device_slices(rule: Rule, cls: cst.ClassDef | None) -> bool:
    """The dataset's `__getitem__` only indexes tensors it holds (torch calls, tensor methods, index
    arithmetic) and moves the item to a device: no loading for a worker to overlap, and a device
    copy that a worker process could not make."""
    if cls is None:
        return False
    get = next(
        (
            s
            for s in cls.body.body
            if isinstance(s, cst.FunctionDef) and s.name.value == "__getitem__" and not s.decorators
        ),
        None,
    )
    if get is None:
        return False
    moved = False
    for n in walk(get.body):
        if not isinstance(n, cst.Call):
            continue
        func = n.func
        if isinstance(func, cst.Name) and func.value in _INDEX_BUILTINS:
            continue
        q = callee(rule, n)
        if q is not None and q.startswith("torch."):
            continue
        if not isinstance(func, cst.Attribute) or q is not None:
            return False
        meth = func.attr.value
        if meth in ("to", "cuda") and not any(a.star for a in n.args):
            first = n.args[0].value if n.args else None
            device = classify_device(rule, first) if first is not None else None
            if meth == "cuda" or (device is not None and device.kind is not DeviceKind.DTYPE and not device.is_cpu):
                moved = True
                continue
        if meth not in TENSOR_METHODS and meth not in ("size", "long", "float", "int"):
            return False
    return moved


_DISTRIBUTED_HINTS = (
    "torch.distributed",
    "DistributedSampler",
    "DistributedDataParallel",
    "LOCAL_RANK",
    "init_process_group",
)


class SingleProcessLoading(LoaderRule):
    """## What it does
    Flags a `torch.utils.data.DataLoader(...)` without worker processes (`num_workers` missing or
    `0`) and offers `num_workers=min(8, os.cpu_count() or 1)` (divided by `LOCAL_WORLD_SIZE` in
    distributed scripts, or the `num-workers` option).

    The arguments may come through `**`: a dict literal bound once in the same scope
    (`loader_kwargs = dict(batch_size=64)`, `{"num_workers": 0}`) or a dict that a helper of the
    project returns (`**utils.loader_kwargs(args)`, read through the project index). The fix writes
    into the dict when the call is its only use, else into the call, before the `**` (only when the
    dict does not have the argument). A dict changed after it is built, or built out of sight,
    hides the arguments: nothing is reported.

    ## Why is this slow
    With `num_workers=0` every batch is read, decoded, augmented and collated in the training
    process, between two steps: the device idles while the host loads. Worker processes prepare
    the next batches while the current one trains.

    ## Example
    ```python
    loader = DataLoader(ds, batch_size=64, shuffle=True)
    ```

    ## Use instead
    ```python
    loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=min(8, os.cpu_count() or 1))
    ```

    ## Fix safety
    Unsafe (**rng**). The sample order of a map-style dataset is unchanged (`in_order=True`), and
    creating an iterator draws the workers' base seed from the global generator with or without
    workers, so the main process's random stream does not move. But random augmentation in
    `__getitem__` now draws from each worker's generators (torch and `random` seeded with
    `base_seed + worker_id`, NumPy with a state derived from both), so its values change, and workers
    run with one intra-op thread. Validated by comparing sample order and everything else bitwise.

    When the dataset's type is not visible (a parameter, a call into another module) the fix is
    also tagged **semantics**: an `IterableDataset` is copied into every worker, which yields it
    whole, so `k` workers repeat every sample `k` times unless its `__iter__` shards with
    `torch.utils.data.get_worker_info()`. An `IterableDataset` class in the file that does not shard
    is only reported. Also reported without a fix: a dataset holding device tensors (CUDA cannot be
    used in forked workers), a `collate_fn`/`worker_init_fn` that is a lambda
    or a local function and a dataset class defined in a function (the `spawn`/`forkserver` start
    methods cannot pickle them), a dataset whose `__init__` opens a file handle, and a script that
    would start workers at import time without an `if __name__ == "__main__":` guard.

    Not reported: a dataset class of the file whose `__getitem__` only slices tensors it holds
    (torch calls, tensor methods, index arithmetic) and moves the item to a device: there is no
    loading for workers to overlap, and no worker process could make the device copy.
    """

    code = "TOP701"
    name = "dataloader-without-workers"
    family = FAMILY
    message = "`{loader}` loads every batch in the main process (no worker processes)"
    blocked_message = (
        "`{loader}` loads every batch in the main process (no worker processes); "
        "add workers by hand once this is fixed: {why}"
    )
    fix_title = "Load batches in worker processes: `num_workers={workers}`"
    safety = Safety.UNSAFE
    tags = (Tag.RNG,)
    prefilter = ("DataLoader",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # _check: num_workers absent or the literal 0.
        return super().could_match(text) and loader_calls_possible(
            text,
            lambda a: (
                a.get("num_workers") is None
                or (
                    isinstance(a["num_workers"], ast.Constant)
                    and type(a["num_workers"].value) is int
                    and a["num_workers"].value == 0
                )
            ),
        )

    options = (
        Option(
            "num-workers",
            int,
            0,
            "the worker count to write; 0 writes `min(8, os.cpu_count() or 1)` (divided by the "
            "`LOCAL_WORLD_SIZE` environment variable in distributed scripts)",
        ),
    )

    examples = (
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))


                def main():
                    loader = DataLoader(ds, batch_size=4, shuffle=True)
                    return [x.sum() for x, y in loader]


                if __name__ == "__main__":
                    out = main()
            """),
            after=dedent("""\
                import os

                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))


                def main():
                    loader = DataLoader(
                        ds, batch_size=4, shuffle=True, num_workers=min(8, os.cpu_count() or 1)
                    )
                    return [x.sum() for x, y in loader]


                if __name__ == "__main__":
                    out = main()
            """),
            unsafe="rng",
            runnable=True,
            note="TensorDataset is map-style: only random augmentation could change",
        ),
        Invalid(
            dedent("""\
                import os
                from torch.utils.data import DataLoader


                def make_loader(ds):
                    return DataLoader(ds, 32, True, None, None, 0)
            """),
            after=dedent("""\
                import os
                from torch.utils.data import DataLoader


                def make_loader(ds):
                    return DataLoader(ds, 32, True, None, None, min(8, os.cpu_count() or 1))
            """),
            unsafe=("rng", "semantics"),
            note="positional `num_workers=0`; the dataset's type is unknown (an IterableDataset would be duplicated)",
        ),
        Invalid(
            dedent("""\
                import torch.distributed as dist
                from torch.utils.data import DataLoader, DistributedSampler


                def make_loader(ds):
                    return DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds), num_workers=0)
            """),
            after=dedent("""\
                import os

                import torch.distributed as dist
                from torch.utils.data import DataLoader, DistributedSampler


                def make_loader(ds):
                    return DataLoader(
                        ds,
                        batch_size=8,
                        sampler=DistributedSampler(ds),
                        num_workers=min(
                            8,
                            max(
                                1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                            ),
                        ),
                    )
            """),
            unsafe=("rng", "semantics"),
            note="one process per GPU: the CPUs are shared by the local ranks",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                class Stream(torch.utils.data.IterableDataset):
                    def __iter__(self):
                        return iter(range(8))


                def main():
                    loader = DataLoader(Stream(), batch_size=2)
                    return list(loader)


                if __name__ == "__main__":
                    main()
            """),
            note="an IterableDataset that does not shard: every worker would yield all 8 items",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))
                loader = DataLoader(ds, batch_size=4, collate_fn=lambda b: b)
            """),
            note="no main guard and a lambda collate_fn: reported, not fixed",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                def make(x, y, device):
                    ds = TensorDataset(x.to(device), y.to(device))
                    return DataLoader(ds, batch_size=4)
            """),
            note="device tensors in the dataset: CUDA cannot be used in forked workers",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset


                class Windows(Dataset):
                    def __init__(self, data, n, device):
                        self.data, self.n, self.device = data, n, device

                    def __getitem__(self, i):
                        start = torch.randint(0, self.data.size(0) - self.n, (1,))
                        return self.data[start : start + self.n].long().to(self.device)

                    def __len__(self):
                        return self.data.size(0) // self.n


                def make(data, device):
                    return DataLoader(Windows(data, 8, device), batch_size=4)
            """),
            note="each item is a slice of an in-memory tensor moved to the device: nothing for a worker to do",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                def make(ds, args):
                    return DataLoader(ds, batch_size=4, num_workers=args.workers)
            """)
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))


                def main():
                    loader_kwargs = {"batch_size": 4, "num_workers": 0}
                    loader = DataLoader(ds, **loader_kwargs)
                    return [x.sum() for x, y in loader]


                if __name__ == "__main__":
                    out = main()
            """),
            after=dedent("""\
                import os

                import torch
                from torch.utils.data import DataLoader, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))


                def main():
                    loader_kwargs = {"batch_size": 4, "num_workers": min(8, os.cpu_count() or 1)}
                    loader = DataLoader(ds, **loader_kwargs)
                    return [x.sum() for x, y in loader]


                if __name__ == "__main__":
                    out = main()
            """),
            unsafe="rng",
            runnable=True,
            note="the arguments come from a dict used only here: the fix edits the dict",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, TensorDataset


                def loaders(train_ds, val_ds):
                    common = dict(batch_size=4, drop_last=True)
                    return DataLoader(train_ds, shuffle=True, **common), DataLoader(val_ds, **common)
            """),
            after=dedent("""\
                import os

                import torch
                from torch.utils.data import DataLoader, TensorDataset


                def loaders(train_ds, val_ds):
                    common = dict(batch_size=4, drop_last=True)
                    return DataLoader(
                        train_ds, shuffle=True, num_workers=min(8, os.cpu_count() or 1), **common
                    ), DataLoader(val_ds, num_workers=min(8, os.cpu_count() or 1), **common)
            """),
            unsafe=("rng", "semantics"),
            note="a dict shared by two loaders, without `num_workers`: each call gets its own, before the `**`",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))
                loader_kwargs = dict(batch_size=4, num_workers=4, pin_memory=True)
                loader = DataLoader(ds, **loader_kwargs)
            """),
            note="`num_workers` comes from the dict",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, TensorDataset

                def make(ds, args):
                    kw = {"batch_size": 4}
                    kw["num_workers"] = args.workers
                    return DataLoader(ds, **kw)
            """),
            note="the dict is changed after it is built: its entries are not known",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                def make(ds, **kw):
                    return DataLoader(ds, batch_size=4, **kw)
            """),
            note="`**kw` may carry num_workers",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))
                loader = DataLoader(ds, batch_size=4, num_workers=2)
            """),
            runnable=True,
        ),
        Valid(
            dedent("""\
                from mylib import DataLoader

                loader = DataLoader(ds)
            """)
        ),
    )

    def analyse(self, infos: list[LoaderInfo]) -> None:
        for info in infos:
            self._check(info)

    def _check(self, info: LoaderInfo) -> None:
        call = info.call
        kwargs = loader_kwargs(self, call)
        if kwargs is None:
            return
        nw = loader_arg(call, "num_workers")
        given = kwargs.value("num_workers", nw)
        if given is not None and not (isinstance(given, cst.Integer) and int(given.evaluated_value) == 0):
            return
        kind, cls = self.dataset_kind(call)
        if _device_slices(self, _dataset_class(self, call)):
            return  # nothing for a worker to do, and what it does (a device copy) no worker can
        why = self.worker_blockers(call, cls)
        if any(isinstance(v, cst.Lambda) for v in kwargs.entries.values()):
            why.append(f"{kwargs.source} holds a lambda, which worker processes started with `spawn` cannot pickle")
        if kind is DatasetKind.ITERABLE:
            name = cls.name.value if cls is not None else "the dataset"
            why.insert(
                0,
                f"`{name}` is an IterableDataset whose `__iter__` does not shard with "
                "`torch.utils.data.get_worker_info()`, so every worker would yield all of it",
            )
        fmt = {"loader": _loader_text(self, call)}
        if why:
            self.report(call, message=self.blocked_message, fmt={**fmt, "why": "; ".join(why)})
            return
        value = self._workers()
        if value is None:
            self.report(call, fmt=fmt)
            return
        text = cst.Module([]).code_for_node(value)
        edit = (call, _replace_arg(call, nw, value)) if nw is not None else kwargs.edit("num_workers", value)
        if edit is None:  # the `**` dict sets it, and is shared with other calls
            self.report(call, fmt=fmt)
            return
        tags: tuple[Tag, ...] = (Tag.RNG,)
        note = (
            "random augmentation in the dataset draws from the workers' generators; sample order "
            "is unchanged; the dataset and collate_fn must be picklable"
        )
        if kind is DatasetKind.UNKNOWN:
            tags = (Tag.RNG, Tag.SEMANTICS)
            note += (
                "; if the dataset is an IterableDataset that does not shard with get_worker_info(), "
                "every worker yields all of it"
            )
        imports = () if self.option("num-workers") > 0 else (ImportSpec("os"),)
        target = None if edit[0] is call else edit[0]
        self.report(
            call,
            fmt={**fmt, "workers": text},
            replacement=edit[1],
            target=target,
            tags=tags,
            note=note,
            imports=imports,
        )

    def _workers(self) -> cst.BaseExpression | None:
        k = self.option("num-workers")
        if k > 0:
            return cst.Integer(str(k))
        module = self.ctx.module
        hit = self.__dict__.get("_workers_memo")
        if hit is None or hit[0] is not module:  # once per parse
            shadowed = self._os_shadowed()
            code = "" if shadowed else source_of(module)
            hit = self._workers_memo = (module, shadowed, any(h in code for h in _DISTRIBUTED_HINTS))
        if hit[1]:
            return None
        text = AUTO_WORKERS_DISTRIBUTED if hit[2] else AUTO_WORKERS
        return cst.parse_expression(text)

    def _os_shadowed(self) -> bool:
        for stmt in self.ctx.module.body:
            try:
                scope = self.get_metadata(ScopeProvider, stmt)
            except KeyError:
                continue
            if scope is None or "os" not in scope:
                return False
            for a in scope["os"]:
                node = getattr(a, "node", None)
                if not (
                    isinstance(node, cst.Import)
                    and any(cst.helpers.get_full_name_for_node(n.name) == "os" and n.asname is None for n in node.names)
                ):
                    return True
            return False
        return False
