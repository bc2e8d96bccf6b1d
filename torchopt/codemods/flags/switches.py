"""TOP501 (cuDNN auto-tuner), TOP502 (TF32 matmuls), TOP503 (determinism switches that cost speed):
rules.md FLAG-001, FLAG-002, FLAG-003. The analysis of the file is in ``_program.py``."""
from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import torch_ref
from torchopt.analysis.syntax import source
from torchopt.codemods.flags import FAMILY
from torchopt.codemods.flags._program import determinism_possible, entry_possible, insertion, program
from torchopt.rewrite.rule import Invalid, Rule, Safety, Tag, Valid

_ENTRY_DOC = """\
    **Entry script.** A global switch belongs to the program, not to a library, so it is only
    inserted into an *entry script*: a file with a module-level `if __name__ == "__main__":` block,
    or one that calls a module-level `main()` from module level, or one that runs a training loop
    at module level (a module-level `for`/`while` whose body calls `.backward()` or `.step()`).
    The line goes at the start of `main()` (after its docstring) when the entry calls `main()`,
    else at the start of the `if __name__ == "__main__":` block, else right after the module's
    imports; next to any backend switch already there. Files that only define models or helpers
    are left alone."""

_CONV_SCRIPT = '''\
import torch
import torch.nn as nn

model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(10):
    loss = model(torch.randn(16, 3, 32, 32, device="cuda")).mean()
    loss.backward()
    opt.step()
'''
_CONV_SCRIPT_AFTER = _CONV_SCRIPT.replace(
    "import torch.nn as nn\n", "import torch.nn as nn\ntorch.backends.cudnn.benchmark = True  # torchopt TOP501\n")

_MAIN_SCRIPT = '''\
import torch
from torch import nn


def main():
    """Train."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    net = nn.Conv1d(4, 4, 3).to(device)
    for _ in range(3):
        net(torch.randn(2, 4, 16, device=device)).sum().backward()


if __name__ == "__main__":
    main()
'''
_MAIN_SCRIPT_AFTER = _MAIN_SCRIPT.replace(
    '    """Train."""\n', '    """Train."""\n    torch.backends.cudnn.benchmark = True  # torchopt TOP501\n')


class CudnnBenchmark(Rule):
    __doc__ = """## What it does
    Flags an entry script that builds convolutions (`nn.Conv{1,2,3}d`, `nn.ConvTranspose*d`,
    `F.conv*`, `torchvision.models` builders), runs on CUDA, and leaves the cuDNN auto-tuner off.
    The fix inserts `torch.backends.cudnn.benchmark = True` once.

    It does nothing when the file already sets `torch.backends.cudnn.benchmark` (to anything: an
    explicit user setting is never overridden), or shows reproducibility intent
    (`torch.backends.cudnn.deterministic = True`, `torch.use_deterministic_algorithms(True)`,
    `CUBLAS_WORKSPACE_CONFIG`). When input shapes vary per batch (`pad_sequence` /
    `pack_padded_sequence`, `transforms.Resize(<int>)` without a crop) it reports without a fix.

    ## Why is this slow
    With the auto-tuner off, cuDNN picks a convolution algorithm by heuristics. With it on, the
    first call for each input shape benchmarks the available algorithms and caches the fastest
    one, which usually speeds up fixed-shape convolutional training (PyTorch tuning guide,
    "Enable cuDNN auto-tuner"). With highly variable shapes every new shape pays for a benchmark,
    which can make the program slower: then the rule only reports (pair it with MEM-001).

{entry}

    ## Example
    ```python
    import torch
    import torch.nn as nn

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
    for x in loader:
        model(x.cuda()).mean().backward()
    ```

    ## Use instead
    ```python
    import torch
    import torch.nn as nn
    torch.backends.cudnn.benchmark = True  # torchopt TOP501

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
    for x in loader:
        model(x.cuda()).mean().backward()
    ```

    ## Fix safety
    Unsafe (tag tolerance). The auto-tuner may select another algorithm in different runs, so
    convolution outputs change by rounding and training trajectories drift slowly. `torchopt
    validate` holds a tolerance-tagged rewrite to the fp32 `assert_close` defaults for outputs and
    rel 1e-5 for training probes (rules.md VAL-6 allows rtol 1e-4 / atol 1e-5 for this switch on
    a GPU; not yet measured there). On a CPU-only build the switch is a no-op and the rewrite is
    bitwise the same. The line is inserted exactly once; a second run finds the switch set and
    changes nothing.
    """.replace("{entry}", _ENTRY_DOC)

    code = "TOP501"
    name = "cudnn-benchmark-off"
    family = FAMILY
    message = "This program builds convolutions ({what}) with the cuDNN auto-tuner off"
    varying_message = ("This program builds convolutions but its input shapes vary per batch ({why}): "
                       "`torch.backends.cudnn.benchmark = True` would re-tune for every new shape; "
                       "pad inputs to a few fixed shapes (MEM-001) before enabling it")
    fix_title = "Insert `torch.backends.cudnn.benchmark = True` ({where})"
    safety = Safety.UNSAFE
    tags = (Tag.TOLERANCE,)
    prefilter = ("cuda",)  # the switch only matters on CUDA, and the rule requires the program to use it

    @classmethod
    def could_match(cls, text: str) -> bool:
        # program(): a convolution (torch.nn Conv*/conv* or a torchvision model) in an entry script.
        return super().could_match(text) and ("onv" in text or "torchvision" in text) and entry_possible(text)

    examples = (
        Invalid(_CONV_SCRIPT, after=_CONV_SCRIPT_AFTER, unsafe="tolerance"),
        Invalid(_MAIN_SCRIPT, after=_MAIN_SCRIPT_AFTER, unsafe="tolerance", runnable=True),
        Invalid(
            "import torch as T\nfrom torchvision import models\n\n\nif __name__ == '__main__':\n"
            "    net = models.resnet18().cuda()\n    net(T.randn(1, 3, 224, 224).cuda())\n",
            after="import torch as T\nfrom torchvision import models\n\n\nif __name__ == '__main__':\n"
            "    T.backends.cudnn.benchmark = True  # torchopt TOP501\n"
            "    net = models.resnet18().cuda()\n    net(T.randn(1, 3, 224, 224).cuda())\n",
            unsafe="tolerance",
            note="the file's torch alias; a guard without main(): first statement of the guard",
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\nfrom torch.nn.utils.rnn import pad_sequence\n\n"
            "conv = nn.Conv1d(8, 8, 3).cuda()\nfor seqs in batches:\n"
            "    x = pad_sequence(seqs, batch_first=True).transpose(1, 2).cuda()\n"
            "    conv(x).sum().backward()\n",
            after=None,
            note="variable sequence length fed to Conv1d: reported, not fixed",
        ),
        Valid(_CONV_SCRIPT_AFTER, note="already set: a second run changes nothing"),
        Valid(_CONV_SCRIPT.replace("import torch.nn as nn\n",
                                   "import torch.nn as nn\ntorch.backends.cudnn.benchmark = False\n"),
              note="an explicit user setting is never overridden"),
        Valid(_CONV_SCRIPT.replace("import torch.nn as nn\n",
                                   "import torch.nn as nn\ntorch.use_deterministic_algorithms(True)\n"),
              note="reproducibility intent"),
        Valid("import torch.nn as nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n"
              "        super().__init__()\n        self.conv = nn.Conv2d(3, 8, 3)\n",
              note="a library module, not an entry script"),
        Valid("import torch\nimport torch.nn as nn\n\nmodel = nn.Linear(4, 4).cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "for _ in range(3):\n    model(torch.randn(2, 4).cuda()).sum().backward()\n    opt.step()\n",
              note="no convolution"),
        Valid("import torch\nimport torch.nn as nn\n\nmodel = nn.Conv2d(3, 8, 3)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "for _ in range(2):\n    model(torch.randn(2, 3, 8, 8)).sum().backward()\n    opt.step()\n",
              runnable=True, note="never runs on CUDA: the switch would be a no-op"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        prog = program(self)
        if not prog.convs or not prog.cuda or prog.benchmark_set or prog.intent:
            return
        if prog.anchor is None:
            return
        if prog.variable_shapes:
            where, why = prog.variable_shapes[0]
            self.report(where, message=self.varying_message, fmt={"why": why})
            return
        ref = torch_ref(self)
        if ref is None:
            return
        line = cst.parse_statement(f"{ref.name}.backends.cudnn.benchmark = True  # torchopt TOP501\n")
        self.report(prog.convs[0], fmt={"what": source(self, prog.convs[0]), "where": prog.entry},
                    replacement=insertion(prog, line), target=prog.anchor,  # type: ignore[arg-type]
                    tags=[Tag.TOLERANCE], imports=ref.imports,
                    note="cuDNN may pick another convolution algorithm per run: outputs change by rounding")


_LINEAR_SCRIPT = '''\
import torch

model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(10):
    model(torch.randn(8, 64, device="cuda")).pow(2).mean().backward()
    opt.step()
'''


class MatmulPrecision(Rule):
    __doc__ = """## What it does
    Flags an entry script that runs float32 matrix multiplies (`nn.Linear`, attention, RNNs,
    `torch.matmul`, `@`, ...) on CUDA at the default `"highest"` precision. The fix inserts
    `torch.set_float32_matmul_precision("high")` once (where: see below).

    It does nothing when the file already sets any TF32 switch
    (`torch.backends.cuda.matmul.allow_tf32`, `torch.backends.cudnn.allow_tf32`, any
    `fp32_precision`, `torch.set_float32_matmul_precision`) or a determinism switch
    (`cudnn.deterministic`, `use_deterministic_algorithms`, `CUBLAS_WORKSPACE_CONFIG`: a program
    that asks for reproducible results does not want reduced precision either). When the file uses
    precision-sensitive float32 linear algebra (`torch.linalg.*`, `torch.cdist`, `torch.inverse`,
    ...) it reports without a fix, because the switch is global. Existing `allow_tf32`
    assignments are never migrated to `fp32_precision`.

    ## Why is this slow
    With precision `"highest"` (the default) float32 matmuls run in full IEEE fp32. `"high"` lets
    them use TensorFloat-32 tensor cores on Ampere and later GPUs (or a sum of two bfloat16
    numbers), several times the fp32 throughput (PyTorch tuning guide, "Enable Tensor cores").
    It does not change the output dtype, does not affect convolutions (cuDNN already uses TF32 for
    them by default) and only affects CUDA.

{entry}

    ## Example
    ```python
    import torch

    model = torch.nn.Linear(64, 64).cuda()
    ```

    ## Use instead
    ```python
    import torch
    torch.set_float32_matmul_precision("high")  # torchopt TOP502

    model = torch.nn.Linear(64, 64).cuda()
    ```

    ## Fix safety
    Unsafe (tag numerics): TF32 keeps 10 explicit mantissa bits instead of 23, so matmul results
    lose precision on purpose (validator bound: rel-L2 of matmul-heavy outputs ≤ 5e-3). On a
    CPU-only build nothing changes. Inserted exactly once; a second run finds the switch and
    changes nothing.
    """.replace("{entry}", _ENTRY_DOC)

    code = "TOP502"
    name = "fp32-matmul-precision-highest"
    family = FAMILY
    message = "float32 matmuls ({what}) run at full IEEE precision; TF32 tensor cores are not used"
    sensitive_message = ("float32 matmuls run at full precision, but this file uses precision-sensitive "
                         "linear algebra (`{what}`): `torch.set_float32_matmul_precision(\"high\")` is "
                         "global and would change it too; enable TF32 only around the model, if at all")
    fix_title = "Insert `torch.set_float32_matmul_precision(\"high\")` ({where})"
    safety = Safety.UNSAFE
    tags = (Tag.NUMERICS,)
    prefilter = ("cuda",)  # the switch only matters on CUDA, and the rule requires the program to use it

    @classmethod
    def could_match(cls, text: str) -> bool:
        # program(): the switch goes into an entry script only.
        return super().could_match(text) and entry_possible(text)

    examples = (
        Invalid(_LINEAR_SCRIPT, after=_LINEAR_SCRIPT.replace(
            "import torch\n", "import torch\ntorch.set_float32_matmul_precision(\"high\")  # torchopt TOP502\n", 1),
            unsafe="numerics"),
        Invalid(
            "import torch\nimport torch.nn as nn\n\n\ndef main():\n    device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "    w = torch.randn(4, 4, device=device)\n    print((w @ w).sum())\n\n\nmain()\n",
            after="import torch\nimport torch.nn as nn\n\n\ndef main():\n"
            "    torch.set_float32_matmul_precision(\"high\")  # torchopt TOP502\n"
            "    device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "    w = torch.randn(4, 4, device=device)\n    print((w @ w).sum())\n\n\nmain()\n",
            unsafe="numerics", runnable=True,
        ),
        Invalid(_LINEAR_SCRIPT.replace("for _", "basis = torch.linalg.qr(torch.randn(4, 4))\nfor _"), after=None,
                note="precision-sensitive linear algebra: reported, not fixed"),
        Valid(_LINEAR_SCRIPT.replace("import torch\n", "import torch\ntorch.backends.cuda.matmul.allow_tf32 = True\n"),
              note="the user already chose"),
        Valid(_LINEAR_SCRIPT.replace("import torch\n", "import torch\ntorch.set_float32_matmul_precision(\"high\")  # torchopt TOP502\n"),
              note="a second run changes nothing"),
        Valid(_LINEAR_SCRIPT.replace("import torch\n", "import torch\ntorch.backends.cudnn.deterministic = True\n"),
              note="reproducibility intent"),
        Valid("import torch\n\nlayer = torch.nn.Linear(4, 4).cuda()\n", note="not an entry script"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        prog = program(self)
        if not prog.matmuls or not prog.cuda or prog.tf32_set or prog.intent or prog.anchor is None:
            return
        if prog.sensitive:
            where, what = prog.sensitive[0]
            self.report(where, message=self.sensitive_message, fmt={"what": what})
            return
        ref = torch_ref(self)
        if ref is None:
            return
        line = cst.parse_statement(f'{ref.name}.set_float32_matmul_precision("high")  # torchopt TOP502\n')
        self.report(prog.matmuls[0], fmt={"what": source(self, prog.matmuls[0]), "where": prog.entry},
                    replacement=insertion(prog, line), target=prog.anchor,  # type: ignore[arg-type]
                    tags=[Tag.NUMERICS], imports=ref.imports,
                    note="float32 matmuls on CUDA use TF32 (10 mantissa bits): rel-L2 of outputs up to ~5e-3")


class DeterminismSwitch(Rule):
    """## What it does
    Reports the switches that make CUDA results reproducible at a cost in speed:
    `torch.backends.cudnn.deterministic = True`, `torch.use_deterministic_algorithms(True)` and the
    `CUBLAS_WORKSPACE_CONFIG` environment variable (the first two when set to a literal `True`).
    Display-only: they are never removed.

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
        Valid("import torch\n\ntorch.backends.cudnn.deterministic = False\ntorch.use_deterministic_algorithms(False)\n",
              runnable=True),
        Valid("class Cfg:\n    pass\n\ncfg = Cfg()\ncfg.deterministic = True\n", runnable=True),
        Valid("import torch\n\ndef restore(previous):\n    torch.use_deterministic_algorithms(previous)\n",
              note="only literal `True` is reported: a variable may hold either"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        for sw in program(self).determinism:
            self.report(sw.node, fmt={"what": sw.what})
