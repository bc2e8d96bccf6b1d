"""DataLoader construction (rules.md DATA-001..003): TOP701 `num_workers`, TOP702 `pin_memory`,
TOP703 `persistent_workers`."""
from __future__ import annotations

import ast

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import torch_ref
from torchopt.analysis.values import DeviceKind, classify_device
from torchopt.analysis.arguments import has_star, keyword, positional, set_kwarg
from torchopt.analysis.syntax import source, walk
from torchopt.codemods.data import FAMILY
from torchopt.codemods.data._loaders import (
    DatasetKind,
    LoaderInfo,
    LoaderRule,
    Loop,
    loader_arg,
    loader_calls_possible,
    names_in,
)
from torchopt.analysis.transfers import loop_copies, move_device
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import ImportSpec, Invalid, Option, Safety, Tag, Valid

# What TOP701 writes when no `num-workers` option is set (TOP703 recognises them as > 0).
AUTO_WORKERS = "min(8, os.cpu_count() or 1)"
AUTO_WORKERS_DISTRIBUTED = 'min(8, max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))'
_DISTRIBUTED_HINTS = ("torch.distributed", "DistributedSampler", "DistributedDataParallel", "LOCAL_RANK",
                      "init_process_group")


def _replace_arg(call: cst.Call, arg: cst.Arg, value: cst.BaseExpression) -> cst.Call:
    return call.with_changes(args=[a.with_changes(value=value) if a is arg else a for a in call.args])


def _loader_text(rule: LoaderRule, call: cst.Call) -> str:
    return source(rule, call.func) + "(...)"


_H = "import torch\nfrom torch.utils.data import DataLoader, Dataset, TensorDataset\n\n"
_TDS = "ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))\n"


class SingleProcessLoading(LoaderRule):
    """## What it does
    Flags a `torch.utils.data.DataLoader(...)` without worker processes (`num_workers` missing or
    `0`) and offers `num_workers=min(8, os.cpu_count() or 1)` (divided by `LOCAL_WORLD_SIZE` in
    distributed scripts, or the `num-workers` option).

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
    """

    code = "TOP701"
    name = "dataloader-without-workers"
    family = FAMILY
    message = "`{loader}` loads every batch in the main process (no worker processes)"
    blocked_message = ("`{loader}` loads every batch in the main process (no worker processes); "
                       "add workers by hand once this is fixed: {why}")
    fix_title = "Load batches in worker processes: `num_workers={workers}`"
    safety = Safety.UNSAFE
    tags = (Tag.RNG,)
    prefilter = ("DataLoader",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # _check: num_workers absent or the literal 0.
        return super().could_match(text) and loader_calls_possible(text, lambda a: a.get("num_workers") is None or (
            isinstance(a["num_workers"], ast.Constant) and type(a["num_workers"].value) is int
            and a["num_workers"].value == 0))
    options = (
        Option("num-workers", int, 0,
               "the worker count to write; 0 writes `min(8, os.cpu_count() or 1)` (divided by the "
               "`LOCAL_WORLD_SIZE` environment variable in distributed scripts)"),
    )

    examples = (
        Invalid(
            _H + _TDS + "\n\ndef main():\n    loader = DataLoader(ds, batch_size=4, shuffle=True)\n"
            "    return [x.sum() for x, y in loader]\n\n\nif __name__ == \"__main__\":\n    out = main()\n",
            after=_H.replace("\n\n", "\nimport os\n\n") + _TDS + "\n\ndef main():\n"
            "    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=min(8, os.cpu_count() or 1))\n"
            "    return [x.sum() for x, y in loader]\n\n\nif __name__ == \"__main__\":\n    out = main()\n",
            unsafe="rng",
            runnable=True,
            note="TensorDataset is map-style: only random augmentation could change",
        ),
        Invalid(
            "import os\nfrom torch.utils.data import DataLoader\n\n\ndef make_loader(ds):\n"
            "    return DataLoader(ds, 32, True, None, None, 0)\n",
            after="import os\nfrom torch.utils.data import DataLoader\n\n\ndef make_loader(ds):\n"
            "    return DataLoader(ds, 32, True, None, None, min(8, os.cpu_count() or 1))\n",
            unsafe=("rng", "semantics"),
            note="positional `num_workers=0`; the dataset's type is unknown (an IterableDataset would be duplicated)",
        ),
        Invalid(
            "import torch.distributed as dist\nfrom torch.utils.data import DataLoader, DistributedSampler\n\n\n"
            "def make_loader(ds):\n    return DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds), num_workers=0)\n",
            after="import torch.distributed as dist\nfrom torch.utils.data import DataLoader, DistributedSampler\nimport os\n\n\n"
            "def make_loader(ds):\n    return DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds), "
            "num_workers=min(8, max(1, (os.cpu_count() or 1) // int(os.environ.get(\"LOCAL_WORLD_SIZE\", \"1\")))))\n",
            unsafe=("rng", "semantics"),
            note="one process per GPU: the CPUs are shared by the local ranks",
        ),
        Invalid(
            _H + "class Stream(torch.utils.data.IterableDataset):\n    def __iter__(self):\n"
            "        return iter(range(8))\n\n\ndef main():\n    loader = DataLoader(Stream(), batch_size=2)\n"
            "    return list(loader)\n\n\nif __name__ == \"__main__\":\n    main()\n",
            after=None,
            note="an IterableDataset that does not shard: every worker would yield all 8 items",
        ),
        Invalid(
            _H + _TDS + "loader = DataLoader(ds, batch_size=4, collate_fn=lambda b: b)\n",
            after=None,
            note="no main guard and a lambda collate_fn: reported, not fixed",
        ),
        Invalid(
            _H + "def make(x, y, device):\n    ds = TensorDataset(x.to(device), y.to(device))\n"
            "    return DataLoader(ds, batch_size=4)\n",
            after=None,
            note="device tensors in the dataset: CUDA cannot be used in forked workers",
        ),
        Valid(_H + "def make(ds, args):\n    return DataLoader(ds, batch_size=4, num_workers=args.workers)\n"),
        Valid(_H + "def make(ds, **kw):\n    return DataLoader(ds, batch_size=4, **kw)\n",
              note="`**kw` may carry num_workers"),
        Valid(_H + _TDS + "loader = DataLoader(ds, batch_size=4, num_workers=2)\n", runnable=True),
        Valid("from mylib import DataLoader\n\nloader = DataLoader(ds)\n"),
    )

    def analyse(self, infos: list[LoaderInfo]) -> None:
        for info in infos:
            self._check(info)

    def _check(self, info: LoaderInfo) -> None:
        call = info.call
        if has_star(call):
            return
        nw = loader_arg(call, "num_workers")
        if nw is not None and not (isinstance(nw.value, cst.Integer) and int(nw.value.evaluated_value) == 0):
            return
        kind, cls = self.dataset_kind(call)
        why = self.worker_blockers(call, cls)
        if kind is DatasetKind.ITERABLE:
            name = cls.name.value if cls is not None else "the dataset"
            why.insert(0, f"`{name}` is an IterableDataset whose `__iter__` does not shard with "
                          "`torch.utils.data.get_worker_info()`, so every worker would yield all of it")
        fmt = {"loader": _loader_text(self, call)}
        if why:
            self.report(call, message=self.blocked_message, fmt={**fmt, "why": "; ".join(why)})
            return
        value = self._workers()
        if value is None:
            self.report(call, fmt=fmt)
            return
        text = cst.Module([]).code_for_node(value)
        replacement = set_kwarg(call, "num_workers", value) if nw is None else _replace_arg(call, nw, value)
        tags: tuple[Tag, ...] = (Tag.RNG,)
        note = ("random augmentation in the dataset draws from the workers' generators; sample order "
                "is unchanged; the dataset and collate_fn must be picklable")
        if kind is DatasetKind.UNKNOWN:
            tags = (Tag.RNG, Tag.SEMANTICS)
            note += ("; if the dataset is an IterableDataset that does not shard with get_worker_info(), "
                     "every worker yields all of it")
        imports = () if self.option("num-workers") > 0 else (ImportSpec("os"),)
        self.report(call, fmt={**fmt, "workers": text}, replacement=replacement, tags=tags, note=note,
                    imports=imports)

    def _workers(self) -> cst.BaseExpression | None:
        k = self.option("num-workers")
        if k > 0:
            return cst.Integer(str(k))
        module = self.ctx.module
        hit = self.__dict__.get("_workers_memo")
        if hit is None or hit[0] is not module:  # once per parse: module.code regenerates the file
            shadowed = self._os_shadowed()
            code = "" if shadowed else module.code
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
                if not (isinstance(node, cst.Import) and any(
                        cst.helpers.get_full_name_for_node(n.name) == "os" and n.asname is None
                        for n in node.names)):
                    return True
            return False
        return False


class UnpinnedLoader(LoaderRule):
    """## What it does
    Flags a `DataLoader(...)` without `pin_memory` whose batches reach the device in a way TOP104
    does not follow: the loader is passed to a function that iterates it and copies the batch, the
    copy goes through a helper (`to_device(batch, device)`), a dict comprehension
    (`{k: v.to(device) for k, v in batch.items()}`), or a tensor derived from the batch. Loaders whose
    loop copies the batch directly are TOP104's (it also adds `non_blocking=True`).

    ## Why is this slow
    Without pinned (page-locked) host memory each host→device copy is staged through a driver
    buffer and blocks the host. With `pin_memory=True` the loader pins every batch in a background
    thread, copies are faster and can be asynchronous (`non_blocking=True`, TOP104).

    ## Example
    ```python
    def train(model, loader, device):
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}

    train(model, DataLoader(ds, batch_size=64), device)
    ```

    ## Use instead
    ```python
    train(model, DataLoader(ds, batch_size=64, pin_memory=torch.cuda.is_available()), device)
    ```

    ## Fix safety
    Safe: pinned memory holds the same bytes, and the copies stay as they are (synchronous unless
    they already say otherwise). `pin_memory=True` is written when every copy goes to CUDA
    literally; when the device comes from a variable the fix writes
    `pin_memory=torch.cuda.is_available()` (rules.md G-10), because on a machine without a GPU
    `pin_memory=True` only warns. Calls with `**kwargs` or an explicit `pin_memory` are left alone.
    """

    code = "TOP702"
    name = "unpinned-dataloader"
    family = FAMILY
    message = "`{loader}` feeds the device but does not pin its batches"
    fix_title = "Add `pin_memory={value}`"
    safety = Safety.SAFE
    prefilter = ("DataLoader",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # analyse: no pin_memory, at most 7 positional arguments, a loop over the loader.
        return super().could_match(text) and loader_calls_possible(
            text, lambda a: a.get("pin_memory") is None and a["__positional__"] <= 7, looped=True)

    examples = (
        Invalid(
            _H + _TDS + "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n\n\n"
            "def run(loader, device):\n    total = torch.zeros(2, device=device)\n"
            "    for x, y in loader:\n        total += x.to(device).sum(0)\n    return total\n\n\n"
            "total = run(DataLoader(ds, batch_size=4), device)\n",
            after=_H + _TDS + "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n\n\n"
            "def run(loader, device):\n    total = torch.zeros(2, device=device)\n"
            "    for x, y in loader:\n        total += x.to(device).sum(0)\n    return total\n\n\n"
            "total = run(DataLoader(ds, batch_size=4, pin_memory=torch.cuda.is_available()), device)\n",
            runnable=True,
            note="the loop is in another function: TOP104 cannot see it",
        ),
        Invalid(
            "import torch\nfrom torch.utils.data import DataLoader\n\nloader = DataLoader(ds, batch_size=8)\n"
            "for batch in loader:\n    batch = {k: v.cuda() for k, v in batch.items()}\n",
            after="import torch\nfrom torch.utils.data import DataLoader\n\n"
            "loader = DataLoader(ds, batch_size=8, pin_memory=True)\n"
            "for batch in loader:\n    batch = {k: v.cuda() for k, v in batch.items()}\n",
        ),
        Invalid(
            "from torch.utils.data import DataLoader\nfrom helpers import to_device\n\n\n"
            "def train(ds, device):\n    loader = DataLoader(ds)\n    for batch in loader:\n"
            "        batch = to_device(batch, device)\n",
            after="from torch.utils.data import DataLoader\nfrom helpers import to_device\nimport torch\n\n\n"
            "def train(ds, device):\n    loader = DataLoader(ds, pin_memory=torch.cuda.is_available())\n"
            "    for batch in loader:\n        batch = to_device(batch, device)\n",
            note="a helper gets the batch and a device",
        ),
        Valid(
            "import torch\nfrom torch.utils.data import DataLoader\n\nloader = DataLoader(ds)\n"
            "for x, y in loader:\n    x = x.cuda()\n",
            note="a direct copy of the batch: TOP104 pins this loader (and makes the copy asynchronous)",
        ),
        Valid(
            "import torch\nfrom torch.utils.data import DataLoader\n\nloader = DataLoader(ds)\n"
            "for x, y in loader:\n    x = x.float().to('cpu')\n",
        ),
        Valid(
            "import torch\nfrom torch.utils.data import DataLoader\n\n\ndef f(ds, **kw):\n    loader = DataLoader(ds, **kw)\n"
            "    for b in loader:\n        b = {k: v.cuda() for k, v in b.items()}\n",
            note="`**kw` may already carry pin_memory",
        ),
        Valid(
            "import torch\nfrom torch.utils.data import DataLoader\n\nloader = DataLoader(ds, pin_memory=False)\n"
            "for b in loader:\n    b = {k: v.cuda() for k, v in b.items()}\n",
        ),
    )

    def analyse(self, infos: list[LoaderInfo]) -> None:
        for info in infos:
            call = info.call
            if has_star(call) or loader_arg(call, "pin_memory") is not None:
                continue
            if len(positional(call)) > 7:
                continue
            if any(not lp.via_parameter and info.binding is not None
                   and loop_copies(self, lp.node, lp.target)[0]  # type: ignore[arg-type]
                   for lp in info.loops):
                continue  # TOP104 pins this loader
            kinds: set[str] = set()
            for lp in info.loops:
                kinds |= self._device_kinds(lp)
            if not kinds:
                continue
            if kinds == {"cuda"}:
                value: cst.BaseExpression = cst.Name("True")
                imports: tuple = ()
            else:
                ref = torch_ref(self)
                if ref is None:
                    continue
                value = ref.attr("cuda.is_available()")
                imports = ref.imports
            text = cst.Module([]).code_for_node(value)
            self.report(call, fmt={"loader": _loader_text(self, call), "value": text},
                        replacement=set_kwarg(call, "pin_memory", value), imports=imports)

    def _device_kinds(self, lp: Loop) -> set[str]:
        """How values derived from the loop's batch reach a device: {"cuda"} for literal CUDA,
        {"device"} for a device variable."""
        tainted = {n.value for n in walk(lp.target) if isinstance(n, cst.Name)}
        body = lp.node.body
        for _ in range(3):
            before = len(tainted)
            for n in walk(body):
                if isinstance(n, cst.Assign) and names_in(n.value) & tainted:
                    for t in n.targets:
                        tainted |= {x.value for x in walk(t.target) if isinstance(x, cst.Name)}
                elif isinstance(n, (cst.AnnAssign, cst.AugAssign)) and n.value is not None \
                        and names_in(n.value) & tainted and isinstance(n.target, cst.Name):
                    tainted.add(n.target.value)
                elif isinstance(n, (cst.For, cst.CompFor)) and names_in(n.iter) & tainted:
                    tainted |= {x.value for x in walk(n.target) if isinstance(x, cst.Name)}
            if len(tainted) == before:
                break
        kinds: set[str] = set()
        for n in walk(body):
            if not isinstance(n, cst.Call) or has_star(n):
                continue
            if isinstance(n.func, cst.Attribute) and n.func.attr.value in ("cuda", "to"):
                if names_in(n.func.value) & tainted:
                    mv = move_device(self, n)
                    if mv is not None:
                        kinds.add(mv[0])
                continue
            args = list(n.args)
            if not any(names_in(a.value) & tainted for a in args):
                continue
            for a in args:
                if names_in(a.value) & tainted:
                    continue
                dev = classify_device(self, a.value)
                if dev.is_device and not dev.is_cpu and dev.text != "meta":
                    literal = dev.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and dev.text.split(":")[0] == "cuda"
                    kinds.add("cuda" if literal else "device")
        return kinds


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
    Unsafe (**rng**), although rules.md lists DATA-003 as exact: measured with torch 2.13, a new
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
    message = "`{loader}` starts and stops its {workers} worker processes every epoch"
    stale_message = ("`{change}` changes the dataset of `{loader}` every epoch: persistent workers would keep "
                     "a stale copy; keep re-creating the workers, or make the change in the main process "
                     "(e.g. in a sampler)")
    fix_title = "Keep the workers between epochs: `persistent_workers={value}`"
    safety = Safety.UNSAFE
    tags = (Tag.RNG,)
    prefilter = ("DataLoader",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # _check: num_workers given, not a literal <= 0, no persistent_workers keyword, and an epoch
        # loop around the loader's loop or a call it is passed to.
        def test(a: dict) -> bool:
            nw = a.get("num_workers")
            if nw is None or "persistent_workers" in a:
                return False
            return not (isinstance(nw, ast.Constant) and type(nw.value) is int and nw.value <= 0)

        return super().could_match(text) and loader_calls_possible(text, test, epoch=True)

    examples = (
        Invalid(
            _H + _TDS + "\n\ndef main():\n    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2)\n"
            "    seen = []\n    for epoch in range(2):\n        for x, y in loader:\n            seen.append(y)\n"
            "    return seen\n\n\nif __name__ == \"__main__\":\n    seen = main()\n",
            after=_H + _TDS + "\n\ndef main():\n    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, "
            "persistent_workers=True)\n"
            "    seen = []\n    for epoch in range(2):\n        for x, y in loader:\n            seen.append(y)\n"
            "    return seen\n\n\nif __name__ == \"__main__\":\n    seen = main()\n",
            unsafe="rng",
            runnable=True,
            note="the second epoch's shuffle order changes",
        ),
        Invalid(
            "from torch.utils.data import DataLoader\n\n\ndef fit(model, ds, args):\n"
            "    loader = DataLoader(ds, batch_size=32, num_workers=args.workers)\n"
            "    for epoch in range(args.epochs):\n        train_one_epoch(model, loader)\n",
            after="from torch.utils.data import DataLoader\n\n\ndef fit(model, ds, args):\n"
            "    loader = DataLoader(ds, batch_size=32, num_workers=args.workers, persistent_workers=args.workers > 0)\n"
            "    for epoch in range(args.epochs):\n        train_one_epoch(model, loader)\n",
            unsafe="rng",
            note="a worker count from a variable: persistent only when it is positive",
        ),
        Invalid(
            "from torch.utils.data import DataLoader\n\n\ndef fit(ds):\n"
            "    loader = DataLoader(ds, batch_size=32, num_workers=4)\n"
            "    for epoch in range(10):\n        ds.set_epoch(epoch)\n        for batch in loader:\n            step(batch)\n",
            after=None,
            note="the dataset changes between epochs: reported at `ds.set_epoch(epoch)`",
        ),
        Valid(
            "from torch.utils.data import DataLoader\n\nloader = DataLoader(ds, num_workers=4)\n"
            "for batch in loader:\n    step(batch)\n",
            note="one epoch",
        ),
        Valid(
            "from torch.utils.data import DataLoader\n\nloader = DataLoader(ds)\n"
            "for epoch in range(3):\n    for batch in loader:\n        step(batch)\n",
            note="no workers: TOP701's business",
        ),
        Valid(
            "from torch.utils.data import DataLoader\n\nfor epoch in range(3):\n"
            "    loader = DataLoader(ds, num_workers=4)\n    for batch in loader:\n        step(batch)\n",
            note="a new loader every epoch",
        ),
        Valid(
            "from torch.utils.data import DataLoader\n\nloader = DataLoader(ds, num_workers=4, persistent_workers=False)\n"
            "for epoch in range(3):\n    for batch in loader:\n        step(batch)\n",
        ),
    )

    def analyse(self, infos: list[LoaderInfo]) -> None:
        for info in infos:
            self._check(info)

    def _check(self, info: LoaderInfo) -> None:
        call = info.call
        if has_star(call) or keyword(call, "persistent_workers") is not None:
            return
        nw = loader_arg(call, "num_workers")
        if nw is None:
            return
        v = nw.value
        code = " ".join(self.ctx.module.code_for_node(v).split())
        if isinstance(v, cst.Integer):
            if int(v.evaluated_value) <= 0:
                return
            value: cst.BaseExpression = cst.Name("True")
            workers = code
        elif code in (AUTO_WORKERS, AUTO_WORKERS_DISTRIBUTED):
            value, workers = cst.Name("True"), "worker"
        elif isinstance(v, (cst.Name, cst.Attribute)):
            value = cst.parse_expression(f"{code} > 0")
            workers = "worker"
        else:
            return
        epoch = self._epoch_loop(info)
        if epoch is None:
            return
        fmt = {"loader": _loader_text(self, call), "workers": workers, "value": cst.Module([]).code_for_node(value)}
        change = self._dataset_change(info, epoch)
        if change is not None:
            self.report(change, message=self.stale_message, fmt={**fmt, "change": source(self, change)})
            return
        note = ("the workers' base seed is drawn once, not every epoch: from the second epoch on the shuffled "
                "order, worker-side random augmentation and later draws from the global torch generator change")
        self.report(call, fmt=fmt, replacement=set_kwarg(call, "persistent_workers", value), note=note)

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
            return (isinstance(expr, cst.Attribute) and expr.attr.value == "dataset"
                    and isinstance(expr.value, cst.Name) and expr.value.value == loader_name)

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
