"""TOP503 `determinism-switch`: Reports the switches that make CUDA results reproducible at a cost in speed:."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.control import Guard, control_of
from torchopt.analysis.run_once import once_per_process

from torchopt.codemods.flags import FAMILY
from torchopt.codemods.flags.program_flags import determinism_possible
from torchopt.codemods.flags.program_flags import program
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class DeterminismSwitch(Rule):
    """## What it does
    Reports the switches that make CUDA results reproducible at a cost in speed:
    `torch.backends.cudnn.deterministic = True`, `torch.use_deterministic_algorithms(True)` and the
    `CUBLAS_WORKSPACE_CONFIG` environment variable (the first two when set to a literal `True`).
    Display-only: they are never removed. A switch set only under a command-line option that is off
    by default (`if args.seed is not None:` with `--seed` defaulting to `None`, a `store_true` flag)
    is not reported: there the user asked for reproducibility. Nor is one in the module-level code of
    a program that runs no step (a model file's `__main__` shape check, a converter).

    ## Why is this slow
    Deterministic mode restricts cuDNN to deterministic convolution algorithms (often not the
    fastest), disables the auto-tuner's free choice, makes some operations fall back to slower
    deterministic implementations or raise, and `CUBLAS_WORKSPACE_CONFIG` limits cuBLAS's
    workspace. It is the right choice while debugging or for exact reproducibility; for
    production training consider turning it off.

    ## Example
    ```python
    import torch

    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)
    ```

    ## Use instead
    ```python
    import torch

    # Reproducibility is only needed when debugging:
    if DEBUG:
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True)
    ```

    ## Fix safety
    Display-only: reproducibility is a user decision, so there is no automatic fix. Turning the
    switches off changes results from run to run (class T), which only the user can accept.
    """

    code = "TOP503"
    name = "determinism-switch"
    family = FAMILY
    message = "{what} makes results reproducible at a cost in speed; keep it only where reproducibility is needed"
    safety = Safety.DISPLAY
    prefilter = ("deterministic", "CUBLAS_WORKSPACE_CONFIG")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and determinism_possible(text)

    examples = (
        Invalid("import torch\n\ntorch.backends.cudnn.deterministic = True\n"),
        Invalid("import torch as T\n\nT.use_deterministic_algorithms(True, warn_only=True)\n"),
        Invalid("import os\n\nos.environ['CUBLAS_WORKSPACE_CONFIG'] = ':4096:8'\n"),
        Invalid("from torch.backends import cudnn\n\ncudnn.deterministic = True\n"),
        Valid(
            "import torch\n\ntorch.backends.cudnn.deterministic = False\ntorch.use_deterministic_algorithms(False)\n",
            runnable=True,
        ),
        Valid("class Cfg:\n    pass\n\ncfg = Cfg()\ncfg.deterministic = True\n", runnable=True),
        Valid(
            dedent("""\
                import argparse
                import torch

                parser = argparse.ArgumentParser()
                parser.add_argument("--seed", type=int, default=None)
                args = parser.parse_args()
                if args.seed is not None:
                    torch.manual_seed(args.seed)
                    torch.backends.cudnn.deterministic = True
            """),
            note="only when the user passes `--seed`, off by default",
        ),
        Valid(
            "import torch\n\ndef restore(previous):\n    torch.use_deterministic_algorithms(previous)\n",
            note="only literal `True` is reported: a variable may hold either",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        for sw in program(self).determinism:
            if Guard.OFF_BY_DEFAULT in control_of(self).guards(sw.node):
                continue  # set only when the user turns on an option, e.g. `--seed`: reproducibility asked for
            if once_per_process(self, sw.node):
                continue  # a program that runs no step (a model file's shape check): nothing to slow down
            self.report(sw.node, fmt={"what": sw.what})
