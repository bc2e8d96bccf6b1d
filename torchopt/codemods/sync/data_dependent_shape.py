"""TOP604 `data-dependent-shape`: Flags operations whose output shape depends on tensor values, inside a training or evaluation."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.names import plainly_assigned
from torchopt.analysis.names import reaching_values
from torchopt.analysis.step_loops import Tensors
from torchopt.analysis.step_loops import dotted
from torchopt.analysis.control import QUIET_GUARDS, control_of
from torchopt.analysis.placement import placements
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.sync import FAMILY
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


_BOOL_FUNCS = {
    "isnan",
    "isinf",
    "isfinite",
    "logical_not",
    "logical_and",
    "logical_or",
    "logical_xor",
    "eq",
    "ne",
    "gt",
    "lt",
    "ge",
    "le",
    "isin",
    "isclose",
    "signbit",
}


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
    differently: class T), so the code around it must be adapted by hand.

    Not reported: code that runs only every few steps (`if step % log_every == 0:`), once (`if i ==
    0:`), after an error (an out-of-memory handler) or under a device check inside the step (see "The
    fact layer" in docs/design.md), and shapes computed from host data (`labels.cpu().unique()`). Code
    that runs at every step on rank 0 only (`if rank == 0:`, `is_main_process()`) is reported: rank 0
    waits at every step and the other ranks wait for it at the next collective.
    """

    code = "TOP604"
    name = "data-dependent-shape"
    family = FAMILY
    message = (
        "`{expr}` has an output shape that depends on tensor values, {where}: the host waits for the "
        "GPU to learn the size; {advice}"
    )
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
            "        loss.backward()\n"
        ),
        Valid(
            "import torch\n\nx = torch.arange(6)\nidx = x.nonzero()\nsel = x[x > 2]\n",
            runnable=True,
            note="not in a training or forward-pass loop",
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        r = y.repeat_interleave(2, output_size=2 * y.numel())\n        model(x[0]).sum().backward()\n"
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.any_hot:
            return
        tz = Tensors(self, hm)
        for n in walk(node, True):
            advice = where = None
            if isinstance(n, cst.Call):
                advice = self._call(n)
            elif isinstance(n, cst.Subscript):
                # Where first: proving a mask and a tensor follows names through the whole file.
                where = hm.where(n)
                advice = self._mask_index(n, tz) if where is not None else None
            if advice is None:
                continue
            where = where or hm.where(n)
            if where is None or control_of(self).not_every_step(n, guards=QUIET_GUARDS) is not None:
                continue
            if self._on_host(n):
                continue  # a shape computed on the host waits for no device
            self.report(n, fmt={"expr": source(self, n), "where": where.text, "advice": advice})

    def _on_host(self, n: cst.CSTNode) -> bool:
        """The tensor whose values decide the shape is on the host (the value facts)."""
        values = placements(self)
        if isinstance(n, cst.Subscript):  # `x[mask]`: the tensor and the mask
            index = n.slice[0].slice
            return isinstance(index, cst.Index) and values.value(n.value).on_host and values.value(index.value).on_host
        if not isinstance(n, cst.Call):
            return False
        if isinstance(n.func, cst.Attribute) and callee(self, n) is None:
            data: cst.BaseExpression | None = n.func.value
        else:
            data = n.args[0].value if n.args and n.args[0].keyword is None and not n.args[0].star else None
        return data is not None and values.value(data).on_host

    def _call(self, c: cst.Call) -> str | None:
        q = callee(self, c)
        meth = c.func.attr.value if isinstance(c.func, cst.Attribute) else None
        if (
            q is None
            and isinstance(c.func, cst.Attribute)
            and (dotted(c.func.value) or "").split(".")[0] in ("np", "numpy")
        ):
            return None
        name = q.rsplit(".", 1)[1] if q and q.startswith("torch.") and q.count(".") == 1 else None
        if name in ("nonzero", "argwhere") or (q is None and meth in ("nonzero", "argwhere")):
            return (
                "use `torch.nonzero_static(t, size=K, fill_value=-1)` with a known bound K, or mask with "
                "`torch.where` instead of gathering indices"
            )
        if name == "where" and len(c.args) == 1:
            return "pass all three arguments (`torch.where(cond, x, y)`) or use `torch.nonzero_static`"
        if name == "masked_select" or (q is None and meth == "masked_select"):
            return "use `torch.where(mask, x, 0)` and reduce, keeping the shape static"
        if name in ("unique", "unique_consecutive") or (q is None and meth in ("unique", "unique_consecutive")):
            return "compute the unique values once outside the step, or use a fixed-size `bincount(minlength=...)`"
        if (
            (name == "repeat_interleave" or (q is None and meth == "repeat_interleave"))
            and keyword(c, "output_size") is None
            and not has_star(c)
        ):
            args = positional(c)
            repeats = args[1] if name and len(args) > 1 else (args[0] if not name and args else None)
            if repeats is not None and isinstance(repeats.value, cst.Integer):
                return None  # an int repeat count needs no sync
            return "pass `output_size=` (the total length) when it is known"
        return None

    def _mask_index(self, s: cst.Subscript, tensors: Tensors) -> str | None:
        if len(s.slice) != 1 or not isinstance(s.slice[0].slice, cst.Index):
            return None
        idx = s.slice[0].slice.value
        if not self._is_mask(idx, tensors):
            return None
        parent = self.get_metadata(ParentProvider, s, None)
        if isinstance(parent, cst.AssignTarget) or (isinstance(parent, cst.AugAssign) and parent.target is s):
            return None  # `x[mask] = v` is an in-place masked fill: no host round trip
        if not tensors.is_tensor(s.value):
            return None
        return "use `torch.where(mask, x, 0)` and reduce (for a mean divide by `mask.sum()`), keeping the shape static"

    def _is_mask(self, e: cst.BaseExpression, tensors: Tensors, depth: int = 0) -> bool:
        if isinstance(e, cst.Comparison):
            return tensors.is_tensor(e)
        if isinstance(e, cst.UnaryOperation) and isinstance(e.operator, cst.BitInvert):
            return self._is_mask(e.expression, tensors, depth)
        if isinstance(e, cst.BinaryOperation) and isinstance(e.operator, (cst.BitAnd, cst.BitOr, cst.BitXor)):
            return self._is_mask(e.left, tensors, depth) and self._is_mask(e.right, tensors, depth)
        if isinstance(e, cst.Call):
            q = callee(self, e)
            if q and q.startswith("torch.") and q.rsplit(".", 1)[1] in _BOOL_FUNCS:
                return True
            if (
                isinstance(e.func, cst.Attribute)
                and e.func.attr.value in _BOOL_FUNCS | {"bool"}
                and tensors.is_tensor(e.func.value)
            ):
                return True
            return False
        if isinstance(e, cst.Name) and depth < 3 and plainly_assigned(self, e):
            values = reaching_values(self, e) or []
            return bool(values) and all(v is not None and self._is_mask(v, tensors, depth + 1) for v in values)
        return False
