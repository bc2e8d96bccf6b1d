"""TOP605 `tensor-control-flow`: Python control flow on tensor values inside a training or evaluation step."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.step_loops import Tensors
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.sync import FAMILY
from torchopt.analysis.control import QUIET_GUARDS, control_of
from torchopt.analysis.placement import placements
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class TensorControlFlow(Rule):
    """## What it does
    Flags Python control flow on tensor values inside a training or evaluation step, including in a
    loss function or module of the same file that the loop calls: `if (t != 0).all():`,
    `while loss > thr:`, `assert torch.isfinite(x).all()`, `a if t.sum() > 0 else b`. A loss
    module that no step of the file calls is TOP610's (it reports the branches of its `forward`).

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

    Not reported: code that runs only every few steps (`if step % log_every == 0:`), once (`if i ==
    0:`), after an error (an out-of-memory handler) or under a device check inside the step (see "The
    fact layer" in docs/design.md), and tests on host values (an `int` counter, a tensor moved with
    `.cpu()`), and a test that decides whether a `while True:` loop goes on on a flag a collective
    of the loop shares with every rank (`dist.broadcast(done, src=0)`, then `if done == 0: break`).
    Code that runs at every step on rank 0 only (`if rank == 0:`, `is_main_process()`) is reported:
    rank 0 waits at every step and the other ranks wait for it at the next collective.
    """

    code = "TOP605"
    name = "tensor-control-flow"
    family = FAMILY
    message = (
        "`{expr}` branches on a tensor value {where}: `bool()` of a tensor copies it to the host and waits "
        "for the GPU; {advice}"
    )
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
            "        loss = model(x).sum()\n        if step % 10 == 0:\n            print(step)\n        loss.backward()\n"
        ),
        Valid(
            "import torch\n\nx = torch.ones(3)\nif (x > 0).all():\n    y = x * 2\n", runnable=True, note="not in a step"
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        loss = model(x).sum()\n        if loss.item() > 10:\n            continue\n        loss.backward()\n",
            note="the `.item()` is TOP601's finding",
        ),
        Valid(
            dedent("""\
            from dataclasses import dataclass

            import torch
            import tyro


            @dataclass
            class Args:
                target_kl: float = None
                update_epochs: int = 4


            if __name__ == "__main__":
                args = tyro.cli(Args)
                agent = torch.nn.Linear(4, 4).cuda()
                optimizer = torch.optim.Adam(agent.parameters())
                obs = torch.randn(64, 4).cuda()
                for iteration in range(100):
                    with torch.no_grad():
                        obs = agent(obs)
                    for epoch in range(args.update_epochs):
                        logratio = agent(obs)
                        loss = logratio.mean()
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
                        approx_kl = (logratio.exp() - 1 - logratio).mean()
                    if args.target_kl is not None and approx_kl > args.target_kl:
                        break
            """),
            note="the tensor is read only when an option off by default is set (`and` evaluates its right side only then)",
        ),
        Valid(
            dedent("""\
            from dataclasses import dataclass

            import torch
            import tyro


            @dataclass
            class Args:
                num_steps: int = 128


            if __name__ == "__main__":
                args = tyro.cli(Args)
                q_network = torch.nn.Linear(4, 2).cuda()
                optimizer = torch.optim.Adam(q_network.parameters())
                obs = torch.zeros((args.num_steps, 4)).cuda()
                rewards = torch.zeros(args.num_steps).cuda()
                for iteration in range(100):
                    with torch.no_grad():
                        returns = torch.zeros_like(rewards)
                        for t in reversed(range(args.num_steps)):
                            if t == args.num_steps - 1:
                                next_value = q_network(obs[t]).max()
                            else:
                                next_value = returns[t + 1]
                            returns[t] = rewards[t] + 0.99 * next_value
                    loss = (q_network(obs).max(dim=1)[0] - returns).pow(2).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            """),
            note="`t` of `reversed(range(n))` counts the steps: an int, not a batch",
        ),
        Valid(
            dedent("""\
            def run(model, dataset):
                for path, im, vid_cap in dataset:
                    pred = model(im)
                    if vid_cap:
                        fps = vid_cap.get(5)
            """),
            note="the truth of a batch element that cannot be a batch tensor (it would raise): a video handle",
        ),
        Valid(
            dedent("""\
            import torch


            def read_shard(path):
                header = torch.from_file(path, size=256, dtype=torch.int32)
                if header[0] != 20240520:
                    raise ValueError(path)
                return header[1:]


            def train(model, paths, opt):
                for path in paths:
                    loss = model(read_shard(path).float().cuda()).sum()
                    loss.backward()
            """),
            note="`torch.from_file` reads into host memory: its truth costs no sync",
        ),
        Invalid(
            dedent("""\
            import torch as T
            from torch import nn as tnn


            class ClippedLoss(tnn.Module):
                def forward(self, pred, target):
                    err = (pred - target).abs()
                    if err.max() > 1.0:
                        err = err.clamp(max=1.0)
                    return err.mean()


            criterion = ClippedLoss()
            for x, y in loader:
                loss = criterion(model(x), y)
                if T.isnan(loss):
                    continue
                loss.backward()
            """),
            note="aliased imports: a loss module the loop calls, and a NaN check in the loop",
        ),
        Invalid(
            dedent("""\
            import torch
            import torch.nn as nn


            class RobustLoss(nn.Module):
                def forward(self, pred, target):
                    err = (pred - target).abs()
                    if err.max() > 1.0:
                        return (err ** 2).mean()
                    return err.mean()


            class Trainer:
                def __init__(self, model, opt):
                    self.model, self.opt = model, opt
                    self.criterion = RobustLoss()

                def fit(self, loader):
                    for x, y in loader:
                        loss = self.criterion(self.model(x), y)
                        loss.backward()
                        self.opt.step()
            """),
            note="the step in a method calls a loss module held in an attribute",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.any_hot:
            return
        tz = Tensors(self, hm)
        for n in walk(node, True):
            if not isinstance(n, (cst.If, cst.While, cst.IfExp, cst.Assert)):
                continue
            test = n.test
            part = self._tensor_part(test, tz)
            if part is None:
                continue
            where = hm.where(n)
            # the operand whose truth is read: the right side of `args.target_kl is not None and kl > ...`
            # runs only when its left side holds, so its guards are the left side's too
            if where is None or control_of(self).not_every_step(part, guards=QUIET_GUARDS) is not None:
                continue
            if control_of(self).decides_exit(test):
                continue  # the loop cannot know whether to go on without the value
            if isinstance(n, cst.Assert):
                advice = "use `torch._assert_async(cond)` or check every N steps, outside the step"
            elif isinstance(n, cst.IfExp):
                advice = "select on the device with `torch.where(cond, a, b)`"
            else:
                advice = (
                    "select on the device with `torch.where`, or check every N steps; `torch.cond` handles "
                    "data-dependent branches under torch.compile"
                )
            self.report(test, fmt={"expr": source(self, test), "where": where.text, "advice": advice})

    def _tensor_part(self, e: cst.BaseExpression, tensors: Tensors) -> cst.BaseExpression | None:
        """The operand of a test whose truth value is a tensor's, or None."""
        if _on_host(self, e):
            return None
        if isinstance(e, cst.BooleanOperation):
            left = self._tensor_part(e.left, tensors)
            return left if left is not None else self._tensor_part(e.right, tensors)
        if isinstance(e, cst.UnaryOperation) and isinstance(e.operator, cst.Not):
            return self._tensor_part(e.expression, tensors)
        if isinstance(e, cst.Name) and tensors.only_batch(e):
            # `if vid_cap:` on an element of what the loop iterates: the truth of a batch tensor of
            # several values raises, so the program itself says this element is something else
            return None
        return e if tensors.is_tensor(e) else None


def _on_host(rule: Rule, e: cst.BaseExpression) -> bool:
    """A test on Python numbers only (`t > 0` for an int `t`): its truth value costs no sync."""
    return placements(rule).value(e).on_host
