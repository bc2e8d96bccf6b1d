"""Fused optimizer kernels for Adam, AdamW and SGD on device parameters."""

from __future__ import annotations

import re

from textwrap import dedent

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.analysis.arguments import has_star, keyword, set_kwarg
from torchopt.analysis.names import callee
from torchopt.codemods.optim import FAMILY
from torchopt.analysis.optimizers import (
    FUSED_OPTIMIZERS,
    OTHER_BACKENDS,
    group_sets,
    on_possible_cuda,
    parameter_owners,
    params_arg,
    seen_through,
)
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Tag, Valid
from torchopt.rewrite.facts import source_of

# Arguments that choose the implementation (or forbid the fused one): the user has decided.
_IMPLEMENTATION_ARGS = ("fused", "foreach", "differentiable")


# Launchers that choose the device for the script (it may be an XLA device, where fused kernels raise).
_LAUNCHER_PICKS_DEVICE = re.compile(r"^\s*(?:from|import)\s+(?:accelerate|lightning|pytorch_lightning)\b", re.M)


class FusedOptimizer(Rule):
    """## What it does
    Adds `fused=True` to `torch.optim.Adam`, `torch.optim.AdamW` and `torch.optim.SGD` when the
    parameters they update belong to a module that the same function (or class, or script) moves
    to a device that may be CUDA: `model.cuda()`, `model.to("cuda")`, `model.to(device)` /
    `Net().to(device)` where `device` is a CUDA or CPU device or a name the `device-names` setting
    says holds one, or a module built with `device=`. Opt-in: select it by code
    (`--select ALL,TOP961 --unsafe-fixes`).

    Nothing is added when the call already passes `fused=`, `foreach=` or `differentiable=`, uses
    `*args`/`**kwargs`, has a param group that sets one of them (or `**`-unpacks a dict), when the
    file names another accelerator (MPS, XLA, XPU, HPU, ...) or uses sparse gradients
    (`sparse=True`), when the script imports a launcher that picks the device itself (Hugging Face
    Accelerate, Lightning: `accelerator.device` may be an XLA device, where the fused kernels raise),
    or for optimizers without a fused kernel (RMSprop, Adagrad on CUDA, ...).

    ## Why is this slow
    Without `fused=`, PyTorch runs the `foreach` implementation on CUDA: a handful of kernels per
    step for each group of tensors, each reading and writing the parameters, gradients and state
    again. The fused kernel does the whole update in one pass over memory. With a `GradScaler`,
    `scaler.step(optimizer)` on a non-fused optimizer reads `found_inf` on the host (a CPU-GPU
    synchronisation every step); a fused optimizer takes the scale and the inf flag into its kernel
    and skips the step on the device, so that synchronisation goes away too.

    ## Example
    ```python
    model = Net().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    ```

    ## Use instead
    ```python
    model = Net().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    ```
    Plain `fused=True` is valid on every device this fix accepts: PyTorch 2.4 added fused Adam,
    AdamW and SGD kernels for the CPU next to the CUDA ones, so the same line runs when `device`
    falls back to the CPU. (`fused=torch.cuda.is_available()` would be wrong whenever the model
    stays on the CPU of a machine that has a GPU.) `foreach=True` is not written: it is already
    the default on CUDA.

    ## Fix safety
    Unsafe (tolerance): the fused kernel computes the same update with other rounding (it
    reassociates the arithmetic), so parameters drift from the non-fused run by a few ULPs per step.
    The optimizer's `state_dict` keeps its keys; each param group gains `"fused": True`, and
    `step` is kept as a tensor on the parameters' device. A checkpoint saved without `fused` loads
    into the fused optimizer and turns it back to the default implementation for the groups it
    restores. Needs PyTorch 2.4 (the CPU kernels): with `target-torch` older, the rule is not run.
    Parameters of complex dtype, or on a device without a fused kernel, make the constructor raise.
    """

    code = "TOP961"
    name = "fused-optimizer"
    family = FAMILY
    message = (
        "`{opt}` updates device parameters one tensor group at a time: `fused=True` runs the whole "
        "step in one kernel (and lets GradScaler skip its per-step host read of found_inf)"
    )
    fix_title = "Add `fused=True`"
    safety = Safety.UNSAFE
    tags = (Tag.TOLERANCE,)
    min_torch = (2, 4)
    opt_in = True
    locality = "file"  # reads the whole file: other accelerators, sparse gradients
    prefilter = ("Adam", "SGD")
    requires = ("torch", "parameters")
    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)
    examples = (
        Invalid(
            dedent("""\
                import torch
                from torch import nn

                torch.manual_seed(0)
                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
                for _ in range(3):
                    loss = model(torch.randn(8, 4, device=device)).square().mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            """),
            after=dedent("""\
                import torch
                from torch import nn

                torch.manual_seed(0)
                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
                for _ in range(3):
                    loss = model(torch.randn(8, 4, device=device)).square().mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            """),
            unsafe="tolerance",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch.optim as optim
                from torch import nn

                model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
                model.cuda()
                opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            """),
            after=dedent("""\
                import torch.optim as optim
                from torch import nn

                model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
                model.cuda()
                opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
            """),
            unsafe="tolerance",
            note="`import torch.optim as optim`, a model moved by `.cuda()`",
        ),
        Invalid(
            dedent("""\
                from torch import nn
                from torch import optim as O


                def train(net, device, steps):
                    net = net.to(device)
                    opt = O.Adam(
                        [
                            {"params": net[0].parameters(), "lr": 1e-3},
                            {"params": net[1].parameters()},
                        ],
                        lr=1e-4,
                    )
                    return opt
            """),
            after=dedent("""\
                from torch import nn
                from torch import optim as O


                def train(net, device, steps):
                    net = net.to(device)
                    opt = O.Adam(
                        [
                            {"params": net[0].parameters(), "lr": 1e-3},
                            {"params": net[1].parameters()},
                        ],
                        lr=1e-4,
                        fused=True,
                    )
                    return opt
            """),
            unsafe="tolerance",
            note="in a function, `from torch import optim as O`, param groups that set only `lr`",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch import nn


                class Trainer:
                    def __init__(self, device):
                        self.model = nn.Linear(4, 2).to(device)
                        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
            """),
            after=dedent("""\
                import torch
                from torch import nn


                class Trainer:
                    def __init__(self, device):
                        self.model = nn.Linear(4, 2).to(device)
                        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3, fused=True)
            """),
            unsafe="tolerance",
            note="in a method",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn

                model = nn.Linear(4, 2).cuda()
                opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
            """),
            note="the implementation is chosen already",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn

                model = nn.Linear(4, 2).cuda()
                opt = torch.optim.Adam([{"params": model.parameters(), "foreach": False}], lr=1e-3)
            """),
            note="a param group chooses its own implementation",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn

                model = nn.Linear(4, 2)
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            """),
            note="parameters stay on the CPU: nothing to gain on the device",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn

                model = nn.Linear(4, 2).to("mps")
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            """),
            note="another accelerator",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn

                model = nn.Linear(4, 2).cuda()
                opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
            """),
            note="no fused kernel",
        ),
        Valid(
            dedent("""\
                import torch
                from accelerate import Accelerator
                from torch import nn

                accelerator = Accelerator()
                model = nn.Linear(4, 2).to(accelerator.device)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                model, opt = accelerator.prepare(model, opt)
            """),
            note="the launcher picks the device, which may be an XLA device",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn

                emb = nn.Embedding(100, 8, sparse=True).cuda()
                opt = torch.optim.SGD(emb.parameters(), lr=0.1)
            """),
            note="sparse gradients: the fused SGD kernel refuses them",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        code = source_of(node)
        self._refused = (
            bool(OTHER_BACKENDS.search(code) or _LAUNCHER_PICKS_DEVICE.search(code)) or "sparse=True" in code
        )

    def visit_Call(self, node: cst.Call) -> None:
        if self._refused:
            return
        opt = FUSED_OPTIMIZERS.get(callee(self, node) or "")
        if opt is None or has_star(node):
            return
        if any(keyword(node, k) is not None for k in _IMPLEMENTATION_ARGS):
            return
        params = params_arg(node)
        if params is None:
            return
        params = seen_through(self, params)
        if group_sets(params, set(_IMPLEMENTATION_ARGS)):
            return
        owners = parameter_owners(params)
        if not owners or not all(on_possible_cuda(self, o, node) for o in owners):
            return
        self.report(
            node,
            fmt={"opt": f"torch.optim.{opt}"},
            replacement=set_kwarg(node, "fused", cst.Name("True")),
            tags=[Tag.TOLERANCE],
            note="the fused kernel rounds differently (a few ULPs per step)",
        )
