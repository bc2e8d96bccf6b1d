"""TOP801 `eval-without-no-grad`: Flags evaluation code that runs a model with autograd on: a function named like evaluation."""
from __future__ import annotations

import re

import libcst as cst

from torchopt.analysis.conventions import EVAL_FUNCTION
from torchopt.analysis.conventions import eval_loader_name
from torchopt.analysis.names import torch_ref
from torchopt.analysis.syntax import walk
from torchopt.codemods.inference import FAMILY
from torchopt.codemods.inference.eval_code import EvalRule
from torchopt.codemods.inference.eval_code import dotted
from torchopt.codemods.inference.grad_free_calls import _GradFree
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


# Loading trained weights: the mark of an inference script (with nothing in the file training).
_LOADS_WEIGHTS = re.compile(r"load_state_dict\s*\(|\bload\s*\(|from_pretrained\s*\(")


def _is_main_guard(stmt: cst.CSTNode) -> bool:
    return (isinstance(stmt, cst.If) and isinstance(stmt.test, cst.Comparison)
            and "__main__" in cst.Module([]).code_for_node(stmt.test)
            and "__name__" in cst.Module([]).code_for_node(stmt.test))


_NO_GRAD_EXAMPLE = "import torch\nfrom torch import nn\n\nmodel = nn.Linear(4, 3)\nval_loader = [(torch.randn(2, 4), torch.tensor([0, 2]))]\n"


class EvalWithoutNoGrad(EvalRule):
    """## What it does
    Flags evaluation code that runs a model with autograd on: a function named like evaluation
    (`evaluate`, `validate`, `predict`, `infer`, `test`, `run_validation`, ...) or a loop over a loader
    named like held-out data (`val_loader`, `test_dl`, `eval_batches`, ...) that calls a model, and
    neither computes gradients (`backward`, `torch.autograd.grad`, an optimizer step) nor runs
    under `torch.no_grad()` / `torch.inference_mode()` already. It decorates the function with
    `@torch.no_grad()` or wraps the loop in `with torch.no_grad():`. Methods count too
    (`Trainer.evaluate(self)`), except methods of a torch module, which are part of its forward.
    A loop whose model calls already sit in a `with torch.no_grad():` is left alone.

    An *inference script* (it loads weights, with `load_state_dict`, `torch.load` or
    `from_pretrained`, and nothing in the file trains) is evaluation code as a whole: its `main()`
    is decorated, and its top-level statements (or those of its `if __name__ == "__main__":`
    block) from the first model call to the last go under one `with torch.no_grad():` (unsafe,
    semantics: the outputs, saved or returned, no longer require grad).

    ## Why is this slow
    With autograd on, every forward records a graph and keeps every activation it needs for a
    backward pass that never comes: more memory (smaller evaluation batches) and bookkeeping time.

    ## Example
    ```python
    for x, y in val_loader:
        correct += (model(x).argmax(1) == y).sum().item()
    ```

    ## Use instead
    ```python
    with torch.no_grad():
        for x, y in val_loader:
            correct += (model(x).argmax(1) == y).sum().item()
    ```

    ## Fix safety
    The values are identical. Only `requires_grad` of the
    results changes, so the fix is safe when everything that leaves the function or loop is
    provably free of gradients (`.item()`, `argmax`, comparisons, counts, data from the loader) and
    unsafe (**semantics**: results no longer require grad) when a tensor computed from the model
    leaves it (a returned or collected logits tensor). Code whose results reach a `backward` in the
    same file, or that reads `.requires_grad`/`.grad`, is not flagged.
    """

    code = "TOP801"
    name = "eval-without-no-grad"
    family = FAMILY
    message = "{what} runs `{model}` for evaluation with autograd recording a graph"
    fix_title = "Run it under `torch.no_grad()`"
    safety = Safety.SAFE
    prefilter = ("val", "test", "eval", "predict", "infer", "dev_", "_dev", "devloader", "holdout")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.patterns import eval_sites_possible
        from torchopt.codemods.inference.eval_code import eval_units_possible

        return (super().could_match(text) and eval_sites_possible(text) and eval_units_possible(
            text, asynchronous=False, mode_calls=False)) or _LOADS_WEIGHTS.search(text) is not None

    examples = (
        Invalid(
            _NO_GRAD_EXAMPLE + "correct = 0\nfor x, y in val_loader:\n"
            "    correct += (model(x).argmax(1) == y).sum().item()\n",
            after=_NO_GRAD_EXAMPLE + "correct = 0\nwith torch.no_grad():\n    for x, y in val_loader:\n"
            "        correct += (model(x).argmax(1) == y).sum().item()\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\n\ndef evaluate(model, loader):\n    model.eval()\n    total = 0.0\n"
            "    for x, y in loader:\n        total += torch.nn.functional.mse_loss(model(x), y).item()\n"
            "    return total / len(loader)\n",
            after="import torch\n\n\n@torch.no_grad()\ndef evaluate(model, loader):\n    model.eval()\n    total = 0.0\n"
            "    for x, y in loader:\n        total += torch.nn.functional.mse_loss(model(x), y).item()\n"
            "    return total / len(loader)\n",
        ),
        Invalid(
            "import torch\n\n\ndef predict(model, x):\n    return model(x).softmax(-1)\n",
            after="import torch\n\n\n@torch.no_grad()\ndef predict(model, x):\n    return model(x).softmax(-1)\n",
            unsafe="semantics",
            note="the returned probabilities no longer require grad",
        ),
        Valid(
            "import torch\n\n\ndef validate(model, loader, opt):\n    for x, y in loader:\n"
            "        loss = model(x).sum()\n        loss.backward()\n        opt.step()\n",
            note="trains",
        ),
        Valid(
            "import torch\n\n\n@torch.no_grad()\ndef evaluate(model, loader):\n"
            "    return [model(x) for x, y in loader]\n",
        ),
        Valid(
            _NO_GRAD_EXAMPLE + "with torch.inference_mode():\n    for x, y in val_loader:\n        out = model(x)\n",
            runnable=True,
        ),
        Valid(
            "import torch\n\n\ndef distill(teacher, student, val_loader):\n    for x, y in val_loader:\n"
            "        soft = teacher(x)\n        loss = (student(x) - soft).pow(2).mean()\n        loss.backward()\n",
        ),
        Valid(
            "import torch\n\n\ndef predict(model, x):\n    return model(x)\n\n\n"
            "def train_step(model, x):\n    out = predict(model, x)\n    out.sum().backward()\n",
            note="the prediction feeds a backward in the same file",
        ),
        Valid("def evaluate(results):\n    return sum(r.score for r in results)\n", note="no model call"),
        Invalid(
            "import torch\n\n\nclass Trainer:\n    def evaluate(self):\n        total = 0\n"
            "        for x, y in self.val_data:\n            total += (self.model(x).argmax(1) == y).sum().item()\n"
            "        return total\n",
            after="import torch\n\n\nclass Trainer:\n    @torch.no_grad()\n    def evaluate(self):\n        total = 0\n"
            "        for x, y in self.val_data:\n            total += (self.model(x).argmax(1) == y).sum().item()\n"
            "        return total\n",
            note="a trainer's method (not a torch module's)",
        ),
        Invalid(
            "import torch\n\nmodel = torch.nn.Linear(4, 2)\nmodel.load_state_dict(torch.load('w.pt'))\nmodel.eval()\n"
            "out = model(torch.load('inputs.pt'))\ntorch.save(out, 'out.pt')\n",
            after="import torch\n\nmodel = torch.nn.Linear(4, 2)\nmodel.load_state_dict(torch.load('w.pt'))\nmodel.eval()\n"
            "with torch.no_grad():\n    out = model(torch.load('inputs.pt'))\ntorch.save(out, 'out.pt')\n",
            unsafe="semantics",
            note="a plain inference script: load weights, call the model, save the output",
        ),
        Valid(
            "import torch\n\n\ndef main(model, eval_dataloader):\n    model.eval()\n"
            "    for batch in eval_dataloader:\n        with torch.no_grad():\n            outputs = model(batch)\n"
            "        print(outputs.argmax(-1))\n",
            note="the model call already runs under `no_grad` inside the loop",
        ),
        Valid(
            "import torch\n\n\nclass Segmenter(torch.nn.Module):\n    def predict(self, h):\n        return self.mask_head(h)\n\n"
            "    def forward(self, x):\n        return self.predict(self.backbone(x))\n",
            note="a method of a module is part of its forward (gradients must flow through it)",
        ),
    )

    def __init__(self, ctx) -> None:  # type: ignore[no-untyped-def]
        super().__init__(ctx)
        self._fns: list[cst.FunctionDef] = []
        self._loops: list[cst.For] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if node.asynchronous is None and EVAL_FUNCTION.match(node.name.value):
            self._fns.append(node)

    def visit_For(self, node: cst.For) -> None:
        if node.asynchronous is None:
            name = self.loop_iter_name(node)
            if name and eval_loader_name(name):
                self._loops.append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        script = _LOADS_WEIGHTS.search(original_node.code) is not None and not self.trains_anywhere()
        if script:  # an inference script's `main()` is its evaluation unit
            self._fns.extend(fn for fn in original_node.body if isinstance(fn, cst.FunctionDef)
                             and fn.name.value == "main" and fn not in self._fns)
        if not (self._fns or self._loops or script):
            return
        gf = _GradFree(self)
        for fn in self._fns:
            self._function(fn, gf)
        for loop in self._loops:
            self._loop(loop, gf)
        if script:
            self._script_block(original_node)
            guard = next((s for s in original_node.body if _is_main_guard(s)), None)
            if guard is not None and isinstance(guard.body, cst.IndentedBlock):
                self._script_block(guard.body)

    def _script_block(self, block: cst.Module | cst.IndentedBlock) -> None:
        """Top-level statements of an inference script (load weights, call the model, save the
        output) that call a model with autograd on: the run from the first to the last of them
        goes under one ``with torch.no_grad():`` (a ``with`` does not scope names, so everything
        after still sees them)."""
        body = list(block.body)
        hits = [i for i, st in enumerate(body) if not isinstance(st, (cst.FunctionDef, cst.ClassDef, cst.If))
                and not (isinstance(st, cst.For) and st in self._loops)
                and any(not self.in_grad_off(c) for c, _ in self.forward_calls(st))]
        if not hits:
            return
        span = body[hits[0]:hits[-1] + 1]
        if any(isinstance(st, (cst.FunctionDef, cst.ClassDef)) or st in self._loops or self.trains(st) is not None
               for st in span):
            return
        ref = torch_ref(self)
        if ref is None:
            return
        first = span[0]
        inner = [first.with_changes(leading_lines=())] + span[1:]
        wrapped = cst.With(items=[cst.WithItem(item=cst.Call(func=ref.attr("no_grad")))],
                           body=cst.IndentedBlock(body=inner), leading_lines=first.leading_lines)
        new_body = body[:hits[0]] + [wrapped] + body[hits[-1] + 1:]
        model = self.forward_calls(first)[0][1] if self.forward_calls(first) else "the model"
        self.report(first, fmt={"what": "This inference script", "model": model},
                    replacement=block.with_changes(body=new_body), target=block, imports=ref.imports,
                    safety=Safety.UNSAFE, tags=(Tag.SEMANTICS,),
                    note="values are identical; tensors computed from the model no longer require grad "
                         "(a saved output tensor no longer carries requires_grad)")

    def _function(self, fn: cst.FunctionDef, gf: _GradFree) -> None:
        if self.decorated_grad_off(fn) or self.in_grad_off(fn):
            return
        if self.is_module_method(fn) or self.called_from_training(fn):
            return
        fwd = self.forward_calls(fn.body)
        if not fwd or self.trains(fn.body) is not None:
            return
        if any(isinstance(n, cst.With) and any(self.grad_off_call(i.item) for i in n.items) for n in walk(fn.body)):
            return  # the user chose where autograd is off
        results = [n.value for n in walk(fn.body) if isinstance(n, (cst.Return, cst.Yield)) and n.value is not None]
        for call in self.calls_to(fn.name.value):
            stmt = self.statement_of(call)
            if self.trains(stmt) is not None:
                return
            names = {x.value for t in walk(stmt) if isinstance(t, cst.AssignTarget)
                     for x in walk(t.target) if isinstance(x, cst.Name)}
            if names & self.backward_uses(self.scope_body(call)):
                return
        ref = torch_ref(self)
        if ref is None:
            return
        free = all(gf.expr(r) for r in results)
        deco = cst.Decorator(decorator=cst.Call(func=ref.attr("no_grad")))
        replacement = fn.with_changes(decorators=[*fn.decorators, deco])
        self._report(fn.name, fn, replacement, free, ref.imports,
                     {"what": f"`{fn.name.value}()`", "model": fwd[0][1]})

    def _loop(self, loop: cst.For, gf: _GradFree) -> None:
        if self.in_grad_off(loop):
            return
        fn = self.enclosing_function(loop)
        if fn is not None and EVAL_FUNCTION.match(fn.name.value):
            return  # the function is the unit
        fwd = [f for f in self.forward_calls(loop.body) if not self.in_grad_off(f[0])]
        if not fwd or self.trains(loop.body) is not None:
            return  # no forward, or every one already runs with autograd off
        parent = self.get_metadata(ParentProvider, loop, None)
        if not isinstance(parent, (cst.IndentedBlock, cst.Module)):
            return
        escaping = self.assigned_names(loop.body) - {x.value for x in walk(loop.target) if isinstance(x, cst.Name)}
        collected = []
        for n in walk(loop.body):
            if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and \
                    n.func.attr.value in ("append", "extend", "add", "update", "insert", "__setitem__"):
                d = dotted(n.func.value)
                if d:
                    escaping.add(d.split(".")[0])
                collected.extend(a.value for a in n.args)
            elif isinstance(n, cst.AssignTarget) and isinstance(n.target, cst.Subscript):
                stmt = self.get_metadata(ParentProvider, n, None)
                if isinstance(stmt, cst.Assign):
                    collected.append(stmt.value)
        if escaping & self.backward_uses(self.scope_body(loop)):
            return
        ref = torch_ref(self)
        if ref is None:
            return
        free = all(self._name_free(loop, n, gf) for n in escaping) and \
            all(gf.expr(c) for c in collected)
        item = cst.WithItem(item=cst.Call(func=ref.attr("no_grad")))
        replacement = cst.With(items=[item], body=cst.IndentedBlock(body=[loop.with_changes(leading_lines=())]),
                               leading_lines=loop.leading_lines)
        it = self.loop_iter_name(loop) or "the loader"
        self._report(loop, loop, replacement, free, ref.imports,
                     {"what": f"The loop over `{it}`", "model": fwd[0][1]})

    def _name_free(self, loop: cst.For, name: str, gf: _GradFree) -> bool:
        for n in walk(loop.body):
            if isinstance(n, cst.Name) and n.value == name:
                return gf.name(n, 0)
        return False

    def _report(self, node: cst.CSTNode, target: cst.CSTNode, replacement: cst.CSTNode, free: bool,
                imports, fmt) -> None:  # type: ignore[no-untyped-def]
        if free:
            self.report(node, fmt=fmt, replacement=replacement, target=target, imports=imports)
        else:
            self.report(node, fmt=fmt, replacement=replacement, target=target, imports=imports,
                        safety=Safety.UNSAFE, tags=(Tag.SEMANTICS,),
                        note="values are identical; tensors computed from the model no longer require grad")
