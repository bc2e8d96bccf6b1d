"""TOP951 (rules.md §17 ENV): launcher and environment settings for scripts that run on the CPU."""
from __future__ import annotations

import re

import libcst as cst

from torchopt.codemods.env import FAMILY
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid

_ACCEL = re.compile(r"cuda|\bmps\b|xpu|accelerator")
_CPU = re.compile(r"""['"]cpu['"]""")

_MAIN = 'if __name__ == "__main__":\n    main()\n'


class CpuLauncherAdvice(Rule):
    """## What it does
    Reports CPU launcher settings (NUMA, OpenMP, allocator) once per CPU script.

    Reports once per script (at its `if __name__ == "__main__":` guard) that runs on the CPU: it
    names the `"cpu"` device, or never mentions an accelerator (`cuda`, `mps`, `xpu`,
    `torch.accelerator`). The message lists the process settings of the tuning guide's CPU section.
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
    `OMP_NUM_THREADS=1` per process (E-19).

    ## Fix safety
    Display-only: nothing in the source changes. Thread placement does not change results; the
    number of threads can change the rounding of reductions.
    """

    code = "TOP951"
    name = "cpu-launcher-settings"
    family = FAMILY
    message = ("runs on the CPU: launch pinned, e.g. `OMP_NUM_THREADS=<cores per socket> OMP_PROC_BIND=CLOSE "
               "OMP_SCHEDULE=STATIC numactl --cpunodebind=0 --membind=0 python ...`; consider LD_PRELOAD of "
               "jemalloc/tcmalloc, or Intel OpenMP (libiomp5.so with KMP_AFFINITY, KMP_BLOCKTIME=1){extra} "
               "(torchrun sets OMP_NUM_THREADS=1 per process)")
    safety = Safety.DISPLAY
    prefilter = ("__main__",)
    requires = ("torch",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # visit_If: an accelerator script that never names the CPU is not reported.
        return super().could_match(text) and not (_ACCEL.search(text) and not _CPU.search(text))
    examples = (
        Invalid("import torch\n\ndef main():\n    print(torch.ones(2).sum())\n\n\n" + _MAIN),
        Invalid("import torch\n\ndef main():\n    device = 'cuda' if torch.cuda.is_available() else 'cpu'\n\n\n"
                + _MAIN, note="may run on the CPU"),
        Invalid("import torch\n\ndef main():\n    m = torch.jit.trace(net, x)\n\n\n" + _MAIN,
                note="traced model: oneDNN Graph fusion is suggested too"),
        Valid("import torch\n\ndef main():\n    x = torch.ones(2, device='cuda')\n\n\n" + _MAIN,
              note="a GPU script"),
        Valid("import torch\n\ndef helper():\n    return torch.ones(2)\n", note="a library module, not a script"),
    )

    def visit_If(self, node: cst.If) -> None:
        test = node.test
        if not (isinstance(test, cst.Comparison) and isinstance(test.left, cst.Name)
                and test.left.value == "__name__" and len(test.comparisons) == 1
                and isinstance(test.comparisons[0].operator, cst.Equal)):
            return
        code = self.ctx.module.code
        if "torch" not in code:
            return  # not a PyTorch script (e.g. a command-line front end): nothing to tune
        if _ACCEL.search(code) and not _CPU.search(code):
            return
        extra = []
        if "jit.trace" in code:
            extra.append("; for the traced model, oneDNN Graph: `torch.jit.enable_onednn_fusion(True)` before "
                         "`torch.jit.trace` + `torch.jit.freeze`, then warm-up runs")
        if "gloo" in code or "DistributedDataParallel" in code:
            extra.append("; CPU DDP: torch-ccl (oneCCL) backend")
        self.report(test, fmt={"extra": "".join(extra)})
