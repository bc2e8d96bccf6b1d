"""TOP813 `gradcheck-in-training`: Reports `torch.autograd.gradcheck` / `gradgradcheck` calls reachable from a training loop: in a."""

from __future__ import annotations

from libcst.metadata import PositionProvider
import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.debug import FAMILY
from torchopt.codemods.debug.debug_switches import DebugRule, GRADCHECKS
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class GradcheckInTraining(DebugRule):
    """## What it does
    Reports `torch.autograd.gradcheck` / `gradgradcheck` calls reachable from a training loop: in a
    loop that calls `backward`/`step`, in a function that trains, or in a function of the file that
    such a loop calls.

    ## Why is this slow
    `gradcheck` compares the analytical gradient with finite differences: it re-runs the function
    twice per input element, usually in float64, and synchronises to compare. It is a unit-test
    tool; inside the training loop it can cost more than the training step itself.

    ## Example
    ```python
    for x, y in loader:
        torch.autograd.gradcheck(my_op, (x.double().requires_grad_(),))
        loss = loss_fn(model(x), y); loss.backward(); opt.step()
    ```

    ## Use instead
    ```python
    # tests/test_my_op.py
    def test_my_op_gradient():
        assert torch.autograd.gradcheck(my_op, (torch.randn(4, dtype=torch.float64, requires_grad=True),))
    ```

    ## Fix safety
    Display-only: moving a check into the test suite is a decision about the project's layout.
    """

    code = "TOP813"
    name = "gradcheck-in-training"
    family = FAMILY
    message = "`{call}` runs in the training loop (line {line}): a finite-difference check per input element every step"
    safety = Safety.DISPLAY
    prefilter = ("gradcheck",)

    examples = (
        Invalid(
            "import torch\n\nfor x in batches:\n    torch.autograd.gradcheck(op, (x,))\n    op(x).sum().backward()\n    opt.step()\n"
        ),
        Invalid(
            "from torch.autograd import gradgradcheck\n\n\ndef check(op, x):\n    gradgradcheck(op, (x,))\n\n\n"
            "def train(loader, op, opt):\n    for x in loader:\n        check(op, x)\n        op(x).sum().backward()\n        opt.step()\n",
            note="through a function the loop calls",
        ),
        Valid("import torch\n\n\ndef test_op_grad():\n    assert torch.autograd.gradcheck(op, (x,))\n"),
        Valid(
            "import torch\n\nfor op in ops:\n    torch.autograd.gradcheck(op, (x,))\n",
            note="a loop of checks, no training",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self._checks: list[cst.Call] = []

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) in GRADCHECKS:
            self._checks.append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self._checks:
            return
        loops = self.training_loops()
        fns = {n.name.value: n for n in walk(self.ctx.module, cross_scopes=True) if isinstance(n, cst.FunctionDef)}
        # Functions reachable from a training loop, two calls deep.
        reach: dict[str, cst.CSTNode] = {}
        frontier: list[tuple[cst.CSTNode, cst.For | cst.While]] = [(loop, loop) for loop in loops]
        for _ in range(2):
            nxt: list[tuple[cst.CSTNode, cst.For | cst.While]] = []
            for body, loop in frontier:
                for n in walk(body, cross_scopes=True):
                    if (
                        isinstance(n, cst.Call)
                        and isinstance(n.func, cst.Name)
                        and n.func.value in fns
                        and n.func.value not in reach
                    ):
                        reach[n.func.value] = loop
                        nxt.append((fns[n.func.value], loop))
            frontier = nxt
        for check in self._checks:
            where = self._where(check, loops, fns, reach)
            if where is not None:
                line = self.get_metadata(PositionProvider, where).start.line
                self.report(check, fmt={"call": source(self, check), "line": str(line)})

    def _where(self, check, loops, fns, reach):
        cur = self.get_metadata(ParentProvider, check, None)
        while cur is not None:
            if isinstance(cur, (cst.For, cst.While)) and any(cur is lp for lp in loops):
                return cur
            if isinstance(cur, cst.FunctionDef):
                if self.trains(cur.body):
                    return cur
                if cur.name.value in reach:
                    return reach[cur.name.value]
                return None
            cur = self.get_metadata(ParentProvider, cur, None)
        return None
