"""rules.md INF-001..003: TOP801 add `torch.no_grad()` to evaluation code, TOP802 `no_grad` →
`inference_mode` in pure inference scripts, TOP803 missing `model.eval()` / `model.train()`."""
from __future__ import annotations

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import callee, torch_ref
from torchopt.analysis.syntax import source, walk
from torchopt.codemods.inference import FAMILY
from torchopt.codemods.inference._evalcode import EvalRule, dotted
from torchopt.analysis.conventions import EVAL_FUNCTION, eval_loader_name
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Safety, Tag, Valid

# Results that never require grad, whatever they are computed from.
_GRAD_FREE_METHODS = {"item", "tolist", "numpy", "detach", "argmax", "argmin", "long", "int", "bool", "short",
                      "byte", "size", "dim", "numel", "nonzero", "eq", "ne", "lt", "le", "gt", "ge", "isnan",
                      "isfinite", "isinf", "count_nonzero", "__len__", "keys", "argsort"}
_GRAD_FREE_BUILTINS = {"float", "int", "len", "str", "round", "bool", "print", "range", "repr", "format"}
_GRAD_FREE_TORCH = {"torch.argmax", "torch.argmin", "torch.bincount", "torch.eq", "torch.isnan",
                    "torch.isfinite", "torch.zeros", "torch.ones", "torch.full", "torch.arange", "torch.tensor",
                    "torch.zeros_like", "torch.ones_like", "torch.empty", "torch.count_nonzero"}


class _GradFree:
    """Whether values can require grad: decided from the expression, following names to every
    definition in their scope (loop targets over data count as data)."""

    def __init__(self, rule: EvalRule) -> None:
        self.rule = rule
        self._names: dict[int, bool] = {}

    def expr(self, e: cst.BaseExpression | None, depth: int = 0) -> bool:
        if e is None or depth > 6:
            return e is None
        if isinstance(e, (cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.ConcatenatedString,
                          cst.FormattedString, cst.Comparison, cst.Lambda)):
            return True
        if isinstance(e, cst.Name):
            return e.value in ("None", "True", "False") or self.name(e, depth)
        if isinstance(e, (cst.Tuple, cst.List, cst.Set)):
            return all(self.expr(x.value, depth + 1) for x in e.elements)
        if isinstance(e, cst.Dict):
            return all(isinstance(x, cst.DictElement) and self.expr(x.value, depth + 1) for x in e.elements)
        if isinstance(e, cst.BinaryOperation):
            return self.expr(e.left, depth + 1) and self.expr(e.right, depth + 1)
        if isinstance(e, cst.UnaryOperation):
            return self.expr(e.expression, depth + 1)
        if isinstance(e, cst.BooleanOperation):
            return self.expr(e.left, depth + 1) and self.expr(e.right, depth + 1)
        if isinstance(e, cst.IfExp):
            return self.expr(e.body, depth + 1) and self.expr(e.orelse, depth + 1)
        if isinstance(e, cst.Subscript):
            return self.expr(e.value, depth + 1)
        if isinstance(e, cst.Attribute):
            return e.attr.value in ("shape", "dtype", "device", "ndim") or self.expr(e.value, depth + 1)
        if isinstance(e, cst.Call):
            args_free = all(self.expr(a.value, depth + 1) for a in e.args)
            if isinstance(e.func, cst.Attribute):
                if e.func.attr.value in _GRAD_FREE_METHODS:
                    return True
                q = callee(self.rule, e)
                if q is not None:
                    return q in _GRAD_FREE_TORCH or args_free
                return self.expr(e.func.value, depth + 1) and args_free
            if isinstance(e.func, cst.Name) and e.func.value in _GRAD_FREE_BUILTINS:
                return True
            q = callee(self.rule, e)
            if q is not None:
                return q in _GRAD_FREE_TORCH or args_free
            return False
        return False

    def name(self, n: cst.Name, depth: int) -> bool:
        try:
            scope = self.rule.get_metadata(ScopeProvider, n)
        except KeyError:
            return False
        if scope is None or n.value not in scope:
            return False
        key = id(scope) ^ hash(n.value)
        if key in self._names:
            return self._names[key]
        self._names[key] = False  # recursion guard
        ok = True
        for a in scope[n.value]:
            if not self._definition(getattr(a, "node", None), depth):
                ok = False
                break
        self._names[key] = ok
        return ok

    def _definition(self, node: cst.CSTNode | None, depth: int) -> bool:
        if node is None or isinstance(node, (cst.Param, cst.Import, cst.ImportFrom)):
            return isinstance(node, (cst.Import, cst.ImportFrom))
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            return True
        get = self.rule.get_metadata
        cur = node
        for _ in range(8):
            parent = get(ParentProvider, cur, None)
            if parent is None:
                return False
            if isinstance(parent, cst.AssignTarget):
                stmt = get(ParentProvider, parent, None)
                return isinstance(stmt, cst.Assign) and self.expr(stmt.value, depth + 1)
            if isinstance(parent, (cst.AugAssign, cst.AnnAssign)) and cur is parent.target:
                return self.expr(parent.value, depth + 1)
            if isinstance(parent, cst.For) and cur is parent.target:
                return not self.rule.forward_calls(parent.iter)  # batches of data
            if isinstance(parent, cst.CompFor) and cur is parent.target:
                return self.expr(parent.iter, depth + 1) or not self.rule.forward_calls(parent.iter)
            if isinstance(parent, (cst.WithItem, cst.NamedExpr, cst.ExceptHandler)):
                return False
            if not isinstance(parent, (cst.Tuple, cst.List, cst.Element, cst.StarredElement)):
                return False
            cur = parent
        return False


_NO_GRAD_EXAMPLE = "import torch\nfrom torch import nn\n\nmodel = nn.Linear(4, 3)\nval_loader = [(torch.randn(2, 4), torch.tensor([0, 2]))]\n"


class EvalWithoutNoGrad(EvalRule):
    """## What it does
    Flags evaluation code that runs a model with autograd on: a function named like evaluation
    (`evaluate`, `validate`, `predict`, `infer`, `test`, `run_validation`, ...) or a loop over a loader
    named like held-out data (`val_loader`, `test_dl`, `eval_batches`, ...) that calls a model, and
    neither computes gradients (`backward`, `torch.autograd.grad`, an optimizer step) nor runs
    under `torch.no_grad()` / `torch.inference_mode()` already. It decorates the function with
    `@torch.no_grad()` or wraps the loop in `with torch.no_grad():`.

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
    The values are identical (rules.md INF-001, class E for values). Only `requires_grad` of the
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
        from torchopt.codemods.inference._evalcode import eval_units_possible

        return super().could_match(text) and eval_sites_possible(text) and eval_units_possible(
            text, asynchronous=False, mode_calls=False)

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
        if not (self._fns or self._loops):
            return
        gf = _GradFree(self)
        for fn in self._fns:
            self._function(fn, gf)
        for loop in self._loops:
            self._loop(loop, gf)

    def _function(self, fn: cst.FunctionDef, gf: _GradFree) -> None:
        if self.decorated_grad_off(fn) or self.in_grad_off(fn):
            return
        if self.is_method(fn) or self.called_from_training(fn):
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
        fwd = self.forward_calls(loop.body)
        if not fwd or self.trains(loop.body) is not None:
            return
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


_PURE = ("import torch\nfrom torch import nn\n\nmodel = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))\n"
         "model.eval()\nx = torch.randn(3, 4)\n")


class NoGradInPureInference(EvalRule):
    """## What it does
    In a script that never trains (no `backward`, `torch.autograd.grad`, optimizer, or
    `requires_grad_`), flags `torch.no_grad()` (a `with` block or a decorator) and offers
    `torch.inference_mode()`.

    ## Why is this slow
    `no_grad` still tracks tensor versions and view relationships so that the results can later
    be used with autograd. `inference_mode` skips that bookkeeping: fewer CPU-side costs per
    operation, which matters for small kernels and high request rates.

    ## Example
    ```python
    with torch.no_grad():
        probs = model(x).softmax(-1)
    ```

    ## Use instead
    ```python
    with torch.inference_mode():
        probs = model(x).softmax(-1)
    ```

    ## Fix safety
    Unsafe (**semantics**), opt-in. Tensors created in inference mode are *inference tensors*
    (E-11): using one later in a computation autograd records raises `RuntimeError: Inference
    tensors cannot be saved for backward`, and modifying one in place outside inference mode raises
    `RuntimeError: Inplace update to inference tensor outside InferenceMode is not allowed`. The fix is
    therefore offered only in scripts (a `with` block at module level, or a file with an
    `if __name__ == "__main__":` guard; a decorated function must be called in the file) that never
    train, never in library modules whose results go to unknown callers, and not when a name assigned in the block is
    later modified in place or passed to a model (or any function that is not a torch function
    or a builtin) outside a no-grad region. The values are identical.
    """

    code = "TOP802"
    name = "no-grad-instead-of-inference-mode"
    family = FAMILY
    message = "`{call}` in an inference-only script: `inference_mode` skips autograd bookkeeping altogether"
    fix_title = "Use `{new}`"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS,)
    prefilter = ("no_grad",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.patterns import module_level_with

        return super().could_match(text) and ("__main__" in text or module_level_with(text))

    examples = (
        Invalid(
            _PURE + "with torch.no_grad():\n    probs = model(x).softmax(-1)\nprint(probs.argmax(-1).tolist())\n",
            after=_PURE + "with torch.inference_mode():\n    probs = model(x).softmax(-1)\nprint(probs.argmax(-1).tolist())\n",
            unsafe="semantics",
            runnable=True,
        ),
        Invalid(
            "import torch\n\n\n@torch.no_grad()\ndef predict(model, batch):\n    return model(batch).argmax(-1)\n\n\n"
            "if __name__ == \"__main__\":\n    print(predict(torch.nn.Linear(3, 2), torch.ones(1, 3)))\n",
            after="import torch\n\n\n@torch.inference_mode()\ndef predict(model, batch):\n    return model(batch).argmax(-1)\n\n\n"
            "if __name__ == \"__main__\":\n    print(predict(torch.nn.Linear(3, 2), torch.ones(1, 3)))\n",
            unsafe="semantics",
        ),
        Invalid(
            "from torch import no_grad\nimport torch as T\n\nwith no_grad():\n    y = net(x)\n",
            after="from torch import no_grad\nimport torch as T\n\nwith T.inference_mode():\n    y = net(x)\n",
            unsafe="semantics",
        ),
        Valid(
            _PURE + "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nwith torch.no_grad():\n    ref = model(x)\n"
            "loss = (model(x) - ref).pow(2).sum()\nloss.backward()\n",
            note="the script trains: tensors made in inference mode cannot be saved for backward",
            runnable=True,
        ),
        Valid(
            _PURE + "with torch.no_grad():\n    feats = model[0](x)\nfeats += 1\n",
            note="an in-place update outside inference mode would raise",
            runnable=True,
        ),
        Valid(
            "import torch\n\n\n@torch.no_grad()\ndef fuse(conv, bn):\n    return conv.weight * bn.weight.view(-1, 1, 1, 1)\n",
            note="a library function: its result may become a parameter that is trained later",
        ),
        Valid(
            _PURE + "with torch.no_grad():\n    feats = model[0](x)\nout = model[2](feats)\n",
            note="used by a forward with autograd on (the parameters require grad): would raise",
            runnable=True,
        ),
    )

    def __init__(self, ctx) -> None:  # type: ignore[no-untyped-def]
        super().__init__(ctx)
        self._sites: list[tuple[cst.Call, cst.CSTNode]] = []  # (no_grad call, the with or the def)

    def visit_With(self, node: cst.With) -> None:
        for item in node.items:
            if isinstance(item.item, cst.Call) and self._is_no_grad(item.item):
                self._sites.append((item.item, node))

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        for d in node.decorators:
            if isinstance(d.decorator, cst.Call) and self._is_no_grad(d.decorator):
                self._sites.append((d.decorator, node))

    def _is_no_grad(self, call: cst.Call) -> bool:
        return not call.args and callee(self, call) in ("torch.no_grad", "torch.autograd.no_grad",
                                                        "torch.autograd.grad_mode.no_grad")

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self._sites or self._trains_anywhere():
            return
        ref = torch_ref(self)
        if ref is None:
            return
        guarded = any(isinstance(stmt, cst.If) and "__main__" in self.ctx.module.code_for_node(stmt.test)
                      for stmt in self.ctx.module.body)
        for call, owner in self._sites:
            # Only in scripts: in a library module the results escape to callers that may train
            # with them (a `fuse()` that builds parameters, a loss helper), which would then raise.
            if not (guarded or isinstance(owner, cst.With) and self._at_module_level(owner)):
                continue
            if isinstance(owner, cst.FunctionDef) and not self.calls_to(owner.name.value):
                continue
            if not self._escapes_ok(owner):
                continue
            new = cst.Call(func=self._inference_mode_func(call, ref.name))
            text = cst.Module([]).code_for_node(new)
            self.report(call, fmt={"call": source(self, call), "new": text}, replacement=new,
                        imports=ref.imports if not isinstance(call.func, cst.Attribute) else (),
                        note="tensors made in the block are inference tensors: no later autograd use or in-place "
                             "update outside inference mode")

    def _at_module_level(self, node: cst.CSTNode) -> bool:
        cur = self.get_metadata(ParentProvider, node, None)
        while cur is not None:
            if isinstance(cur, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return False
            cur = self.get_metadata(ParentProvider, cur, None)
        return True

    def _inference_mode_func(self, call: cst.Call, torch_alias: str) -> cst.BaseExpression:
        if isinstance(call.func, cst.Attribute) and dotted(call.func) in ("torch.no_grad", f"{torch_alias}.no_grad"):
            return call.func.with_changes(attr=cst.Name("inference_mode"))
        return cst.parse_expression(f"{torch_alias}.inference_mode")

    def _trains_anywhere(self) -> bool:
        for n in walk(self.ctx.module, cross_scopes=True):
            if isinstance(n, cst.Call):
                q = callee(self, n)
                if q and (q.startswith("torch.optim.") or q in ("torch.autograd.grad", "torch.autograd.backward",
                                                               "torch.enable_grad", "torch.set_grad_enabled")):
                    return True
                if isinstance(n.func, cst.Attribute) and n.func.attr.value in ("backward", "requires_grad_",
                                                                               "zero_grad", "retain_grad"):
                    return True
            elif isinstance(n, cst.Attribute) and n.attr.value in ("grad", "grad_fn"):
                return True
        return False

    def _escapes_ok(self, owner: cst.CSTNode) -> bool:
        """No tensor made under the new mode is modified in place, or given to a function that may
        record it for autograd, outside a no-grad region."""
        if isinstance(owner, cst.With):
            names = self.assigned_names(owner.body)
            region: cst.CSTNode = owner
        else:
            assert isinstance(owner, cst.FunctionDef)
            names = set()
            for call in self.calls_to(owner.name.value):
                stmt = self.statement_of(call)
                names |= {x.value for t in walk(stmt) if isinstance(t, cst.AssignTarget)
                          for x in walk(t.target) if isinstance(x, cst.Name)}
                if not isinstance(stmt, cst.SimpleStatementLine) or not names and not self._value_use_ok(call):
                    return False
            region = owner
        if not names:
            return True
        for n in walk(self.ctx.module, cross_scopes=True):
            if self.inside_node(n, region):
                continue
            if isinstance(n, cst.AugAssign):
                base = n.target
                while isinstance(base, (cst.Subscript, cst.Attribute)):
                    base = base.value
                if isinstance(base, cst.Name) and base.value in names:
                    return False
            elif isinstance(n, cst.AssignTarget) and isinstance(n.target, cst.Subscript):
                base = n.target.value
                if isinstance(base, cst.Name) and base.value in names:
                    return False
            elif isinstance(n, cst.Call):
                if isinstance(n.func, cst.Attribute):
                    recv = n.func.value
                    if isinstance(recv, cst.Name) and recv.value in names and n.func.attr.value.endswith("_") \
                            and not n.func.attr.value.startswith("_"):
                        return False
                uses = any(isinstance(x, cst.Name) and x.value in names for a in n.args for x in walk(a.value))
                if uses and not self._harmless_call(n) and not self.in_grad_off(n):
                    return False
        return True

    def _value_use_ok(self, call: cst.Call) -> bool:
        parent = self.get_metadata(ParentProvider, call, None)
        return isinstance(parent, (cst.Expr, cst.Arg)) and (
            not isinstance(parent, cst.Arg) or self._harmless_call(self.get_metadata(ParentProvider, parent, None)))

    def _harmless_call(self, call: cst.CSTNode | None) -> bool:
        if not isinstance(call, cst.Call):
            return False
        if isinstance(call.func, cst.Name) and call.func.value in (
                "print", "len", "list", "tuple", "float", "int", "str", "round", "sorted", "zip", "enumerate",
                "isinstance", "repr", "max", "min", "sum", "dict", "set"):
            return True
        if isinstance(call.func, cst.Attribute) and call.func.attr.value in (
                "append", "extend", "format", "item", "tolist", "numpy", "cpu", "write", "info", "debug",
                "warning", "add_scalar"):
            return True
        q = callee(self, call)
        return q is not None and q.startswith("torch.") and not q.startswith("torch.nn.")

    def inside_node(self, node: cst.CSTNode, container: cst.CSTNode) -> bool:
        cur: cst.CSTNode | None = node
        while cur is not None:
            if cur is container:
                return True
            cur = self.get_metadata(ParentProvider, cur, None)
        return False


class EvalTrainModeMismatch(EvalRule):
    """## What it does
    Reports two mode mistakes around evaluation:

    * evaluation code (a function named like evaluation, or a loop over a loader named like
      held-out data) that runs a model without `model.eval()` before it — neither in the function
      nor before the calls to it;
    * an epoch loop that trains and then switches a model to evaluation (`model.eval()`, or a
      function of the file that calls `.eval()`) but never switches it back with `model.train()`, so
      from the second epoch on the model trains in evaluation mode.

    ## Why is this slow
    It is a correctness trap that looks like a tuning one: `torch.no_grad()` does not disable
    dropout (E-11: 49 % of the entries were still zeroed) or freeze BatchNorm statistics, so evaluation
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
    Display-only: inserting `.eval()`/`.train()` changes what dropout and BatchNorm compute (rules.md
    INF-003 allows it only as an opt-in semantic rewrite), and the right place depends on the code.
    """

    code = "TOP803"
    name = "eval-train-mode-mismatch"
    family = FAMILY
    message = "{what} runs `{model}` without `{model_root}.eval()`: dropout and BatchNorm stay in training mode"
    train_message = ("`{call}` switches the model to evaluation inside an epoch loop that trains, and nothing "
                     "switches it back: from the second epoch on it trains in eval mode; call `.train()` "
                     "at the start of each epoch")
    safety = Safety.DISPLAY
    prefilter = ("val", "test", "eval", "predict", "infer", "dev_", "_dev", "devloader", "holdout")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.patterns import eval_sites_possible

        # An epoch loop that trains (`.backward()` or torch.autograd's grad/backward) and calls
        # `.eval()`, or an evaluation function / loop that calls a model.
        from torchopt.codemods.inference._evalcode import epoch_loop_possible, eval_units_possible

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
            "        model.eval()\n        score = sum(model(x).sum().item() for x, y in val_loader)\n",
        ),
        Valid(
            "def evaluate(model, loader):\n    model.eval()\n    return [model(x) for x, y in loader]\n",
        ),
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
            "            opt.step()\n        model.eval()\n        evaluate(model, val_loader)\n",
        ),
    )

    def __init__(self, ctx) -> None:  # type: ignore[no-untyped-def]
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
        fwd = self.forward_calls(fn.body)
        if not fwd or self.trains(fn.body) is not None or self._mode_calls(fn.body, "eval"):
            return
        calls = self.calls_to(fn.name.value)
        for call in calls:
            if not self._eval_before(call):
                break
        else:
            if calls:
                return
        model = fwd[0][1]
        self.report(fn.name, fmt={"what": f"`{fn.name.value}()`", "model": model, "model_root": model.split(".")[0]
                                  if model.split(".")[0] != "self" else model})

    def _eval_before(self, node: cst.CSTNode, root: str | None = None) -> bool:
        """Whether an `.eval()` call (on ``root``, when given) precedes ``node`` in its function (or
        the module)."""
        scope = self.scope_body(node)
        pos = self.get_metadata_pos(node)
        if any(self.get_metadata_pos(c) < pos for c in self._mode_calls(scope, "eval")
               if root is None or (dotted(c.func.value) or "").split(".")[0] == root):
            return True
        # A call, before ``node``, of a function of this file that switches its argument to eval mode.
        fns = {f.name.value: f for f in self._fns}
        for n in walk(scope):
            if isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value in fns \
                    and self.get_metadata_pos(n) < pos and self._mode_calls(fns[n.func.value].body, "eval"):
                if root is None or any(isinstance(a.value, cst.Name) and a.value.value == root for a in n.args):
                    return True
        return False

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
        fwd = self.forward_calls(loop.body)
        if not fwd or self.trains(loop.body) is not None:
            return
        model = fwd[0][1]
        root = model.split(".")[0]
        if self._eval_before(loop, root if root != "self" else None):
            return
        self.report(loop.iter, fmt={"what": f"The loop over `{name}`", "model": model,
                                    "model_root": root if root != "self" else model})

    def _epoch_loop(self, loop: cst.For | cst.While, fns: dict[str, cst.FunctionDef], reported: set[int]) -> None:
        body = loop.body
        called = [fns[n.func.value] for n in walk(body)
                  if isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value in fns]
        trains = self._has_backward(body) or any(self._has_backward(f.body) for f in called)
        if not trains:
            return
        if self._mode_calls(body, "train") or any(self._mode_calls(f.body, "train") for f in called):
            return
        # The models the loop trains: called with autograd on, or handed to a function that trains.
        trained = {d.split(".")[0] for c, d in self.forward_calls(body) if not self.in_grad_off(c)}
        for n in walk(body):
            if isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value in fns \
                    and self._has_backward(fns[n.func.value].body):
                trained |= {a.value.value for a in n.args if isinstance(a.value, cst.Name)}
        evals: list[cst.CSTNode] = [c for c in self._mode_calls(body, "eval")
                                    if (dotted(c.func.value) or "").split(".")[0] in trained]  # type: ignore[union-attr]
        for n in walk(body):
            if isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value in fns \
                    and self._mode_calls(fns[n.func.value].body, "eval") \
                    and any(isinstance(a.value, cst.Name) and a.value.value in trained for a in n.args):
                evals.append(n)
        if not evals:
            return
        first = min(evals, key=self.get_metadata_pos)
        if id(first) in reported:
            return
        reported.add(id(first))
        self.report(first, message=self.train_message, fmt={"call": source(self, first)})

    def _has_backward(self, body: cst.CSTNode) -> bool:
        for n in walk(body):
            if isinstance(n, cst.Call):
                if isinstance(n.func, cst.Attribute) and n.func.attr.value == "backward":
                    return True
                if callee(self, n) in ("torch.autograd.grad", "torch.autograd.backward"):
                    return True
        return False
