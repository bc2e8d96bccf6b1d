"""TOP951: launcher and environment settings for scripts that run on the CPU."""

from __future__ import annotations

import re
from textwrap import dedent

import libcst as cst

from torchopt.analysis.accelerators import ACCELERATOR_TEXT as _ACCEL
from torchopt.analysis.accelerators import device_flag_default, no_accelerator_named
from torchopt.analysis.entry_points import ProgramRule
from torchopt.analysis.names import callee, qualified_names
from torchopt.analysis.run_once import steady_work
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import walk
from torchopt.codemods.env import FAMILY
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid

_CPU = re.compile(r"""['"]cpu['"]""")
_TEST_RUNNERS = {"unittest.main", "pytest.main"}
_EXPORTS = {
    "torch.onnx.export",
    "torch.onnx.dynamo_export",
    "torch.export.export",
    "torch.export.save",
    "torch.jit.save",
}


def _no_workload(rule: Rule, guard: cst.If) -> bool:
    """The program runs no steady work whose threads are worth pinning: its guard starts a test
    runner (`unittest.main()`), or it exports a model (`torch.onnx.export`) and runs no step loop."""
    calls = [n for n in walk(guard.body, cross_scopes=True) if isinstance(n, cst.Call)]
    if any(qualified_names(rule, c.func) & _TEST_RUNNERS for c in calls):
        return True
    module = rule.ctx.module
    exports = any(callee(rule, n) in _EXPORTS for n in walk(module, cross_scopes=True) if isinstance(n, cst.Call))
    return exports and not hot_map(rule).step_loops


def cpu_reason(rule: Rule, module: cst.Module) -> str | None:
    """Why the whole program runs on the CPU, or None when it may well run on an accelerator.

    A command-line or parameter default of "cpu" decides it. Otherwise any sign of an accelerator
    (its name, a trainer that picks one, a device computed elsewhere) keeps the rule silent: a script
    whose default is the GPU and whose CPU branch is only a fallback is a GPU script.
    """
    flag = device_flag_default(rule, module, skip_passed=True)
    if flag is not None:
        value, line = flag
        if value.split(":")[0] == "cpu":
            return f'its device option defaults to "cpu" (line {line})'
        return None
    return no_accelerator_named(rule, module)


class CpuLauncherAdvice(ProgramRule):
    """## What it does
    Reports CPU launcher settings (NUMA, OpenMP, allocator) once per script that runs on the CPU.

    Reports once per script (at its `if __name__ == "__main__":` guard) that runs on the CPU, and
    says why it thinks so: its `--device` option (or a `device` parameter) defaults to `"cpu"`, or
    nothing in it selects an accelerator. A script that picks an accelerator and falls back to the
    CPU (`"cuda" if torch.cuda.is_available() else "cpu"`, `torch.accelerator.current_accelerator()`,
    a `--device` option defaulting to `"cuda"`, a trainer or `Accelerator` that picks the device, a
    device returned by a helper) is a GPU script and is left alone, and so is a file that only
    defines models (its guard only smoke-tests them: see "Where programs run" in docs/design.md), a
    unit-test module (its guard starts `unittest.main()` or `pytest.main()`), and a script that
    exports a model (`torch.onnx.export`, `torch.jit.save`, `torch.export`) and runs no step loop: a
    one-off conversion has no steady work whose threads are worth pinning. Nor is a program with no
    steady tensor work: no step loop, and no loop that computes on tensors (a data-packing script
    whose loop only converts batches and writes them out, a download-and-dump script, one SVD).
    Display-only: these are launcher settings, not source changes.

    ## Why is this slow
    On the CPU, PyTorch's speed depends on how its threads are placed: threads that migrate
    between cores or NUMA nodes, memory allocated on the far node, OpenMP threads spinning or
    sleeping at the wrong time, and the default allocator's fragmentation all cost throughput
    (tuning guide, "CPU specific optimizations").

    ## Example
    ```python
    if __name__ == "__main__":
        main()  # run as: python train.py
    ```

    ## Use instead
    Launch it pinned, with OpenMP set for the machine:
    ```
    OMP_NUM_THREADS=<cores per socket> OMP_PROC_BIND=CLOSE OMP_SCHEDULE=STATIC \\
    numactl --cpunodebind=0 --membind=0 python train.py
    ```
    and consider `LD_PRELOAD` of jemalloc or tcmalloc, Intel OpenMP (`libiomp5.so` with
    `KMP_AFFINITY=granularity=fine,compact,1,0` and `KMP_BLOCKTIME=1`), oneDNN Graph for TorchScript
    inference (`torch.jit.enable_onednn_fusion(True)`, then `torch.jit.trace` + `torch.jit.freeze`
    and a few warm-up runs), and torch-ccl for CPU DDP. `torchrun` already sets
    `OMP_NUM_THREADS=1` per process.

    ## Fix safety
    Display-only: nothing in the source changes. Thread placement does not change results; the
    number of threads can change the rounding of reductions.
    """

    code = "TOP951"
    name = "cpu-launcher-settings"
    family = FAMILY
    message = (
        "runs on the CPU ({why}): launch pinned, e.g. `OMP_NUM_THREADS=<cores per socket> OMP_PROC_BIND=CLOSE "
        "OMP_SCHEDULE=STATIC numactl --cpunodebind=0 --membind=0 python ...`; consider LD_PRELOAD of "
        "jemalloc/tcmalloc, or Intel OpenMP (libiomp5.so with KMP_AFFINITY, KMP_BLOCKTIME=1){extra} "
        "(torchrun sets OMP_NUM_THREADS=1 per process)"
    )
    safety = Safety.DISPLAY
    prefilter = ("__main__",)
    requires = ("torch",)
    locality = "file"  # the verdict reads the whole program

    @classmethod
    def could_match(cls, text: str) -> bool:
        # cpu_reason: with an accelerator named, only a "cpu" default can make the script a CPU one.
        return super().could_match(text) and not (_ACCEL.search(text) and not _CPU.search(text))

    examples = (
        Invalid(
            dedent("""\
                import torch

                def main():
                    for _ in range(100):
                        print(torch.ones(2).sum())


                if __name__ == "__main__":
                    main()
            """),
            note="nothing selects an accelerator",
        ),
        Invalid(
            dedent("""\
                import argparse
                import torch

                def main():
                    parser = argparse.ArgumentParser()
                    parser.add_argument("--device", default="cpu", help="cpu or cuda")
                    args = parser.parse_args()
                    x = torch.ones(2, device=args.device)
                    for _ in range(100):
                        x = torch.mm(x, x)


                if __name__ == "__main__":
                    main()
            """),
            note="the device option defaults to the CPU",
        ),
        Valid(
            dedent("""\
                import torch


                def load_data(path, device="cpu"):
                    return torch.load(path).to(device)


                if __name__ == "__main__":
                    use_accel = torch.accelerator.is_available()
                    device = torch.accelerator.current_accelerator() if use_accel else torch.device("cpu")
                    x = load_data("x.pt", device=device)
                    for _ in range(100):
                        x = torch.mm(x, x)
            """),
            note="a helper's parameter default that every call overrides: the caller picks the accelerator",
        ),
        Invalid(
            dedent("""\
                import torch

                def main():
                    m = torch.jit.trace(net, x)
                    for batch in batches:
                        m(batch)


                if __name__ == "__main__":
                    main()
            """),
            note="traced model: oneDNN Graph fusion is suggested too",
        ),
        Valid(
            dedent("""\
                import torch

                def main():
                    x = torch.ones(2, device='cuda')


                if __name__ == "__main__":
                    main()
            """),
            note="a GPU script",
        ),
        Valid(
            dedent("""\
                import torch

                def main():
                    device = 'cuda' if torch.cuda.is_available() else 'cpu'


                if __name__ == "__main__":
                    main()
            """),
            note="the GPU by default; the CPU is only a fallback",
        ),
        Valid(
            dedent("""\
                import torch as T

                def main():
                    device = T.accelerator.current_accelerator() if T.accelerator.is_available() else T.device("cpu")
                    net = T.nn.Linear(2, 2).to(device)


                if __name__ == "__main__":
                    main()
            """),
            note="the device comes from torch.accelerator",
        ),
        Valid(
            dedent("""\
                import torch as th
                from . import dist_util

                def main():
                    model = th.load("m.pt", map_location="cpu")
                    model.to(dist_util.dev())


                if __name__ == "__main__":
                    main()
            """),
            note="the device is chosen by a helper",
        ),
        Valid(
            dedent("""\
                import torch

                def helper():
                    return torch.ones(2)
            """),
            note="a library module, not a script",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc = nn.Linear(4, 2)

                    def forward(self, x):
                        return self.fc(x)


                def test():
                    net = Net()
                    print(net(torch.randn(2, 4)).shape)


                if __name__ == "__main__":
                    test()
            """),
            note="a file that only defines models and smoke-tests them is no program to launch",
        ),
        Valid(
            dedent("""\
                import unittest

                import torch


                class TestSum(unittest.TestCase):
                    def test_sum(self):
                        self.assertEqual(torch.ones(2).sum().item(), 2.0)


                if __name__ == "__main__":
                    unittest.main()
            """),
            note="a unit-test module: its guard starts the test runner",
        ),
        Valid(
            dedent("""\
                import torch


                def export(path):
                    model = torch.nn.Linear(4, 2).eval()
                    torch.onnx.export(model, (torch.randn(1, 4),), path)


                if __name__ == "__main__":
                    export("model.onnx")
            """),
            note="a one-off export, no step loop",
        ),
        Valid(
            dedent("""\
                import numpy as np
                import torch


                def main():
                    weights = torch.load("ckpt.pt", map_location="cpu")
                    rows = []
                    for name, w in weights.items():
                        rows.append(w)
                    u, s, v = torch.svd(torch.cat(rows))
                    for i, image in enumerate(np.load("images.npy")):
                        print(i, image.shape)


                if __name__ == "__main__":
                    main()
            """),
            note="no steady work: the loops only collect and print, the one SVD runs once",
        ),
    )

    def visit_If(self, node: cst.If) -> None:
        test = node.test
        if not (
            isinstance(test, cst.Comparison)
            and isinstance(test.left, cst.Name)
            and test.left.value == "__name__"
            and len(test.comparisons) == 1
            and isinstance(test.comparisons[0].operator, cst.Equal)
        ):
            return
        code = self.ctx.text
        if "torch" not in code:
            return  # not a PyTorch script (e.g. a command-line front end): nothing to tune
        why = cpu_reason(self, self.ctx.module)
        if why is None or _no_workload(self, node) or not steady_work(self):
            return
        extra = []
        if "jit.trace" in code:
            extra.append(
                "; for the traced model, oneDNN Graph: `torch.jit.enable_onednn_fusion(True)` before "
                "`torch.jit.trace` + `torch.jit.freeze`, then warm-up runs"
            )
        if "gloo" in code or "DistributedDataParallel" in code:
            extra.append("; CPU DDP: torch-ccl (oneCCL) backend")
        self.report(test, fmt={"why": why, "extra": "".join(extra)})
