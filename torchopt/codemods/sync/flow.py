"""Synchronising operations other than host reads (rules.md SYNC-004 ... SYNC-009): data-dependent
shapes, Python control flow on tensor values, explicit synchronisation, gradient-norm checks,
GradScaler's inf check, and synchronous batch copies. All display-only, with the sync-free
alternative in the message."""
from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.values import classify_device
from torchopt.analysis.arguments import has_star, keyword, positional
from torchopt.analysis.syntax import source, walk
from torchopt.codemods.sync import FAMILY
from torchopt.analysis.step_loops import Tensors, calls_in, dotted, hot_map
from torchopt.codemods.sync.reads import grad_norm_names, host_read
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid

_BOOL_FUNCS = {"isnan", "isinf", "isfinite", "logical_not", "logical_and", "logical_or", "logical_xor", "eq", "ne",
               "gt", "lt", "ge", "le", "isin", "isclose", "signbit"}


# --------------------------------------------------------------------------- TOP604


class DataDependentShape(Rule):
    """## What it does
    Flags operations whose output shape depends on tensor values, inside a training or evaluation
    step: `t.nonzero()`, `torch.nonzero(t)`, `torch.argwhere(t)`, one-argument `torch.where(cond)`,
    boolean-mask indexing `x[mask]` (the mask being a comparison or a boolean torch function),
    `masked_select`, `torch.unique`, and `repeat_interleave` without `output_size`.

    ## Why is this slow
    To allocate the output, the host must know how many elements it has, so it copies a count back
    from the device and waits for it: a synchronisation hidden inside an innocent-looking line.

    ## Example
    ```python
    for x, y in loader:
        out = model(x)
        valid = y != -100
        loss = (out[valid] - y[valid]).pow(2).sum()
    ```

    ## Use instead
    ```python
    for x, y in loader:
        out = model(x)
        valid = y != -100
        loss = torch.where(valid, (out - y).pow(2), 0).sum()
    ```
    Other sync-free forms: `torch.nonzero_static(t, size=K, fill_value=-1)` when an upper bound
    `K` is known, `repeat_interleave(r, output_size=N)`.

    ## Fix safety
    Display-only: every alternative changes a shape (`nonzero_static` pads with the fill value) or
    the order of a summation (`torch.where(mask, x, 0).sum()` adds zeros, which can round
    differently: class T), so the code around it must be adapted by hand (rules.md SYNC-004).
    """

    code = "TOP604"
    name = "data-dependent-shape"
    family = FAMILY
    message = ("`{expr}` has an output shape that depends on tensor values, {where}: the host waits for the "
               "GPU to learn the size; {advice}")
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("nonzero", "where", "[", "masked_select", "unique", "repeat_interleave", "argwhere")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_dynamic_shape
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_dynamic_shape).
        return super().could_match(text) and hot_check(text, may_dynamic_shape)

    examples = (
        Invalid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        out = model(x)\n        valid = y != -100\n"
            "        loss = (out[valid] - y[valid]).pow(2).sum()\n        loss.backward()\n",
            after=None,
        ),
        Invalid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        idx = torch.nonzero(y)\n        loss = model(x[idx]).sum()\n        loss.backward()\n",
            after=None,
        ),
        Invalid(
            "import torch\n\ndef evaluate(model, loader):\n    for x, y in loader:\n"
            "        pos = torch.where(model(x) > 0)\n",
            after=None,
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        out = model(x)\n        loss = torch.where(y != -100, (out - y).pow(2), 0).sum()\n"
            "        loss.backward()\n",
        ),
        Valid(
            "import torch\n\nx = torch.arange(6)\nidx = x.nonzero()\nsel = x[x > 2]\n", runnable=True,
            note="not in a training or forward-pass loop",
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        r = y.repeat_interleave(2, output_size=2 * y.numel())\n        model(x[0]).sum().backward()\n",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.step_loops:
            return
        tz = Tensors(self, hm)
        for n in walk(node, True):
            advice = None
            if isinstance(n, cst.Call):
                advice = self._call(n)
            elif isinstance(n, cst.Subscript):
                advice = self._mask_index(n, tz)
            if advice is None:
                continue
            where = hm.where(n)
            if where is not None:
                self.report(n, fmt={"expr": source(self, n), "where": where.text, "advice": advice})

    def _call(self, c: cst.Call) -> str | None:
        q = callee(self, c)
        meth = c.func.attr.value if isinstance(c.func, cst.Attribute) else None
        if q is None and meth is not None and (dotted(c.func.value) or "").split(".")[0] in ("np", "numpy"):
            return None
        name = q.rsplit(".", 1)[1] if q and q.startswith("torch.") and q.count(".") == 1 else None
        if name in ("nonzero", "argwhere") or (q is None and meth in ("nonzero", "argwhere")):
            return ("use `torch.nonzero_static(t, size=K, fill_value=-1)` with a known bound K, or mask with "
                    "`torch.where` instead of gathering indices")
        if name == "where" and len(c.args) == 1:
            return "pass all three arguments (`torch.where(cond, x, y)`) or use `torch.nonzero_static`"
        if name == "masked_select" or (q is None and meth == "masked_select"):
            return "use `torch.where(mask, x, 0)` and reduce, keeping the shape static"
        if name in ("unique", "unique_consecutive") or (q is None and meth in ("unique", "unique_consecutive")):
            return "compute the unique values once outside the step, or use a fixed-size `bincount(minlength=...)`"
        if (name == "repeat_interleave" or (q is None and meth == "repeat_interleave")) \
                and keyword(c, "output_size") is None and not has_star(c):
            args = positional(c)
            repeats = args[1] if name and len(args) > 1 else (args[0] if not name and args else None)
            if repeats is not None and isinstance(repeats.value, cst.Integer):
                return None  # an int repeat count needs no sync
            return "pass `output_size=` (the total length) when it is known"
        return None

    def _mask_index(self, s: cst.Subscript, tz: Tensors) -> str | None:
        if len(s.slice) != 1 or not isinstance(s.slice[0].slice, cst.Index):
            return None
        idx = s.slice[0].slice.value
        if not self._is_mask(idx, tz):
            return None
        parent = self.get_metadata(ParentProvider, s, None)
        if isinstance(parent, cst.AssignTarget) or (isinstance(parent, cst.AugAssign) and parent.target is s):
            return None  # `x[mask] = v` is an in-place masked fill: no host round trip
        if not tz.is_tensor(s.value):
            return None
        return ("use `torch.where(mask, x, 0)` and reduce (for a mean divide by `mask.sum()`), keeping the shape "
                "static")

    def _is_mask(self, e: cst.BaseExpression, tz: Tensors, depth: int = 0) -> bool:
        if isinstance(e, cst.Comparison):
            return tz.is_tensor(e)
        if isinstance(e, cst.UnaryOperation) and isinstance(e.operator, cst.BitInvert):
            return self._is_mask(e.expression, tz, depth)
        if isinstance(e, cst.BinaryOperation) and isinstance(e.operator, (cst.BitAnd, cst.BitOr, cst.BitXor)):
            return self._is_mask(e.left, tz, depth) and self._is_mask(e.right, tz, depth)
        if isinstance(e, cst.Call):
            q = callee(self, e)
            if q and q.startswith("torch.") and q.rsplit(".", 1)[1] in _BOOL_FUNCS:
                return True
            if isinstance(e.func, cst.Attribute) and e.func.attr.value in _BOOL_FUNCS | {"bool"} \
                    and tz.is_tensor(e.func.value):
                return True
            return False
        if isinstance(e, cst.Name) and depth < 3:
            from torchopt.analysis.names import reaching_values

            values = reaching_values(self, e)
            return bool(values) and all(v is not None and self._is_mask(v, tz, depth + 1) for v in values)
        return False


# --------------------------------------------------------------------------- TOP605


class TensorControlFlow(Rule):
    """## What it does
    Flags Python control flow on tensor values inside a training or evaluation step, including in a
    loss function or module of the same file that the loop calls: `if (t != 0).all():`,
    `while loss > thr:`, `assert torch.isfinite(x).all()`, `a if t.sum() > 0 else b`.

    ## Why is this slow
    Python must know the truth value now, so `Tensor.__bool__` copies the value to the host and
    waits for every queued kernel: the GPU drains its queue at every branch. In a loss function
    that branches per batch, this happens on every step.

    ## Example
    ```python
    def robust_loss(pred, target):
        err = (pred - target).abs()
        if err.max() > 1.0:
            return (err ** 2).mean()
        return err.mean()
    ```

    ## Use instead
    ```python
    def robust_loss(pred, target):
        err = (pred - target).abs()
        return torch.where(err.max() > 1.0, (err ** 2).mean(), err.mean())
    ```
    For checks, use `torch._assert_async(cond)` or check every N steps; `torch.cond` exists for
    data-dependent branches under `torch.compile`.

    ## Fix safety
    Display-only: `torch.where` evaluates both branches (which may fail or cost more, and changes
    the autograd graph), and an asynchronous assert reports the failure later. The user must decide.
    """

    code = "TOP605"
    name = "tensor-control-flow"
    family = FAMILY
    message = ("`{expr}` branches on a tensor value {where}: `bool()` of a tensor copies it to the host and waits "
               "for the GPU; {advice}")
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("if ", "while ", "assert ")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_tensor_branch
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_tensor_branch).
        return super().could_match(text) and hot_check(text, may_tensor_branch)

    examples = (
        Invalid(
            "import torch\n\ndef robust_loss(pred, target):\n    err = (pred - target).abs()\n"
            "    if err.max() > 1.0:\n        return (err ** 2).mean()\n    return err.mean()\n\n"
            "def train(model, loader, opt):\n    for x, y in loader:\n"
            "        loss = robust_loss(model(x), y)\n        loss.backward()\n",
            after=None,
            note="in a loss function the loop calls",
        ),
        Invalid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        out = model(x)\n        assert torch.isfinite(out).all()\n        out.sum().backward()\n",
            after=None,
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt, step):\n    for x, y in loader:\n"
            "        loss = model(x).sum()\n        if step % 10 == 0:\n            print(step)\n        loss.backward()\n",
        ),
        Valid(
            "import torch\n\nx = torch.ones(3)\nif (x > 0).all():\n    y = x * 2\n", runnable=True,
            note="not in a step",
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        loss = model(x).sum()\n        if loss.item() > 10:\n            continue\n        loss.backward()\n",
            note="the `.item()` is TOP601's finding",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.step_loops:
            return
        tz = Tensors(self, hm)
        for n in walk(node, True):
            test = None
            if isinstance(n, (cst.If, cst.While, cst.IfExp)):
                test = n.test
            elif isinstance(n, cst.Assert):
                test = n.test
            if test is None or not self._tensor_truth(test, tz):
                continue
            where = hm.where(n)
            if where is None:
                continue
            if isinstance(n, cst.Assert):
                advice = "use `torch._assert_async(cond)` or check every N steps, outside the step"
            elif isinstance(n, cst.IfExp):
                advice = "select on the device with `torch.where(cond, a, b)`"
            else:
                advice = ("select on the device with `torch.where`, or check every N steps; `torch.cond` handles "
                          "data-dependent branches under torch.compile")
            self.report(test, fmt={"expr": source(self, test), "where": where.text, "advice": advice})

    def _tensor_truth(self, e: cst.BaseExpression, tz: Tensors) -> bool:
        if isinstance(e, cst.BooleanOperation):
            return self._tensor_truth(e.left, tz) or self._tensor_truth(e.right, tz)
        if isinstance(e, cst.UnaryOperation) and isinstance(e.operator, cst.Not):
            return self._tensor_truth(e.expression, tz)
        return tz.is_tensor(e)


# --------------------------------------------------------------------------- TOP606


_SYNC_CALLS = {"torch.cuda.synchronize": "synchronises the host with the GPU",
               "torch.cuda.empty_cache": "synchronises and returns cached memory to the driver, which the next "
                                         "step must allocate again",
               "torch.accelerator.synchronize": "synchronises the host with the device",
               "torch.mps.synchronize": "synchronises the host with the device",
               "torch.xpu.synchronize": "synchronises the host with the device",
               "torch.mps.empty_cache": "returns cached memory, which the next step must allocate again",
               "torch.xpu.empty_cache": "returns cached memory, which the next step must allocate again"}


class ExplicitSyncInLoop(Rule):
    """## What it does
    Flags `torch.cuda.synchronize()` and `torch.cuda.empty_cache()` (and the `torch.accelerator`,
    `mps` and `xpu` equivalents) inside a training or evaluation step.

    ## Why is this slow
    `synchronize()` blocks the host until the GPU has finished everything queued: the queue runs dry
    every step. `empty_cache()` also synchronises, and hands the allocator's cached blocks back to
    the driver, so the next step pays for `cudaMalloc` again.

    ## Example
    ```python
    for x, y in loader:
        loss = model(x).sum()
        loss.backward()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    ```

    ## Use instead
    ```python
    for x, y in loader:
        loss = model(x).sum()
        loss.backward()
    # time with torch.cuda.Event(enable_timing=True) pairs and synchronise once when reporting
    ```

    ## Fix safety
    Display-only: both calls are legitimate in timing and memory-measurement code.
    """

    code = "TOP606"
    name = "explicit-sync-in-loop"
    family = FAMILY
    message = ("`{expr}` {why} {where}; remove it from the step (time with `torch.cuda.Event(enable_timing=True)` "
               "and synchronise once when reporting)")
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("synchronize", "empty_cache")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_torch_call
        from torchopt.analysis.precheck.step_loops import hot_check

        # A call that may resolve to one of _SYNC_CALLS in a step (a superset of HotMap.where).
        return super().could_match(text) and hot_check(text, lambda h: may_torch_call(h, set(_SYNC_CALLS)))

    examples = (
        Invalid(
            "import torch\n\ndef train(model, loader):\n    for x, y in loader:\n"
            "        model(x).sum().backward()\n        torch.cuda.synchronize()\n",
            after=None,
        ),
        Invalid(
            "from torch.cuda import empty_cache\n\ndef train(model, loader):\n    for x, y in loader:\n"
            "        model(x).sum().backward()\n        empty_cache()\n",
            after=None,
        ),
        Valid(
            "import torch\n\ndef train(model, loader):\n    for x, y in loader:\n        model(x).sum().backward()\n"
            "    torch.cuda.synchronize()\n",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.step_loops:
            return
        for n in walk(node, True):
            if isinstance(n, cst.Call):
                q = callee(self, n)
                if q in _SYNC_CALLS:
                    where = hm.where(n)
                    if where is not None:
                        self.report(n, fmt={"expr": source(self, n), "where": where.text, "why": _SYNC_CALLS[q]})


# --------------------------------------------------------------------------- TOP607


class GradNormSync(Rule):
    """## What it does
    Flags, inside a training step, `clip_grad_norm_(..., error_if_nonfinite=True)` and host reads of
    the norm it returns (`norm.item()`, `float(norm)`, printing it) every step.

    ## Why is this slow
    `error_if_nonfinite=True` checks the total norm on the host: a synchronisation per step. Reading
    the returned norm for logging does the same.

    ## Example
    ```python
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        history.append(norm.item())
        optimizer.step()
    ```

    ## Use instead
    ```python
    for step, (x, y) in enumerate(loader):
        loss = criterion(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(norm)  # stays on the device
        optimizer.step()
    history = torch.stack(norms).tolist()  # one read after the loop
    ```

    ## Fix safety
    Display-only: dropping `error_if_nonfinite` removes the exception the program relies on.
    """

    code = "TOP607"
    name = "grad-norm-sync"
    family = FAMILY
    message = "`{expr}` {why} {where}; {advice}"
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("clip_grad_norm", "get_total_norm")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_grad_norm_read
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_grad_norm_read).
        return super().could_match(text) and hot_check(text, may_grad_norm_read)

    examples = (
        Invalid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        model(x).sum().backward()\n"
            "        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "        print(norm.item())\n        opt.step()\n",
            after=None,
        ),
        Invalid(
            "from torch.nn.utils import clip_grad_norm_\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        model(x).sum().backward()\n"
            "        clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)\n        opt.step()\n",
            after=None,
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        model(x).sum().backward()\n"
            "        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n        opt.step()\n",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.step_loops:
            return
        tz = Tensors(self, hm)
        norms = grad_norm_names(hm)
        for n in walk(node, True):
            if not isinstance(n, cst.Call):
                continue
            where = hm.where(n)
            if where is None:
                continue
            d = dotted(n.func) or ""
            if d.rsplit(".", 1)[-1] in ("clip_grad_norm_", "clip_grad_norm"):
                kw = keyword(n, "error_if_nonfinite")
                if kw is not None and not (isinstance(kw.value, cst.Name) and kw.value.value == "False"):
                    self.report(n, fmt={"expr": source(self, n), "where": where.text,
                                        "why": "checks the total norm on the host (error_if_nonfinite)",
                                        "advice": "check `torch.isfinite(norm)` every N steps instead"})
                continue
            if isinstance(n.func, cst.Attribute) and dotted(n.func.value) in norms and host_read(hm, tz, n):
                self.report(n, fmt={"expr": source(self, n), "where": where.text,
                                    "why": "reads the gradient norm on the host",
                                    "advice": "keep the norms on the device (`norms.append(norm)`) and read them "
                                              "every N steps or after the loop"})
            elif isinstance(n.func, cst.Name) and n.func.value in ("float", "print") and any(
                    dotted(a.value) in norms for a in n.args):
                self.report(n, fmt={"expr": source(self, n), "where": where.text,
                                    "why": "reads the gradient norm on the host",
                                    "advice": "keep the norms on the device and read them every N steps"})


# --------------------------------------------------------------------------- TOP608


_SCALERS = {"torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.amp.grad_scaler.GradScaler",
            "torch.cpu.amp.GradScaler"}
_FUSABLE = {"Adam", "AdamW", "SGD", "Adagrad"}


class GradScalerSync(Rule):
    """## What it does
    Flags, inside a training step, `scaler.step(optimizer)` for an optimizer of this file that is
    not `fused=True`, and `scaler.get_scale()`.

    ## Why is this slow
    `GradScaler.step` reads `found_inf` with `.item()` to decide whether to skip the update (a
    synchronisation every step) unless the optimizer handles the scale itself, which the fused
    Adam/AdamW/SGD/Adagrad kernels do on the device. `get_scale()` reads the scale on the host.

    ## Example
    ```python
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in loader:
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    ```

    ## Use instead
    ```python
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ```

    ## Fix safety
    Display-only here: a fused optimizer is a different kernel whose results are not guaranteed to
    be bitwise identical (class T, [GPU-unverified]).
    """

    code = "TOP608"
    name = "grad-scaler-sync"
    family = FAMILY
    message = "`{expr}` {why} {where}; {advice}"
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("GradScaler",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_scaler_sync
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_scaler_sync).
        return super().could_match(text) and hot_check(text, may_scaler_sync)

    examples = (
        Invalid(
            "import torch\n\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.AdamW(model.parameters())\n"
            "scaler = torch.amp.GradScaler('cuda')\n\ndef train(loader):\n    for x, y in loader:\n"
            "        scaler.scale(model(x).sum()).backward()\n        scaler.step(opt)\n        scaler.update()\n",
            after=None,
        ),
        Invalid(
            "import torch\n\nmodel = torch.nn.Linear(2, 1)\nscaler = torch.amp.GradScaler('cuda')\n\n"
            "def train(loader, opt):\n    for x, y in loader:\n"
            "        scaler.scale(model(x).sum()).backward()\n        print(scaler.get_scale())\n",
            after=None,
        ),
        Valid(
            "import torch\n\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.AdamW(model.parameters(), fused=True)\n"
            "scaler = torch.amp.GradScaler('cuda')\n\ndef train(loader):\n    for x, y in loader:\n"
            "        scaler.scale(model(x).sum()).backward()\n        scaler.step(opt)\n        scaler.update()\n",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.step_loops:
            return
        scalers: set[str] = set()
        optims: dict[str, tuple[str, cst.Call]] = {}
        for n in walk(node, True):
            if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.value, cst.Call):
                d = dotted(n.targets[0].target)
                q = callee(self, n.value)
                if d and q in _SCALERS:
                    scalers.add(d)
                elif d and q and q.startswith("torch.optim.") and q.rsplit(".", 1)[1] in _FUSABLE:
                    optims[d] = (q.rsplit(".", 1)[1], n.value)
        if not scalers:
            return
        for n in walk(node, True):
            if not isinstance(n, cst.Call) or not isinstance(n.func, cst.Attribute):
                continue
            if dotted(n.func.value) not in scalers:
                continue
            meth = n.func.attr.value
            where = hm.where(n)
            if where is None:
                continue
            if meth == "get_scale":
                self.report(n, fmt={"expr": source(self, n), "where": where.text,
                                    "why": "reads the loss scale on the host",
                                    "advice": "read it every N steps, outside the step"})
            elif meth == "step" and n.args and not n.args[0].star:
                opt = dotted(n.args[0].value)
                if opt in optims:
                    cls, ctor = optims[opt]
                    fused = keyword(ctor, "fused")
                    if fused is not None or has_star(ctor):
                        continue
                    self.report(n, fmt={"expr": source(self, n), "where": where.text,
                                        "why": "reads `found_inf` with `.item()` to decide whether to step",
                                        "advice": f"create the optimizer with `{cls}(..., fused=True)`, which "
                                                  "checks for infs on the device (a different kernel: not "
                                                  "guaranteed bitwise identical)"})


# --------------------------------------------------------------------------- TOP609


class PageableBatchCopy(Rule):
    """## What it does
    Flags, inside a training or evaluation step, a synchronous host→device copy (`x.cuda()`,
    `x.to(device)` without `non_blocking=True`) of a batch the loop iterates over, when the batches
    do not come from a `DataLoader` built in the same file (then TOP104 fixes both the loader and
    the copy).

    ## Why is this slow
    A copy from pageable host memory is staged through a pinned buffer and blocks the host until it
    completes, so the next kernels are queued late (rules.md DEV-004).

    ## Example
    ```python
    def train(model, loader, device):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
    ```

    ## Use instead
    ```python
    # loader = DataLoader(..., pin_memory=True)
    def train(model, loader, device):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    ```

    ## Fix safety
    Display-only: without seeing the loader, torchopt cannot pin its batches.
    """

    code = "TOP609"
    name = "pageable-batch-copy"
    family = FAMILY
    message = ("`{expr}` copies a batch to the device synchronously {where}; pin the loader's batches "
               "(`DataLoader(..., pin_memory=True)`) and copy with `non_blocking=True`")
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = (".cuda(", ".to(")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_pageable_copy
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_pageable_copy).
        return super().could_match(text) and hot_check(text, may_pageable_copy)

    examples = (
        Invalid(
            "import torch\n\ndef train(model, loader, opt, device):\n    for x, y in loader:\n"
            "        x, y = x.to(device), y.to(device)\n        model(x).sum().backward()\n",
            after=None,
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt, device):\n    for x, y in loader:\n"
            "        x = x.to(device, non_blocking=True)\n        model(x).sum().backward()\n",
        ),
        Valid(
            "import torch\nfrom torch.utils.data import DataLoader\n\nloader = DataLoader(ds)\n"
            "def train(model, opt, device):\n    for x, y in loader:\n"
            "        x = x.to(device)\n        model(x).sum().backward()\n",
            note="the loader is built in this file: TOP104's finding",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.step_loops:
            return
        loaders = self._file_loaders(node)
        for loop in hm.step_loops.values():
            if not isinstance(loop.node, cst.For):
                continue
            it, target = loop.node.iter, loop.node.target
            for _ in range(3):
                if isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.args and \
                        it.func.value in ("enumerate", "tqdm", "iter"):
                    if it.func.value == "enumerate" and isinstance(target, cst.Tuple) and len(target.elements) == 2:
                        target = target.elements[1].value
                    it = it.args[0].value
            if dotted(it) in loaders:
                continue
            names = {n.value for n in walk(target) if isinstance(n, cst.Name)}
            for c in calls_in(loop.node.body):
                if not isinstance(c.func, cst.Attribute) or has_star(c):
                    continue
                if not isinstance(c.func.value, cst.Name) or c.func.value.value not in names:
                    continue
                if keyword(c, "non_blocking") is not None:
                    continue
                meth = c.func.attr.value
                if meth == "cuda" and not c.args:
                    pass
                elif meth == "to" and positional(c) and len(c.args) == 1:
                    dev = classify_device(self, positional(c)[0].value)
                    if not dev.is_device or dev.is_cpu or dev.text == "meta":
                        continue
                else:
                    continue
                self.report(c, fmt={"expr": source(self, c), "where": f"in {loop.text}"})

    def _file_loaders(self, node: cst.Module) -> set[str]:
        out = set()
        for n in walk(node, True):
            if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.value, cst.Call):
                q = callee(self, n.value) or ""
                if q.endswith("DataLoader"):
                    d = dotted(n.targets[0].target)
                    if d:
                        out.add(d)
        return out
