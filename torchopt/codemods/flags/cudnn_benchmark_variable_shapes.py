"""TOP504 `cudnn-benchmark-variable-shapes`: the cuDNN auto-tuner left on for inputs whose shapes vary."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.codemods.flags import FAMILY
from torchopt.codemods.flags.program_flags import program
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class CudnnBenchmarkVariableShapes(Rule):
    """## What it does
    Reports `torch.backends.cudnn.benchmark = True` (under any name: `import torch.backends.cudnn
    as cudnn; cudnn.benchmark = True`, in a function or a method) in a file that builds
    convolutions and whose input shapes vary from batch to batch, and advises `False`. The
    variation is recognised from the code that makes it, and the message names it:
    `pad_sequence` / `pack_padded_sequence` batches (variable-length sequences),
    `transforms.Resize(<int>)` without a crop (each image keeps its aspect ratio), torchvision's
    random-size transforms (`RandomResize`, `RandomShortestSize`, `ScaleJitter`, `RandomZoomOut`),
    and `F.interpolate` / `nn.Upsample` / `Resize` given a size or scale drawn at random
    (multi-scale training). Display-only.

    ## Why is this slow
    With the auto-tuner on, the first convolution call for every new input shape benchmarks all
    the available algorithms before running. When shapes keep changing, most batches pay for a
    benchmark and the cache never settles: the PyTorch tuning guide asks for the auto-tuner to be
    turned off when input sizes vary a lot. Padding or bucketing inputs to a few fixed shapes
    (then keeping the auto-tuner on) is the other way out.

    ## Example
    ```python
    import torch
    from torch.nn.utils.rnn import pad_sequence

    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv1d(8, 8, 3).cuda()
    for seqs in batches:
        x = pad_sequence(seqs, batch_first=True).transpose(1, 2).cuda()
        conv(x).sum().backward()
    ```

    ## Use instead
    ```python
    torch.backends.cudnn.benchmark = False  # input lengths vary per batch
    ```
    or pad every batch to one of a few fixed lengths and keep the auto-tuner on.

    ## Fix safety
    Display-only: whether the shapes vary enough to matter depends on the data (a few buckets are
    fine), and turning the auto-tuner off changes which convolution algorithms run (outputs change
    by rounding). TOP501 never inserts the switch into such a file.
    """

    code = "TOP504"
    name = "cudnn-benchmark-variable-shapes"
    family = FAMILY
    message = (
        "`cudnn.benchmark = True` with input shapes that vary per batch ({why}): every new shape is "
        "benchmarked again; set it to `False`, or pad inputs to a few fixed shapes"
    )
    safety = Safety.DISPLAY
    prefilter = ("benchmark",)
    examples = (
        Invalid(
            dedent("""\
            import torch
            import torch.nn as nn
            from torch.nn.utils.rnn import pad_sequence

            torch.backends.cudnn.benchmark = True
            conv = nn.Conv1d(8, 8, 3).cuda()
            for seqs in batches:
                x = pad_sequence(seqs, batch_first=True).transpose(1, 2).cuda()
                conv(x).sum().backward()
        """),
            note="variable-length sequences fed to a convolution",
        ),
        Invalid(
            dedent("""\
            import random

            import torch.backends.cudnn as cudnn
            import torch.nn.functional as F
            from torchvision import models

            cudnn.benchmark = True
            net = models.resnet18().cuda()
            for images, labels in loader:
                size = random.choice([224, 256, 288])
                images = F.interpolate(images.cuda(), size=size)
                net(images).sum().backward()
        """),
            note="an aliased import; multi-scale training through a random size",
        ),
        Invalid(
            dedent("""\
            import torch
            from torchvision import transforms
            from torchvision.models import resnet50


            class Trainer:
                def __init__(self):
                    torch.backends.cudnn.benchmark = True
                    self.model = resnet50().cuda()
                    self.augment = transforms.v2.RandomShortestSize([480, 512, 544, 576, 608])
        """),
            note="set in a method; a random-size augmentation",
        ),
        Valid(
            dedent("""\
            import torch
            import torch.nn as nn

            torch.backends.cudnn.benchmark = True
            model = nn.Conv2d(3, 8, 3).cuda()
            for x in loader:
                model(x.cuda()).sum().backward()
        """),
            note="fixed input shapes: the auto-tuner pays off",
        ),
        Valid(
            dedent("""\
            import torch
            import torch.nn as nn
            from torch.nn.utils.rnn import pad_sequence

            torch.backends.cudnn.benchmark = False
            conv = nn.Conv1d(8, 8, 3).cuda()
            for seqs in batches:
                conv(pad_sequence(seqs, batch_first=True).transpose(1, 2).cuda()).sum().backward()
        """),
            note="already off",
        ),
        Valid(
            dedent("""\
            import torch
            from torch.nn.utils.rnn import pad_sequence

            torch.backends.cudnn.benchmark = True
            lstm = torch.nn.LSTM(8, 8).cuda()
            out = lstm(pad_sequence(seqs).cuda())
        """),
            note="no convolution: the auto-tuner only tunes convolutions",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        prog = program(self)
        if not prog.benchmark_on or not prog.convs or not prog.variable_shapes:
            return
        why = prog.variable_shapes[0][1]
        for setting in prog.benchmark_on:
            self.report(setting, fmt={"why": why})
