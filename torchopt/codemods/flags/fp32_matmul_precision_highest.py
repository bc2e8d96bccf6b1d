"""TOP502 `fp32-matmul-precision-highest`: Flags an entry script that runs float32 matrix multiplies (`nn.Linear`, attention, RNNs,."""

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


class MatmulPrecision(Rule):
    __doc__ = """## What it does
    Flags an entry script that runs float32 matrix multiplies (`nn.Linear`, attention, RNNs,
    `torch.matmul`, `@`, ...) on CUDA at the default `"highest"` precision. The fix inserts
    `torch.set_float32_matmul_precision("high")` once (where: see below).

    It does nothing when the file already sets any TF32 switch
    (`torch.backends.cuda.matmul.allow_tf32`, `torch.backends.cudnn.allow_tf32`, any
    `fp32_precision`, `torch.set_float32_matmul_precision`) or a determinism switch
    (`cudnn.deterministic`, `use_deterministic_algorithms`, `CUBLAS_WORKSPACE_CONFIG`: a program
    that asks for reproducible results does not want reduced precision either), here or in a project
    function it calls (`init_seeds(seed, deterministic=True)`; when a value known only at run time
    decides whether that function sets one, nothing is reported). When the file uses
    precision-sensitive float32 linear algebra (`torch.linalg.*`, `torch.cdist`, `torch.inverse`,
    ...) it reports without a fix, because the switch is global. Existing `allow_tf32`
    assignments are never migrated to `fp32_precision`.

    It does nothing where the switch cannot pay (the facts of `flags/pays.py`): when no loop of
    the program runs a matmul or calls a model (one forward per model, a FLOP counter whose
    forwards run inside `FlopCounterMode` or are handed to `fvcore`'s `FlopCountAnalysis`), and
    the model is never handed to code outside the file; and when every repeated forward and
    matmul runs inside the program's own `torch.autocast` / `torch.cuda.amp.autocast` block
    (written there, or returned by a function of the file or of the project), not turned off by a
    literal `enabled=False`. When the block is a helper whose name says autocast but whose
    definition cannot be read (a library's, or a module outside the run) it reports without a fix.

    ## Why is this slow
    With precision `"highest"` (the default) float32 matmuls run in full IEEE fp32. `"high"` lets
    them use TensorFloat-32 tensor cores on Ampere and later GPUs (or a sum of two bfloat16
    numbers), several times the fp32 throughput (PyTorch tuning guide, "Enable Tensor cores").
    It does not change the output dtype, does not affect convolutions (cuDNN already uses TF32 for
    them by default) and only affects CUDA.
    TF32 affects float32 matmuls only. Under autocast on CUDA, `matmul`, `linear`, `bmm`,
    `addmm`, `baddbmm` and the RNN and attention kernels are on autocast's float16/bfloat16 list:
    their inputs are cast to half precision and they run on the half-precision tensor cores
    whatever the float32 precision setting. What stays float32 under autocast (softmax, norms,
    losses, reductions) holds no matmul, so the switch changes nothing measurable in such a step.

{entry}

    ## Example
    ```python
    import torch

    model = torch.nn.Linear(64, 64).cuda()
    ```

    ## Use instead
    ```python
    import torch
    torch.set_float32_matmul_precision("high")

    model = torch.nn.Linear(64, 64).cuda()
    ```

    ## Fix safety
    Unsafe (tag numerics): TF32 keeps 10 explicit mantissa bits instead of 23, so matmul results
    lose precision on purpose (validator bound: rel-L2 of matmul-heavy outputs ≤ 5e-3). On a
    CPU-only build nothing changes. Inserted exactly once; a second run finds the switch and
    changes nothing. It is offered only where a loop repeats float32 matmuls outside autocast: a
    program whose forwards all run under its own autocast keeps the precision it chose (with
    `enabled=<flag>` turned off, the program asked for float32 and keeps it).
    """.replace("{entry}", _ENTRY_DOC)

    code = "TOP502"
    name = "fp32-matmul-precision-highest"
    family = FAMILY
    message = "float32 matmuls ({what}) run at full IEEE precision; TF32 tensor cores are not used"
    sensitive_message = (
        "float32 matmuls run at full precision, but this file uses precision-sensitive "
        'linear algebra (`{what}`): `torch.set_float32_matmul_precision("high")` is '
        "global and would change it too; enable TF32 only around the model, if at all"
    )
    autocast_message = (
        "float32 matmuls may run at full precision, but whether the step runs under autocast "
        "(where TF32 changes nothing) is unknown: {why}; enable "
        '`torch.set_float32_matmul_precision("high")` only if it does not'
    )
    fix_title = 'Insert `torch.set_float32_matmul_precision("high")` ({where})'
    safety = Safety.UNSAFE
    tags = (Tag.NUMERICS,)
    # The switch only matters on CUDA, and the rule requires the program to use it: named, reached
    # through `torch.accelerator`, or a device index moved to (`.to(gpu_id)`).
    prefilter = ("cuda", "accelerator", ".to(")

    @classmethod
    def could_match(cls, text: str) -> bool:
        # program(): the switch goes into an entry script only.
        return super().could_match(text) and entry_possible(text)

    examples = (
        Invalid(
            dedent("""\
                import torch

                model = torch.nn.Linear(64, 64).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(10):
                    model(torch.randn(8, 64, device="cuda")).pow(2).mean().backward()
                    opt.step()
            """),
            after=dedent("""\
                import torch

                torch.set_float32_matmul_precision("high")

                model = torch.nn.Linear(64, 64).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(10):
                    model(torch.randn(8, 64, device="cuda")).pow(2).mean().backward()
                    opt.step()
            """),
            unsafe="numerics",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn


                def main():
                    device = 'cuda' if torch.cuda.is_available() else 'cpu'
                    w = torch.randn(4, 4, device=device)
                    for _ in range(3):
                        w = torch.tanh(w @ w)
                    print(w.sum())


                main()
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn


                def main():
                    torch.set_float32_matmul_precision('high')
                    device = 'cuda' if torch.cuda.is_available() else 'cpu'
                    w = torch.randn(4, 4, device=device)
                    for _ in range(3):
                        w = torch.tanh(w @ w)
                    print(w.sum())


                main()
            """),
            unsafe="numerics",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import sys
                with open(sys.argv[0]) as f:
                    source = f.read()
                import torch

                model = torch.nn.Linear(64, 64).cuda()
                for _ in range(10):
                    model(torch.randn(8, 64, device="cuda")).sum().backward()
            """),
            after=dedent("""\
                import sys
                with open(sys.argv[0]) as f:
                    source = f.read()
                import torch

                torch.set_float32_matmul_precision("high")

                model = torch.nn.Linear(64, 64).cuda()
                for _ in range(10):
                    model(torch.randn(8, 64, device="cuda")).sum().backward()
            """),
            unsafe="numerics",
            note="code runs before `import torch`: the switch goes after the import that binds `torch`",
        ),
        Invalid(
            dedent("""\
                import torch

                model = torch.nn.Linear(64, 64).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                basis = torch.linalg.qr(torch.randn(4, 4))
                for _ in range(10):
                    model(torch.randn(8, 64, device="cuda")).pow(2).mean().backward()
                    opt.step()
            """),
            note="precision-sensitive linear algebra: reported, not fixed",
        ),
        Valid(
            dedent("""\
                import torch

                model = torch.nn.Linear(64, 64).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for x in torch.randn(10, 8, 64).cuda():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(x).pow(2).mean()
                    loss.backward()
                    opt.step()
            """),
            note="the step runs under the program's own autocast: its matmuls are not float32",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.utils.flop_counter import FlopCounterMode

                if __name__ == "__main__":
                    for width in (64, 128):
                        model = torch.nn.Linear(width, width).cuda()
                        with FlopCounterMode() as counter:
                            model(torch.randn(8, width, device="cuda"))
                        print(width, counter.get_total_flops())
            """),
            note="a FLOP counter: one measured forward per model, no repeated step",
        ),
        Valid(
            dedent("""\
                import torch
                torch.backends.cuda.matmul.allow_tf32 = True

                model = torch.nn.Linear(64, 64).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(10):
                    model(torch.randn(8, 64, device="cuda")).pow(2).mean().backward()
                    opt.step()
            """),
            note="the user already chose",
        ),
        Valid(
            dedent("""\
                import torch
                torch.set_float32_matmul_precision("high")

                model = torch.nn.Linear(64, 64).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(10):
                    model(torch.randn(8, 64, device="cuda")).pow(2).mean().backward()
                    opt.step()
            """),
            note="a second run changes nothing",
        ),
        Valid(
            dedent("""\
                import torch as T
                from torch import set_float32_matmul_precision as precision

                precision("high")
                model = T.nn.Linear(64, 64).cuda()
                for _ in range(10):
                    model(T.randn(8, 64, device="cuda")).sum().backward()
            """),
            note="already set through an alias: recognised by the call, not its spelling",
        ),
        Valid(
            dedent("""\
                import torch
                torch.backends.cudnn.deterministic = True

                model = torch.nn.Linear(64, 64).cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(10):
                    model(torch.randn(8, 64, device="cuda")).pow(2).mean().backward()
                    opt.step()
            """),
            note="reproducibility intent",
        ),
        Valid(
            dedent("""\
                import torch

                layer = torch.nn.Linear(4, 4).cuda()
            """),
            note="not an entry script",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        prog = program(self)
        if not prog.matmuls or not prog.cuda or prog.tf32_set or prog.intent or prog.anchor is None:
            return
        if prog.unknown_intent:  # a project function may ask for reproducible runs: never overridden on a guess
            return
        facts = pays(self, prog)
        if facts.repeats is False or facts.autocast is True:
            return  # no loop runs a matmul, or every one that does runs under the program's autocast
        if facts.autocast is None:
            self.report(prog.matmuls[0], message=self.autocast_message, fmt={"why": facts.autocast_why})
            return
        if prog.sensitive:
            where, what = prog.sensitive[0]
            self.report(where, message=self.sensitive_message, fmt={"what": what})
            return
        ref = torch_ref(self)
        if ref is None:
            return
        anchor = placed_after_binding(self, prog, ref.name)
        if anchor is None:
            return
        line = cst.parse_statement(f'{ref.name}.set_float32_matmul_precision("high")\n')
        self.report(
            prog.matmuls[0],
            fmt={
                "what": prog.built_elsewhere.get(id(prog.matmuls[0])) or source(self, prog.matmuls[0]),
                "where": prog.entry,
            },
            replacement=insertion(anchor, line),
            target=anchor[0],
            tags=[Tag.NUMERICS],
            imports=ref.imports,
            note="float32 matmuls on CUDA use TF32 (10 mantissa bits): rel-L2 of outputs up to ~5e-3",
        )
