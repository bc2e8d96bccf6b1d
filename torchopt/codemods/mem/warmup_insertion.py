"""The edit TOP711 writes: the warm-up helper at module level, and before the epoch loop a
function replaying the step's forward and loss, passed to the helper with the longest batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from torchopt.analysis.step_loops import HotLoop
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

HELPER = "preallocate_for_longest_batch"
STEP = "warmup_loss"

HELPER_SRC = '''\
def {helper}(modules, optimizers, make_batch, forward_loss):
    """Run one forward and backward pass on the largest batch before training, so the
    CUDA caching allocator already holds blocks of the maximum size and later, smaller
    batches reuse them instead of fragmenting memory (PyTorch tuning guide, "Preallocate
    memory in case of variable input length"). Random streams are forked, buffers
    (BatchNorm statistics) restored, train/eval modes and gradients put back, so
    training is bitwise unchanged. The backward goes through torch.autograd.backward:
    this is not a training step, and hooks or profilers that count Tensor.backward calls
    should not see it."""
    import random
    import sys

    params = {{}}
    for m in modules:
        for p in m.parameters():
            params[id(p)] = p
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                params[id(p)] = p
    grads = {{k: p.grad for k, p in params.items()}}
    for p in params.values():
        p.grad = None
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    modes = [(sub, sub.training) for m in modules for sub in m.modules()]
    py_state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    devices = [{T}.cuda.current_device()] if {T}.cuda.is_available() else []
    with {T}.random.fork_rng(devices=devices):
        for m in modules:
            m.train()
        {T}.autograd.backward(forward_loss(*make_batch()))
    with {T}.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    for sub, mode in modes:
        sub.training = mode
    for k, p in params.items():
        p.grad = grads[k]
    random.setstate(py_state)
    if np_state is not None:
        np.random.set_state(np_state)
'''


@dataclass
class WarmupPlan:
    """Everything the edit needs, read from one training loop before anything is written."""

    loop: HotLoop
    outer: cst.BaseStatement  # statement the warm-up goes before
    owner: cst.CSTNode  # FunctionDef or Module holding ``outer``
    params: list[str]
    star: bool  # the loop target is a tuple (forward_loss(*batch))
    prefix: list[cst.BaseStatement]
    loss: str
    make_batch: str
    modules: list[str]
    optimizers: list[str] = field(default_factory=list)


class WarmupInsertion(cst.CSTTransformer):
    """Insert the helper (module level) and the warm-up (before the outer loop)."""

    def __init__(self, plan: WarmupPlan, T: str, rule: Rule) -> None:
        super().__init__()
        self.plan = plan
        self.T = T
        self.rule = rule

    def _warmup(self) -> list[cst.BaseStatement]:
        p = self.plan
        body = [s.deep_clone() for s in p.prefix]
        body[0] = body[0].with_changes(leading_lines=())
        body.append(cst.parse_statement(f"return {p.loss}\n"))
        fn = cst.FunctionDef(
            name=cst.Name(STEP),
            params=cst.Parameters(params=[cst.Param(cst.Name(x)) for x in p.params]),
            body=cst.IndentedBlock(body=body),
            leading_lines=[cst.EmptyLine(), cst.EmptyLine()] if isinstance(p.owner, cst.Module) else [cst.EmptyLine()],
        )
        mods = ", ".join(p.modules)
        opts = ", ".join(p.optimizers)
        call = cst.parse_statement(f"{HELPER}([{mods}], [{opts}], {p.make_batch}, {STEP})\n")
        call = call.with_changes(leading_lines=fn.leading_lines)
        return [fn, call]

    def _helper(self) -> cst.BaseStatement:
        fn = cst.parse_statement(HELPER_SRC.format(helper=HELPER, T=self.T))
        return fn.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])

    def _rebuild(self, original: cst.Module | cst.IndentedBlock, body: list) -> list:
        out = []
        p = self.plan
        top = self._top_statement()
        orig_body = original.body
        for o, u in zip(orig_body, body):
            if o is top:
                out.append(self._helper())
                if top is p.outer:
                    out.extend(self._warmup())
            out.append(u)
        return out

    def _top_statement(self) -> cst.CSTNode:
        cur: cst.CSTNode = self.plan.outer
        while True:
            parent = self.rule.get_metadata(ParentProvider, cur, None)
            if parent is None or isinstance(parent, cst.Module):
                return cur
            cur = parent

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return updated_node.with_changes(body=self._rebuild(original_node, list(updated_node.body)))

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock):
        if any(o is self.plan.outer for o in original_node.body):
            out = []
            for o, u in zip(original_node.body, updated_node.body):
                if o is self.plan.outer:
                    w = self._warmup()
                    w[0] = w[0].with_changes(leading_lines=[])
                    out.extend(w)
                out.append(u)
            return updated_node.with_changes(body=out)
        return updated_node
