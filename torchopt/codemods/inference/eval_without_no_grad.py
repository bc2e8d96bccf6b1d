"""TOP801 `eval-without-no-grad`: Flags evaluation code that runs a model with autograd on: a function named like evaluation."""

from __future__ import annotations

import re
from textwrap import dedent
from typing import Sequence

import libcst as cst

from torchopt.analysis.conventions import EVAL_FUNCTION
from torchopt.analysis.conventions import eval_loader_name
from torchopt.analysis.lifecycle import lifecycle_of
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
    return (
        isinstance(stmt, cst.If)
        and isinstance(stmt.test, cst.Comparison)
        and "__main__" in cst.Module([]).code_for_node(stmt.test)
        and "__name__" in cst.Module([]).code_for_node(stmt.test)
    )


def _script_possible(text: str) -> bool:
    """Cheap necessary condition for the inference-script unit of `leave_Module`: the text loads
    weights and, at top level, defines `main()` or has a statement (in the module, or in the body
    of a top-level `if`) that calls something named like a model. True when it does not parse."""
    import ast

    from torchopt.analysis.precheck.patterns import ast_model_call
    from torchopt.analysis.precheck.tree import ast_tree

    if _LOADS_WEIGHTS.search(text) is None:
        return False
    tree = ast_tree(text)
    if tree is None:
        return True
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    statements = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == "main":
            return True
        if isinstance(stmt, ast.If):
            statements += [s for s in stmt.body if not isinstance(s, (*defs, ast.If))]
        elif not isinstance(stmt, defs):
            statements.append(stmt)
    return ast_model_call(statements)


class EvalWithoutNoGrad(EvalRule):
    """## What it does
    Flags evaluation code that runs a model with autograd on: a function named like evaluation
    (`evaluate`, `validate`, `predict`, `infer`, `test`, `run_validation`, ...) or a loop over a loader
    named like held-out data (`val_loader`, `test_dl`, `eval_batches`, ...) that calls a model, and
    neither computes gradients (`backward`, `torch.autograd.grad`, an optimizer step) nor runs
    under `torch.no_grad()` / `torch.inference_mode()` already. It decorates the function with
    `@torch.no_grad()` or wraps the loop in `with torch.no_grad():`. Methods count too
    (`Trainer.evaluate(self)`), except methods of a torch module, which are part of its forward.
    A loop whose model calls already sit in a `with torch.no_grad():` is left alone, and so is a
    call of an object whose class (of the file or of another module of the project) runs its
    `__call__`, else its `forward`, under `@torch.no_grad()` / `@torch.inference_mode()` (a
    pipeline: it records no graph), and a call `accelerator.unwrap_model(model)` (it returns the
    model, it runs nothing), and so is a model module's self-test (`def test(): net = Net(); print(net(torch.randn(2, 4)).shape)`, run
    only by the module's `if __name__ == "__main__":` block; see "Where programs run" in
    docs/design.md): no evaluation program runs there.

    An *inference script* (it loads weights, with `load_state_dict`, `torch.load` or
    `from_pretrained`, and nothing in the file trains) is evaluation code as a whole: its `main()`
    is decorated, and its top-level statements (or those of its `if __name__ == "__main__":`
    block) from the first model call to the last go under one `with torch.no_grad():` (unsafe,
    semantics: the outputs, saved or returned, no longer require grad).

    A fix never wraps a model's construction or weight loading (the model lifecycle of
    docs/design.md): a function that builds or loads a model (an inference `main()`) is not
    decorated, its statements that run the model are wrapped instead, and a statement that builds
    or loads a module ends one `with` block (the next model call starts another). Parameters made
    under `inference_mode` (which TOP802 may make of the block) are inference tensors, and a later
    `load_state_dict` on them raises.

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

        return (
            super().could_match(text)
            and eval_sites_possible(text)
            and eval_units_possible(text, asynchronous=False, mode_calls=False)
        ) or _script_possible(text)

    examples = (
        Invalid(
            dedent("""\
                import torch
                from torch import nn

                model = nn.Linear(4, 3)
                val_loader = [(torch.randn(2, 4), torch.tensor([0, 2]))]
                correct = 0
                for x, y in val_loader:
                    correct += (model(x).argmax(1) == y).sum().item()
            """),
            after=dedent("""\
                import torch
                from torch import nn

                model = nn.Linear(4, 3)
                val_loader = [(torch.randn(2, 4), torch.tensor([0, 2]))]
                correct = 0
                with torch.no_grad():
                    for x, y in val_loader:
                        correct += (model(x).argmax(1) == y).sum().item()
            """),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch


                def evaluate(model, loader):
                    model.eval()
                    total = 0.0
                    for x, y in loader:
                        total += torch.nn.functional.mse_loss(model(x), y).item()
                    return total / len(loader)
            """),
            after=dedent("""\
                import torch


                @torch.no_grad()
                def evaluate(model, loader):
                    model.eval()
                    total = 0.0
                    for x, y in loader:
                        total += torch.nn.functional.mse_loss(model(x), y).item()
                    return total / len(loader)
            """),
        ),
        Invalid(
            dedent("""\
                import torch


                def predict(model, x):
                    return model(x).softmax(-1)
            """),
            after=dedent("""\
                import torch


                @torch.no_grad()
                def predict(model, x):
                    return model(x).softmax(-1)
            """),
            unsafe="semantics",
            note="the returned probabilities no longer require grad",
        ),
        Valid(
            dedent("""\
                import torch


                def validate(model, loader, opt):
                    for x, y in loader:
                        loss = model(x).sum()
                        loss.backward()
                        opt.step()
            """),
            note="trains",
        ),
        Valid(
            dedent("""\
                import torch


                @torch.no_grad()
                def evaluate(model, loader):
                    return [model(x) for x, y in loader]
            """)
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn

                model = nn.Linear(4, 3)
                val_loader = [(torch.randn(2, 4), torch.tensor([0, 2]))]
                with torch.inference_mode():
                    for x, y in val_loader:
                        out = model(x)
            """),
            runnable=True,
        ),
        Valid(
            dedent("""\
                import torch


                def distill(teacher, student, val_loader):
                    for x, y in val_loader:
                        soft = teacher(x)
                        loss = (student(x) - soft).pow(2).mean()
                        loss.backward()
            """)
        ),
        Valid(
            dedent("""\
                import torch


                def predict(model, x):
                    return model(x)


                def train_step(model, x):
                    out = predict(model, x)
                    out.sum().backward()
            """),
            note="the prediction feeds a backward in the same file",
        ),
        Valid(
            dedent("""\
                def evaluate(results):
                    return sum(r.score for r in results)
            """),
            note="no model call",
        ),
        Invalid(
            dedent("""\
                import torch


                class Trainer:
                    def evaluate(self):
                        total = 0
                        for x, y in self.val_data:
                            total += (self.model(x).argmax(1) == y).sum().item()
                        return total
            """),
            after=dedent("""\
                import torch


                class Trainer:
                    @torch.no_grad()
                    def evaluate(self):
                        total = 0
                        for x, y in self.val_data:
                            total += (self.model(x).argmax(1) == y).sum().item()
                        return total
            """),
            note="a trainer's method (not a torch module's)",
        ),
        Invalid(
            dedent("""\
                import torch

                model = torch.nn.Linear(4, 2)
                model.load_state_dict(torch.load('w.pt'))
                model.eval()
                out = model(torch.load('inputs.pt'))
                torch.save(out, 'out.pt')
            """),
            after=dedent("""\
                import torch

                model = torch.nn.Linear(4, 2)
                model.load_state_dict(torch.load('w.pt'))
                model.eval()
                with torch.no_grad():
                    out = model(torch.load('inputs.pt'))
                torch.save(out, 'out.pt')
            """),
            unsafe="semantics",
            note="a plain inference script: load weights, call the model, save the output",
        ),
        Valid(
            dedent("""\
                import torch


                def main(model, eval_dataloader):
                    model.eval()
                    for batch in eval_dataloader:
                        with torch.no_grad():
                            outputs = model(batch)
                        print(outputs.argmax(-1))
            """),
            note="the model call already runs under `no_grad` inside the loop",
        ),
        Valid(
            dedent("""\
                import torch


                class Segmenter(torch.nn.Module):
                    def predict(self, h):
                        return self.mask_head(h)

                    def forward(self, x):
                        return self.predict(self.backbone(x))
            """),
            note="a method of a module is part of its forward (gradients must flow through it)",
        ),
        Valid(
            dedent("""\
                import torch


                class Upscaler:
                    def __init__(self, net):
                        self.net = net

                    @torch.no_grad()
                    def __call__(self, x):
                        return self.net(x).clamp(0, 1)


                def predict(net, images):
                    generator = Upscaler(net)
                    return [generator(x) for x in images]
            """),
            note="the pipeline's `__call__` already runs under `no_grad`",
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
        mains = [
            fn
            for fn in original_node.body
            if isinstance(fn, cst.FunctionDef) and fn.name.value == "main" and fn not in self._fns
        ]
        script = (
            _LOADS_WEIGHTS.search(self.ctx.text) is not None
            and (bool(mains) or self._top_level_forwards(original_node))
            and not self.trains_anywhere()
        )
        if script:  # an inference script's `main()` is its evaluation unit
            self._fns.extend(mains)
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

    def _top_level_forwards(self, module: cst.Module) -> bool:
        """Whether a statement `_script_block` looks at calls a model: without a `main()` and such a
        statement, being an inference script changes nothing, and asking costs a walk of the file."""
        guard = next((s for s in module.body if _is_main_guard(s)), None)
        blocks: list[Sequence[cst.BaseStatement]] = [module.body]
        if guard is not None and isinstance(guard.body, cst.IndentedBlock):
            blocks.append(guard.body.body)
        return any(
            not isinstance(st, (cst.FunctionDef, cst.ClassDef, cst.If)) and self.forward_calls(st)
            for block in blocks
            for st in block
        )

    def _script_block(self, block: cst.Module | cst.IndentedBlock) -> None:
        """Top-level statements of an inference script (load weights, call the model, save the
        output) that call a model with autograd on go under ``with torch.no_grad():`` (a ``with``
        does not scope names, so everything after still sees them)."""
        self._wrap_runs(block, "This inference script", None, in_function=False)

    def _wrap_runs(
        self, block: cst.Module | cst.IndentedBlock, what: str, gf: _GradFree | None, in_function: bool = True
    ) -> bool | None:
        """Wrap the statements of ``block`` that call a model with autograd on, from the first to the
        last, in one ``with torch.no_grad():``; a statement that builds a module or loads weights into
        one (the lifecycle's construction and loading) stays outside and splits the run, since
        parameters made under ``inference_mode`` (which TOP802 may make of it) are inference tensors
        that a later ``load_state_dict`` cannot update. ``gf``: decide safety from the names the
        wrapped statements bind (None: always unsafe). Returns True when it reported, None when no
        statement of ``block`` is left to wrap, False when the statements cannot be wrapped."""
        body = list(block.body)
        lc = lifecycle_of(self)
        hits = [
            i
            for i, st in enumerate(body)
            if not isinstance(st, (cst.FunctionDef, cst.ClassDef))
            and (in_function or not isinstance(st, cst.If))  # a script's `if`s are its guard, wrapped on its own
            and not self._own_unit(st)
            and any(not self.in_grad_off(c) for c, _ in self.forward_calls(st))
            and not lc.builds_or_loads(st)
        ]
        runs: list[list[int]] = []
        for i in hits:  # a construction, a loading or a loop wrapped on its own ends a run
            if runs and not any(lc.builds_or_loads(st) or self._own_unit(st) for st in body[runs[-1][1] + 1 : i]):
                runs[-1][1] = i
            else:
                runs.append([i, i])
        for first, last in runs:
            if any(
                isinstance(st, (cst.FunctionDef, cst.ClassDef)) or self.trains(st) is not None
                for st in body[first : last + 1]
            ):
                return False
        ref = torch_ref(self)
        if not runs:
            blocked = any(
                lc.builds_or_loads(st) and any(not self.in_grad_off(c) for c, _ in self.forward_calls(st))
                for st in body
                if not isinstance(st, (cst.FunctionDef, cst.ClassDef))
            )
            return False if blocked else None
        if ref is None:
            return False
        new_body: list[cst.BaseStatement] = []
        done = 0
        for first, last in runs:
            head = body[first]
            assert isinstance(head, (cst.SimpleStatementLine, cst.BaseCompoundStatement))  # as every statement is
            new_body += body[done:first]
            new_body.append(
                cst.With(
                    items=[cst.WithItem(item=cst.Call(func=ref.attr("no_grad")))],
                    body=cst.IndentedBlock(body=[head.with_changes(leading_lines=()), *body[first + 1 : last + 1]]),
                    leading_lines=head.leading_lines,
                )
            )
            done = last + 1
        new_body += body[done:]
        wrapped = [st for first, last in runs for st in body[first : last + 1]]
        free = gf is not None and all(self._bound_free(wrapped, name, gf) for name in self._bound(wrapped))
        fwd = self.forward_calls(body[runs[0][0]])
        model = fwd[0][1] if fwd else "the model"
        fix = {"replacement": block.with_changes(body=new_body), "target": block, "imports": ref.imports}
        if free:
            self.report(body[runs[0][0]], fmt={"what": what, "model": model}, **fix)
            return True
        self.report(
            body[runs[0][0]],
            fmt={"what": what, "model": model},
            **fix,
            safety=Safety.UNSAFE,
            tags=(Tag.SEMANTICS,),
            note="values are identical; tensors computed from the model no longer require grad "
            "(a saved output tensor no longer carries requires_grad)",
        )
        return True

    def _own_unit(self, st: cst.CSTNode) -> bool:
        """A loop over held-out data that ``_loop`` wraps on its own (not one inside a function named
        like evaluation: there the function is the unit)."""
        if not (isinstance(st, cst.For) and st in self._loops):
            return False
        fn = self.enclosing_function(st)
        return fn is None or not EVAL_FUNCTION.match(fn.name.value)

    def _bound(self, stmts: list[cst.BaseStatement]) -> set[str]:
        out: set[str] = set()
        for st in stmts:
            out |= self.assigned_names(st)
        return out

    def _bound_free(self, stmts: list[cst.BaseStatement], name: str, gf: _GradFree) -> bool:
        for st in stmts:
            for n in walk(st):
                if isinstance(n, cst.Name) and n.value == name:
                    return gf.name(n, 0)
        return False

    def _function(self, fn: cst.FunctionDef, gf: _GradFree) -> None:
        if self.decorated_grad_off(fn) or self.in_grad_off(fn):
            return
        if self.is_module_method(fn) or self.called_from_training(fn):
            return
        fwd = [f for f in self.forward_calls(fn.body) if not self.in_grad_off(f[0])]
        if not fwd or self.trains(fn.body) is not None:
            return
        if any(isinstance(n, cst.With) and any(self.grad_off_call(i.item) for i in n.items) for n in walk(fn.body)):
            return  # the user chose where autograd is off
        if lifecycle_of(self).builds_or_loads(fn.body):
            # Never decorate over the model's construction or weight loading: wrap the statements
            # that run the model instead.
            what = f"`{fn.name.value}()`"
            if not isinstance(fn.body, cst.IndentedBlock) or self._wrap_runs(fn.body, what, gf) is False:
                self.report(
                    fn.name,
                    fmt={"what": what, "model": fwd[0][1]},
                    note="not rewritten: the statements that run the model also build it or load its weights",
                )
            return
        results = [n.value for n in walk(fn.body) if isinstance(n, (cst.Return, cst.Yield)) and n.value is not None]
        for call in self.calls_to(fn.name.value):
            stmt = self.statement_of(call)
            if self.trains(stmt) is not None:
                return
            names = {
                x.value
                for t in walk(stmt)
                if isinstance(t, cst.AssignTarget)
                for x in walk(t.target)
                if isinstance(x, cst.Name)
            }
            if names & self.backward_uses(self.scope_body(call)):
                return
        ref = torch_ref(self)
        if ref is None:
            return
        free = all(gf.expr(r) for r in results)
        deco = cst.Decorator(decorator=cst.Call(func=ref.attr("no_grad")))
        replacement = fn.with_changes(decorators=[*fn.decorators, deco])
        self._report(fn.name, fn, replacement, free, ref.imports, {"what": f"`{fn.name.value}()`", "model": fwd[0][1]})

    def _loop(self, loop: cst.For, gf: _GradFree) -> None:
        if self.in_grad_off(loop):
            return
        fn = self.enclosing_function(loop)
        if fn is not None and EVAL_FUNCTION.match(fn.name.value):
            return  # the function is the unit
        fwd = [f for f in self.forward_calls(loop.body) if not self.in_grad_off(f[0])]
        if not fwd or self.trains(loop.body) is not None:
            return  # no forward, or every one already runs with autograd off
        if lifecycle_of(self).builds_or_loads(loop.body):
            return  # a loop over checkpoints loads weights: never under no_grad/inference_mode
        parent = self.get_metadata(ParentProvider, loop, None)
        if not isinstance(parent, (cst.IndentedBlock, cst.Module)):
            return
        escaping = self.assigned_names(loop.body) - {x.value for x in walk(loop.target) if isinstance(x, cst.Name)}
        collected: list[cst.BaseExpression] = []
        for n in walk(loop.body):
            if (
                isinstance(n, cst.Call)
                and isinstance(n.func, cst.Attribute)
                and n.func.attr.value in ("append", "extend", "add", "update", "insert", "__setitem__")
            ):
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
        free = all(self._name_free(loop, n, gf) for n in escaping) and all(gf.expr(c) for c in collected)
        item = cst.WithItem(item=cst.Call(func=ref.attr("no_grad")))
        replacement = cst.With(
            items=[item],
            body=cst.IndentedBlock(body=[loop.with_changes(leading_lines=())]),
            leading_lines=loop.leading_lines,
        )
        it = self.loop_iter_name(loop) or "the loader"
        self._report(loop, loop, replacement, free, ref.imports, {"what": f"The loop over `{it}`", "model": fwd[0][1]})

    def _name_free(self, loop: cst.For, name: str, gf: _GradFree) -> bool:
        for n in walk(loop.body):
            if isinstance(n, cst.Name) and n.value == name:
                return gf.name(n, 0)
        return False

    def _report(
        self, node: cst.CSTNode, target: cst.CSTNode, replacement: cst.CSTNode, free: bool, imports, fmt
    ) -> None:
        if free:
            self.report(node, fmt=fmt, replacement=replacement, target=target, imports=imports)
        else:
            self.report(
                node,
                fmt=fmt,
                replacement=replacement,
                target=target,
                imports=imports,
                safety=Safety.UNSAFE,
                tags=(Tag.SEMANTICS,),
                note="values are identical; tensors computed from the model no longer require grad",
            )
