"""Multi-GPU inference advice for `nn.DataParallel` used only to evaluate or predict."""

from __future__ import annotations

import re
from textwrap import dedent

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.analysis.control import Guard, control_of
from torchopt.analysis.names import callee, dotted, torch_name
from torchopt.analysis.syntax import walk
from torchopt.codemods.ddp import FAMILY
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid

DATA_PARALLEL = {
    "torch.nn.DataParallel",
    "torch.nn.parallel.DataParallel",
    "torch.nn.parallel.data_parallel.DataParallel",
}
_NO_GRAD = {
    "torch.no_grad",
    "torch.inference_mode",
    "torch.autograd.no_grad",
    "torch.autograd.grad_mode.no_grad",
    "torch.autograd.grad_mode.inference_mode",
}
# Anything that may train: a backward pass, an optimizer, a parameter update by hand.
_TRAINS = re.compile(
    r"\.backward\s*\(|autograd\s*\.\s*(grad|backward)\b|\boptim\b|Optimizer\b|\.step\s*\("
    r"|\bgrad\s*\("
)


def _grad_off(rule: Rule, node: cst.CSTNode) -> bool:
    """Inside ``with torch.no_grad()/inference_mode()`` or a function decorated with either."""
    cur = rule.get_metadata(ParentProvider, node, None)
    while cur is not None:
        if isinstance(cur, cst.With):
            for item in cur.items:
                ctx = item.item.func if isinstance(item.item, cst.Call) else item.item
                if torch_name(rule, ctx) in _NO_GRAD:
                    return True
        if isinstance(cur, cst.FunctionDef):
            for d in cur.decorators:
                dec = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
                if torch_name(rule, dec) in _NO_GRAD:
                    return True
        cur = rule.get_metadata(ParentProvider, cur, None)
    return False


def _wrapped_name(rule: Rule, call: cst.Call) -> str | None:
    """``model`` in ``model = nn.DataParallel(net)`` (or ``= nn.DataParallel(net).cuda()``)."""
    node: cst.CSTNode = call
    parent = rule.get_metadata(ParentProvider, node, None)
    while isinstance(parent, cst.Attribute) and parent.value is node:
        grand = rule.get_metadata(ParentProvider, parent, None)
        if not (isinstance(grand, cst.Call) and grand.func is parent and parent.attr.value in ("cuda", "to", "eval")):
            return None
        node, parent = grand, rule.get_metadata(ParentProvider, grand, None)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and parent.value is node:
        return dotted(parent.targets[0].target)
    return None


def data_parallel_for_inference(rule: Rule, call: cst.Call) -> bool:
    """Whether the ``nn.DataParallel(...)`` ``call`` only ever runs inference: the file never
    trains (no ``backward``, optimizer, ``autograd.grad`` or ``.step(``), or every call of the
    wrapped model runs with gradients off and its parameters are never handed to anything.
    DataParallel-to-DDP conversion must not be offered for such a call."""
    module = rule.ctx.module
    if not _TRAINS.search(rule.ctx.text):
        return True
    name = _wrapped_name(rule, call)
    if name is None:
        return False
    uses = 0
    for node in walk(module, cross_scopes=True):
        if isinstance(node, cst.Call):
            if dotted(node.func) == name:
                if not _grad_off(rule, node):
                    return False
                uses += 1
            elif (
                isinstance(node.func, cst.Attribute)
                and dotted(node.func.value) == name
                and node.func.attr.value in ("parameters", "train", "named_parameters", "forward")
            ):
                return False
    return uses > 0


class DataParallelInference(Rule):
    """## What it does
    Reports `nn.DataParallel(model)` when the program only evaluates or predicts with it: the file
    never trains (no `backward()`, no optimizer, no `torch.autograd.grad`, no `.step(`), or every
    call of the wrapped model runs under `torch.no_grad()` / `torch.inference_mode()` (a `with`
    block or a decorator) and its parameters are never handed to an optimizer. The advice is for
    inference: split the batch across devices, or run one process per device. (The training
    conversion to DistributedDataParallel is TOP401's, for programs that train.) Display-only.

    ## Why is this slow
    On every forward, DataParallel copies the model's parameters and buffers from the first GPU to
    every other one, splits the batch, runs one Python thread per GPU (serialised by the GIL),
    and gathers all outputs back on the first GPU. For inference the weights never change, so the
    per-call replication is pure overhead, and GPU 0 does extra work gathering.

    ## Example
    ```python
    model = nn.DataParallel(Net()).cuda().eval()
    with torch.no_grad():
        for x in loader:
            preds.append(model(x.cuda()))
    ```

    ## Use instead
    One process per GPU, each predicting its shard (`torchrun --standalone --nproc_per_node=N
    predict.py`):
    ```python
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    model = Net().to(device).eval()
    shard = torch.utils.data.Subset(dataset, range(rank, len(dataset), world))
    with torch.inference_mode():
        preds = [model(x.to(device, non_blocking=True)) for x in DataLoader(shard, batch_size=B)]
    torch.save(preds, f"preds.{rank}.pt")  # merge the shards afterwards
    ```
    or, in one process, one replica per GPU made once, fed a slice of each batch (the launches are
    asynchronous, so the GPUs overlap):
    ```python
    replicas = [copy.deepcopy(model).to(f"cuda:{i}").eval() for i in range(torch.cuda.device_count())]
    with torch.inference_mode():
        parts = [m(x.to(m_dev, non_blocking=True)) for m, m_dev, x in
                 zip(replicas, devices, batch.chunk(len(replicas)))]
        out = torch.cat([p.to("cuda:0") for p in parts])
    ```

    ## Fix safety
    Display-only: either form restructures the program (a launcher, a merge step, or a per-device
    loop) and each device's outputs come from its own kernels; only the author can choose.
    """

    code = "TOP411"
    name = "data-parallel-inference"
    family = FAMILY
    message = (
        "`nn.DataParallel` used only for inference replicates the model on every forward: run one process "
        "per GPU on a shard of the data (torchrun), or keep one replica per GPU and split each batch"
    )
    safety = Safety.DISPLAY
    prefilter = ("DataParallel",)
    requires = ("torch",)
    locality = "file"  # whether anything in the file trains
    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)
    examples = (
        Invalid(
            dedent("""\
            import torch
            from torch import nn

            model = nn.DataParallel(nn.Linear(16, 4)).cuda().eval()
            with torch.no_grad():
                for x in torch.randn(10, 32, 16):
                    y = model(x.cuda())
        """)
        ),
        Invalid(
            dedent("""\
            import torch
            from torch.nn import DataParallel as DP


            @torch.inference_mode()
            def predict(net, batches):
                model = DP(net)
                return [model(b) for b in batches]
        """),
            note="in a function, `from torch.nn import DataParallel as DP`",
        ),
        Invalid(
            dedent("""\
            import torch
            from torch import nn


            class Predictor:
                def __init__(self, net):
                    self.model = nn.DataParallel(net).cuda().eval()

                @torch.no_grad()
                def predict(self, batches):
                    return [self.model(b.cuda()) for b in batches]
        """),
            note="in a method: the wrapper held in an attribute, used under `no_grad`",
        ),
        Invalid(
            dedent("""\
            import torch
            from torch import nn

            net = nn.Linear(16, 4)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for x in data:
                net(x).sum().backward()
                opt.step()
            evaluator = nn.DataParallel(net)
            with torch.no_grad():
                score = evaluator(val_x)
        """),
            note="the file trains another wrapper-free model; this DataParallel is only evaluated",
        ),
        Valid(
            dedent("""\
            import torch
            from torch import nn

            model = nn.DataParallel(nn.Linear(16, 4)).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for x in data:
                model(x).sum().backward()
                opt.step()
        """),
            note="training: TOP401's conversion applies",
        ),
        Valid(
            dedent("""\
            import argparse

            import torch
            from torch import nn

            parser = argparse.ArgumentParser()
            parser.add_argument("--num-gpu", type=int, default=1)
            args = parser.parse_args()
            model = nn.Linear(16, 4).cuda()
            if args.num_gpu > 1:
                model = nn.DataParallel(model, device_ids=list(range(args.num_gpu)))
            with torch.no_grad():
                for x in loader:
                    y = model(x.cuda())
        """),
            note="only with more GPUs than the default one asked for on the command line",
        ),
        Valid(
            dedent("""\
            import torch
            from torch import nn

            model = mylib.DataParallel(nn.Linear(16, 4))
            with torch.no_grad():
                y = model(x)
        """),
            note="not torch's",
        ),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) in DATA_PARALLEL and data_parallel_for_inference(self, node):
            if Guard.OFF_BY_DEFAULT in control_of(self).guards(node):
                return  # `if args.num_gpu > 1:` with one GPU by default: a plain run never wraps it
            self.report(node)
