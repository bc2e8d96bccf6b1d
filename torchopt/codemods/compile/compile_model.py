"""TOP911: compile the model with ``model.compile()`` once it is built, moved
and wrapped."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.syntax import walk
from torchopt.codemods.compile import FAMILY
from torchopt.analysis.models import Model, find_models, has_random_ops, strip_chain
from torchopt.rewrite.rule import Invalid, Rule, Safety, Tag, Valid
from torchopt.rewrite.facts import source_of

CHECKPOINT_NOTE = (
    "`model.compile()` compiles in place: the object keeps its type and its state_dict keys, so "
    "checkpoints stay loadable both ways. (`model = torch.compile(model)` would instead return an "
    "OptimizedModule whose state_dict keys gain `_orig_mod.`.)"
)
RNG_NOTE = (
    "Random ops (dropout, rand) inside the compiled graph draw from inductor's own generator: masks "
    "differ from eager ones under the same seed unless `torch._inductor.config.fallback_random = "
    "True`; `torchopt validate` sets it."
)
# Debugging set-ups under which compiling makes no sense: the rule leaves those scripts alone.
_DEBUG = ("CUDA_LAUNCH_BLOCKING", "detect_anomaly", "set_detect_anomaly")


def already_compiled(module: cst.Module, rule: Rule, name: str) -> bool:
    for node in walk(module, cross_scopes=True):
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
            f = node.func
            if f.attr.value == "compile" and isinstance(f.value, cst.Name) and f.value.value == name:
                return True
        if isinstance(node, cst.Call):
            q = callee(rule, node)
            if q in ("torch.compile", "torch.jit.script", "torch.jit.trace"):
                return True
    return False


def builtin_root(rule: Rule, model: Model) -> str | None:
    """``torch.nn.Sequential`` when the model is a torch.nn module built from torch.nn modules only."""
    q = callee(rule, model.base)
    if not q or not q.startswith("torch.nn.") or q.startswith("torch.nn.parallel"):
        return None
    for node in walk(model.base, cross_scopes=True):
        if isinstance(node, cst.Call) and node is not model.base:
            inner = callee(rule, node)
            if not inner or not inner.startswith("torch."):
                return None  # a user module inside: dynamo traces its forward
    return q


class CompileModel(Rule):
    """## What it does
    Inserts `model.compile()` once the model is built, moved and wrapped (opt-in).

    Inserts `model.compile()` after the statements that build the model, move it to its device and
    wrap it (DDP), in scripts whose model feeds a `torch.optim` optimizer or is put in `eval()` mode.
    Opt-in: it runs only when selected by its code (`--select TOP911`).

    It stays silent when the file already compiles, scripts or traces something
    (`torch.compile`, `model.compile()`, `torch.jit.script`/`trace`), and reports without a fix when
    a debugging set-up is on (`CUDA_LAUNCH_BLOCKING`, anomaly detection) or when the model is a
    `torch.nn` container of `torch.nn` layers only (`nn.Sequential(nn.Linear(...), ...)`):
    `nn.Module.compile()` compiles nothing there in PyTorch 2.13 (dynamo skips the frames of
    torch.nn's own modules, and no user `forward` is left to trace; measured: zero graphs), so the
    message suggests `model = torch.compile(model)` instead.

    ## Why is this slow
    Eager PyTorch launches one kernel per operation and writes every intermediate to memory.
    `torch.compile` (TorchInductor) fuses pointwise chains into single kernels and removes Python
    overhead (PyTorch tuning guide, "Fuse operations").

    ## Example
    ```python
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ```

    ## Use instead
    ```python
    model = Net().to(device)
    model.compile()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ```

    ## Fix safety
    Unsafe (tag tolerance; also rng when the file uses random ops such as dropout).

    * **Rounding**: inductor's fused kernels reassociate float arithmetic: fp32 results differed by
      up to 6e-8 on a small model (torch 2.13, CPU); over training steps the error compounds (validated with
      rtol 1e-5 on parameters). The `eager`/`aot_eager` backends are bitwise equal.
    * **RNG**: dropout masks drawn inside a compiled graph differ from eager ones under the same seed
      unless `torch._inductor.config.fallback_random = True`. `torchopt validate` sets it.
    * **Checkpoints**: `model.compile()` keeps the module's type and its state_dict keys
      (`['0.weight', ...]`), so saving and loading are unchanged. (The other spelling,
      `model = torch.compile(model)`, returns an `OptimizedModule` whose keys gain `_orig_mod.`;
      loading them into a plain model then needs
      `consume_prefix_in_state_dict_if_present(sd, "_orig_mod.")`.)
    * **Cost**: the first call compiles (seconds on the CPU, minutes on a loaded machine); a new
      input shape recompiles (consider `dynamic=True` for variable shapes); `.item()`, `print` and
      data-dependent control flow in `forward` cause graph breaks (see the SYNC rules).
    * Needs PyTorch ≥ 2.2 (`nn.Module.compile`) and a C++ compiler for inductor on the CPU.
    """

    code = "TOP911"
    name = "compile-model"
    family = FAMILY
    opt_in = True
    message = "`{name}` is trained/evaluated uncompiled: `{name}.compile()` fuses its kernels (torch.compile)"
    fix_title = "Insert `{name}.compile()` after the model is built and moved"
    safety = Safety.UNSAFE
    tags = (Tag.TOLERANCE,)
    prefilter = ("parameters(", ".eval(")
    requires = ("torch",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.models import models_possible

        return super().could_match(text) and models_possible(text)  # visit_Module: find_models

    min_torch = (2, 2)
    examples = (
        Invalid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(8, 16)
                        self.fc2 = nn.Linear(16, 2)

                    def forward(self, x):
                        return self.fc2(torch.relu(self.fc1(x)))


                torch.manual_seed(0)
                model = Net()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(3):
                    loss = model(torch.randn(4, 8)).square().mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            """),
            after=dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(8, 16)
                        self.fc2 = nn.Linear(16, 2)

                    def forward(self, x):
                        return self.fc2(torch.relu(self.fc1(x)))


                torch.manual_seed(0)
                model = Net()
                model.compile()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(3):
                    loss = model(torch.randn(4, 8)).square().mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            """),
            unsafe="tolerance",
            note="not runnable here: inductor on a loaded CPU box compiles for minutes",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.nn.parallel import DistributedDataParallel as DDP
                from mynets import ResNet

                model = ResNet().cuda()
                model = DDP(model, device_ids=[0])
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for images, labels in loader:
                    loss = model(images.cuda()).logsumexp(1).mean()
            """),
            after=dedent("""\
                import torch
                from torch.nn.parallel import DistributedDataParallel as DDP
                from mynets import ResNet

                model = ResNet().cuda()
                model = DDP(model, device_ids=[0])
                model.compile()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for images, labels in loader:
                    loss = model(images.cuda()).logsumexp(1).mean()
            """),
            unsafe="tolerance",
            note="after the DDP wrap: DDPOptimizer splits the graph at bucket boundaries",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(8, 16)
                        self.fc2 = nn.Linear(16, 2)

                    def forward(self, x):
                        return self.fc2(torch.relu(self.fc1(x)))


                model = Net()
                model.load_state_dict(torch.load('w.pt'))
                model.eval()
                print(model(torch.randn(1, 8)))
            """),
            after=dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(8, 16)
                        self.fc2 = nn.Linear(16, 2)

                    def forward(self, x):
                        return self.fc2(torch.relu(self.fc1(x)))


                model = Net()
                model.load_state_dict(torch.load('w.pt'))
                model.eval()
                model.compile()
                print(model(torch.randn(1, 8)))
            """),
            unsafe="tolerance",
            note="state_dict keys are unchanged, so the load can come before or after",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch import nn

                model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
                opt = torch.optim.Adam(model.parameters())
                loss = model(x).sum()
            """),
            note="built-in modules only: model.compile() would compile nothing; display-only",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(8, 16)
                        self.fc2 = nn.Linear(16, 2)

                    def forward(self, x):
                        return self.fc2(torch.relu(self.fc1(x)))


                torch.manual_seed(0)
                model = Net()
                model.compile()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(3):
                    loss = model(torch.randn(4, 8)).square().mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            """),
            note="already compiled",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(8, 16)
                        self.fc2 = nn.Linear(16, 2)

                    def forward(self, x):
                        return self.fc2(torch.relu(self.fc1(x)))


                torch.manual_seed(0)
                model = torch.compile(Net())
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(3):
                    loss = model(torch.randn(4, 8)).square().mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            """),
            note="torch.compile in the file: left alone",
        ),
        Valid(
            dedent("""\
                import re

                pattern = re.compile('a+')
                model = make()
                opt = make_opt(model.parameters())
            """),
            note="no torch.optim optimizer",
        ),
        Valid(
            dedent("""\
                import torch

                def train(model):
                    opt = torch.optim.SGD(model.parameters(), lr=0.1)
            """),
            note="the model is a parameter: where it is built is unknown",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        models = find_models(self, node)
        if not models:
            return
        debug = any(tok in source_of(node) for tok in _DEBUG)
        tags = (Tag.TOLERANCE, Tag.RNG) if has_random_ops(node) else (Tag.TOLERANCE,)
        for m in models:
            if already_compiled(node, self, m.name):
                continue
            first = m.assigns[0]
            if debug:
                self.report(
                    first,
                    fmt={"name": m.name},
                    message=(
                        "`{name}` could be compiled (`{name}.compile()`), but a debugging set-up is on "
                        "(CUDA_LAUNCH_BLOCKING / anomaly detection): compile once it is off"
                    ).format(name=m.name),
                )
                continue
            if any(
                isinstance(built := strip_chain(cst.ensure_type(a.body[0], cst.Assign).value), cst.Call)
                and (callee(self, built) or "").endswith(".DataParallel")
                for a in m.assigns
            ):
                continue  # nn.DataParallel: TOP401 converts it to DDP first; compiling DP is not supported
            root = builtin_root(self, m)
            if root is not None:
                self.report(
                    first,
                    fmt={"name": m.name},
                    message=(
                        "`{name}` is a `{root}` of torch.nn layers only: `{name}.compile()` compiles nothing "
                        "there (dynamo skips torch.nn's own frames); use `{name} = torch.compile({name})`, whose "
                        "state_dict keys gain `_orig_mod.`"
                    ).format(name=m.name, root=root.rsplit(".", 1)[-1]),
                )
                continue
            end = m.setup_end
            stmt = cst.SimpleStatementLine(body=[cst.Expr(cst.parse_expression(f"{m.name}.compile()"))])
            note = CHECKPOINT_NOTE + (" " + RNG_NOTE if Tag.RNG in tags else "")
            self.report(
                first,
                fmt={"name": m.name},
                target=end,
                replacement=cst.FlattenSentinel([end, stmt]),
                tags=tags,
                note=note,
            )
