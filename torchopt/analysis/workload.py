"""What a training program's iteration is made of, for the rules whose advice only pays when the GPU
work dominates it (Tensor Core padding, mixed precision).

Public API:

* ``workload_of(rule) -> Workload`` (built once per parsed module).
* ``Workload.env_steps``: the training steps (``Program.steps``) whose loop, or a loop around it, also
  steps an environment made by ``gym``/``gymnasium`` (``envs.step(actions)`` in the same iteration,
  or in a rollout loop that iteration runs).
* ``Workload.widths``: every size of the file's ``torch.nn.Linear`` layers that is an integer literal;
  ``Workload.small_mlp``: the file's layers are all ``nn.Linear`` (no convolution, recurrent or
  attention layer), each with at least one literal size, and none of those above ``SMALL_WIDTH``;
  False when the file builds no layer or any size is unknown on both sides.
* ``Workload.environment_bound``: every training step of the file steps an environment and the
  file's model is a small MLP: the iteration is dominated by the environment and its host copies,
  and a GEMM of a few hundred columns gains nothing from Tensor Cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from torchopt.analysis.names import callee, dotted, qualified_names
from torchopt.analysis.program import Step, program_of
from torchopt.rewrite.metadata import children_of, remembered
from torchopt.rewrite.rule import Rule

SMALL_WIDTH = 256
_ENV_PACKAGES = ("gym.", "gymnasium.")
# torch.nn layers that are heavy GEMMs or convolutions: a file that builds one is no small MLP.
_HEAVY = ("Conv", "ConvTranspose", "LSTM", "GRU", "RNN", "MultiheadAttention", "Transformer", "Embedding", "Bilinear")


@dataclass
class Workload:
    env_steps: list[Step] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    small_mlp: bool = False
    environment_bound: bool = False


def _env_names(rule: Rule, module: cst.Module) -> set[str]:
    """Names (as written) bound to a call of the gym/gymnasium packages: ``envs = gym.vector.SyncVectorEnv(...)``."""
    out: set[str] = set()
    for n in _walk(module, into_loops=True):
        if isinstance(n, cst.Assign) and isinstance(n.value, cst.Call):
            if any(q.startswith(_ENV_PACKAGES) for q in qualified_names(rule, n.value.func)):
                for t in n.targets:
                    d = dotted(t.target)
                    if d:
                        out.add(d)
    return out


def _walk(node: cst.CSTNode, into_loops: bool):
    stack = [node]
    while stack:
        cur = stack.pop()
        yield cur
        for child in reversed(children_of(cur)):
            if not into_loops and isinstance(child, (cst.FunctionDef, cst.ClassDef, cst.Lambda, cst.For, cst.While)):
                continue
            stack.append(child)


def _steps_env(loop: cst.For | cst.While, envs: set[str]) -> bool:
    """The loop's iteration steps an environment, itself or in a loop it runs (a PPO rollout loop
    before the update epochs)."""
    for n in _walk(loop.body, into_loops=True):
        if isinstance(n, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        if (
            isinstance(n, cst.Call)
            and isinstance(n.func, cst.Attribute)
            and n.func.attr.value == "step"
            and dotted(n.func.value) in envs
        ):
            return True
    return False


def _loops_around(program, step: Step) -> list[cst.For | cst.While]:
    """The step's loop and the loops around it (an update loop nested in the environment loop)."""
    out: list[cst.For | cst.While] = []
    cur: cst.CSTNode | None = step.loop
    while cur is not None:
        if isinstance(cur, (cst.For, cst.While)):
            out.append(cur)
        cur = program.parent(cur)
    return out


def _layers(rule: Rule, module: cst.Module) -> tuple[list[int], bool]:
    """The literal Linear sizes of the file, and whether its layers make a small MLP."""
    widths: list[int] = []
    linear = False
    for n in _walk(module, into_loops=True):
        if not isinstance(n, cst.Call):
            continue
        q = callee(rule, n) or ""
        if not q.startswith("torch.nn.") or q.startswith("torch.nn.functional"):
            continue
        cls = q.rsplit(".", 1)[1]
        if cls.startswith(_HEAVY):
            return widths, False
        if cls != "Linear":
            continue
        linear = True
        sizes = [a.value for a in n.args[:2] if a.keyword is None and not a.star]
        sizes += [
            a.value for a in n.args if a.keyword is not None and a.keyword.value in ("in_features", "out_features")
        ]
        known = [int(v.value) for v in sizes if isinstance(v, cst.Integer)]
        if not known:
            return widths, False
        widths += known
    return widths, linear and all(w <= SMALL_WIDTH for w in widths)


def _build(rule: Rule) -> Workload:
    module = rule.ctx.module
    program = program_of(rule)
    training = [s for s in program.steps if s.kind == "training"]
    envs = _env_names(rule, module)
    env_steps = [s for s in training if envs and any(_steps_env(loop, envs) for loop in _loops_around(program, s))]
    widths, small = _layers(rule, module)
    bound = bool(training) and len(env_steps) == len(training) and small
    return Workload(env_steps, widths, small, bound)


def workload_of(rule: Rule) -> Workload:
    """The file's workload facts, built once per parsed module."""
    return remembered(("workload",), rule.ctx.module, lambda: _build(rule))
