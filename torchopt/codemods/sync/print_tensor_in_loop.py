"""TOP602 `print-tensor-in-loop`: Flags printing, logging or formatting a tensor inside a training or evaluation step:."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.conventions import LOGGER_NAMES
from torchopt.analysis.conventions import LOG_METHODS
from torchopt.analysis.step_loops import Tensors
from torchopt.analysis.step_loops import dotted
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.sync import FAMILY
from torchopt.analysis.control import QUIET_GUARDS, control_of
from torchopt.analysis.placement import placements
from torchopt.codemods.sync.host_read_planning import builtin_unbound
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class PrintTensorInLoop(Rule):
    """## What it does
    Flags printing, logging or formatting a tensor inside a training or evaluation step:
    `print(loss)`, `print(f"{loss:.3f}")`, `str(t)`, `repr(t)`, `"{}".format(t)`,
    `logging.info("%s", t)`, `logger.info(f"{t}")`.

    ## Why is this slow
    Turning a tensor into text reads its values on the host, which waits for every kernel queued
    before it (a synchronisation per step), and formatting a large tensor is itself slow.

    ## Example
    ```python
    for step, (x, y) in enumerate(loader):
        loss = criterion(model(x), y)
        loss.backward()
        print(f"step {step}: {loss:.4f}")
    ```

    ## Use instead
    ```python
    for step, (x, y) in enumerate(loader):
        loss = criterion(model(x), y)
        loss.backward()
        if step % 100 == 0:  # and only on rank 0 under DDP
            print(f"step {step}: {loss.item():.4f}")
    ```

    ## Fix safety
    Display-only: how often to log is the user's choice; moving the print out of the step or
    under `if step % N == 0` changes what the program prints.

    Not reported: code that runs only every few steps (`if step % log_every == 0:`), once (`if i ==
    0:`), after an error (an out-of-memory handler) or under a device check inside the step (see "The
    fact layer" in docs/design.md), and host values (an f-string of a `str`, a counter from
    `itertools.count()`). Code that runs at every step on rank 0 only (`if rank == 0:`,
    `is_main_process()`) is reported: rank 0 waits at every step and the other ranks wait for it at the
    next collective.
    """

    code = "TOP602"
    name = "print-tensor-in-loop"
    family = FAMILY
    message = (
        "`{expr}` formats a tensor on the host {where}: every call waits for the GPU to finish "
        "the step; log every N steps (on rank 0), or move the print out of the step"
    )
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("print", "log", "str(", "repr(", "format(", 'f"', "f'")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_print_tensor
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_print_tensor).
        return super().could_match(text) and hot_check(text, may_print_tensor)

    examples = (
        Invalid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        loss = torch.nn.functional.mse_loss(model(x), y)\n        loss.backward()\n"
            "        print(f'loss {loss:.4f}')\n",
            after=None,
        ),
        Invalid(
            "import logging\nimport torch\n\ndef train(model, loader):\n    for x, y in loader:\n"
            "        out = torch.softmax(model(x), -1)\n        logging.info('probs %s', out)\n",
            after=None,
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt):\n    for step, (x, y) in enumerate(loader):\n"
            "        loss = torch.nn.functional.mse_loss(model(x), y)\n        loss.backward()\n"
            "        print(f'step {step}')\n    print(loss)\n"
        ),
        Valid("import torch\n\nt = torch.ones(2)\nprint(t)\n", runnable=True),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.any_hot:
            return
        tz = Tensors(self, hm)
        for n in walk(node, True):
            if isinstance(n, cst.Call):
                if self._formats_tensor(n, tz):
                    where = hm.where(n)
                    if where is not None and control_of(self).not_every_step(n, guards=QUIET_GUARDS) is None:
                        self.report(n, fmt={"expr": source(self, n), "where": where.text})

    def _formats_tensor(self, c: cst.Call, tensors: Tensors) -> bool:
        f = c.func
        args = [a.value for a in c.args if not a.star]
        if isinstance(f, cst.Name) and f.value in ("print", "str", "repr") and builtin_unbound(self, f):
            return any(self._text_of_tensor(a, tensors) for a in args)
        if (
            isinstance(f, cst.Attribute)
            and f.attr.value == "format"
            and isinstance(f.value, (cst.SimpleString, cst.ConcatenatedString))
        ):
            return any(self._device_value(a, tensors) for a in args)
        if isinstance(f, cst.Attribute) and f.attr.value in LOG_METHODS and dotted(f.value) in LOGGER_NAMES:
            return any(self._text_of_tensor(a, tensors) for a in args)
        return False

    def _text_of_tensor(self, expr: cst.BaseExpression, tensors: Tensors) -> bool:
        if isinstance(expr, cst.FormattedString):
            return any(
                isinstance(p, cst.FormattedStringExpression) and self._device_value(p.expression, tensors)
                for p in expr.parts
            )
        return self._device_value(expr, tensors)

    def _device_value(self, e: cst.BaseExpression, tensors: Tensors) -> bool:
        """A tensor that may live on the device: Python numbers (a loop counter from
        `itertools.count()`, a reward summed from `.item()`) print without a sync."""
        return tensors.is_tensor(e) and not placements(self).value(e).on_host
