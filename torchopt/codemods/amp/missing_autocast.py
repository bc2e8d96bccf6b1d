"""TOP202 `missing-autocast`: rewrites a float32 training step into automatic mixed precision
(autocast around the forward and the loss, and a GradScaler unless bfloat16 is chosen)."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.program import program_of
from torchopt.analysis.statement_edits import Refusal
from torchopt.codemods.amp import FAMILY
from torchopt.codemods.amp import prechecks
from torchopt.codemods.amp.autocast_insertion import OPTION_DTYPE, _AmpBase, _Analysis
from torchopt.codemods.amp.step_analysis import _loop_sites, analyse_step
from torchopt.codemods.amp.foreign_wrappers import foreign_wrapper_steps
from torchopt.codemods.amp.program_gate import no_float32_step
from torchopt.codemods.amp.step_fixes import apply_fix, fix_hand_update, fix_step
from torchopt.codemods.amp.imported_steps import imported_step_reason, imported_steps
from torchopt.codemods.amp.remote_steps import check_remote_models, plan_remote, remote_sites
from torchopt.codemods.amp.step_placement import inside
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class MissingAutocast(_AmpBase):
    """## What it does
    Rewrites a float32 training step into automatic mixed precision. A step is recognised in the body of a
    `for`/`while` loop, or in a function of the same file that a loop calls: a call of an `nn.Module` instance (a
    name bound to a `torch.nn` constructor or to a class deriving from `torch.nn.Module`, in this file or, as the
    project index shows, in another file of the project, or whose `.parameters()` a `torch.optim` optimizer takes; a
    `torch.nn` module without parameters, such as `nn.CosineSimilarity`, is no model), a loss computed from its
    output, `loss.backward()`, and `optimizer.step()`. A program that never selects an accelerator (run as a script,
    no device named, chosen or loaded from a checkpoint, here or in the project modules it imports) trains on the
    CPU and is left alone with the default float16; with `dtype = "bfloat16"` it is rewritten (CPU autocast). The
    forward and the loss (from the first statement that calls the model to the last statement the loss depends on)
    go under `torch.autocast`; with the default `dtype = "float16"` the same fix adds one `torch.amp.GradScaler`:
    `scaler.scale(loss).backward(...)` (also `scaler.scale(out).backward(grad)` and
    `torch.autograd.backward(scaler.scale(loss))`), `scaler.step(opt)`, one `scaler.update()` after the last step of
    the iteration, `scaler.unscale_(opt)` before the first gradient clipping or gradient read, and the scaler's
    state next to the optimizer's in `torch.save({...})` checkpoints (a dict literal passed directly or bound to a
    name first, `ckpt = {...}; torch.save(ckpt, f)`) and restored after `optimizer.load_state_dict(ckpt[...])`.
    Gradient accumulation (`if (i + 1) % k == 0:` guarding the step) keeps scaling every micro-batch and
    steps/updates under the condition; accumulation written as an inner loop (`for _ in range(k): loss = model(...);
    (loss / k).backward()`, the optimizer stepped after it) gets autocast and the scaled backward inside that loop
    and `unscale_`/`step`/`update` once after it. Several losses (each `backward()` scaled, `retain_graph=` kept),
    several models and optimizers (a GAN) share one scaler and one `update()`. A step whose optimizer is created in
    another function gets its scaler the way it gets the optimizer: created after the optimizer in the caller and
    passed as a new last parameter (`train(args, model, device, loader, optimizer, epoch, scaler)`), or set as
    `self.scaler` next to `self.optimizer` in a trainer class; the step's function then chooses the autocast device
    type and dtype from the device it moves its batches to. A step function that reads the model and optimizer as
    module globals built below it (in `if __name__ == "__main__":` or after argparse) gets its scaler as a module
    global next to the optimizer, when every call of the function runs after that point. An optimizer held by a
    small wrapper class of the file whose own method (`step_and_update_lr()`, `step()`) adds a learning-rate
    schedule and calls `self._optimizer.step()` is stepped inside the wrapper: that method takes the scaler as a new
    last parameter and calls `scaler.step(self._optimizer)`, so the schedule runs as before; every call of the
    method passes the scaler (refused when it is called elsewhere, has default parameters, or gradients are read
    before it). A step imported from another module of the project is not seen in this file; the loop that calls it
    is reported with the file it lives in, unless the project index shows that the function runs no `backward()` (a
    learning-rate setter handed the optimizer) or already names autocast or GradScaler (itself or through a project
    function it calls). A name that autocast assigns and later code reads is upcast with `.float()` only when it is
    known to be a tensor (a name unpacked from a model whose `forward` is not in the file may be a list: refused).
    Names are resolved the way Python resolves them in the step's function (its own `model`/`optimizer` first, then
    the module's), so each training function of a file gets the finding, and its own scaler, that it gets alone.

    A loss computed with `F.binary_cross_entropy` or an `nn.BCELoss` instance (also inside a loss
    function of the file) raises under CUDA autocast, so autocast covers only the forward: the
    statement computing that loss, and what follows it, stay after the `with` block, and the
    forward's outputs they read are upcast with `.float()` first (the float32 inputs the loss
    needs); a model output fed back into the model (`out, hidden = model(x, hidden)`, an RNN
    state that may be a tuple) is not upcast. A step that writes the parameters by hand
    (`for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)`) gets bfloat16 autocast and
    no GradScaler, whichever `dtype` is set: a scaler can only step an optimizer, and bfloat16
    keeps float32's exponent range, so its gradients need no scaling (on CUDA bfloat16 pays off
    on Ampere or newer GPUs; older ones emulate it). A step whose backward goes through `accelerate`'s
    `accelerator.backward(loss)` is not flagged: `Accelerator(mixed_precision=...)` owns it.

    The step is left alone, with a diagnostic saying why, when it takes `optimizer.step(closure)`,
    calls `torch.autograd.grad`, casts the model with `.half()`, steps an optimizer built by a class
    of another library (`Lion(...)`: `GradScaler.step` needs a `torch.optim.Optimizer`, and that class
    is not known to be one), interleaves optimizer or metric
    code with the forward, calls the model and the binary cross-entropy loss in one statement (or
    runs the model again after that loss), or would choose bfloat16 (the `dtype` option, or
    parameters updated by hand) for a model wrapped in `nn.DataParallel`: its replica threads
    enter autocast with the caller's on/off state but CUDA's default dtype, float16, so the default
    float16 rewrite reaches them and a bfloat16 one would not (convert to DDP, TOP401, or decorate
    `forward` with `@torch.autocast(...)`). A step already under autocast or using a scaler is not flagged, nor a
    program trained in half precision by hand, nor an MLP policy (<= 256 features) between `gym` environment steps.
    Option `dtype` (`[tool.torchopt.rules.TOP202]`): `"float16"` (default) or `"bfloat16"`
    (autocast only, no scaler). TOP203 is the same check for autocast that already exists.

    ## Why is this slow
    In float32 every matmul and convolution runs at a fraction of the Tensor Core rate and moves
    twice the bytes. Under autocast those ops run in float16/bfloat16 (typically 2-3x faster on
    recent NVIDIA GPUs) while reductions, losses and the weights stay in float32.

    ## Example
    ```python
    for x, y in loader:
        optimizer.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        optimizer.step()
    ```

    ## Use instead
    ```python
    amp_device_type = torch.device(device).type
    amp_dtype = torch.float16 if amp_device_type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
            out = model(x)
            loss = loss_fn(out, y)
        out = out.float()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    ```

    ## Fix safety
    Unsafe (numerics): matmuls and convolutions in the region compute in float16 (on CUDA) or
    bfloat16 (elsewhere, e.g. on the CPU), so activations, logits and the loss lose precision
    (a 2-layer MLP forward differs from float32 by rel-L2 ~3.7e-4 in float16 and ~3.5e-3 in
    bfloat16) and training follows a slightly different trajectory (max relative loss
    difference over 50 steps 6e-6 fp16 + GradScaler, 4.8e-5 bf16). With float16 the scaler
    may skip the first steps while it calibrates its scale (their gradients overflow), so the
    number of optimizer updates can differ. Tensors assigned in the region and used after it are
    upcast with `.float()` so later float32 code keeps working. `torchopt validate` holds
    the result to its AMP tolerances: model outputs within rtol 1e-2 / atol 1e-3·max|ref| /
    rel-L2 1e-2 (float16) or 5e-2 / 1e-2·max|ref| / 5e-2 (bfloat16); losses within 1 % for the
    first 20 steps and 2 % after. On a CPU the rewritten program runs bfloat16 autocast with the
    scaler disabled; CPU autocast casts other ops than CUDA's (softmax, log_softmax and sum stay
    low precision on CPU), so a CPU validation is not representative of CUDA numerics.
    The inserted code chooses float16 (with an enabled scaler) where the model runs on CUDA and
    bfloat16 (scaler disabled) elsewhere, or bfloat16 on every device for a step that updates its
    parameters by hand; a binary cross-entropy loss keeps computing in float32, on the forward's
    outputs rounded to the autocast dtype. To go back to float32, revert the fix.
    """

    code = "TOP202"
    min_torch = (2, 3)  # `torch.amp.GradScaler(device)`
    # Each step reads only what its scope sees (the keyed view of _Analysis): its function, the functions
    # and classes it names, and module-level statements it is linked with.
    locality = "component"
    name = "missing-autocast"
    family = FAMILY
    message = "training step runs in float32: wrap {region} in `torch.autocast`{extra}"
    refuse_message = "training step not rewritten to mixed precision: {reason}"
    fix_title = "Insert `torch.autocast`{extra}"
    safety = Safety.UNSAFE
    tags = (Tag.NUMERICS,)
    prefilter = ("backward", "optim")  # "optim": a step imported from another module, handed an optimizer

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and prechecks.missing_autocast_possible(text)

    options = (OPTION_DTYPE,)
    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in batches:
                    optimizer.zero_grad()
                    out = model(x)
                    loss = nn.functional.mse_loss(out, y)
                    loss.backward()
                    optimizer.step()
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == 'cuda' else torch.bfloat16
                scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
                for x, y in batches:
                    optimizer.zero_grad()
                    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                        out = model(x)
                        loss = nn.functional.mse_loss(out, y)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
            """),
            unsafe="numerics",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in batches:
                    optimizer.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == 'cuda' else torch.bfloat16
                scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
                for x, y in batches:
                    optimizer.zero_grad()
                    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                        loss = nn.functional.mse_loss(model(x), y)
                    scaler.scale(loss).backward()
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(optimizer)
                    scaler.update()
            """),
            unsafe="numerics",
            note="clipping reads true gradient magnitudes only after unscale_",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in batches:
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    optimizer.step(lambda: loss)
            """),
            after=None,
            note="optimizer.step(closure): refused with a diagnostic",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in batches:
                    optimizer.zero_grad()
                    out = model(x)
                    loss = nn.functional.mse_loss(out, y)
                    torch.autograd.backward(loss)
                    optimizer.step()
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == 'cuda' else torch.bfloat16
                scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
                for x, y in batches:
                    optimizer.zero_grad()
                    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                        out = model(x)
                        loss = nn.functional.mse_loss(out, y)
                    torch.autograd.backward(scaler.scale(loss))
                    scaler.step(optimizer)
                    scaler.update()
            """),
            unsafe="numerics",
            note="torch.autograd.backward(loss) scales its tensors argument",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in batches:
                    optimizer.zero_grad()
                    out = model(x)
                    loss = nn.functional.mse_loss(out, y)
                    loss.backward()
                    optimizer.step()
                    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                    torch.save(ckpt, "ckpt.pt")
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == "cuda" else torch.bfloat16
                scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
                for x, y in batches:
                    optimizer.zero_grad()
                    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                        out = model(x)
                        loss = nn.functional.mse_loss(out, y)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                    ckpt = {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(),
                    }
                    torch.save(ckpt, "ckpt.pt")
            """),
            unsafe="numerics",
            note="a checkpoint dict bound to a name gains the scaler state",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in batches:
                    optimizer.zero_grad()
                    out = model(x)
                    loss = nn.functional.binary_cross_entropy(torch.sigmoid(out), y)
                    loss.backward()
                    optimizer.step()
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == 'cuda' else torch.bfloat16
                scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
                for x, y in batches:
                    optimizer.zero_grad()
                    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                        out = model(x)
                    out = out.float()
                    loss = nn.functional.binary_cross_entropy(torch.sigmoid(out), y)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
            """),
            unsafe="numerics",
            note="binary_cross_entropy raises under CUDA autocast: it runs after the block, on float32 inputs",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                bce = nn.BCELoss()
                for x, y in batches:
                    optimizer.zero_grad()
                    loss = bce(torch.sigmoid(model(x)), y)
                    loss.backward()
                    optimizer.step()
            """),
            after=None,
            note="the forward and the BCE loss in one statement cannot be separated: refused",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                for x, y in batches:
                    model.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(p.grad, alpha=-0.1)
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.bfloat16
                for x, y in batches:
                    model.zero_grad()
                    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                        loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(p.grad, alpha=-0.1)
            """),
            unsafe="numerics",
            note="parameters updated by hand: bfloat16 autocast and no GradScaler (a scaler can only step an optimizer)",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.DataParallel(nn.Linear(4, 2)).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in batches:
                    optimizer.zero_grad()
                    out = model(x)
                    loss = nn.functional.mse_loss(out, y)
                    loss.backward()
                    optimizer.step()
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.DataParallel(nn.Linear(4, 2)).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == 'cuda' else torch.bfloat16
                scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
                for x, y in batches:
                    optimizer.zero_grad()
                    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                        out = model(x)
                        loss = nn.functional.mse_loss(out, y)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
            """),
            unsafe="numerics",
            note="nn.DataParallel's replica threads autocast to CUDA's default float16, the dtype chosen on CUDA",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                scaler = torch.amp.GradScaler('cuda')
                for x, y in batches:
                    with torch.autocast('cuda', dtype=torch.float16):
                        loss = nn.functional.mse_loss(model(x), y)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
            """),
            note="already autocast + GradScaler",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn
                from accelerate import Accelerator

                accelerator = Accelerator(mixed_precision="fp16")
                model = nn.Linear(4, 2)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                model, optimizer = accelerator.prepare(model, optimizer)
                for x, y in batches:
                    optimizer.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
            """),
            note="`accelerator.backward`: the Accelerator's `mixed_precision` owns the step's precision",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == "cuda" else torch.bfloat16
                scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
                for x, y in batches:
                    optimizer.zero_grad()
                    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                        out = model(x)
                        loss = nn.functional.mse_loss(out, y)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
            """),
            note="the rewrite's own output is never flagged again",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn


                def train(epoch):
                    for x, y in batches:
                        optimizer.zero_grad()
                        loss = nn.functional.mse_loss(net(x), y)
                        loss.backward()
                        optimizer.step()


                if __name__ == "__main__":
                    device = 'cuda' if torch.cuda.is_available() else 'cpu'
                    net = nn.Linear(4, 2).to(device)
                    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
                    for epoch in range(2):
                        train(epoch)
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn


                def train(epoch):
                    for x, y in batches:
                        optimizer.zero_grad()
                        with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                            loss = nn.functional.mse_loss(net(x), y)
                        scaler.scale(loss).backward()
                        scaler.step(optimizer)
                        scaler.update()


                if __name__ == "__main__":
                    device = 'cuda' if torch.cuda.is_available() else 'cpu'
                    net = nn.Linear(4, 2).to(device)
                    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
                    amp_device_type = torch.device(device).type
                    amp_dtype = torch.float16 if amp_device_type == 'cuda' else torch.bfloat16
                    scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
                    for epoch in range(2):
                        train(epoch)
            """),
            unsafe="numerics",
            note="module globals built in `__main__` below the step function: every call of `train` runs after them",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn


                class WarmupOptim:
                    def __init__(self, optimizer, warmup):
                        self._optimizer = optimizer
                        self.warmup = warmup
                        self.n_steps = 0

                    def step_and_update_lr(self):
                        self.n_steps += 1
                        for group in self._optimizer.param_groups:
                            group["lr"] = min(1.0, self.n_steps / self.warmup)
                        self._optimizer.step()


                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = WarmupOptim(torch.optim.SGD(model.parameters(), lr=0.0), warmup=10)
                for x, y in batches:
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    optimizer.step_and_update_lr()
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn


                class WarmupOptim:
                    def __init__(self, optimizer, warmup):
                        self._optimizer = optimizer
                        self.warmup = warmup
                        self.n_steps = 0

                    def step_and_update_lr(self, scaler):
                        self.n_steps += 1
                        for group in self._optimizer.param_groups:
                            group["lr"] = min(1.0, self.n_steps / self.warmup)
                        scaler.step(self._optimizer)


                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = WarmupOptim(torch.optim.SGD(model.parameters(), lr=0.0), warmup=10)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == 'cuda' else torch.bfloat16
                scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
                for x, y in batches:
                    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                        loss = nn.functional.mse_loss(model(x), y)
                    scaler.scale(loss).backward()
                    optimizer.step_and_update_lr(scaler)
                    scaler.update()
            """),
            unsafe="numerics",
            note="an optimizer wrapper's own stepping method takes the scaler and steps the inner optimizer through it",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                from models import Discriminator

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = Discriminator().to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in batches:
                    optimizer.zero_grad()
                    scores, feature_maps = model(x)
                    loss = nn.functional.mse_loss(scores, y)
                    loss.backward()
                    optimizer.step()
                    log(feature_maps)
            """),
            after=None,
            note="`feature_maps`, read after the block, may be a list (the model is imported): not upcast, refused",
        ),
        Valid(
            dedent("""\
                import torch

                if __name__ == "__main__":
                    policy = torch.nn.Linear(4, 2)
                    optimizer = torch.optim.Adam(policy.parameters())
                    for epoch in range(50):
                        loss = policy(torch.randn(64, 4)).pow(2).mean()
                        loss.backward()
                        optimizer.step()
            """),
            note="a program that never selects an accelerator: it trains on the CPU, where this step is no float16 step",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn

                def main(loader):
                    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.LazyLinear(10))
                    net = net.half().cuda()
                    opt = torch.optim.SGD(net.parameters(), lr=0.1)
                    for x, y in loader:
                        loss = nn.functional.cross_entropy(net(x), y)
                        loss.backward()
                        opt.step()
            """),
            note="the program trains in half precision by hand (the model is cast unconditionally): no float32 step",
        ),
        Valid(
            dedent("""\
                import gymnasium as gym
                import torch
                import torch.nn as nn

                env = gym.make("CartPole-v1")
                policy = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2)).cuda()
                opt = torch.optim.Adam(policy.parameters())
                obs, _ = env.reset()
                for step in range(1000):
                    logits = policy(torch.tensor(obs, device="cuda"))
                    obs, reward, done, trunc, _ = env.step(logits.argmax().item())
                    loss = -logits.log_softmax(-1).max() * reward
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            """),
            note="a small MLP policy trained between environment steps: the environment dominates, autocast cannot pay",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        if no_float32_step(self):
            return  # a CPU program, half precision by hand, or an environment-bound small policy
        a = _Analysis(self)
        program = program_of(self)
        remote = remote_sites(a, program)
        handled = [site.owner for site, _ in remote]
        for site, step in remote:
            try:
                plan = analyse_step(a, site)
                if plan is None:
                    continue
                check_remote_models(a, program, plan, self.option("dtype") == "bfloat16")
                if plan.manual_update is not None:
                    fix_hand_update(self, a, plan)
                    continue
                scaler = self.option("dtype") != "bfloat16"
                setup = plan_remote(self, a, program, plan, step, scaler)
                apply_fix(self, a, plan, setup.edits, setup.names, setup.item, setup.imports, scaler, None)
            except Refusal as r:
                self.report(r.node or a.module, message=self.refuse_message.format(reason=r.reason))
        for call, func, path, opt in imported_steps(a):
            self.report(
                call,
                message=self.refuse_message.format(reason=imported_step_reason(func, path, opt, self.option("dtype"))),
            )
        reported: list[cst.CSTNode] = []
        for site in _loop_sites(a):
            if any(inside(a, site.owner, owner) for owner in handled):
                continue
            try:
                plan = analyse_step(a, site)
                if plan is None:
                    continue
                fix_step(self, a, plan)
            except Refusal as r:
                reported.append(r.node or a.module)
                self.report(r.node or a.module, message=self.refuse_message.format(reason=r.reason))
        for stmt, reason, fn in foreign_wrapper_steps(self, a):
            if not any(inside(a, n, fn) for n in reported):  # one finding per step
                self.report(stmt, message=self.refuse_message.format(reason=reason))
