"""TOP811 `anomaly-detection-left-on`: anomaly detection left switched on in a training run."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.syntax import source
from torchopt.codemods.debug import FAMILY
from torchopt.codemods.debug.debug_switches import DETECT_ANOMALY, DebugRule, SET_ANOMALY
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class AnomalyDetectionLeftOn(DebugRule):
    """## What it does
    Flags anomaly detection switched on unconditionally: `torch.autograd.set_detect_anomaly(True)`
    and `with torch.autograd.detect_anomaly():`. The fix removes the debugging aid the way one
    would by hand: the `set_detect_anomaly(True)` statement is deleted, and the `with` is unwrapped
    (its body dedented in place, comments kept). It is only reported when that cannot be done
    cleanly: the call's value is used, the `as` name is read, the statement shares its line with
    others, or comments written just above it would be lost. Calls already under an `if` are left
    alone: the program switches them itself.

    ## Why is this slow
    Anomaly mode records a Python traceback for every operation of the forward pass and checks
    every backward result for NaN, which synchronises with the device: PyTorch itself warns that it
    "will increase the runtime and should only be enabled for debugging".

    ## Example
    ```python
    torch.autograd.set_detect_anomaly(True)
    loss.backward()
    ```

    ## Use instead
    ```python
    loss.backward()
    ```

    ## Fix safety
    Safe for the values: anomaly mode computes nothing differently. What changes is error
    reporting, and only when a backward produces NaN or Inf: before the fix that raised an error
    with the forward traceback, after it the run goes on with NaN. Put the switch back (behind your
    own command-line flag, for instance) when hunting a NaN.
    """

    code = "TOP811"
    name = "anomaly-detection-left-on"
    family = FAMILY
    message = "`{call}` leaves anomaly detection on: every op records a traceback, every backward checks for NaN"
    fix_title = "Remove the anomaly-detection switch"
    unwrap_title = "Remove `{call}` and keep the body of its `with`"
    kept_message = (
        "`{call}` leaves anomaly detection on: every op records a traceback, every backward checks "
        "for NaN; not removed automatically because {why}"
    )
    safety = Safety.SAFE
    prefilter = ("anomaly",)

    examples = (
        Invalid(
            "import torch\n\nx = torch.ones(2, requires_grad=True)\ntorch.autograd.set_detect_anomaly(True)\n"
            "(x * 2).sum().backward()\n",
            after="import torch\n\nx = torch.ones(2, requires_grad=True)\n(x * 2).sum().backward()\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\n\ndef step(model, x):\n    with torch.autograd.detect_anomaly():\n"
            "        # the loss of the whole batch\n        model(x).sum().backward()\n",
            after="import torch\n\n\ndef step(model, x):\n"
            "    # the loss of the whole batch\n    model(x).sum().backward()\n",
        ),
        Invalid(
            "from torch.autograd import detect_anomaly\n\nwith detect_anomaly(check_nan=False):  # NaN hunt\n    run()\n",
            after="from torch.autograd import detect_anomaly\n\n# NaN hunt\nrun()\n",
        ),
        Invalid(
            "import torch\n\nprevious = torch.autograd.set_detect_anomaly(True)\n",
            after=None,
            note="its value is used: reported, not removed",
        ),
        Valid("import torch\n\nif args.debug:\n    torch.autograd.set_detect_anomaly(True)\n"),
        Valid("import torch\n\ntorch.autograd.set_detect_anomaly(False)\n", runnable=True),
        Valid("import torch\n\ntorch.autograd.set_detect_anomaly(args.debug)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        q = callee(self, node)
        if q in SET_ANOMALY:
            mode = keyword(node, "mode") or (positional(node)[0] if positional(node) else None)
            if mode is None or not (isinstance(mode.value, cst.Name) and mode.value.value == "True"):
                return
        elif q not in DETECT_ANOMALY:
            return
        if self.gated(node):
            return
        parent = self.get_metadata(ParentProvider, node, None)
        if isinstance(parent, cst.WithItem):
            self._unwrap(node, parent)
        elif q in SET_ANOMALY:
            self._remove(node, parent)
        else:
            self._refuse(node, "`detect_anomaly()` outside a `with` statement has no plain form")

    def _remove(self, node: cst.Call, parent: cst.CSTNode | None) -> None:
        line = self.get_metadata(ParentProvider, parent, None) if isinstance(parent, cst.Expr) else None
        if not isinstance(line, cst.SimpleStatementLine):
            self._refuse(node, "its value is used")
        elif len(line.body) != 1:
            self._refuse(node, "it shares its line with other statements")
        elif any(empty.comment is not None for empty in line.leading_lines):
            self._refuse(node, "the comment above it would be lost")
        else:
            self.report(node, fmt={"call": source(self, node)}, replacement=cst.RemovalSentinel.REMOVE, target=line)

    def _unwrap(self, node: cst.Call, item: cst.WithItem) -> None:
        stmt = self.get_metadata(ParentProvider, item, None)
        if not isinstance(stmt, cst.With):
            return
        if self.as_name_used(item):
            self._refuse(node, "the `as` name is used")
            return
        new = self.unwrapped(stmt, item)
        if new is None:
            self._refuse(
                node,
                "a comment at the end of the `with` block would be lost"
                if stmt.asynchronous is None
                else "it is an `async with`",
            )
            return
        self.report(node, fmt={"call": source(self, node)}, replacement=new, target=stmt, fix_title=self.unwrap_title)

    def _refuse(self, node: cst.Call, why: str) -> None:
        self.report(node, message=self.kept_message, fmt={"call": source(self, node), "why": why})
