"""TOP803 `eval-train-mode-mismatch`: Reports two mode mistakes around evaluation:."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.conventions import EVAL_FUNCTION
from torchopt.analysis.conventions import eval_loader_name
from torchopt.analysis.lifecycle import Mode, lifecycle_of
from torchopt.analysis.module_modes import mode_matters
from torchopt.analysis.names import callee
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.inference import FAMILY
from torchopt.codemods.inference.eval_code import EvalRule
from torchopt.codemods.inference.eval_code import dotted
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


def _module_key(model: str) -> str:
    """The module a forward of ``model`` runs: ``self.net`` for ``self.net.forward``, ``model`` for ``model``."""
    parts = model.split(".")
    return ".".join(parts[:2]) if parts[0] == "self" and len(parts) > 1 else parts[0]


def _receiver_root(call: cst.Call) -> str:
    """The first name of what a ``.eval()``/``.train()`` call is called on (``model`` for ``model.enc.eval()``)."""
    func = call.func
    return (dotted(func.value) or "").split(".")[0] if isinstance(func, cst.Attribute) else ""


class EvalTrainModeMismatch(EvalRule):
    """## What it does
    Reports two mode mistakes around evaluation:

    * evaluation code (a function named like evaluation, or a loop over a loader named like
      held-out data) that runs a model that is in eval mode on no way in: the model lifecycle of
      docs/design.md follows the statements in order, so `model.eval()` a few lines above, in a
      chain (`Net().eval()`), in a factory of the file that returns the model, or in a helper called
      with it counts (for an evaluation function's parameter: before every call of it);
    * an epoch loop that trains and then switches a whole model it trains to evaluation
      (`model.eval()`, or a function of the file that calls `.eval()` on the model it is given) but
      never switches it back with `model.train()`, so from the second epoch on the model trains in
      evaluation mode. Switching a part on purpose (`model.backbone.eval()`, or the BatchNorm layers
      of `model.modules()`) is not reported, nor is a loop whose training step runs the model in
      eval mode on every way in, the first epoch included (a linear probe on frozen features that
      calls `model.eval()` before its own step): the code chose that mode.

    A model module's self-test (`def test(): net = Net(); print(net(torch.randn(2, 4)).shape)`, run
    only by the module's `if __name__ == "__main__":` block; see "Where programs run" in
    docs/design.md) is not evaluation code and is not reported.

    Nor is a model whose output does not depend on the mode: when every way it is built is known
    (a class of the file or of another module of the project, read through the project index, with
    the project classes it builds from, `nn.Sequential(...)` and its contents) and holds only layers
    that compute the same in both modes (Linear, convolutions, activations, pooling, LayerNorm,
    GroupNorm, Embedding...), with no Dropout, BatchNorm, InstanceNorm tracking running statistics,
    RNN or Transformer dropout, `F.dropout` or read of `self.training`, `eval()` would change
    nothing. A model this cannot tell (a library model such as `torchvision.models.resnet18()`, a
    class of a module the run does not read) is reported as before. The mode reaches a nested
    function from the function around it (`model.eval()` before each call of a `run_validate`
    that reads `model`), and `accelerator.unwrap_model(model)(x)` runs `model`.

    ## Why is this slow
    It is a correctness trap that looks like a tuning one: `torch.no_grad()` does not disable
    dropout (in a measured case 49 % of the entries were still zeroed) or freeze BatchNorm statistics, so evaluation
    without `.eval()` is noisy and updates running statistics with evaluation data; training left in
    `.eval()` mode runs without dropout and with frozen statistics.

    ## Example
    ```python
    for epoch in range(10):
        for x, y in train_loader:
            loss = criterion(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        model.eval()
        evaluate(model, val_loader)
    ```

    ## Use instead
    ```python
    for epoch in range(10):
        model.train()
        for x, y in train_loader:
            ...
        model.eval()
        evaluate(model, val_loader)
    ```

    ## Fix safety
    Display-only: inserting `.eval()`/`.train()` changes what dropout and BatchNorm compute (it could
    only ever be an opt-in semantic rewrite), and the right place depends on the code.
    """

    code = "TOP803"
    name = "eval-train-mode-mismatch"
    family = FAMILY
    message = "{what} runs `{model}` without `{model_root}.eval()`: dropout and BatchNorm stay in training mode"
    train_message = (
        "`{call}` switches the model to evaluation inside an epoch loop that trains, and nothing "
        "switches it back: from the second epoch on it trains in eval mode; call `.train()` "
        "at the start of each epoch"
    )
    safety = Safety.DISPLAY
    prefilter = ("val", "test", "eval", "predict", "infer", "dev_", "_dev", "devloader", "holdout")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.patterns import eval_sites_possible

        # An epoch loop that trains (`.backward()` or torch.autograd's grad/backward) and calls
        # `.eval()`, or an evaluation function / loop that calls a model.
        from torchopt.codemods.inference.eval_code import epoch_loop_possible, eval_units_possible

        if not super().could_match(text):
            return False
        if ("backward" in text or "autograd" in text) and epoch_loop_possible(text):
            return True
        return eval_sites_possible(text) and eval_units_possible(text, asynchronous=True, mode_calls=True)

    examples = (
        Invalid(
            "def evaluate(model, loader):\n    return [model(x) for x, y in loader]\n",
            note="no `.eval()` here nor before a call",
        ),
        Invalid(
            "def fit(model, opt, train_loader, val_loader, epochs):\n    for epoch in range(epochs):\n"
            "        for x, y in train_loader:\n            model(x).sum().backward()\n            opt.step()\n"
            "        model.eval()\n        score = sum(model(x).sum().item() for x, y in val_loader)\n"
        ),
        Valid("def evaluate(model, loader):\n    model.eval()\n    return [model(x) for x, y in loader]\n"),
        Valid(
            "import torch\n\n\ndef distill(student, teacher, opt, loader, epochs):\n    for epoch in range(epochs):\n"
            "        teacher.eval()\n        for x, y in loader:\n            with torch.no_grad():\n"
            "                soft = teacher(x)\n            (student(x) - soft).pow(2).mean().backward()\n"
            "            opt.step()\n",
            note="the model switched to eval mode is not the one trained",
        ),
        Valid(
            "def evaluate(model, loader):\n    return [model(x) for x, y in loader]\n\n\n"
            "def main(model, loader):\n    model.eval()\n    return evaluate(model, loader)\n",
            note="the caller switches the mode",
        ),
        Valid(
            "def fit(model, opt, train_loader, val_loader, epochs):\n    for epoch in range(epochs):\n"
            "        model.train()\n        for x, y in train_loader:\n            model(x).sum().backward()\n"
            "            opt.step()\n        model.eval()\n        evaluate(model, val_loader)\n"
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
                        self.fc = nn.Linear(8, 10)

                    def forward(self, x):
                        return self.fc(self.body(x).flatten(1))


                net = Net()
                test_loader = [torch.randn(2, 3, 8, 8)]
                for x in test_loader:
                    print(net(x).argmax(1))
            """),
            note="no layer of `Net` computes differently in eval mode",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
                        self.fc = nn.Linear(8, 10)
                        self.drop = nn.Dropout(0.5)

                    def forward(self, x):
                        return self.fc(self.drop(self.body(x).flatten(1)))


                net = Net()
                test_loader = [torch.randn(2, 3, 8, 8)]
                for x in test_loader:
                    print(net(x).argmax(1))
            """),
            note="the Dropout keeps dropping",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc = nn.Linear(4, 2)

                    def forward(self, x):
                        return self.fc(x)


                def test():
                    net = Net()
                    print(net(torch.randn(2, 4)).shape)


                if __name__ == "__main__":
                    test()
            """),
            note="a model module's smoke test runs no evaluation program",
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._fns: list[cst.FunctionDef] = []
        self._loops: list[cst.For | cst.While] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._fns.append(node)

    def visit_For(self, node: cst.For) -> None:
        self._loops.append(node)

    def visit_While(self, node: cst.While) -> None:
        self._loops.append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        fns = {f.name.value: f for f in self._fns}
        for fn in self._fns:
            if EVAL_FUNCTION.match(fn.name.value):
                self._eval_function(fn)
        for loop in self._loops:
            if isinstance(loop, cst.For):
                self._eval_loop(loop)
        reported: set[int] = set()
        for loop in self._loops:
            self._epoch_loop(loop, fns, reported)

    def _mode_calls(self, body: cst.CSTNode, mode: str) -> list[cst.Call]:
        out = []
        for n in walk(body):
            if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute):
                attr = n.func.attr.value
                arg = n.args[0].value if n.args else None
                false = isinstance(arg, cst.Name) and arg.value == "False"
                if mode == "eval" and (attr == "eval" and not n.args or attr == "train" and false):
                    out.append(n)
                elif mode == "train" and attr == "train" and not false:
                    out.append(n)
        return out

    def _eval_function(self, fn: cst.FunctionDef) -> None:
        if self.is_method(fn) or self.called_from_training(fn):
            return
        fwd = self._mode_sensitive(self.forward_calls(fn.body))
        if not fwd or self.trains(fn.body) is not None:
            return
        call, model = fwd[0]
        if self._switched_to_eval(fn, call, model):
            return
        self.report(
            fn.name,
            fmt={
                "what": f"`{fn.name.value}()`",
                "model": model,
                "model_root": model.split(".")[0] if model.split(".")[0] != "self" else model,
            },
        )

    def _mode_sensitive(self, fwd: list[tuple[cst.Call, str]]) -> list[tuple[cst.Call, str]]:
        """The model calls of ``fwd`` whose model may compute differently in eval mode: a model known
        to hold no dropout, no BatchNorm and nothing else that reads the mode is left out."""
        return [(c, m) for c, m in fwd if mode_matters(self, m, c) is not False]

    def _switched_to_eval(self, fn: cst.FunctionDef, call: cst.Call, model: str) -> bool:
        """Whether the model an evaluation function runs is in eval mode there (the lifecycle's
        modes): switched in the function itself, or, for a parameter, before every call of it."""
        lc = lifecycle_of(self)
        key = _module_key(model)
        here = lc.modes_at(key, call)
        if Mode.EVAL in here and Mode.UNKNOWN not in here:
            return True
        params = [p.name.value for p in fn.params.params]
        if key in params:
            per_call = lc.argument_modes(fn, key)
            return bool(per_call) and all(Mode.EVAL in modes for modes in per_call or ())
        return Mode.EVAL in here

    def get_metadata_pos(self, node: cst.CSTNode) -> tuple[int, int]:
        from libcst.metadata import PositionProvider

        r = self.get_metadata(PositionProvider, node)
        return (r.start.line, r.start.column)

    def _eval_loop(self, loop: cst.For) -> None:
        name = self.loop_iter_name(loop)
        if not name or not eval_loader_name(name):
            return
        fn = self.enclosing_function(loop)
        if fn is not None and EVAL_FUNCTION.match(fn.name.value):
            return
        fwd = self._mode_sensitive(self.forward_calls(loop.body))
        if not fwd or self.trains(loop.body) is not None:
            return
        call, model = fwd[0]
        root = model.split(".")[0]
        if Mode.EVAL in lifecycle_of(self).modes_at(_module_key(model), call):
            return
        self.report(
            loop.iter,
            fmt={"what": f"The loop over `{name}`", "model": model, "model_root": root if root != "self" else model},
        )

    def _epoch_loop(self, loop: cst.For | cst.While, fns: dict[str, cst.FunctionDef], reported: set[int]) -> None:
        body = loop.body
        called = [
            fns[n.func.value]
            for n in walk(body)
            if isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value in fns
        ]
        trains = self._has_backward(body) or any(self._has_backward(f.body) for f in called)
        if not trains:
            return
        if self._mode_calls(body, "train") or any(self._mode_calls(f.body, "train") for f in called):
            return
        # The models the loop trains: called with autograd on, or handed to a function that trains.
        trained = {d.split(".")[0] for c, d in self.forward_calls(body) if not self.in_grad_off(c)}
        for n in walk(body):
            if (
                isinstance(n, cst.Call)
                and isinstance(n.func, cst.Name)
                and n.func.value in fns
                and self._has_backward(fns[n.func.value].body)
            ):
                trained |= {a.value.value for a in n.args if isinstance(a.value, cst.Name)}
        # Only a switch of a whole trained model counts: `model.backbone.eval()` or a helper that puts
        # the BatchNorm layers in eval mode freezes part of the model on purpose (a linear probe).
        lc = lifecycle_of(self)
        trained = {m for m in trained if mode_matters(self, m, loop) is not False}
        evals: list[cst.CSTNode] = [
            c
            for c in self._mode_calls(body, "eval")
            if _receiver_root(c) in trained and lc.sets_whole_mode(c, Mode.EVAL)
        ]
        for n in walk(body):
            if (
                isinstance(n, cst.Call)
                and isinstance(n.func, cst.Name)
                and n.func.value in fns
                and self._mode_calls(fns[n.func.value].body, "eval")
                and any(isinstance(a.value, cst.Name) and a.value.value in trained for a in n.args)
                and lc.sets_whole_mode(n, Mode.EVAL)
            ):
                evals.append(n)
        if not evals or any(self._trains_in_eval_mode(b) for b in [body, *(f.body for f in called)]):
            return
        first = min(evals, key=self.get_metadata_pos)
        if id(first) in reported:
            return
        reported.add(id(first))
        self.report(first, message=self.train_message, fmt={"call": source(self, first)})

    def _trains_in_eval_mode(self, body: cst.CSTNode) -> bool:
        """Whether a training step in ``body`` runs its model in eval mode on every way in, the first
        epoch included: the code chose eval mode for its own step (a linear probe on frozen features
        keeps BatchNorm statistics fixed), so an `eval()` after it leaves nothing behind."""
        lc = lifecycle_of(self)
        for n in walk(body):
            if not (isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "backward"):
                continue
            for _call, name in self.forward_calls(body):
                if lc.modes_at(_module_key(name), n) == {Mode.EVAL}:
                    return True
        return False

    def _has_backward(self, body: cst.CSTNode) -> bool:
        for n in walk(body):
            if isinstance(n, cst.Call):
                if isinstance(n.func, cst.Attribute) and n.func.attr.value == "backward":
                    return True
                if callee(self, n) in ("torch.autograd.grad", "torch.autograd.backward"):
                    return True
        return False
