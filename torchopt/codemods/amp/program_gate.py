"""Programs in which TOP202 has no float32 step to make mixed precision: asked once per file,
before any step is analysed (the facts: torchopt/analysis/accelerators.py, precision.py, workload.py)."""

from __future__ import annotations

from torchopt.analysis.accelerators import host_program
from torchopt.analysis.precision import precision_of
from torchopt.analysis.workload import workload_of
from torchopt.rewrite.rule import Rule


def half_cast_reason(rule: Rule, name: str, where: str = "") -> str:
    """Why a step whose model ``name`` is cast to half is not rewritten: pure half precision, or a cast
    that runs only under an opt-in switch (then the program is float32 by default: say so)."""
    switch = [c.condition for c in precision_of(rule).opt_in() if c.model == name]
    if switch and switch[0] is not None:
        test = " ".join(rule.ctx.module.code_for_node(switch[0].test).split())
        return (
            f"`{name}` is cast to float16/bfloat16 only `if {test}:` (an opt-in switch; started plainly "
            "the model is float32), and autocast must not be combined with that cast: make the "
            "autocast and the cast exclusive under the same switch"
        )
    return (
        f"`{name}` is cast to float16/bfloat16{where} (pure low-precision training): "
        "autocast must not be combined with `.half()`"
    )


def no_float32_step(rule: Rule) -> bool:
    """A CPU program (float16 only; bfloat16 pays there), a program already trained in half precision
    by hand (the model cast unconditionally), or a small MLP policy trained between environment
    steps (the environment dominates the iteration: autocast cannot pay)."""
    if rule.option("dtype") != "bfloat16" and host_program(rule) is not None:
        return True
    return precision_of(rule).kind == "half" or workload_of(rule).environment_bound
