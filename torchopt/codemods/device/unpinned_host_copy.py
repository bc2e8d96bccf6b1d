"""TOP104 `unpinned-host-copy`: Flags a `torch.utils.data.DataLoader` whose batches are copied to the device in a `for` loop."""

from __future__ import annotations

import ast as _ast
from textwrap import dedent

from libcst.metadata import ScopeProvider
import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import keyword
from torchopt.analysis.loader_kwargs import loader_kwargs
from torchopt.analysis.arguments import positional
from torchopt.analysis.arguments import set_kwarg
from torchopt.analysis.names import callee
from torchopt.analysis.names import torch_ref
from torchopt.analysis.precheck.scopes import ast_loop_calls
from torchopt.analysis.precheck.torch_imports import torch_calls_to
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.analysis.transfers import DATALOADERS
from torchopt.analysis.transfers import assigned_before
from torchopt.analysis.transfers import base_name
from torchopt.analysis.transfers import loop_copies
from torchopt.analysis.transfers import move_device
from torchopt.analysis.transfers import mutated_names
from torchopt.codemods.device import FAMILY
from torchopt.codemods.device.dataset_copies import sample_copy
from torchopt.codemods.device.loader_sources import int_device_attribute
from torchopt.codemods.device.loader_sources import loader_calls
from torchopt.codemods.device.loop_prechecks import _LoaderUse
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import ImportSpec
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


_PIN_MEMORY_POSITION = (
    7  # DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory, ...)
)


class UnpinnedHostCopy(Rule):
    """## What it does
    Flags a `torch.utils.data.DataLoader` whose batches are copied to the device in a `for` loop
    (`for x, y in loader`, `for i, (x, y) in enumerate(loader)`, `for b in tqdm(loader)`) when
    the loader does not pin its batches or the copies are synchronous. Two findings, each with its
    own fix: `pin_memory=...` on the `DataLoader(...)` call, and `non_blocking=True` on each
    host→device copy (`x.cuda()`, `x.to(device)`) of a tensor that comes from the loop target.

    ## Why is this slow
    A copy from ordinary (pageable) host memory is staged through a pinned buffer by the driver
    and blocks the host until it is done, so the next kernels cannot be queued meanwhile. With
    `pin_memory=True` the loader's worker puts every batch in page-locked memory, and a copy with
    `non_blocking=True` from there is a true asynchronous DMA that overlaps with compute.

    ## Example
    ```python
    loader = DataLoader(ds, batch_size=64, num_workers=4)
    for x, y in loader:
        x, y = x.cuda(), y.cuda()
    ```

    ## Use instead
    ```python
    loader = DataLoader(ds, batch_size=64, num_workers=4, pin_memory=True)
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
    ```

    ## Fix safety
    Safe: the values are identical. A host→device copy with `non_blocking=True` is ordered before
    every later kernel on the same stream, and a DataLoader yields a fresh batch per iteration, so
    nothing mutates the source while the copy runs (copies of tensors mutated in place in the loop
    are left alone). `non_blocking` is never added to device→host copies (`.cpu()`, `.to('cpu')`),
    whose result the host may read before it arrives. `pin_memory=True` is used when the copies go
    to CUDA explicitly; when the device comes from a variable the fix writes
    `pin_memory=torch.cuda.is_available()`, so the script still runs without a GPU. A loader that
    already passes `pin_memory` (any value), in the call or in the `**` dict it spreads, keeps its
    arguments; a `**` dict built once in the same scope (or returned by a helper of the project)
    is read, and the flag goes into the dict when this loader is its only user, else into the call.
    A `**` dict that cannot be followed (a parameter, changed after it is built) leaves the loader
    alone. The fix does not insert `.pin_memory()` calls, which are slower than a plain copy.

    A loader whose dataset (a class of this file) copies each sample to the device in its own
    `__getitem__` (`return seq.to(device)`) is reported without a fix: every batch is then as many
    small synchronous copies as it has samples; moving the copy out of the dataset changes what the
    dataset returns, which is the author's call.
    """

    code = "TOP104"
    name = "unpinned-host-copy"
    family = FAMILY
    message = "`{move}` copies a DataLoader batch to the device synchronously"
    loader_message = "`{loader}` feeds host→device copies but does not pin its batches"
    sample_message = (
        "`{getitem}` copies every sample to the device (`{move}`): each batch is that many small "
        "synchronous copies; return host tensors and copy the collated batch once in the loop "
        "(`pin_memory=True` on the loader, `non_blocking=True` on the copy)"
    )
    fix_title = "Add `non_blocking=True`"
    loader_fix_title = "Add `pin_memory={value}`"
    safety = Safety.SAFE
    prefilter = ("DataLoader",)

    @classmethod
    def could_match(cls, text: str) -> bool:

        # visit_Call/leave_Module: `<name> = DataLoader(...)` and a `.cuda()`/`.to()` in a for loop.
        if not super().could_match(text):
            return False
        calls = torch_calls_to(text, DATALOADERS)
        if calls is None:
            return True
        if not calls:
            return False
        if "__getitem__" in text and (".to(" in text or ".cuda(" in text):
            return True  # a dataset that copies its samples (visit_Call)
        loop_calls = ast_loop_calls(text)
        return loop_calls is None or any(
            isinstance(c.func, _ast.Attribute) and c.func.attr in ("cuda", "to") for c, _ in loop_calls
        )

    examples = (
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset


                class Samples(Dataset):
                    def __init__(self, data, device):
                        self.data, self.device = data, device

                    def __getitem__(self, i):
                        return self.data[i].to(self.device)

                    def __len__(self):
                        return len(self.data)


                loader = DataLoader(Samples(torch.randn(8, 2), "cuda"), batch_size=4)
            """),
            after=None,
            note="the dataset copies each sample itself: reported without a fix",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, TensorDataset

                ds = TensorDataset(torch.arange(8.0).reshape(4, 2), torch.arange(4))
                loader = DataLoader(ds, batch_size=2, num_workers=4)
                for x, y in loader:
                    x, y = x.cuda(), y.cuda()
            """),
            after=dedent("""\
                import torch
                from torch.utils.data import DataLoader, TensorDataset

                ds = TensorDataset(torch.arange(8.0).reshape(4, 2), torch.arange(4))
                loader = DataLoader(ds, batch_size=2, num_workers=4, pin_memory=True)
                for x, y in loader:
                    x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            """),
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, TensorDataset

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                ds = TensorDataset(torch.arange(8.0).reshape(4, 2), torch.arange(4))
                loader = DataLoader(ds, batch_size=2)
                seen = []
                for x, y in loader:
                    x, y = x.to(device), y.to(device)
                    seen.append(x.sum(0) + y)
            """),
            after=dedent("""\
                import torch
                from torch.utils.data import DataLoader, TensorDataset

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                ds = TensorDataset(torch.arange(8.0).reshape(4, 2), torch.arange(4))
                loader = DataLoader(ds, batch_size=2, pin_memory=torch.cuda.is_available())
                seen = []
                for x, y in loader:
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    seen.append(x.sum(0) + y)
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader

                def train(model, ds, device):
                    loader = DataLoader(ds, batch_size=32, shuffle=True)
                    for step, (images, labels) in enumerate(loader):
                        out = model(images.to(device))
                        loss = (out - labels.to(device, torch.float32)).pow(2).mean()
            """),
            after=dedent("""\
                import torch
                from torch.utils.data import DataLoader

                def train(model, ds, device):
                    loader = DataLoader(
                        ds, batch_size=32, shuffle=True, pin_memory=torch.cuda.is_available()
                    )
                    for step, (images, labels) in enumerate(loader):
                        out = model(images.to(device, non_blocking=True))
                        loss = (out - labels.to(device, torch.float32, non_blocking=True)).pow(2).mean()
            """),
        ),
        Invalid(
            dedent("""\
                import torch

                loader = torch.utils.data.DataLoader(ds, pin_memory=True)
                for batch in loader:
                    batch = batch.cuda()
            """),
            after=dedent("""\
                import torch

                loader = torch.utils.data.DataLoader(ds, pin_memory=True)
                for batch in loader:
                    batch = batch.cuda(non_blocking=True)
            """),
            note="the loader already pins: only the copy changes",
        ),
        Invalid(
            dedent("""\
                from torch.utils.data import DataLoader

                loader = DataLoader(ds)
                for x, y in loader:
                    x = x.cuda(non_blocking=True)
            """),
            after=dedent("""\
                from torch.utils.data import DataLoader

                loader = DataLoader(ds, pin_memory=True)
                for x, y in loader:
                    x = x.cuda(non_blocking=True)
            """),
            note="the copies are already asynchronous: only the loader changes",
        ),
        Invalid(
            dedent("""\
                from torch.utils.data import DataLoader

                loader_kwargs = dict(batch_size=8, num_workers=4)
                loader = DataLoader(ds, shuffle=True, **loader_kwargs)
                for x, y in loader:
                    x = x.cuda(non_blocking=True)
            """),
            after=dedent("""\
                from torch.utils.data import DataLoader

                loader_kwargs = dict(batch_size=8, num_workers=4, pin_memory=True)
                loader = DataLoader(ds, shuffle=True, **loader_kwargs)
                for x, y in loader:
                    x = x.cuda(non_blocking=True)
            """),
            note="the loader's arguments are in a dict used by this loader only: the flag goes into the dict",
        ),
        Invalid(
            dedent("""\
                from torch.utils.data import DataLoader

                kwargs = {"batch_size": 8}
                train_loader = DataLoader(train_ds, shuffle=True, **kwargs)
                test_loader = DataLoader(test_ds, **kwargs)
                for x, y in train_loader:
                    x = x.cuda(non_blocking=True)
            """),
            after=dedent("""\
                from torch.utils.data import DataLoader

                kwargs = {"batch_size": 8}
                train_loader = DataLoader(train_ds, shuffle=True, pin_memory=True, **kwargs)
                test_loader = DataLoader(test_ds, **kwargs)
                for x, y in train_loader:
                    x = x.cuda(non_blocking=True)
            """),
            note="a dict shared by two loaders: only the loader whose batches are copied is pinned, in its call",
        ),
        Valid(
            dedent("""\
                from torch.utils.data import DataLoader

                def make(ds, kwargs):
                    loader = DataLoader(ds, **kwargs)
                    for x, y in loader:
                        x = x.cuda(non_blocking=True)
            """),
            note="the `**` dict is a parameter: whether it pins is not known",
        ),
        Valid(
            dedent("""\
                from torch.utils.data import DataLoader

                kw = dict(batch_size=8, pin_memory=False)
                loader = DataLoader(ds, **kw)
                for x, y in loader:
                    x = x.cuda(non_blocking=True)
            """),
            note="the program chose `pin_memory` in the dict",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, TensorDataset

                ds = TensorDataset(torch.arange(8.0).reshape(4, 2), torch.arange(4))
                loader = DataLoader(ds, batch_size=2)
                for x, y in loader:
                    x = x.to('cpu')
            """),
            runnable=True,
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader

                loader = DataLoader(ds, pin_memory=False)
                for x, y in loader:
                    x = x.cuda(non_blocking=True)
            """)
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader

                def make(ds, **kw):
                    loader = DataLoader(ds, **kw)
                    for x, y in loader:
                        x = x.cuda(non_blocking=True)
            """)
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader

                loader = DataLoader(ds, pin_memory=True)
                for x, y in loader:
                    p = model(x.cuda(non_blocking=True)).cpu()
                    q = p.to('cpu')
            """),
            note="device→host copies never get non_blocking",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader

                loader = DataLoader(ds)
                for x, y in loader:
                    x = x.to(other)
            """),
            note="`other` may be a tensor or a dtype",
        ),
        Valid(
            dedent("""\
                from torch.utils.data import DataLoader

                def build(ds):
                    loader = DataLoader(ds)
                    return loader

                def train(loader):
                    for x, y in loader:
                        x = x.cuda()
            """),
            note="the loop's loader is a parameter, not the DataLoader built elsewhere",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.utils.data as tud

                def train(model, device, train_loader):
                    for batch_idx, (data, target) in enumerate(train_loader):
                        data, target = data.to(device), target.to(device)

                def main(ds, model):
                    device = torch.device("cuda")
                    kwargs = {"batch_size": 8, "pin_memory": True}
                    loader = tud.DataLoader(ds, **kwargs)
                    for epoch in range(2):
                        train(model, device, loader)
            """),
            after=dedent("""\
                import torch
                import torch.utils.data as tud

                def train(model, device, train_loader):
                    for batch_idx, (data, target) in enumerate(train_loader):
                        data, target = (
                            data.to(device, non_blocking=True),
                            target.to(device, non_blocking=True),
                        )

                def main(ds, model):
                    device = torch.device("cuda")
                    kwargs = {"batch_size": 8, "pin_memory": True}
                    loader = tud.DataLoader(ds, **kwargs)
                    for epoch in range(2):
                        train(model, device, loader)
            """),
            note="the copy is in a function that every call in the file gives a DataLoader",
        ),
        Invalid(
            dedent("""\
                from torch.utils.data import DataLoader


                class Trainer:
                    def __init__(self, model, train_data: DataLoader, gpu_id: int):
                        self.gpu_id = gpu_id
                        self.train_data = train_data

                    def run_epoch(self):
                        for source, targets in self.train_data:
                            source = source.to(self.gpu_id)


                def prepare(ds):
                    return DataLoader(ds, batch_size=32, pin_memory=True)


                Trainer(None, prepare(ds), 0).run_epoch()
            """),
            after=dedent("""\
                from torch.utils.data import DataLoader


                class Trainer:
                    def __init__(self, model, train_data: DataLoader, gpu_id: int):
                        self.gpu_id = gpu_id
                        self.train_data = train_data

                    def run_epoch(self):
                        for source, targets in self.train_data:
                            source = source.to(self.gpu_id, non_blocking=True)


                def prepare(ds):
                    return DataLoader(ds, batch_size=32, pin_memory=True)


                Trainer(None, prepare(ds), 0).run_epoch()
            """),
            note="a trainer method: the loader comes through `__init__`, the device is an `int` GPU index",
        ),
        Valid(
            dedent("""\
                from torch.utils.data import DataLoader

                def train(loader, device):
                    for x in loader:
                        x = x.to(device)

                train(DataLoader(ds), "cuda")
                train(prefetcher, "cuda")
            """),
            note="one call passes something else: a prefetcher may reuse its pinned buffers",
        ),
        Valid(
            dedent("""\
                from torch.utils.data import DataLoader


                class Trainer:
                    def __init__(self, data, gpu_id):
                        self.gpu_id = gpu_id
                        self.data = data

                    def run(self):
                        for x in self.data:
                            x = x.to(self.gpu_id)


                Trainer(DataLoader(ds), 0).run()
            """),
            note="`gpu_id` is not known to be a GPU index (no `int` annotation)",
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._loaders: dict[int, cst.Call] = {}  # id(binding Name) -> DataLoader call
        self._fors: list[cst.For] = []
        self._seen_loader = False  # any DataLoader call, bound to a name or not (`return DataLoader(...)`)

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) not in DATALOADERS:
            return
        self._seen_loader = True
        copied = sample_copy(self, node)
        if copied is not None:
            self.report(node, message=self.sample_message, fmt={"getitem": copied[0], "move": source(self, copied[1])})
        parent = self.get_metadata(ParentProvider, node, None)
        if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
            target = parent.targets[0].target
        elif isinstance(parent, cst.AnnAssign):
            target = parent.target
        else:
            return
        if isinstance(target, cst.Name):
            self._loaders[id(target)] = node

    def visit_For(self, node: cst.For) -> None:
        if node.asynchronous is None:
            self._fors.append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self._seen_loader:
            return
        uses: dict[int, _LoaderUse] = {}
        moves: dict[int, cst.Call] = {}
        for loop in self._fors:
            unwrapped = self._unwrap(loop.iter, loop.target)
            if unwrapped is None:
                continue
            name, target = unwrapped
            calls = self._loader_calls(name)
            if not calls:
                continue
            kinds, fixable = self._moves(loop, target)
            if not kinds:
                continue
            for call in calls:
                uses.setdefault(id(call), _LoaderUse(call)).kinds |= kinds
            for m in fixable:
                moves[id(m)] = m
        for m in moves.values():
            self.report(m, fmt={"move": source(self, m)}, replacement=set_kwarg(m, "non_blocking", cst.Name("True")))
        for use in uses.values():
            self._report_loader(use)

    def _report_loader(self, use: _LoaderUse) -> None:
        call = use.call
        kwargs = loader_kwargs(self, call)
        if kwargs is None or kwargs.value("pin_memory") is not None:
            return  # `*args`, a `**` dict not followed, or pinning already chosen
        if len(positional(call)) > _PIN_MEMORY_POSITION:
            return
        if use.kinds == {"cuda"}:
            value: cst.BaseExpression = cst.Name("True")
            imports: tuple[ImportSpec, ...] = ()
        else:
            ref = torch_ref(self)
            if ref is None:
                return
            value = ref.attr("cuda.is_available()")
            imports = ref.imports
        text = cst.Module([]).code_for_node(value)
        fmt = {"loader": source(self, call.func) + "(...)", "value": text}
        edit = kwargs.edit("pin_memory", value)
        if edit is None:
            return
        self.report(
            call,
            fmt=fmt,
            message=self.loader_message,
            fix_title=self.loader_fix_title,
            target=edit[0],
            replacement=edit[1],
            imports=imports,
        )

    def _unwrap(
        self, it: cst.BaseExpression, target: cst.BaseExpression
    ) -> tuple[cst.Name | cst.Attribute, cst.BaseExpression] | None:
        """The loader (a name or ``self.X``) and the part of the target that receives its batches."""
        for _ in range(4):
            if isinstance(it, cst.Name) or (isinstance(it, cst.Attribute) and isinstance(it.value, cst.Name)):
                return it, target
            if not isinstance(it, cst.Call) or has_star(it):
                return None
            args = positional(it)
            if not args:
                return None
            fname = (
                it.func.value
                if isinstance(it.func, cst.Name)
                else (it.func.attr.value if isinstance(it.func, cst.Attribute) else "")
            )
            if fname == "enumerate" and isinstance(it.func, cst.Name):
                if not isinstance(target, (cst.Tuple, cst.List)) or len(target.elements) != 2:
                    return None
                target = target.elements[1].value
            elif fname in ("tqdm", "track", "progress_bar"):
                pass
            else:
                return None
            it = args[0].value
        return None

    def _loader_calls(self, name: cst.Name | cst.Attribute) -> list[cst.Call]:
        """The DataLoader calls ``name`` is bound to, if every binding it can see is one (or, for a
        parameter or a ``self.`` attribute, if every call or assignment in the file passes one)."""
        if isinstance(name, cst.Attribute):
            return loader_calls(self, name)
        try:
            scope = self.get_metadata(ScopeProvider, name)
        except KeyError:
            return []
        if scope is None or name.value not in scope:
            return []
        out = []
        for a in scope[name.value]:
            call = self._loaders.get(id(getattr(a, "node", None)))
            if call is None:
                return loader_calls(self, name)
            out.append(call)
        return out

    def _moves(self, loop: cst.For, target: cst.BaseExpression) -> tuple[set[str], list[cst.Call]]:
        kinds, fixable = loop_copies(self, loop, target)
        extra_kinds, extra = self._copies_to_gpu_index(loop, target)
        return kinds | extra_kinds, fixable + extra

    def _copies_to_gpu_index(self, loop: cst.For, target: cst.BaseExpression) -> tuple[set[str], list[cst.Call]]:
        """Trainer classes copy to ``self.gpu_id``, an ``int`` GPU index the shared device analysis
        does not know: ``x.to(self.gpu_id)`` of a loop-target tensor."""
        names = {n.value for n in walk(target) if isinstance(n, cst.Name)}
        mutated = mutated_names(loop.body)
        kinds: set[str] = set()
        fixable: list[cst.Call] = []
        for n in walk(loop.body):
            if not (isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "to"):
                continue
            pos = positional(n)
            if has_star(n) or len(pos) != 1 or any(a.keyword.value != "non_blocking" for a in n.args if a.keyword):
                continue
            base = base_name(n.func.value)
            if base is None or base.value not in names or base.value in mutated:
                continue
            if move_device(self, n) is not None or not isinstance(pos[0].value, cst.Attribute):
                continue
            if assigned_before(self, base, loop.body, n) or not int_device_attribute(self, pos[0].value):
                continue
            kinds.add("device")
            if keyword(n, "non_blocking") is None:
                fixable.append(n)
        return kinds, fixable
