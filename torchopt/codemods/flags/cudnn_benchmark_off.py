"""TOP501 `cudnn-benchmark-off`: Flags an entry script that builds convolutions (`nn.Conv{1,2,3}d`, `nn.ConvTranspose*d`,."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.names import torch_ref
from torchopt.analysis.syntax import source
from torchopt.codemods.flags import FAMILY
from torchopt.codemods.flags.program_flags import entry_possible
from torchopt.codemods.flags.program_flags import insertion
from torchopt.codemods.flags.program_flags import placed_after_binding
from torchopt.codemods.flags.program_flags import program
from torchopt.codemods.flags.example_scripts import _ENTRY_DOC
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class CudnnBenchmark(Rule):
    __doc__ = """## What it does
    Flags an entry script that builds convolutions (`nn.Conv{1,2,3}d`, `nn.ConvTranspose*d`,
    `F.conv*`, `torchvision.models` builders), runs on CUDA, and leaves the cuDNN auto-tuner off.
    The fix inserts `torch.backends.cudnn.benchmark = True` once.

    The convolutions may be built in another module of the project: `model = Net()` with
    `from models import Net` counts when the project index finds convolutions in `Net` (its body,
    its project bases, the project classes it builds). When the module that defines `Net` is not
    part of the run (a single file named on the command line, no project folder above it), the rule
    reports without a fix and names that file.

    It does nothing when the file already sets `torch.backends.cudnn.benchmark` (to anything: an
    explicit user setting is never overridden), or shows reproducibility intent
    (`torch.backends.cudnn.deterministic = True`, `torch.use_deterministic_algorithms(True)`,
    `CUBLAS_WORKSPACE_CONFIG`), here or in a project function it calls (`init_seeds(seed,
    deterministic=True)` with `utils.py` setting the switches when `deterministic` is true); when a
    value known only at run time decides (`init_seeds(seed, deterministic=args.det)`) it reports
    without a fix. When input shapes vary per batch (`pad_sequence` /
    `pack_padded_sequence`, `transforms.Resize(<int>)` without a crop) it reports without a fix.

    ## Why is this slow
    With the auto-tuner off, cuDNN picks a convolution algorithm by heuristics. With it on, the
    first call for each input shape benchmarks the available algorithms and caches the fastest
    one, which usually speeds up fixed-shape convolutional training (PyTorch tuning guide,
    "Enable cuDNN auto-tuner"). With highly variable shapes every new shape pays for a benchmark,
    which can make the program slower: then the rule only reports (TOP504 advises turning it off where it is already on).

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
    torch.backends.cudnn.benchmark = True

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
    for x in loader:
        model(x.cuda()).mean().backward()
    ```

    ## Fix safety
    Unsafe (tag tolerance). The auto-tuner may select another algorithm in different runs, so
    convolution outputs change by rounding and training trajectories drift slowly. `torchopt
    validate` holds a tolerance-tagged rewrite to the fp32 `assert_close` defaults for outputs and
    rel 1e-5 for training probes (on a GPU the expected drift is about rtol 1e-4 / atol 1e-5;
    not yet measured there). On a CPU-only build the switch is a no-op and the rewrite is
    bitwise the same. The line is inserted exactly once; a second run finds the switch set and
    changes nothing.
    """.replace("{entry}", _ENTRY_DOC)

    code = "TOP501"
    name = "cudnn-benchmark-off"
    family = FAMILY
    message = "This program builds convolutions ({what}) with the cuDNN auto-tuner off"
    varying_message = (
        "This program builds convolutions but its input shapes vary per batch ({why}): "
        "`torch.backends.cudnn.benchmark = True` would re-tune for every new shape; "
        "pad inputs to a few fixed shapes before enabling it"
    )
    unknown_message = (
        "Whether this program builds convolutions (and the cuDNN auto-tuner would pay) is unknown: {why}; "
        "check the whole project (`torchopt check <project folder>`)"
    )
    intent_message = (
        "This program builds convolutions with the cuDNN auto-tuner off, and whether it asks for "
        "reproducible runs is unknown: {why}; the auto-tuner is not switched on"
    )
    fix_title = "Insert `torch.backends.cudnn.benchmark = True` ({where})"
    safety = Safety.UNSAFE
    tags = (Tag.TOLERANCE,)
    # The switch only matters on CUDA, and the rule requires the program to use it: named, reached
    # through `torch.accelerator`, or a device index moved to (`.to(gpu_id)`).
    prefilter = ("cuda", "accelerator", ".to(")

    @classmethod
    def could_match(cls, text: str) -> bool:
        # program(): a convolution (torch.nn Conv*/conv* or a torchvision model) in an entry script.
        # The convolutions may be built by a class the file imports from the project (project index).
        return super().could_match(text) and ("onv" in text or "import" in text) and entry_possible(text)

    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(10):
                    loss = model(torch.randn(16, 3, 32, 32, device="cuda")).mean()
                    loss.backward()
                    opt.step()
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn

                torch.backends.cudnn.benchmark = True

                model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(10):
                    loss = model(torch.randn(16, 3, 32, 32, device="cuda")).mean()
                    loss.backward()
                    opt.step()
            """),
            unsafe="tolerance",
        ),
        Invalid(
            dedent('''\
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
            '''),
            after=dedent('''\
                import torch
                from torch import nn


                def main():
                    """Train."""
                    torch.backends.cudnn.benchmark = True
                    device = "cuda" if torch.cuda.is_available() else "cpu"
                    net = nn.Conv1d(4, 4, 3).to(device)
                    for _ in range(3):
                        net(torch.randn(2, 4, 16, device=device)).sum().backward()


                if __name__ == "__main__":
                    main()
            '''),
            unsafe="tolerance",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch as T
                from torchvision import models


                if __name__ == '__main__':
                    net = models.resnet18().cuda()
                    net(T.randn(1, 3, 224, 224).cuda())
            """),
            after=dedent("""\
                import torch as T
                from torchvision import models


                if __name__ == '__main__':
                    T.backends.cudnn.benchmark = True
                    net = models.resnet18().cuda()
                    net(T.randn(1, 3, 224, 224).cuda())
            """),
            unsafe="tolerance",
            note="the file's torch alias; a guard without main(): first statement of the guard",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                from torch.nn.utils.rnn import pad_sequence

                conv = nn.Conv1d(8, 8, 3).cuda()
                for seqs in batches:
                    x = pad_sequence(seqs, batch_first=True).transpose(1, 2).cuda()
                    conv(x).sum().backward()
            """),
            note="variable sequence length fed to Conv1d: reported, not fixed",
        ),
        Invalid(
            dedent("""\
                import random

                import torch as T
                from torch import nn as N
                import torch.nn.functional as F


                class Trainer:
                    def __init__(self):
                        self.net = N.Conv2d(3, 8, 3).cuda()

                    def run(self, loader):
                        for x in loader:
                            x = F.interpolate(x.cuda(), size=random.choice([224, 256]))
                            self.net(x).sum().backward()


                if __name__ == "__main__":
                    Trainer().run(T.randn(4, 2, 3, 32, 32))
            """),
            note="aliased imports, the loop in a method: a random multi-scale size, reported, not fixed",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn
                torch.backends.cudnn.benchmark = True

                model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(10):
                    loss = model(torch.randn(16, 3, 32, 32, device="cuda")).mean()
                    loss.backward()
                    opt.step()
            """),
            note="already set: a second run changes nothing",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn
                import torch.backends.cudnn as cudnn
                cudnn.benchmark = True

                model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(10):
                    loss = model(torch.randn(16, 3, 32, 32, device="cuda")).mean()
                    loss.backward()
                    opt.step()
            """),
            note="already set through an alias: recognised by the statement, not its spelling",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn
                torch.backends.cudnn.benchmark = False

                model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(10):
                    loss = model(torch.randn(16, 3, 32, 32, device="cuda")).mean()
                    loss.backward()
                    opt.step()
            """),
            note="an explicit user setting is never overridden",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn
                torch.use_deterministic_algorithms(True)

                model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(10):
                    loss = model(torch.randn(16, 3, 32, 32, device="cuda")).mean()
                    loss.backward()
                    opt.step()
            """),
            note="reproducibility intent",
        ),
        Valid(
            dedent("""\
                import torch.nn as nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.conv = nn.Conv2d(3, 8, 3)
            """),
            note="a library module, not an entry script",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn

                model = nn.Linear(4, 4).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(3):
                    model(torch.randn(2, 4).cuda()).sum().backward()
                    opt.step()
            """),
            note="no convolution",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn

                model = nn.Conv2d(3, 8, 3)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(2):
                    model(torch.randn(2, 3, 8, 8)).sum().backward()
                    opt.step()
            """),
            note="never runs on CUDA: the switch would be a no-op",
            runnable=True,
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        prog = program(self)
        if not prog.cuda or prog.benchmark_set or prog.intent or prog.anchor is None:
            return
        if not prog.convs:
            if prog.unknown_layers:
                call, why = prog.unknown_layers[0]
                self.report(call, message=self.unknown_message, fmt={"why": why})
            return
        if prog.variable_shapes:
            where, why = prog.variable_shapes[0]
            self.report(where, message=self.varying_message, fmt={"why": why})
            return
        if prog.unknown_intent:
            call, why = prog.unknown_intent[0]
            self.report(call, message=self.intent_message, fmt={"why": why})
            return
        ref = torch_ref(self)
        if ref is None:
            return
        anchor = placed_after_binding(self, prog, ref.name)
        if anchor is None:
            return
        line = cst.parse_statement(f"{ref.name}.backends.cudnn.benchmark = True\n")
        self.report(
            prog.convs[0],
            fmt={
                "what": prog.built_elsewhere.get(id(prog.convs[0])) or source(self, prog.convs[0]),
                "where": prog.entry,
            },
            replacement=insertion(anchor, line),
            target=anchor[0],
            tags=[Tag.TOLERANCE],
            imports=ref.imports,
            note="cuDNN may pick another convolution algorithm per run: outputs change by rounding",
        )
