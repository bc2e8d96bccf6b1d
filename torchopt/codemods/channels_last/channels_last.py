"""TOP901: convert a CNN and its 4-D input batches to ``torch.channels_last``."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.names import qualified_names, torch_name, torch_ref
from torchopt.analysis.arguments import has_star, keyword, set_kwarg
from torchopt.analysis.syntax import walk
from torchopt.codemods.channels_last import FAMILY
from torchopt.analysis.models import calls_of, find_models
from torchopt.rewrite.rule import Invalid, Rule, Safety, Tag, Valid
from torchopt.rewrite.facts import source_of

_CONV2D = (
    "torch.nn.Conv2d",
    "torch.nn.modules.conv.Conv2d",
    "torch.nn.ConvTranspose2d",
    "torch.nn.modules.conv.ConvTranspose2d",
)
_BLOCKERS = ("is_contiguous(", "jit.trace", "jit.script", "cpp_extension", "load_inline")
_NOTE = (
    "Outputs come back channels_last (not `is_contiguous()`); values agree within rounding (9.5e-7 measured in float32). "
    "`.view` on them fails, so `.view(` in `forward` becomes `.reshape(`. Checkpoints are unaffected: "
    "state_dict values are equal and load into either layout. 3-D inputs cannot be converted "
    "(only `.to(...)`/`.cuda()` batch copies passed straight to the model are)."
)


def _is_cnn(rule: Rule, module: cst.Module, base: cst.Call) -> bool:
    if any(q.startswith("torchvision.models.") for q in qualified_names(rule, base.func)):
        return True
    for node in walk(module, cross_scopes=True):
        if isinstance(node, (cst.Attribute, cst.Name)) and getattr(node, "attr", node).value in (
            "Conv2d",
            "ConvTranspose2d",
        ):
            if torch_name(rule, node) in _CONV2D:
                return True
    return False


def _views_in_forward(rule: Rule, module: cst.Module) -> list[cst.Call]:
    out = []
    for fn in walk(module, cross_scopes=True):
        if not (isinstance(fn, cst.FunctionDef) and fn.name.value == "forward"):
            continue
        for node in walk(fn.body):
            if (
                isinstance(node, cst.Call)
                and isinstance(node.func, cst.Attribute)
                and node.func.attr.value == "view"
                and node.args
                and not has_star(node)
            ):
                dtype_like = any(
                    isinstance(a.value, (cst.SimpleString, cst.ConcatenatedString))
                    or a.keyword is not None
                    or "dtype" in module.code_for_node(a.value)
                    or any(torch_name(rule, n) for n in walk(a.value) if isinstance(n, (cst.Name, cst.Attribute)))
                    for a in node.args
                )
                if not dtype_like:
                    out.append(node)
    return out


class ChannelsLast(Rule):
    """## What it does
    Converts a CNN, its input batches and `forward` views to `torch.channels_last` (opt-in).

    In a script that trains or evaluates a CNN (a model whose file uses `nn.Conv2d`, or a
    `torchvision.models` constructor), converts

    * the model where it is built: `model = Net().to(memory_format=torch.channels_last)`;
    * each batch copied straight into the model: `model(images.to(device))` →
      `model(images.to(device, memory_format=torch.channels_last))` (also `.cuda()`);
    * `.view(...)` in the file's `forward` methods → `.reshape(...)` (a view of a channels_last
      tensor fails; `reshape` returns the same view when one exists and copies otherwise).

    Opt-in: it runs only when selected by its code (`--select TOP901`). Reported without a fix
    when the file checks `is_contiguous()`, traces or scripts the model, or builds C++/CUDA
    extensions (kernels that may expect NCHW-contiguous inputs). 5-D (`Conv3d`) models, which would
    need `torch.channels_last_3d`, are not converted.

    ## Why is this slow
    Tensor Cores and oneDNN run convolutions in NHWC; with NCHW tensors every convolution
    transposes its input and output. channels_last keeps activations in NHWC end to end (tuning
    guide, "Enable channels_last memory format for computer vision models"; best with AMP).

    ## Example
    ```python
    model = ResNet().cuda()
    out = model(images.cuda())
    ```

    ## Use instead
    ```python
    model = ResNet().cuda().to(memory_format=torch.channels_last)
    out = model(images.cuda(memory_format=torch.channels_last))
    ```

    ## Fix safety
    Unsafe (tag tolerance).

    * Convolutions in NHWC accumulate in another order: values agree within 9.5e-7 in fp32, not
      bitwise (measured with torch 2.13 on the CPU); the validator compares with fp32 `assert_close` tolerances (rtol 1e-5 on
      parameters after training steps).
    * Outputs are channels_last: `out.is_contiguous()` is False, `.view(N, -1)` on them raises
      (hence `.reshape`), and `torch.flatten(out, 1)` works. Code elsewhere in the project that
      views conv outputs must use `reshape` too.
    * Only 4-D tensors convert: a 3-D input raises `required rank 4 tensor to use channels_last
      format`; only batch copies passed straight to the model are converted.
    * RNG: unchanged (no random op is added or moved).
    * Checkpoints: unchanged. state_dict values are equal; `load_state_dict` copies into whatever
      layout the model has. DDP: every rank runs the same code, so parameter strides agree.
    """

    code = "TOP901"
    name = "channels-last"
    family = FAMILY
    opt_in = True
    message = "CNN `{name}` runs in NCHW: channels_last (NHWC) convolutions avoid layout transposes"
    fix_title = "Convert the model, its input batches and `.view` calls for channels_last"
    safety = Safety.UNSAFE
    tags = (Tag.TOLERANCE,)
    prefilter = ("Conv2d", "ConvTranspose2d", "torchvision")
    requires = ("torch",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.models import models_possible

        return super().could_match(text) and models_possible(text)  # visit_Module: find_models

    min_torch = (1, 5)
    examples = (
        Invalid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.conv = nn.Conv2d(3, 8, 3, padding=1)
                        self.fc = nn.Linear(8 * 8 * 8, 10)

                    def forward(self, x):
                        x = torch.relu(self.conv(x))
                        return self.fc(x.view(x.size(0), -1))


                torch.manual_seed(0)
                device = "cpu"
                model = Net()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(3):
                    images = torch.randn(4, 3, 8, 8)
                    loss = model(images.to(device)).logsumexp(1).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            """),
            after=dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.conv = nn.Conv2d(3, 8, 3, padding=1)
                        self.fc = nn.Linear(8 * 8 * 8, 10)

                    def forward(self, x):
                        x = torch.relu(self.conv(x))
                        return self.fc(x.reshape(x.size(0), -1))


                torch.manual_seed(0)
                device = "cpu"
                model = Net().to(memory_format=torch.channels_last)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(3):
                    images = torch.randn(4, 3, 8, 8)
                    loss = (
                        model(images.to(device, memory_format=torch.channels_last)).logsumexp(1).mean()
                    )
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            """),
            unsafe="tolerance",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                import torchvision

                model = torchvision.models.resnet18().cuda()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for x in loader:
                    out = model(x.cuda())
            """),
            after=dedent("""\
                import torch
                import torchvision

                model = torchvision.models.resnet18().cuda().to(memory_format=torch.channels_last)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for x in loader:
                    out = model(x.cuda(memory_format=torch.channels_last))
            """),
            unsafe="tolerance",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.conv = nn.Conv2d(3, 8, 3, padding=1)
                        self.fc = nn.Linear(8 * 8 * 8, 10)

                    def forward(self, x):
                        x = torch.relu(self.conv(x))
                        return self.fc(x.view(x.size(0), -1))


                torch.manual_seed(0)
                device = "cpu"
                model = Net()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(3):
                    images = torch.randn(4, 3, 8, 8)
                    loss = model(images.to(device)).logsumexp(1).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                assert images.is_contiguous()
            """),
            note="an is_contiguous() check: display-only",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.conv = nn.Conv2d(3, 8, 3, padding=1)
                        self.fc = nn.Linear(8 * 8 * 8, 10)

                    def forward(self, x):
                        x = torch.relu(self.conv(x))
                        return self.fc(x.reshape(x.size(0), -1))


                torch.manual_seed(0)
                device = "cpu"
                model = Net().to(memory_format=torch.channels_last)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(3):
                    images = torch.randn(4, 3, 8, 8)
                    loss = model(images.to(device, memory_format=torch.channels_last)).logsumexp(1).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            """),
            note="already converted",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.conv = nn.Linear(3, 8)
                        self.fc = nn.Linear(8 * 8 * 8, 10)

                    def forward(self, x):
                        x = torch.relu(self.conv(x))
                        return self.fc(x.view(x.size(0), -1))


                torch.manual_seed(0)
                device = "cpu"
                model = Net()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(3):
                    images = torch.randn(4, 3, 8, 8)
                    loss = model(images.to(device)).logsumexp(1).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            """),
            note="no convolution",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        models = [m for m in find_models(self, node) if _is_cnn(self, node, m.base)]
        if not models:
            return
        ref = torch_ref(self)
        if ref is None:
            return
        cl = ref.attr("channels_last")
        blocked = next((b for b in _BLOCKERS if b in source_of(node)), None)
        converted = False
        for m in models:
            first = m.assigns[0]
            value = cst.ensure_type(first.body[0], cst.Assign).value  # (a model is built by an assignment)
            if "channels_last" in node.code_for_node(value):
                converted = blocked is None  # converted already: views left in `forward` still fail
                continue
            fmt = {"name": m.name}
            if blocked is not None:
                self.report(
                    first,
                    fmt=fmt,
                    message=self.message.format(**fmt)
                    + (
                        f"; not rewritten: the file uses `{blocked.rstrip('(')}`, which may expect NCHW-contiguous "
                        "tensors (convert by hand, adding `.contiguous()` where they need it)"
                    ),
                )
                continue
            new = cst.Call(
                func=cst.Attribute(value=value, attr=cst.Name("to")),
                args=[
                    cst.Arg(
                        keyword=cst.Name("memory_format"),
                        value=cl,
                        equal=cst.AssignEqual(
                            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
                        ),
                    )
                ],
            )
            self.report(first, fmt=fmt, target=value, replacement=new, imports=ref.imports, note=_NOTE)
            for call in calls_of(node, m.name):
                if not call.args or call.args[0].keyword is not None or call.args[0].star:
                    continue
                arg = call.args[0].value
                if not (
                    isinstance(arg, cst.Call)
                    and isinstance(arg.func, cst.Attribute)
                    and arg.func.attr.value in ("to", "cuda")
                    and not has_star(arg)
                    and keyword(arg, "memory_format") is None
                ):
                    continue
                self.report(
                    arg,
                    fmt=fmt,
                    message="input batch of CNN `{name}`: copy it as channels_last",
                    replacement=set_kwarg(arg, "memory_format", cl),
                    imports=ref.imports,
                    note=_NOTE,
                )
            converted = True
        if converted:
            for view in _views_in_forward(self, node):
                attr = view.func
                assert isinstance(attr, cst.Attribute)
                self.report(
                    attr.attr,
                    message="`.view` of a channels_last activation fails: use `.reshape`",
                    replacement=cst.Name("reshape"),
                    note=_NOTE,
                )
