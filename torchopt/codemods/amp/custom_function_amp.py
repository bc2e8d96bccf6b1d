"""TOP207 `custom-function-amp`: Points at the `forward` / `backward` of a custom `torch.autograd.Function` that lack."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.analysis.names import torch_name
from torchopt.codemods.amp import FAMILY
from torchopt.codemods.amp import prechecks
from torchopt.codemods.amp.amp_api import AUTOCAST_NAMES, _AmpUses, _FUNCTION_BASES, _WithCalls
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


_CUSTOM_FWD = frozenset(
    {
        "torch.amp.custom_fwd",
        "torch.amp.autocast_mode.custom_fwd",
        "torch.cuda.amp.custom_fwd",
        "torch.cuda.amp.autocast_mode.custom_fwd",
    }
)


_CUSTOM_BWD = frozenset(
    {
        "torch.amp.custom_bwd",
        "torch.amp.autocast_mode.custom_bwd",
        "torch.cuda.amp.custom_bwd",
        "torch.cuda.amp.autocast_mode.custom_bwd",
    }
)


class CustomFunctionAmp(_AmpUses):
    """## What it does
    Points at the `forward` / `backward` of a custom `torch.autograd.Function` that lack
    `@torch.amp.custom_fwd(device_type=...)` / `@torch.amp.custom_bwd(device_type=...)`, in a file
    that uses `autocast`.

    ## Why is this slow
    Under autocast, a custom Function's `forward` receives tensors in whatever dtype autocast
    produced (fp16 for some, fp32 for others) and its own operations are autocast too, while its
    `backward` runs later, outside the autocast region, so it recomputes in other dtypes than the
    forward used. The results are dtype mismatch errors or silent precision loss, and the common
    workaround — disabling AMP — gives up its speed. `custom_fwd` records the autocast state for
    `backward` and `custom_bwd` restores it; `cast_inputs=torch.float32` runs an op that is not
    fp16-safe in float32 with autocast disabled inside.

    ## Example
    ```python
    class MyOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ...

        @staticmethod
        def backward(ctx, g):
            ...
    ```

    ## Use instead
    ```python
    class MyOp(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cuda")  # add cast_inputs=torch.float32 if not fp16-safe
        def forward(ctx, x):
            ...

        @staticmethod
        @torch.amp.custom_bwd(device_type="cuda")
        def backward(ctx, g):
            ...
    ```

    ## Fix safety
    Display-only: whether the op needs `cast_inputs=torch.float32` depends on its numerics, and
    the device type on where it runs. A `forward` that disables autocast itself
    (`@torch.autocast(..., enabled=False)` or such a `with` block) is not flagged, nor are
    Functions with a separate `setup_context` (their `forward` has no `ctx` for `custom_fwd`).
    """

    code = "TOP207"
    name = "custom-function-amp"
    family = FAMILY
    message = (
        "`{cls}.{method}` of a custom autograd Function lacks `@torch.amp.{deco}(device_type=...)`: "
        "under autocast it sees mixed dtypes and backward does not run in forward's autocast state"
    )
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("Function",)
    requires = ("autocast",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and prechecks.custom_function_possible(text)

    _amp_watch = frozenset({"autocast"})

    examples = (
        Invalid(
            "import torch\n\n\nclass Square(torch.autograd.Function):\n    @staticmethod\n"
            "    def forward(ctx, x):\n        ctx.save_for_backward(x)\n        return x * x\n\n"
            "    @staticmethod\n    def backward(ctx, g):\n        (x,) = ctx.saved_tensors\n        return 2 * x * g\n\n\n"
            'def run(x):\n    with torch.autocast("cuda"):\n        return Square.apply(x)\n',
            after=None,
        ),
        Invalid(
            "import torch\nfrom torch.autograd import Function\nfrom torch.cuda.amp import autocast\n\n\n"
            'class Double(Function):\n    @staticmethod\n    @torch.amp.custom_fwd(device_type="cuda")\n'
            "    def forward(ctx, x):\n        return x * 2\n\n"
            "    @staticmethod\n    def backward(ctx, g):\n        return g * 2\n\n\nctx = autocast()\n",
            after=None,
            note="backward lacks custom_bwd",
        ),
        Valid(
            "import torch\n\n\nclass Square(torch.autograd.Function):\n    @staticmethod\n"
            "    def forward(ctx, x):\n        return x * x\n\n    @staticmethod\n    def backward(ctx, g):\n        return g\n",
            note="no autocast in the file",
        ),
        Valid(
            "import torch\n\n\nclass Square(torch.autograd.Function):\n    @staticmethod\n"
            '    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)\n'
            "    def forward(ctx, x):\n        return x * x\n\n    @staticmethod\n"
            '    @torch.amp.custom_bwd(device_type="cuda")\n    def backward(ctx, g):\n        return g\n\n\n'
            'with torch.autocast("cpu"):\n    y = Square.apply(torch.ones(2))\n',
            runnable=True,
        ),
        Valid(
            "import torch\n\n\nclass Square(torch.autograd.Function):\n    @staticmethod\n"
            '    @torch.autocast("cuda", enabled=False)\n    def forward(ctx, x):\n        return x * x\n\n'
            '    @staticmethod\n    def backward(ctx, g):\n        return g\n\n\nctx = torch.autocast("cuda")\n',
            note="forward disables autocast itself",
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._classes: dict[str, cst.ClassDef] = {}

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.setdefault(node.name.value, node)

    def _is_function(self, cls: cst.ClassDef, seen: set[str]) -> bool:
        for base in cls.bases:
            if base.keyword is not None:
                continue
            if torch_name(self, base.value) in _FUNCTION_BASES:
                return True
            if isinstance(base.value, cst.Name) and base.value.value in self._classes and base.value.value not in seen:
                if self._is_function(self._classes[base.value.value], seen | {cls.name.value}):
                    return True
        return False

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self._classes or not self.uses(AUTOCAST_NAMES):
            return
        for cls in self._classes.values():
            if not self._is_function(cls, set()):
                continue
            methods = {}
            for stmt in cls.body.body:
                if isinstance(stmt, cst.FunctionDef):
                    methods[stmt.name.value] = stmt
            if "setup_context" in methods:
                continue
            fwd = methods.get("forward")
            if fwd is None:
                continue
            if self._disables_autocast(fwd):
                continue
            if not self._decorated(fwd, _CUSTOM_FWD):
                self.report(fwd.name, fmt={"cls": cls.name.value, "method": "forward", "deco": "custom_fwd"})
            bwd = methods.get("backward")
            if bwd is not None and not self._decorated(bwd, _CUSTOM_BWD):
                self.report(bwd.name, fmt={"cls": cls.name.value, "method": "backward", "deco": "custom_bwd"})

    def _decorated(self, fn: cst.FunctionDef, names: frozenset[str]) -> bool:
        for d in fn.decorators:
            expr = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
            if torch_name(self, expr) in names:
                return True
        return False

    def _disables_autocast(self, fn: cst.FunctionDef) -> bool:
        calls = [d.decorator for d in fn.decorators if isinstance(d.decorator, cst.Call)]
        fn.visit(_WithCalls(fn, calls))
        for c in calls:
            if torch_name(self, c.func) in AUTOCAST_NAMES:
                en = keyword(c, "enabled")
                if en is not None and isinstance(en.value, cst.Name) and en.value.value == "False":
                    return True
        return False
