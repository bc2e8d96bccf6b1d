"""TOP802 `no-grad-instead-of-inference-mode`: In a script that never trains (no `backward`, `torch.autograd.grad`, optimizer, or."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.lifecycle import lifecycle_of
from torchopt.analysis.run_once import once_per_process
from torchopt.analysis.names import callee
from torchopt.analysis.names import torch_ref
from torchopt.analysis.project import Definition, index_of
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.inference import FAMILY
from torchopt.codemods.inference.eval_code import EvalRule
from torchopt.codemods.inference.eval_code import dotted
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid

# Methods that restore saved weights into objects the block may go on to use.
_RESTORES = frozenset(("load", "load_checkpoint", "restore", "load_state_dict", "from_pretrained", "load_model"))


class NoGradInPureInference(EvalRule):
    """## What it does
    In a script that never trains (no `backward`, `torch.autograd.grad`, optimizer,
    `requires_grad_`, `model.train()`, or call of a training routine such as `train_one_epoch(...)` or
    `trainer.fit(...)` that may train elsewhere), flags `torch.no_grad()` (a `with` block or a decorator) and offers
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
    Unsafe (**semantics**), opt-in. Tensors created in inference mode are *inference tensors*:
    using one later in a computation autograd records raises `RuntimeError: Inference
    tensors cannot be saved for backward`, and modifying one in place outside inference mode raises
    `RuntimeError: Inplace update to inference tensor outside InferenceMode is not allowed`. The fix is
    therefore offered only in scripts (a `with` block at module level, or a file with an
    `if __name__ == "__main__":` guard; a decorated function must be called in the file) that never
    train, never in library modules whose results go to unknown callers, and not when a name assigned in the block is
    later modified in place or passed to a model (or any function that is not a torch function
    or a builtin) outside a no-grad region, nor for a block or function that builds a model or loads
    weights into one (see "Model lifecycle" in docs/design.md): parameters made in inference mode
    are inference tensors, and the `load_state_dict` that follows outside the block would raise.
    The values are identical.
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
            dedent("""\
                import torch
                from torch import nn

                model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
                model.eval()
                x = torch.randn(3, 4)
                with torch.no_grad():
                    probs = model(x).softmax(-1)
                print(probs.argmax(-1).tolist())
            """),
            after=dedent("""\
                import torch
                from torch import nn

                model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
                model.eval()
                x = torch.randn(3, 4)
                with torch.inference_mode():
                    probs = model(x).softmax(-1)
                print(probs.argmax(-1).tolist())
            """),
            unsafe="semantics",
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch


                @torch.no_grad()
                def predict(model, batch):
                    return model(batch).argmax(-1)


                if __name__ == "__main__":
                    print(predict(torch.nn.Linear(3, 2), torch.ones(1, 3)))
            """),
            after=dedent("""\
                import torch


                @torch.inference_mode()
                def predict(model, batch):
                    return model(batch).argmax(-1)


                if __name__ == "__main__":
                    print(predict(torch.nn.Linear(3, 2), torch.ones(1, 3)))
            """),
            unsafe="semantics",
        ),
        Invalid(
            dedent("""\
                from torch import no_grad
                import torch as T

                with no_grad():
                    y = net(x)
            """),
            after=dedent("""\
                from torch import no_grad
                import torch as T

                with T.inference_mode():
                    y = net(x)
            """),
            unsafe="semantics",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn

                model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
                model.eval()
                x = torch.randn(3, 4)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                with torch.no_grad():
                    ref = model(x)
                loss = (model(x) - ref).pow(2).sum()
                loss.backward()
            """),
            note="the script trains: tensors made in inference mode cannot be saved for backward",
            runnable=True,
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn

                model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
                model.eval()
                x = torch.randn(3, 4)
                with torch.no_grad():
                    feats = model[0](x)
                feats += 1
            """),
            note="an in-place update outside inference mode would raise",
            runnable=True,
        ),
        Valid(
            dedent("""\
                import torch


                @torch.no_grad()
                def fuse(conv, bn):
                    return conv.weight * bn.weight.view(-1, 1, 1, 1)
            """),
            note="a library function: its result may become a parameter that is trained later",
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn

                model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
                model.eval()
                x = torch.randn(3, 4)
                with torch.no_grad():
                    feats = model[0](x)
                out = model[2](feats)
            """),
            note="used by a forward with autograd on (the parameters require grad): would raise",
            runnable=True,
        ),
        Valid(
            dedent("""\
                import torch
                from torch import nn

                if __name__ == "__main__":
                    with torch.no_grad():
                        model = nn.Linear(4, 2)
                    model.load_state_dict({"weight": torch.ones(2, 4), "bias": torch.zeros(2)})
            """),
            note="builds the model: its parameters would be inference tensors, and the `load_state_dict` "
            "after the block would raise",
            runnable=True,
        ),
    )

    def __init__(self, ctx) -> None:
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
        return not call.args and callee(self, call) in (
            "torch.no_grad",
            "torch.autograd.no_grad",
            "torch.autograd.grad_mode.no_grad",
        )

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self._sites or self.trains_anywhere():
            return
        ref = torch_ref(self)
        if ref is None:
            return
        guarded = any(
            isinstance(stmt, cst.If) and "__main__" in self.ctx.module.code_for_node(stmt.test)
            for stmt in self.ctx.module.body
        )
        for call, owner in self._sites:
            # Only in scripts: in a library module the results escape to callers that may train
            # with them (a `fuse()` that builds parameters, a loss helper), which would then raise.
            if not (guarded or isinstance(owner, cst.With) and self._at_module_level(owner)):
                continue
            if isinstance(owner, cst.FunctionDef) and not self.calls_to(owner.name.value):
                continue
            if once_per_process(self, owner):
                continue  # one forward of a program that runs no step: nothing to pay back
            if not self._escapes_ok(owner):
                continue
            if lifecycle_of(self).builds_or_loads(owner) or self._builds_through_project(owner):
                # Parameters made under inference_mode are inference tensors: the `load_state_dict`
                # (or training) that follows outside the block would raise.
                continue
            new = cst.Call(func=self._inference_mode_func(call, ref.name))
            text = cst.Module([]).code_for_node(new)
            self.report(
                call,
                fmt={"call": source(self, call), "new": text},
                replacement=new,
                imports=ref.imports if not isinstance(call.func, cst.Attribute) else (),
                note="tensors made in the block are inference tensors: no later autograd use or in-place "
                "update outside inference mode",
            )

    def _builds_through_project(self, owner: cst.CSTNode) -> bool:
        """The block builds an object of the project whose construction builds layers, or may (a
        trainer that makes its model: `trainer = FluxTrainer(config)`), or restores a checkpoint
        through a method (`trainer.checkpointer.load(step=...)`)."""
        index = index_of(self)
        for c in walk(owner):
            if not isinstance(c, cst.Call):
                continue
            if isinstance(c.func, cst.Attribute) and c.func.attr.value in _RESTORES:
                return True
            written = dotted(c.func)
            found = index.resolve(written) if written is not None and index.path is not None else None
            if isinstance(found, Definition) and found.kind == "class":
                layers = index.layers(found)
                if layers.counts or layers.unknown:
                    return True
        return False

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
                names |= {
                    x.value
                    for t in walk(stmt)
                    if isinstance(t, cst.AssignTarget)
                    for x in walk(t.target)
                    if isinstance(x, cst.Name)
                }
                if not isinstance(stmt, cst.SimpleStatementLine) or not names and not self._value_use_ok(call):
                    return False
            region = owner
        if not names:
            return True
        for n in walk(self.ctx.module, cross_scopes=True):
            if self.inside_node(n, region):
                continue
            if isinstance(n, cst.AugAssign):
                base: cst.BaseExpression = n.target
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
                    if (
                        isinstance(recv, cst.Name)
                        and recv.value in names
                        and n.func.attr.value.endswith("_")
                        and not n.func.attr.value.startswith("_")
                    ):
                        return False
                uses = any(isinstance(x, cst.Name) and x.value in names for a in n.args for x in walk(a.value))
                if uses and not self._harmless_call(n) and not self.in_grad_off(n):
                    return False
        return True

    def _value_use_ok(self, call: cst.Call) -> bool:
        parent = self.get_metadata(ParentProvider, call, None)
        return isinstance(parent, (cst.Expr, cst.Arg)) and (
            not isinstance(parent, cst.Arg) or self._harmless_call(self.get_metadata(ParentProvider, parent, None))
        )

    def _harmless_call(self, call: cst.CSTNode | None) -> bool:
        if not isinstance(call, cst.Call):
            return False
        if isinstance(call.func, cst.Name) and call.func.value in (
            "print",
            "len",
            "list",
            "tuple",
            "float",
            "int",
            "str",
            "round",
            "sorted",
            "zip",
            "enumerate",
            "isinstance",
            "repr",
            "max",
            "min",
            "sum",
            "dict",
            "set",
        ):
            return True
        if isinstance(call.func, cst.Attribute) and call.func.attr.value in (
            "append",
            "extend",
            "format",
            "item",
            "tolist",
            "numpy",
            "cpu",
            "write",
            "info",
            "debug",
            "warning",
            "add_scalar",
        ):
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
