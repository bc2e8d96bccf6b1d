"""TOP922 `manual-cuda-graphs`: Reports hand-made CUDA graphs with the constraints they must meet."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.codemods.compile import FAMILY
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


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
    message = (
        "hand-made CUDA graph (`{api}`): sample args must be tensors, no double backward, only "
        "parameters may require grad, no hooks at capture, no parameters added later, same argument "
        "order/format on replay, autocast only with cache_enabled=False; outputs are overwritten by "
        'the next replay. `model.compile(mode="reduce-overhead")` checks these for you'
    )
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
    _APIS = (
        "torch.cuda.make_graphed_callables",
        "torch.cuda.graphs.make_graphed_callables",
        "torch.cuda.graph",
        "torch.cuda.graphs.graph",
        "torch.cuda.CUDAGraph",
        "torch.cuda.graphs.CUDAGraph",
    )

    def visit_Call(self, node: cst.Call) -> None:
        q = callee(self, node)
        if q in self._APIS:
            self.report(node, fmt={"api": q.replace(".graphs.", ".")})
