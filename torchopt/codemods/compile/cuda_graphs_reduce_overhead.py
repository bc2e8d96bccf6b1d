"""TOP921 `cuda-graphs-reduce-overhead`: Adds `mode="reduce-overhead"` (CUDA graphs) to an existing model compile (opt-in)."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import set_kwarg
from torchopt.analysis.models import find_models
from torchopt.analysis.models import has_random_ops
from torchopt.analysis.names import callee
from torchopt.analysis.syntax import in_version_guard
from torchopt.analysis.syntax import walk
from torchopt.codemods.compile import FAMILY
from torchopt.codemods.compile.graph_outputs import _kept_outputs
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


_MODE_KEYS = ("mode", "backend", "options")


_KEPT_NOTE = (
    "CUDA-graph outputs are overwritten by the next replay: a tensor kept across iterations (a logged "
    'loss, stored predictions, an EMA) must be `.clone()`d, or reading it raises "accessing tensor '
    'output of CUDAGraphs that has been overwritten by a subsequent run"; call '
    "`torch.compiler.cudagraph_mark_step_begin()` at the start of an iteration if the step heuristic "
    "is wrong. Memory use grows (the graph pool is static). Needs static input shapes, inputs on the "
    "GPU and no CPU synchronisation in the compiled region. On the CPU the mode only compiles "
    "(no CUDA graph is recorded)."
)


_RNG_NOTE = (
    "Random ops inside the graph draw from inductor's generator: dropout masks differ from eager "
    "ones under the same seed unless `torch._inductor.config.fallback_random = True`."
)


class CudaGraphsReduceOverhead(Rule):
    """## What it does
    Adds `mode="reduce-overhead"` (CUDA graphs) to an existing model compile (opt-in).

    Adds `mode="reduce-overhead"` to an existing `model.compile()` or `torch.compile(...)` call that
    names no `mode`, `backend` or `options`: inductor then records the compiled graphs as CUDA
    graphs and replays them. Opt-in: it runs only when selected by its code (`--select TOP921`).
    Combined with TOP911 it upgrades the compile that rule inserts.

    Reported without a fix when the file keeps tensors in a list (`history.append(loss)`: a CUDA
    graph overwrites its outputs on the next replay) or the compile asks for `dynamic=True` shapes.

    ## Why is this slow
    Small models and small batches are bound by kernel launches: the CPU cannot issue kernels as
    fast as the GPU runs them. A CUDA graph replays the whole recorded sequence with one launch
    (tuning guide, "Use CUDA Graphs").

    ## Example
    ```python
    model.compile()
    ```

    ## Use instead
    ```python
    model.compile(mode="reduce-overhead")
    ```
    (Always as a keyword: `torch.compile(m, "reduce-overhead")`, the guide's literal snippet, raises
    `TypeError` in 2.13.)

    ## Fix safety
    Unsafe (tag tolerance; also rng when the file uses random ops).

    * Same kernels as the plain compile: rounding as in TOP911; random ops draw from
      inductor's generator unless `torch._inductor.config.fallback_random = True`.
    * **Output aliasing**: outputs of a replay are overwritten by the next one; tensors kept across
      iterations must be `.clone()`d. `torch.compiler.cudagraph_mark_step_begin()` marks iteration
      starts when the heuristic is wrong.
    * More GPU memory (a static pool per graph); each new input shape records a new graph.
    * Checkpoints: unchanged by the mode (`model.compile()` keeps state_dict keys; `torch.compile`'s
      `OptimizedModule` prefixes them with `_orig_mod.` either way).
    * On the CPU the mode compiles but records no graph.
    """

    code = "TOP921"
    name = "cuda-graphs-reduce-overhead"
    family = FAMILY
    opt_in = True
    message = '`{call}` can replay CUDA graphs: `mode="reduce-overhead"` removes per-kernel launch overhead'
    fix_title = 'Add `mode="reduce-overhead"` (CUDA graphs)'
    safety = Safety.UNSAFE
    tags = (Tag.TOLERANCE,)
    prefilter = ("compile(",)
    requires = ("torch",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.models import models_possible

        # visit_Module: `<model>.compile(...)` or `torch.compile(...)` of a model find_models finds.
        return super().could_match(text) and models_possible(text)

    min_torch = (2, 0)
    examples = (
        Invalid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc = nn.Linear(8, 2)

                    def forward(self, x):
                        return self.fc(x)


                model = Net()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


                def predict(x):
                    return model(x)


                model.compile()
            """),
            after=dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc = nn.Linear(8, 2)

                    def forward(self, x):
                        return self.fc(x)


                model = Net()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


                def predict(x):
                    return model(x)


                model.compile(mode="reduce-overhead")
            """),
            unsafe="tolerance",
        ),
        Invalid(
            dedent("""\
                import torch

                net = torch.compile(make_net())
                opt = torch.optim.SGD(net.parameters())
                y = net(x)
            """),
            after=dedent("""\
                import torch

                net = torch.compile(make_net(), mode="reduce-overhead")
                opt = torch.optim.SGD(net.parameters())
                y = net(x)
            """),
            unsafe="tolerance",
        ),
        Valid(
            dedent("""\
                import torch

                fast_gelu = torch.compile(gelu)
            """),
            note="a compiled function, not a model",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc = nn.Sequential(nn.Linear(8, 2), nn.Dropout(0.1))

                    def forward(self, x):
                        return self.fc(x)


                model = Net()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


                def predict(x):
                    return model(x)


                model.compile()
            """),
            after=dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc = nn.Sequential(nn.Linear(8, 2), nn.Dropout(0.1))

                    def forward(self, x):
                        return self.fc(x)


                model = Net()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


                def predict(x):
                    return model(x)


                model.compile(mode="reduce-overhead")
            """),
            unsafe=("tolerance", "rng"),
            note="dropout: the masks come from inductor's generator",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc = nn.Linear(8, 2)

                    def forward(self, x):
                        return self.fc(x)


                model = Net()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


                def predict(x):
                    return model(x)


                model.compile()
                losses = []
                for x in data:
                    loss = model(x).sum()
                    losses.append(loss)
            """),
            note="a kept output would be overwritten by the next replay: display-only",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc = nn.Linear(8, 2)

                    def forward(self, x):
                        return self.fc(x)


                model = Net()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


                def predict(x):
                    return model(x)


                model.compile(mode="max-autotune")
            """),
            note="a mode is chosen already",
        ),
        Valid(
            dedent("""\
                import torch

                net = torch.compile(make_net(), backend='eager')
            """)
        ),
        Valid(
            dedent("""\
                import re

                rx = re.compile('a')
            """)
        ),
        Valid(
            dedent("""\
                import torch

                net = torch.compile(make_net(), **kw)
            """),
            note="keywords unknown",
        ),
    )

    def _compiles_model(self, call: cst.Call, models: set[str]) -> bool:
        """``torch.compile(model)`` or ``model = torch.compile(...)``: not a compiled helper function."""
        first = call.args[0].value if call.args and call.args[0].keyword is None else None
        if isinstance(first, cst.Name) and first.value in models:
            return True
        parent = self.get_metadata(ParentProvider, call, None)
        return (
            isinstance(parent, cst.Assign)
            and len(parent.targets) == 1
            and isinstance(parent.targets[0].target, cst.Name)
            and parent.targets[0].target.value in models
        )

    def visit_Module(self, node: cst.Module) -> None:
        models = {m.name for m in find_models(self, node)}
        kept = _kept_outputs(node)
        tags = (Tag.TOLERANCE, Tag.RNG) if has_random_ops(node) else (Tag.TOLERANCE,)
        for call in walk(node, cross_scopes=True):
            if not isinstance(call, cst.Call):
                continue
            f = call.func
            is_method = (
                isinstance(f, cst.Attribute)
                and f.attr.value == "compile"
                and isinstance(f.value, cst.Name)
                and f.value.value in models
            )
            if not is_method and (callee(self, call) != "torch.compile" or not self._compiles_model(call, models)):
                continue
            if in_version_guard(self, call):
                continue
            if has_star(call) or any(keyword(call, k) is not None for k in _MODE_KEYS):
                continue
            if not is_method and not call.args:
                continue  # the decorator-factory form `torch.compile()` without a function
            text = " ".join(node.code_for_node(call).split())
            fmt = {"call": text if len(text) <= 60 else text[:57] + "..."}
            dyn = keyword(call, "dynamic")
            if kept is not None or (dyn is not None and isinstance(dyn.value, cst.Name) and dyn.value.value == "True"):
                why = (
                    "`dynamic=True`: every new shape records another graph"
                    if kept is None
                    else f"`{' '.join(node.code_for_node(kept).split())}` keeps an output that the next replay "
                    "overwrites (`.clone()` it first)"
                )
                self.report(call, fmt=fmt, message=self.message.format(**fmt) + "; not rewritten: " + why)
                continue
            new = set_kwarg(call, "mode", cst.SimpleString('"reduce-overhead"'))
            self.report(
                call,
                fmt=fmt,
                replacement=new,
                tags=tags,
                note=_KEPT_NOTE + (" " + _RNG_NOTE if Tag.RNG in tags else ""),
            )
