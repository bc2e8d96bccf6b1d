"""TOP814 `sync-debug-left-on`: Reports synchronous-CUDA debugging switched on by the script: `torch.cuda.set_sync_debug_mode(...)`."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.syntax import source
from torchopt.analysis.values import string_value
from torchopt.codemods.debug import FAMILY
from torchopt.codemods.debug.debug_switches import DebugRule, SYNC_DEBUG
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class SyncDebugLeftOn(DebugRule):
    """## What it does
    Reports synchronous-CUDA debugging switched on by the script: `torch.cuda.set_sync_debug_mode(...)`
    with a non-zero mode (`1`, `2`, `"warn"`, `"error"`), and `CUDA_LAUNCH_BLOCKING=1` set through
    `os.environ[...] = "1"`, `os.environ.setdefault(...)`, `os.environ.update(...)` or `os.putenv(...)`.
    Settings under an `if` (a debug flag) are left alone.

    ## Why is this slow
    `CUDA_LAUNCH_BLOCKING=1` makes every kernel launch wait until the kernel has finished, so the
    host can never run ahead of the device: no overlap at all between Python, data loading and
    GPU work. `set_sync_debug_mode` checks every operation for synchronisation and warns or raises.

    ## Example
    ```python
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    torch.cuda.set_sync_debug_mode("warn")
    ```

    ## Use instead
    ```python
    # set them from the shell when debugging:  CUDA_LAUNCH_BLOCKING=1 python train.py
    if args.debug_sync:
        torch.cuda.set_sync_debug_mode("warn")
    ```

    ## Fix safety
    Display-only: the setting may be there on purpose while a crash is investigated.
    """

    code = "TOP814"
    name = "sync-debug-left-on"
    family = FAMILY
    message = "`{code}` makes CUDA synchronous: {why}"
    safety = Safety.DISPLAY
    prefilter = ("CUDA_LAUNCH_BLOCKING", "set_sync_debug_mode")
    _LAUNCH = "every kernel launch waits for the kernel to finish, so the host never runs ahead of the GPU"
    _MODE = "every operation is checked for synchronisation, and warns or raises"

    examples = (
        Invalid('import os\n\nos.environ["CUDA_LAUNCH_BLOCKING"] = "1"\n', runnable=True),
        Invalid("import os\n\nos.environ.setdefault('CUDA_LAUNCH_BLOCKING', '1')\n"),
        Invalid("import torch\n\ntorch.cuda.set_sync_debug_mode('warn')\n"),
        Invalid(
            "import torch\n\nif torch.cuda.is_available():\n    torch.cuda.set_sync_debug_mode(1)\n",
            note="a capability check is not a debug switch",
        ),
        Valid("import torch\n\ntorch.cuda.set_sync_debug_mode(0)\n"),
        Valid("import os\n\nif args.debug:\n    os.environ['CUDA_LAUNCH_BLOCKING'] = '1'\n"),
        Valid("import os\n\nos.environ['CUDA_LAUNCH_BLOCKING'] = '0'\n", runnable=True),
    )

    def visit_Call(self, node: cst.Call) -> None:
        q = callee(self, node)
        if q in SYNC_DEBUG:
            mode_kw = keyword(node, "debug_mode")
            arg = positional(node)[0].value if positional(node) else (mode_kw.value if mode_kw else None)
            if arg is None:
                return
            s = string_value(arg)
            if (isinstance(arg, cst.Integer) and int(arg.evaluated_value) == 0) or s == "default":
                return
            if isinstance(arg, cst.Integer) or s in ("warn", "error"):
                if not self.gated(node):
                    self.report(node, fmt={"code": source(self, node), "why": self._MODE})
            return
        d = cst.helpers.get_full_name_for_node(node.func) or ""
        args = [a.value for a in node.args]
        if d in ("os.environ.setdefault", "os.putenv") and len(args) == 2:
            if string_value(args[0]) == "CUDA_LAUNCH_BLOCKING" and self._on(args[1]) and not self.gated(node):
                self.report(node, fmt={"code": source(self, node), "why": self._LAUNCH})
        elif d == "os.environ.update":
            kw = keyword(node, "CUDA_LAUNCH_BLOCKING")
            if kw is not None and self._on(kw.value) and not self.gated(node):
                self.report(node, fmt={"code": source(self, node), "why": self._LAUNCH})
            for a in args:
                if isinstance(a, cst.Dict):
                    for e in a.elements:
                        if (
                            isinstance(e, cst.DictElement)
                            and string_value(e.key) == "CUDA_LAUNCH_BLOCKING"
                            and self._on(e.value)
                            and not self.gated(node)
                        ):
                            self.report(node, fmt={"code": source(self, node), "why": self._LAUNCH})

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            tgt = t.target
            if (
                isinstance(tgt, cst.Subscript)
                and cst.helpers.get_full_name_for_node(tgt.value) == "os.environ"
                and len(tgt.slice) == 1
                and isinstance(tgt.slice[0].slice, cst.Index)
                and string_value(tgt.slice[0].slice.value) == "CUDA_LAUNCH_BLOCKING"
                and self._on(node.value)
                and not self.gated(node)
            ):
                self.report(node, fmt={"code": source(self, node), "why": self._LAUNCH})

    def _on(self, value: cst.BaseExpression) -> bool:
        s = string_value(value)
        return s is not None and s.strip() not in ("", "0")
