"""TOP204 `pure-fp16-model`: Points at a model converted to float16 as a whole — `model.half()`, `model.to(torch.float16)`,."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.names import reaching_values
from torchopt.analysis.names import torch_name
from torchopt.analysis.precision import precision_of
from torchopt.analysis.syntax import source
from torchopt.analysis.values import dtype_of
from torchopt.codemods.amp import FAMILY
from torchopt.codemods.amp import prechecks
from torchopt.codemods.amp.amp_api import _ParamReceivers, _SELF_RETURNING, _dotted, _maybe_fp16, nn_module_class
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class PureFp16Model(Rule):
    """## What it does
    Points at a model converted to float16 as a whole — `model.half()`, `model.to(torch.float16)`,
    `model.to(dtype=torch.half)` — in a file that trains (it builds a `torch.optim` optimizer or
    calls `.backward()` / `torch.autograd.grad`), and advises automatic mixed precision instead.

    Only `nn.Module`s count: a name bound to a `torch.nn` module constructor or to a class of the
    file whose bases resolve to `torch.nn.Module`, or whose `.parameters()` are given to an
    optimizer in the same file. Tensors are never flagged, nor are inference-only files (a pure
    fp16 model is a fine way to serve), nor a program that puts modules of the half model back
    to float32 (`for m in net.modules(): if isinstance(m, BatchNorm): m.float()`): it manages
    each module's precision by hand, deliberately.

    ## Why is this slow
    It is fast but it trains badly, and fixing that by hand costs more than AMP. With fp16
    parameters the optimizer applies its updates in fp16: an update smaller than half a unit in
    the last place of a weight (about 1e-3 relative) is rounded away, so small learning rates
    stop training. Without loss scaling small gradients underflow to zero (fp16 has no values
    below ~6e-8) and large activations overflow to inf. AMP keeps float32 master weights,
    runs the matmuls and convolutions in fp16 (the same tensor-core speed) and scales the loss.

    ## Example
    ```python
    model = Net().cuda().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for x, y in loader:
        loss = loss_fn(model(x.half()), y)
        loss.backward()
        opt.step()
    ```

    ## Use instead
    ```python
    model = Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    ```

    ## Fix safety
    Display-only: the change touches the model, its inputs, the loss and the optimizer step, and
    it changes numerics on purpose (for the better); the message says what to do. On hardware
    with bfloat16, `torch.autocast(..., dtype=torch.bfloat16)` needs no scaler at all.
    """

    code = "TOP204"
    name = "pure-fp16-model"
    family = FAMILY
    message = (
        "`{call}` trains a pure-fp16 model: fp16 weights round small updates away and gradients "
        "underflow without loss scaling; keep the model in float32 and use "
        "`torch.autocast` + `torch.amp.GradScaler`"
    )
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("half", "float16")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and prechecks.pure_fp16_possible(text)

    examples = (
        Invalid(
            "import torch\nimport torch.nn as nn\n\nmodel = nn.Linear(4, 2).half()\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
            after=None,
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\n\n\nclass Net(nn.Module):\n    pass\n\n\n"
            "def train(loader):\n    model = Net()\n    model.to(torch.float16)\n"
            "    for x in loader:\n        model(x).sum().backward()\n",
            after=None,
        ),
        Invalid(
            "import torch\nfrom torch import nn\n\nnet = nn.Sequential(nn.Linear(4, 4), nn.ReLU())\n"
            "net = net.to(dtype=torch.half)\nopt = torch.optim.Adam(net.parameters())\n",
            after=None,
        ),
        Invalid(
            "import torch\n\n\ndef train(model, loader):\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "    model.half()\n    for x in loader:\n        model(x).sum().backward()\n        opt.step()\n",
            after=None,
            note="the receiver of `.parameters()` given to an optimizer is a module",
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\n\nhalf = torch.float16\n"
            "model = nn.Conv2d(3, 8, 3).to('cuda', half)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
            after=None,
        ),
        Valid(
            "import torch\n\nx = torch.randn(4).half()\ny = x.to(torch.float16)\n"
            "opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)\n",
            runnable=True,
            note="tensors",
        ),
        Valid(
            "import torch\nimport torch.nn as nn\n\nmodel = nn.Linear(4, 2).half().eval()\n"
            "with torch.inference_mode():\n    y = model(torch.randn(1, 4).half())\n",
            note="inference only: pure fp16 is fine",
        ),
        Valid(
            "import torch\nimport torch.nn as nn\n\nmodel = nn.Linear(4, 2).to(torch.bfloat16)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
            note="bf16 has fp32's range (a separate question)",
        ),
        Valid(
            "import torch\n\n\ndef train(model, batch):\n    batch = batch.half()\n    model(batch).sum().backward()\n",
            note="`batch` is not known to be a module",
        ),
        Valid(
            "import torch\nimport torch.nn as nn\n\nnet = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)).half()\n"
            "for m in net.modules():\n    if isinstance(m, nn.BatchNorm1d):\n        m.float()\n"
            "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n",
            note="norm layers put back to float32: a precision scheme managed by hand",
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._casts: list[cst.Call] = []
        self._classes: dict[str, list[cst.Arg]] = {}
        self._opt_receivers: set[str] = set()
        self._calls: list[cst.Call] = []
        self._trains = False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.setdefault(node.name.value, []).extend(node.bases)

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Attribute):
            meth = func.attr.value
            if meth == "backward":
                self._trains = True
            elif meth == "half" and not node.args:
                self._casts.append(node)
            elif meth == "to" and not has_star(node) and any(_maybe_fp16(a.value) for a in node.args):
                self._casts.append(node)
        # Only calls that can be an optimizer or `grad` are resolved, and only at the end if a cast
        # was seen at all: name resolution costs a scope analysis of the whole file.
        last = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
        if last == "grad" or last[:1].isupper():
            self._calls.append(node)

    def _resolve_calls(self) -> None:
        for node in self._calls:
            q = callee(self, node)
            if q is None:
                continue
            if q == "torch.autograd.grad":
                self._trains = True
            parts = q.split(".")
            if (
                parts[:2] == ["torch", "optim"]
                and parts[-1][:1].isupper()
                and "lr_scheduler" not in parts
                and "swa_utils" not in parts
            ):
                self._trains = True
                for arg in node.args:
                    self._collect_params(arg.value)

    def _collect_params(self, expr: cst.CSTNode) -> None:
        expr.visit(_ParamReceivers(self._opt_receivers))

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self._casts:
            return
        self._resolve_calls()
        if not self._trains or precision_of(self).restored:
            return  # a restored module: the program manages each module's precision by hand, on purpose
        for call in self._casts:
            if not self._is_fp16_cast(call):
                continue
            recv = cst.ensure_type(call.func, cst.Attribute).value  # (the casts are method calls)
            if self._is_module(recv, set()):
                self.report(call, fmt={"call": source(self, call)})

    def _is_fp16_cast(self, call: cst.Call) -> bool:
        meth = cst.ensure_type(call.func, cst.Attribute).attr.value
        if meth == "half":
            return True
        kw = keyword(call, "dtype")
        cands = [kw.value] if kw is not None else [a.value for a in positional(call)]
        return any(dtype_of(self, c) == "float16" for c in cands)

    def _is_module(self, expr: cst.BaseExpression, seen: set[str], depth: int = 0) -> bool | None:
        """True: surely an nn.Module; False: surely not or unknown; None: no evidence (a cycle)."""
        if depth > 6:
            return False
        while (
            isinstance(expr, cst.Call)
            and isinstance(expr.func, cst.Attribute)
            and expr.func.attr.value in _SELF_RETURNING
        ):
            expr = expr.func.value
        d = _dotted(expr)
        if d is not None and d in self._opt_receivers:
            return True
        if isinstance(expr, cst.Call):
            if nn_module_class(callee(self, expr)):
                return True
            if isinstance(expr.func, cst.Name) and expr.func.value in self._classes:
                return self._user_module(expr.func.value, set())
            return False
        if isinstance(expr, cst.Name):
            if expr.value in seen:
                return None
            values = reaching_values(self, expr)
            if not values:
                return False
            results = [self._is_module(v, seen | {expr.value}, depth + 1) if v is not None else False for v in values]
            return any(r is True for r in results) and all(r is not False for r in results)
        return False

    def _user_module(self, cls: str, seen: set[str]) -> bool:
        if cls in seen:
            return False
        for base in self._classes.get(cls, ()):
            if base.keyword is not None:
                continue
            q = torch_name(self, base.value)
            if q in ("torch.nn.Module", "torch.nn.modules.module.Module") or nn_module_class(q):
                return True
            if isinstance(base.value, cst.Name) and base.value.value in self._classes:
                if self._user_module(base.value.value, seen | {cls}):
                    return True
        return False
