"""TOP951: launcher advice, reported once per script that can run on the CPU."""

from __future__ import annotations

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

SEL = Settings(select=("TOP951",))
SCRIPT = (
    'import torch\n\n\ndef main():\n    x = torch.ones(2, device="{dev}")\n    for _ in range(100):\n'
    '        x = x.matmul(x)\n\n\nif __name__ == "__main__":\n    main()\n'
)


def _diags(src: str):
    return [d for d in check_source(src, SEL).diagnostics if d.code == "TOP951"]


def test_once_per_cpu_script_and_never_a_fix():
    (d,) = _diags(SCRIPT.format(dev="cpu"))
    assert d.fix is None and d.line == 10
    for needle in (
        "numactl",
        "OMP_NUM_THREADS",
        "OMP_PROC_BIND=CLOSE",
        "OMP_SCHEDULE=STATIC",
        "jemalloc",
        "tcmalloc",
        "libiomp5",
        "KMP_BLOCKTIME",
        "torchrun sets OMP_NUM_THREADS=1",
    ):
        assert needle in d.message, needle
    assert fix_source(SCRIPT.format(dev="cpu"), SEL, unsafe=True).text == SCRIPT.format(dev="cpu")


def test_gpu_only_scripts_and_modules_are_silent():
    assert not _diags(SCRIPT.format(dev="cuda"))
    assert not _diags("import torch\n\n\ndef f():\n    return torch.ones(2)\n")


def test_context_specific_advice():
    traced = SCRIPT.format(dev="cpu").replace("    x = ", "    net = torch.jit.trace(f, ())\n    x = ")
    (d,) = _diags(traced)
    assert "enable_onednn_fusion(True)" in d.message and "torch.jit.freeze" in d.message
    ddp = SCRIPT.format(dev="cpu").replace(
        "import torch\n", "import torch\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
    )
    (d,) = _diags(ddp)
    assert "torch-ccl" in d.message
