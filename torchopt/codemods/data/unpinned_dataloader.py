"""TOP702 `unpinned-dataloader`: Flags a `DataLoader(...)` without `pin_memory` whose batches reach the device in a way TOP104."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import positional
from torchopt.analysis.loader_kwargs import loader_kwargs
from torchopt.analysis.names import callee, torch_ref
from torchopt.analysis.syntax import walk
from torchopt.analysis.transfers import loop_copies
from torchopt.analysis.transfers import move_device
from torchopt.analysis.values import DeviceKind
from torchopt.analysis.values import classify_device
from torchopt.codemods.data import FAMILY
from torchopt.codemods.data.loader_analysis import LoaderInfo
from torchopt.codemods.data.loader_analysis import LoaderRule
from torchopt.codemods.data.loader_analysis import Loop
from torchopt.codemods.data.loader_analysis import loader_arg
from torchopt.codemods.data.loader_analysis import loader_calls_possible
from torchopt.codemods.data.loader_analysis import names_in
from torchopt.codemods.data.loader_arguments import _loader_text
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


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
    `pin_memory=torch.cuda.is_available()`, because on a machine without a GPU
    `pin_memory=True` only warns. Calls with `**kwargs` or an explicit `pin_memory` are left alone.
    """

    code = "TOP702"
    name = "unpinned-dataloader"
    family = FAMILY
    message = "`{loader}` feeds the device but does not pin its batches"
    fix_title = "Add `pin_memory={value}`"
    safety = Safety.SAFE
    prefilter = ("DataLoader",)
    yields_to = {"TOP104": "TOP104 writes the same `pin_memory` on this loader and also makes its copies non-blocking"}

    @classmethod
    def could_match(cls, text: str) -> bool:
        # analyse: no pin_memory, at most 7 positional arguments, a loop over the loader.
        return super().could_match(text) and loader_calls_possible(
            text, lambda a: a.get("pin_memory") is None and a["__positional__"] <= 7, looped=True
        )

    examples = (
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))
                device = 'cuda' if torch.cuda.is_available() else 'cpu'


                def run(loader, device):
                    total = torch.zeros(2, device=device)
                    for x, y in loader:
                        total += x.to(device).sum(0)
                    return total


                total = run(DataLoader(ds, batch_size=4), device)
            """),
            after=dedent("""\
                import torch
                from torch.utils.data import DataLoader, Dataset, TensorDataset

                ds = TensorDataset(torch.arange(16.0).reshape(8, 2), torch.arange(8))
                device = 'cuda' if torch.cuda.is_available() else 'cpu'


                def run(loader, device):
                    total = torch.zeros(2, device=device)
                    for x, y in loader:
                        total += x.to(device).sum(0)
                    return total


                total = run(DataLoader(ds, batch_size=4, pin_memory=torch.cuda.is_available()), device)
            """),
            runnable=True,
            note="the loop is in another function: TOP104 cannot see it",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader

                loader = DataLoader(ds, batch_size=8)
                for batch in loader:
                    batch = {k: v.cuda() for k, v in batch.items()}
            """),
            after=dedent("""\
                import torch
                from torch.utils.data import DataLoader

                loader = DataLoader(ds, batch_size=8, pin_memory=True)
                for batch in loader:
                    batch = {k: v.cuda() for k, v in batch.items()}
            """),
        ),
        Invalid(
            dedent("""\
                from torch.utils.data import DataLoader
                from helpers import to_device


                def train(ds, device):
                    loader = DataLoader(ds)
                    for batch in loader:
                        batch = to_device(batch, device)
            """),
            after=dedent("""\
                import torch
                from torch.utils.data import DataLoader
                from helpers import to_device


                def train(ds, device):
                    loader = DataLoader(ds, pin_memory=torch.cuda.is_available())
                    for batch in loader:
                        batch = to_device(batch, device)
            """),
            note="a helper gets the batch and a device",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader

                loader = DataLoader(ds)
                for x, y in loader:
                    x = x.cuda()
            """),
            note="a direct copy of the batch: TOP104 pins this loader (and makes the copy asynchronous)",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader

                loader = DataLoader(ds)
                for x, y in loader:
                    x = x.float().to('cpu')
            """)
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader


                def f(ds, **kw):
                    loader = DataLoader(ds, **kw)
                    for b in loader:
                        b = {k: v.cuda() for k, v in b.items()}
            """),
            note="`**kw` may already carry pin_memory",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader

                test_loader = DataLoader(test_set, batch_size=4, num_workers=2)
                net = Net()
                net.load_state_dict(torch.load("net.pth"))
                correct = 0
                with torch.no_grad():
                    for images, labels in test_loader:
                        _, predicted = torch.max(net(images), 1)
                        correct += (predicted == labels).sum().item()
            """),
            note="evaluation on the host: `torch.max(..., 1)` reduces over a dimension, it moves nothing",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.data import DataLoader

                loader = DataLoader(ds, pin_memory=False)
                for b in loader:
                    b = {k: v.cuda() for k, v in b.items()}
            """)
        ),
    )

    def analyse(self, infos: list[LoaderInfo]) -> None:
        for info in infos:
            call = info.call
            kwargs = loader_kwargs(self, call)
            if kwargs is None or kwargs.value("pin_memory", loader_arg(call, "pin_memory")) is not None:
                continue
            if len(positional(call)) > 7:
                continue
            if any(
                not lp.via_parameter and info.binding is not None and loop_copies(self, lp.node, lp.target)[0]
                for lp in info.loops
            ):
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
            edit = kwargs.edit("pin_memory", value)
            assert edit is not None  # the dict does not set it: there is always a place to write it
            self.report(
                call,
                fmt={"loader": _loader_text(self, call), "value": text},
                replacement=edit[1],
                target=None if edit[0] is call else edit[0],
                imports=imports,
            )

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
                elif (
                    isinstance(n, (cst.AnnAssign, cst.AugAssign))
                    and n.value is not None
                    and names_in(n.value) & tainted
                    and isinstance(n.target, cst.Name)
                ):
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
            if (callee(self, n) or "").startswith("torch."):
                continue  # `torch.max(outputs, 1)`: a torch function computes where its inputs are
            for a in args:
                if names_in(a.value) & tainted or isinstance(a.value, cst.Integer):
                    continue  # (a bare number is an index or a size more often than a device)
                dev = classify_device(self, a.value)
                if dev.is_device and not dev.is_cpu and dev.text != "meta":
                    literal = dev.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and dev.text.split(":")[0] == "cuda"
                    kinds.add("cuda" if literal else "device")
        return kinds
