"""TOP811 `anomaly-detection-left-on`: Flags anomaly detection switched on unconditionally: `torch.autograd.set_detect_anomaly(True)`."""
from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.names import torch_ref
from torchopt.analysis.syntax import source
from torchopt.codemods.debug import FAMILY
from torchopt.codemods.debug.debug_switches import DETECT_ANOMALY, DebugRule, GATE, SET_ANOMALY, _gate
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import ImportSpec
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class AnomalyDetectionLeftOn(DebugRule):
    """## What it does
    Flags anomaly detection switched on unconditionally: `torch.autograd.set_detect_anomaly(True)`
    and `with torch.autograd.detect_anomaly():`. The statement is put under
    `if os.environ.get("TORCHOPT_DEBUG"):`; the context manager becomes
    `torch.autograd.set_detect_anomaly(bool(os.environ.get("TORCHOPT_DEBUG")))`, which is a no-op
    unless the variable is set. Calls already under an `if` are left alone.

    ## Why is this slow
    Anomaly mode records a Python traceback for every operation of the forward pass and checks
    every backward result for NaN, which synchronises with the device: PyTorch itself warns that it
    "will increase the runtime and should only be enabled for debugging".

    ## Example
    ```python
    torch.autograd.set_detect_anomaly(True)
    ```

    ## Use instead
    ```python
    if os.environ.get("TORCHOPT_DEBUG"):
        torch.autograd.set_detect_anomaly(True)
    ```

    ## Fix safety
    Safe for the values (class E): anomaly mode computes nothing differently.
    What changes is error reporting: a backward that produces NaN no longer raises with the
    forward traceback (the run goes on with NaN), unless `TORCHOPT_DEBUG=1` is set to get the check back.
    """

    code = "TOP811"
    name = "anomaly-detection-left-on"
    family = FAMILY
    message = "`{call}` leaves anomaly detection on: every op records a traceback, every backward checks for NaN"
    fix_title = "Turn it on only when `TORCHOPT_DEBUG` is set"
    safety = Safety.SAFE
    prefilter = ("anomaly",)

    examples = (
        Invalid(
            "import torch\n\ntorch.autograd.set_detect_anomaly(True)\nx = torch.ones(2, requires_grad=True)\n"
            "(x * 2).sum().backward()\n",
            after="import torch\nimport os\n\nif os.environ.get(\"TORCHOPT_DEBUG\"):\n    torch.autograd.set_detect_anomaly(True)\n"
            "x = torch.ones(2, requires_grad=True)\n(x * 2).sum().backward()\n",
            runnable=True,
        ),
        Invalid(
            "import os\nimport torch\n\n\ndef step(model, x):\n    with torch.autograd.detect_anomaly():\n"
            "        model(x).sum().backward()\n",
            after="import os\nimport torch\n\n\ndef step(model, x):\n"
            "    with torch.autograd.set_detect_anomaly(bool(os.environ.get(\"TORCHOPT_DEBUG\"))):\n"
            "        model(x).sum().backward()\n",
        ),
        Invalid(
            "import os\nfrom torch.autograd import detect_anomaly\n\nwith detect_anomaly(check_nan=False):\n    run()\n",
            after="import os\nfrom torch.autograd import detect_anomaly\nimport torch\n\n"
            "with torch.autograd.set_detect_anomaly(bool(os.environ.get(\"TORCHOPT_DEBUG\")), check_nan=False):\n    run()\n",
        ),
        Valid("import torch\n\nif args.debug:\n    torch.autograd.set_detect_anomaly(True)\n"),
        Valid("import torch\n\ntorch.autograd.set_detect_anomaly(False)\n", runnable=True),
        Valid("import torch\n\ntorch.autograd.set_detect_anomaly(args.debug)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        q = callee(self, node)
        if q in SET_ANOMALY:
            self._set(node)
        elif q in DETECT_ANOMALY:
            self._detect(node)

    def _set(self, node: cst.Call) -> None:
        mode = keyword(node, "mode") or (positional(node)[0] if positional(node) else None)
        if mode is None or not (isinstance(mode.value, cst.Name) and mode.value.value == "True"):
            return
        if self.gated(node) or not self.os_free():
            return
        parent = self.get_metadata(ParentProvider, node, None)
        if isinstance(parent, cst.WithItem):
            new = node.with_changes(args=[a.with_changes(value=self._gate_bool()) if a is mode else a for a in node.args])
            self.report(node, fmt={"call": source(self, node)}, replacement=new, imports=(ImportSpec("os"),))
            return
        line = self.get_metadata(ParentProvider, parent, None) if isinstance(parent, cst.Expr) else None
        if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
            self.report(node, fmt={"call": source(self, node)})
            return
        gated = cst.If(test=_gate(), body=cst.IndentedBlock(body=[line.with_changes(leading_lines=())]),
                       leading_lines=line.leading_lines)
        self.report(node, fmt={"call": source(self, node)}, replacement=gated, target=line,
                    imports=(ImportSpec("os"),))

    def _gate_bool(self) -> cst.BaseExpression:
        return cst.parse_expression(f"bool({GATE})")

    def _detect(self, node: cst.Call) -> None:
        parent = self.get_metadata(ParentProvider, node, None)
        if not isinstance(parent, cst.WithItem) or self.gated(node) or not self.os_free():
            if not isinstance(parent, cst.WithItem) and not self.gated(node):
                self.report(node, fmt={"call": source(self, node)})
            return
        if any(a.star for a in node.args) or len(node.args) > 1:
            return
        if isinstance(node.func, cst.Attribute):
            func: cst.BaseExpression = node.func.with_changes(attr=cst.Name("set_detect_anomaly"))
            imports: tuple = ()
        else:
            ref = torch_ref(self)
            if ref is None:
                return
            func, imports = ref.attr("autograd.set_detect_anomaly"), ref.imports
        args = [cst.Arg(self._gate_bool())]
        for a in node.args:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            args.append(a.with_changes(keyword=cst.Name("check_nan"), equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
                if a.keyword is None else a)
        new = cst.Call(func=func, args=args)
        self.report(node, fmt={"call": source(self, node)}, replacement=new,
                    imports=(*imports, ImportSpec("os")))
