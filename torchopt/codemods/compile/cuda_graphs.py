"""TOP921 (rules.md CG-001): CUDA graphs through ``mode="reduce-overhead"`` on an existing compile;
TOP922 (CG-002): constraints of hand-made CUDA graphs (display-only)."""
from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.arguments import has_star, keyword, set_kwarg
from torchopt.analysis.syntax import in_version_guard, walk
from torchopt.codemods.compile import FAMILY
from torchopt.analysis.models import find_models, has_random_ops
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Tag, Valid

_MODE_KEYS = ("mode", "backend", "options")
_KEPT_NOTE = (
    "CUDA-graph outputs are overwritten by the next replay: a tensor kept across iterations (a logged "
    "loss, stored predictions, an EMA) must be `.clone()`d, or reading it raises \"accessing tensor "
    "output of CUDAGraphs that has been overwritten by a subsequent run\"; call "
    "`torch.compiler.cudagraph_mark_step_begin()` at the start of an iteration if the step heuristic "
    "is wrong. Memory use grows (the graph pool is static). Needs static input shapes, inputs on the "
    "GPU and no CPU synchronisation in the compiled region. On the CPU the mode only compiles "
    "(no CUDA graph is recorded)."
)
_RNG_NOTE = ("Random ops inside the graph draw from inductor's generator: dropout masks differ from eager "
             "ones under the same seed unless `torch._inductor.config.fallback_random = True` (E-28).")

_HEAD = '''import torch
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


'''


def _kept_outputs(module: cst.Module) -> cst.Call | None:
    """A ``list.append(x)`` of a bare tensor name/attribute/item (not a copy or a Python number)."""
    for node in walk(module, cross_scopes=True):
        if (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "append"
                and len(node.args) == 1 and isinstance(node.args[0].value, (cst.Name, cst.Attribute, cst.Subscript))):
            return node
    return None


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
    `TypeError` in 2.13, E-14.)

    ## Fix safety
    Unsafe (tag tolerance; also rng when the file uses random ops).

    * Same kernels as the plain compile: rounding as in TOP911 (E-14); random ops draw from
      inductor's generator unless `torch._inductor.config.fallback_random = True` (E-28).
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
    message = "`{call}` can replay CUDA graphs: `mode=\"reduce-overhead\"` removes per-kernel launch overhead"
    fix_title = "Add `mode=\"reduce-overhead\"` (CUDA graphs)"
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
        Invalid(_HEAD + "model.compile()\n", after=_HEAD + 'model.compile(mode="reduce-overhead")\n',
                unsafe="tolerance"),
        Invalid("import torch\n\nnet = torch.compile(make_net())\nopt = torch.optim.SGD(net.parameters())\ny = net(x)\n",
                after='import torch\n\nnet = torch.compile(make_net(), mode="reduce-overhead")\n'
                'opt = torch.optim.SGD(net.parameters())\ny = net(x)\n', unsafe="tolerance"),
        Valid("import torch\n\nfast_gelu = torch.compile(gelu)\n", note="a compiled function, not a model"),
        Invalid(_HEAD.replace("nn.Linear(8, 2)", "nn.Sequential(nn.Linear(8, 2), nn.Dropout(0.1))")
                + "model.compile()\n",
                after=_HEAD.replace("nn.Linear(8, 2)", "nn.Sequential(nn.Linear(8, 2), nn.Dropout(0.1))")
                + 'model.compile(mode="reduce-overhead")\n', unsafe=("tolerance", "rng"),
                note="dropout: the masks come from inductor's generator"),
        Invalid(_HEAD + "model.compile()\nlosses = []\nfor x in data:\n    loss = model(x).sum()\n"
                "    losses.append(loss)\n",
                note="a kept output would be overwritten by the next replay: display-only"),
        Valid(_HEAD + 'model.compile(mode="max-autotune")\n', note="a mode is chosen already"),
        Valid("import torch\n\nnet = torch.compile(make_net(), backend='eager')\n"),
        Valid("import re\n\nrx = re.compile('a')\n"),
        Valid("import torch\n\nnet = torch.compile(make_net(), **kw)\n", note="keywords unknown"),
    )

    def _compiles_model(self, call: cst.Call, models: set[str]) -> bool:
        """``torch.compile(model)`` or ``model = torch.compile(...)``: not a compiled helper function."""
        first = call.args[0].value if call.args and call.args[0].keyword is None else None
        if isinstance(first, cst.Name) and first.value in models:
            return True
        parent = self.get_metadata(ParentProvider, call, None)
        return (isinstance(parent, cst.Assign) and len(parent.targets) == 1
                and isinstance(parent.targets[0].target, cst.Name) and parent.targets[0].target.value in models)

    def visit_Module(self, node: cst.Module) -> None:
        models = {m.name for m in find_models(self, node)}
        kept = _kept_outputs(node)
        tags = (Tag.TOLERANCE, Tag.RNG) if has_random_ops(node) else (Tag.TOLERANCE,)
        for call in walk(node, cross_scopes=True):
            if not isinstance(call, cst.Call):
                continue
            f = call.func
            is_method = (isinstance(f, cst.Attribute) and f.attr.value == "compile" and isinstance(f.value, cst.Name)
                         and f.value.value in models)
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
                why = ("`dynamic=True`: every new shape records another graph" if kept is None else
                       f"`{' '.join(node.code_for_node(kept).split())}` keeps an output that the next replay "
                       "overwrites (`.clone()` it first)")
                self.report(call, fmt=fmt, message=self.message.format(**fmt) + "; not rewritten: " + why)
                continue
            new = set_kwarg(call, "mode", cst.SimpleString('"reduce-overhead"'))
            self.report(call, fmt=fmt, replacement=new, tags=tags,
                        note=_KEPT_NOTE + (" " + _RNG_NOTE if Tag.RNG in tags else ""))


class ManualCudaGraphs(Rule):
    """## What it does
    Reports hand-made CUDA graphs with the constraints they must meet.

    Reports calls of `torch.cuda.make_graphed_callables`, `torch.cuda.graph` and
    `torch.cuda.CUDAGraph` with the constraints hand-made CUDA graphs must meet. Display-only.

    ## Why is this slow
    Nothing is slow here: hand-made graphs remove launch overhead, but they silently compute wrong
    results when one of their constraints is broken, and `model.compile(mode="reduce-overhead")`
    (TOP921) checks most of them for you.

    ## Example
    ```python
    model = torch.cuda.make_graphed_callables(model, (sample,))
    ```

    ## Use instead
    Check the constraints listed in the message (from the installed docstring), or
    ```python
    model.compile(mode="reduce-overhead")
    ```

    ## Fix safety
    Display-only: never rewritten. Constraints of `make_graphed_callables` (installed docstring):
    `sample_args` are tensors only; no double backward; only parameters may require grad (buffers
    need `requires_grad=False`); no module hooks registered at the time of the call; no parameters
    or buffers added or removed afterwards; arguments passed in the same order and format as
    `sample_args`; autocast only with `cache_enabled=False`.
    """

    code = "TOP922"
    name = "manual-cuda-graphs"
    family = FAMILY
    message = ("hand-made CUDA graph (`{api}`): sample args must be tensors, no double backward, only "
               "parameters may require grad, no hooks at capture, no parameters added later, same argument "
               "order/format on replay, autocast only with cache_enabled=False; outputs are overwritten by "
               "the next replay. `model.compile(mode=\"reduce-overhead\")` checks these for you")
    safety = Safety.DISPLAY
    prefilter = ("make_graphed_callables", "graph", "CUDAGraph")
    requires = ("torch",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # Every name in _APIS is under torch.cuda: the import or attribute chain spells "cuda".
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and "cuda" in text and may_call_torch(text, cls._APIS)

    examples = (
        Invalid("import torch\n\nmodel = torch.cuda.make_graphed_callables(model, (x,))\n"),
        Invalid("import torch\n\ng = torch.cuda.CUDAGraph()\nwith torch.cuda.graph(g):\n    y = model(x)\n"),
        Valid("import torch\n\nmodel.compile(mode='reduce-overhead')\n"),
        Valid("import networkx\n\ng = networkx.graph(x)\n", note="not torch's"),
    )
    _APIS = ("torch.cuda.make_graphed_callables", "torch.cuda.graphs.make_graphed_callables", "torch.cuda.graph",
             "torch.cuda.graphs.graph", "torch.cuda.CUDAGraph", "torch.cuda.graphs.CUDAGraph")

    def visit_Call(self, node: cst.Call) -> None:
        q = callee(self, node)
        if q in self._APIS:
            self.report(node, fmt={"api": q.replace(".graphs.", ".")})
