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
from torchopt.codemods.flags.pays import pays
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
    reports without a fix and names that file. A call whose module is not part of the run counts
    only when its result is used as a model (the model lifecycle's module objects: called, moved,
    put in eval mode, its parameters optimised, or bound to a model name); a data loader factory
    or a config reader from such a module is not asked about.

    It does nothing when the file already sets `torch.backends.cudnn.benchmark` (to anything: an
    explicit user setting is never overridden), or shows reproducibility intent
    (`torch.backends.cudnn.deterministic = True`, `torch.use_deterministic_algorithms(True)`,
    `CUBLAS_WORKSPACE_CONFIG`), here or in a project function it calls (`init_seeds(seed,
    deterministic=True)` with `utils.py` setting the switches when `deterministic` is true); when a
    value known only at run time decides (`init_seeds(seed, deterministic=args.det)`) it reports
    without a fix. When input shapes vary per batch (`pad_sequence` /
    `pack_padded_sequence`, `transforms.Resize(<int>)` without a crop) it reports without a fix.

    It does nothing where the switch cannot pay (the facts of `flags/pays.py`):

    * **No repeated forward**: no loop of the program calls a model (directly or through the
      functions of the file it calls), and the model is never handed to code outside the file
      (`train(model, loader)` from another module may loop, and then the rule reports as before).
      A program that runs one forward per model (an export, a shape check, a FLOP counter whose
      forwards run inside `FlopCounterMode` or are handed to `fvcore`'s `FlopCountAnalysis`) is
      not a step loop.
    * **One call per file, each file its own size**: every loop that calls the model iterates a
      file listing (`os.listdir`, `glob.glob`, `os.scandir`, `os.walk`, `Path(d).glob(...)`) and
      calls the model once per file on what it read, and nothing on the way (the loop body, the
      functions of the file and of the project it calls) resizes or crops (`interpolate`,
      `resize`, a `torchvision` resize, crop or `Compose`, a slice with literal bounds). When a call on the way
      cannot be read (a function of a module outside the run, a callable the file receives), the
      rule reports that the shapes are unknown, without a fix.

    ## Why is this slow
    With the auto-tuner off, cuDNN picks a convolution algorithm by heuristics. With it on, the
    first call for each input shape benchmarks the available algorithms and caches the fastest
    one, which usually speeds up fixed-shape convolutional training (PyTorch tuning guide,
    "Enable cuDNN auto-tuner"). With highly variable shapes every new shape pays for a benchmark,
    which can make the program slower: then the rule only reports (TOP504 advises turning it off where it is already on).
    The benchmark pays back only over many calls with the same shape: a program that runs one
    forward per model, or one call per input file of its own length (an inference script over
    audio or mel files), pays for a benchmark on every call and never gets it back.

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
    bitwise the same. The fix is offered only where a loop repeats the forward on shapes that are
    not known to change per call; where they are unknown (one call per file through a step the
    file does not show) it reports without a fix. The line is inserted exactly once; a second run finds the switch set and
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
    per_file_message = (
        "This program calls its convolutions once per file it reads, and whether the input shapes "
        "repeat across files is unknown ({why}): `torch.backends.cudnn.benchmark = True` pays only "
        "when they do; check that every input is brought to one size before enabling it"
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
                    for _ in range(3):
                        net(T.randn(1, 3, 224, 224).cuda())
            """),
            after=dedent("""\
                import torch as T
                from torchvision import models


                if __name__ == '__main__':
                    T.backends.cudnn.benchmark = True
                    net = models.resnet18().cuda()
                    for _ in range(3):
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
        Invalid(
            dedent("""\
                import os

                import torch
                from torchvision import models


                def predict(folder, prepare):
                    net = models.resnet18().cuda().eval()
                    for name in sorted(os.listdir(folder)):
                        x = prepare(torch.load(os.path.join(folder, name)))
                        print(name, net(x.cuda()).argmax())


                if __name__ == "__main__":
                    predict("inputs", torch.nn.Identity())
            """),
            note="one call per file, through a callable the file does not show: whether shapes repeat is unknown",
        ),
        Valid(
            dedent("""\
                import glob

                import numpy as np
                import torch
                from torch import nn


                def main():
                    net = nn.Sequential(nn.Conv1d(80, 1, 7), nn.Tanh()).cuda().eval()
                    with torch.no_grad():
                        for path in glob.glob("mels/*.npy"):
                            mel = torch.from_numpy(np.load(path)).cuda()
                            np.save(path + ".out", net(mel.unsqueeze(0)).cpu().numpy())


                if __name__ == "__main__":
                    main()
            """),
            note="one call per file, each file its own length: every call is a new shape, the auto-tuner would not pay",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.flop_counter import FlopCounterMode
                from torchvision import models

                if __name__ == "__main__":
                    for name in ("resnet18", "resnet50"):
                        net = getattr(models, name)().cuda()
                        with FlopCounterMode() as counter:
                            net(torch.randn(1, 3, 224, 224, device="cuda"))
                        print(name, counter.get_total_flops())
            """),
            note="a FLOP counter: one measured forward per model, no repeated step",
        ),
        Valid(
            dedent("""\
                import torch
                from torchvision import models

                if __name__ == "__main__":
                    net = models.resnet18().cuda().eval()
                    torch.onnx.export(net, torch.randn(1, 3, 224, 224, device="cuda"), "net.onnx")
                    print(net(torch.randn(1, 3, 224, 224, device="cuda")).shape)
            """),
            note="one forward, no loop: nothing for the auto-tuner to pay back",
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
        facts = pays(self, prog)
        if facts.repeats is False or facts.per_file is True:
            return  # no loop runs the model, or every call of it gets a new shape
        if facts.per_file is None and facts.per_file_loop is not None:
            self.report(facts.per_file_loop, message=self.per_file_message, fmt={"why": facts.per_file_why})
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
