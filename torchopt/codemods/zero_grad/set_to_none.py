"""TOP831 (``zero_grad(set_to_none=False)``) and TOP832 (hand-written loops that zero every
gradient): rules.md ZG-001 and ZG-002. Both become a plain ``zero_grad()``, which sets gradients
to None (the default since PyTorch 2.0, E-08)."""
from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.syntax import has_comments, source
from torchopt.codemods.zero_grad import FAMILY
from torchopt.codemods.zero_grad._objects import (
    MODULE,
    OPTIM,
    OTHER,
    UNKNOWN,
    grad_reads,
    module_classes,
    receiver_kind,
)
from torchopt.rewrite.rule import Invalid, Rule, Safety, Tag, Valid

_SAFETY_DOC = """\
    Unsafe (tag semantics). Gradients become None instead of zero tensors. Results are bitwise
    identical when every trainable parameter receives a gradient on every step and nothing reads
    `.grad` between the zeroing and the next backward (E-08). Otherwise they change:
    optimizers *skip* a parameter whose `.grad` is None, whereas a zero gradient still moves it
    through momentum, weight decay and Adam's moment decay (verified for `SGD(momentum=0.9)`,
    `SGD(weight_decay=0.1)` and `AdamW`; plain SGD is unaffected). That happens with conditional
    sub-modules, mixture-of-experts routing, partially frozen towers or multi-task heads used
    alternately, which a static tool cannot rule out, so the fix is never applied by default.

    No fix is offered (display-only) when the file reads `.grad` outside an
    `if <p>.grad is not None:` guard (`p.grad.norm()`, `p.grad.add_(...)`, custom accumulation):
    with gradients set to None that code raises `AttributeError: 'NoneType' object has no
    attribute ...`. Nor when the receiver resolves to an optimizer that is not a `torch.optim`
    built-in (its `zero_grad` may not accept or honour `set_to_none`)."""


class ZeroGradSetToNoneFalse(Rule):
    __doc__ = """## What it does
    Flags `optimizer.zero_grad(set_to_none=False)` and `model.zero_grad(set_to_none=False)` and
    rewrites them to the plain `zero_grad()`, which sets gradients to None.

    ## Why is this slow
    `set_to_none=False` launches a memset for every gradient tensor on every step, and the next
    backward then *accumulates* into the zeroed tensors (a read-modify-write) instead of simply
    writing them. With gradients set to None both disappear and the memory of the gradients is
    freed between steps (PyTorch tuning guide, "Use parameter.grad = None instead of
    model.zero_grad() or optimizer.zero_grad()"; since 2.0 `zero_grad()` does exactly that).

    ## Example
    ```python
    optimizer.zero_grad(set_to_none=False)
    ```

    ## Use instead
    ```python
    optimizer.zero_grad()
    ```

    ## Fix safety
{safety}
    """.replace("{safety}", _SAFETY_DOC)

    code = "TOP831"
    name = "zero-grad-set-to-none-false"
    family = FAMILY
    message = "`{call}` fills every gradient with zeros on every step"
    blocked_message = "`{call}` fills every gradient with zeros on every step; not fixed: {why}"
    fix_title = "Set gradients to None: `{new}`"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS,)
    prefilter = ("zero_grad",)

    examples = (
        Invalid(
            "import torch\n\nmodel = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
            "for _ in range(3):\n    opt.zero_grad(set_to_none=False)\n    model(torch.ones(3, 4)).sum().backward()\n    opt.step()\n",
            after="import torch\n\nmodel = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
            "for _ in range(3):\n    opt.zero_grad()\n    model(torch.ones(3, 4)).sum().backward()\n    opt.step()\n",
            unsafe="semantics", runnable=True,
            note="every parameter gets a gradient on every step: bitwise the same",
        ),
        Invalid(
            "def train_step(model, batch):\n    model.zero_grad(False)\n    model(batch).sum().backward()\n",
            after="def train_step(model, batch):\n    model.zero_grad()\n    model(batch).sum().backward()\n",
            unsafe="semantics",
            note="positional form; an unresolved receiver is assumed to be a torch module or optimizer",
        ),
        Invalid(
            "import torch\n\nmodel = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "opt.zero_grad(set_to_none=False)\nmodel(torch.ones(3, 4)).sum().backward()\n"
            "print(model.weight.grad.norm())\n",
            after=None,
            note="`.grad` is read unguarded elsewhere: it would be None before the first backward",
        ),
        Invalid(
            "from apex.optimizers import FusedAdam\n\nopt = FusedAdam(params)\nopt.zero_grad(set_to_none=False)\n",
            after=None,
            note="not a torch.optim built-in",
        ),
        Valid("import torch\n\nopt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)\nopt.zero_grad()\n",
              runnable=True),
        Valid("import torch\n\nopt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)\n"
              "opt.zero_grad(set_to_none=True)\n", runnable=True),
        Valid("def reset(opt, keep):\n    opt.zero_grad(set_to_none=keep)\n", note="not a literal False"),
        Valid("def reset(opt, kw):\n    opt.zero_grad(**kw)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if not isinstance(func, cst.Attribute) or func.attr.value != "zero_grad" or has_star(node):
            return
        if len(node.args) != 1:
            return
        arg = node.args[0]
        if arg.keyword is not None and arg.keyword.value != "set_to_none":
            return
        if not (isinstance(arg.value, cst.Name) and arg.value.value == "False"):
            return
        call = source(self, node)
        modules = module_classes(self)
        kind = receiver_kind(self, func.value, modules)
        why = None
        if kind == OTHER:
            why = f"`{source(self, func.value)}` is not a torch.optim optimizer or torch.nn module"
        else:
            reads = grad_reads(self)
            if reads:
                why = (f"`{source(self, reads[0])}` is read where it would be None "
                       "(gradients set to None have no `.norm()`, `.add_()`, ...)")
            elif has_comments(node):
                why = "a comment would be lost"
        if why:
            self.report(node, message=self.blocked_message, fmt={"call": call, "why": why})
            return
        new = node.with_changes(args=[])
        note = "gradients become None between steps: a parameter that gets no gradient in a step is skipped " \
               "by the optimizer instead of being updated with a zero gradient (momentum, weight decay)"
        if kind == UNKNOWN:
            note += f"; assuming `{source(self, func.value)}` is a torch optimizer or module"
        self.report(node, fmt={"call": call, "new": source(self, new)}, replacement=new,
                    tags=[Tag.SEMANTICS], note=note)


_ZERO_METHODS = {"zero_", "detach_", "requires_grad_"}


def _zeroing_statement(stmt: cst.CSTNode, var: str) -> str | None:
    """``p.grad.zero_()`` / ``p.grad.data.zero_()`` / ``p.grad.detach_()`` /
    ``p.grad.requires_grad_(False)``: the method name, else None."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr)):
        return None
    call = stmt.body[0].value
    if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Attribute):
        return None
    meth = call.func.attr.value
    if meth not in _ZERO_METHODS:
        return None
    if meth == "requires_grad_":
        if not (len(call.args) == 1 and isinstance(call.args[0].value, cst.Name) and call.args[0].value.value == "False"):
            return None
    elif call.args:
        return None
    target = call.func.value
    if isinstance(target, cst.Attribute) and target.attr.value == "data" and meth == "zero_":
        target = target.value
    if (isinstance(target, cst.Attribute) and target.attr.value == "grad"
            and isinstance(target.value, cst.Name) and target.value.value == var):
        return meth
    return None


def _zeroing_body(body: cst.BaseSuite, var: str) -> bool:
    """The body of ``for <var> in ...:`` only zeroes ``<var>.grad`` (optionally under
    ``if <var>.grad is not None:``)."""
    if not isinstance(body, cst.IndentedBlock):
        return False
    stmts = list(body.body)
    if len(stmts) == 1 and isinstance(stmts[0], cst.If) and stmts[0].orelse is None:
        test = stmts[0].test
        if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1
                and isinstance(test.comparisons[0].operator, cst.IsNot)
                and isinstance(test.comparisons[0].comparator, cst.Name)
                and test.comparisons[0].comparator.value == "None"
                and isinstance(test.left, cst.Attribute) and test.left.attr.value == "grad"
                and isinstance(test.left.value, cst.Name) and test.left.value.value == var):
            return False
        if not isinstance(stmts[0].body, cst.IndentedBlock):
            return False
        stmts = list(stmts[0].body.body)
    meths = [_zeroing_statement(s, var) for s in stmts]
    return bool(meths) and all(meths) and "zero_" in meths


def _loop_var(loop: cst.For) -> str | None:
    if loop.orelse is not None or loop.asynchronous is not None or not isinstance(loop.target, cst.Name):
        return None
    return loop.target.value


def _zeroing_loop_possible(text: str) -> bool:
    """visit_For's shapes on CPython's ast: ``for <v> in <X>.parameters():`` or ``for <g> in
    <X>.param_groups:`` around exactly one ``for <v> in <g>["params"]:``, whose body only zeroes
    ``<v>.grad`` (_zeroing_body: optionally under ``if <v>.grad is not None:``, at least one
    ``zero_()``), with X a name or ``self.<name>``. True when the text does not parse."""
    import ast

    from torchopt.analysis.precheck.tree import ast_index

    index = ast_index(text)
    if index is None:
        return True

    def var_of(loop) -> str | None:
        return loop.target.id if isinstance(loop, ast.For) and not loop.orelse and isinstance(loop.target, ast.Name) \
            else None

    def zeroing(stmt, var: str) -> str | None:
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Attribute)):
            return None
        call = stmt.value
        meth = call.func.attr
        if meth not in _ZERO_METHODS:
            return None
        nargs = len(call.args) + len(call.keywords)
        if meth == "requires_grad_":
            arg = call.args[0] if call.args else (call.keywords[0].value if call.keywords else None)
            if not (nargs == 1 and isinstance(arg, ast.Constant) and arg.value is False):
                return None
        elif nargs:
            return None
        target = call.func.value
        if isinstance(target, ast.Attribute) and target.attr == "data" and meth == "zero_":
            target = target.value
        if isinstance(target, ast.Attribute) and target.attr == "grad" and isinstance(target.value, ast.Name) \
                and target.value.id == var:
            return meth
        return None

    def zeroing_body(body: list, var: str) -> bool:
        stmts = body
        if len(stmts) == 1 and isinstance(stmts[0], ast.If) and not stmts[0].orelse:
            t = stmts[0].test
            if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.IsNot)
                    and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value is None
                    and isinstance(t.left, ast.Attribute) and t.left.attr == "grad"
                    and isinstance(t.left.value, ast.Name) and t.left.value.id == var):
                return False
            stmts = stmts[0].body
        meths = [zeroing(st, var) for st in stmts]
        return bool(meths) and all(meths) and "zero_" in meths

    def owner_ok(owner) -> bool:
        return isinstance(owner, ast.Name) or (isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name)
                                               and owner.value.id == "self")

    for loop in index.get(ast.For, ()):
        var = var_of(loop)
        if var is None:
            continue
        it = loop.iter
        if isinstance(it, ast.Call) and not it.args and not it.keywords and isinstance(it.func, ast.Attribute) \
                and it.func.attr == "parameters" and owner_ok(it.func.value) and zeroing_body(loop.body, var):
            return True
        if isinstance(it, ast.Attribute) and it.attr == "param_groups" and owner_ok(it.value) \
                and len(loop.body) == 1 and isinstance(loop.body[0], ast.For):
            inner = loop.body[0]
            ivar = var_of(inner)
            sl = inner.iter.slice if isinstance(inner.iter, ast.Subscript) else None
            if ivar is not None and sl is not None and isinstance(inner.iter.value, ast.Name) \
                    and inner.iter.value.id == var \
                    and isinstance(sl, ast.Constant) and sl.value == "params" and zeroing_body(inner.body, ivar):
                return True
    return False


class ManualGradZeroing(Rule):
    __doc__ = """## What it does
    Flags a loop that zeroes every gradient by hand and rewrites it to `zero_grad()`:

    * `for p in model.parameters(): p.grad.zero_()` (also `p.grad.data.zero_()`, and the
      `if p.grad is not None: p.grad.detach_(); p.grad.zero_()` form) becomes `model.zero_grad()`;
    * `for group in opt.param_groups: for p in group["params"]: ...` becomes `opt.zero_grad()`.

    The guide's loop `for p in model.parameters(): p.grad = None` is already what
    `model.zero_grad()` does and is not flagged.

    ## Why is this slow
    The loop launches one memset per gradient tensor from Python on every step, and the next
    backward accumulates into the zeroed tensors instead of writing them. `zero_grad()` (which
    sets gradients to None by default since PyTorch 2.0) does neither and frees the gradient
    memory between steps.

    ## Example
    ```python
    for p in model.parameters():
        if p.grad is not None:
            p.grad.detach_()
            p.grad.zero_()
    ```

    ## Use instead
    ```python
    model.zero_grad()
    ```

    ## Fix safety
{safety}
    """.replace("{safety}", _SAFETY_DOC)

    code = "TOP832"
    name = "manual-grad-zeroing"
    family = FAMILY
    message = "This loop zeroes every gradient of `{owner}` by hand, one kernel per tensor"
    blocked_message = "This loop zeroes every gradient of `{owner}` by hand; not fixed: {why}"
    fix_title = "Use `{new}` (gradients set to None)"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS,)
    prefilter = (".grad",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # visit_For: a loop over `X.parameters()` or `X.param_groups` whose body calls one of
        # _ZERO_METHODS on `<var>.grad`.
        if not (super().could_match(text) and ("parameters" in text or "param_groups" in text) and any(
                m in text for m in _ZERO_METHODS)):
            return False
        return _zeroing_loop_possible(text)

    examples = (
        Invalid(
            "import torch\n\nmodel = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for _ in range(3):\n    for p in model.parameters():\n        if p.grad is not None:\n"
            "            p.grad.detach_()\n            p.grad.zero_()\n"
            "    model(torch.ones(3, 4)).sum().backward()\n    opt.step()\n",
            after="import torch\n\nmodel = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for _ in range(3):\n    model.zero_grad()\n"
            "    model(torch.ones(3, 4)).sum().backward()\n    opt.step()\n",
            unsafe="semantics", runnable=True,
        ),
        Invalid(
            "import torch\n\nw = torch.ones(3, requires_grad=True)\nopt = torch.optim.Adam([w], lr=0.1)\n"
            "for _ in range(2):\n    (w * 2).sum().backward()\n    opt.step()\n"
            "    for group in opt.param_groups:\n        for q in group['params']:\n            q.grad.data.zero_()\n",
            after="import torch\n\nw = torch.ones(3, requires_grad=True)\nopt = torch.optim.Adam([w], lr=0.1)\n"
            "for _ in range(2):\n    (w * 2).sum().backward()\n    opt.step()\n    opt.zero_grad()\n",
            unsafe="semantics", runnable=True,
        ),
        Invalid(
            "import torch.nn as nn\n\n\nclass Net(nn.Module):\n    def reset(self):\n"
            "        for p in self.parameters():\n            p.grad.zero_()\n",
            after="import torch.nn as nn\n\n\nclass Net(nn.Module):\n    def reset(self):\n"
            "        self.zero_grad()\n",
            unsafe="semantics",
        ),
        Invalid(
            "def step(model, loss):\n    for p in model.parameters():\n        p.grad.zero_()\n"
            "    loss.backward()\n    return [p.grad.norm() for p in model.parameters()]\n",
            after=None, note="`.grad` read unguarded after the zeroing",
        ),
        Valid("def reset(model):\n    for p in model.parameters():\n        p.grad = None\n",
              note="already what zero_grad() does"),
        Valid("def reset(model):\n    for p in model.parameters():\n        p.grad.zero_()\n        p.data.mul_(0.5)\n",
              note="the loop does more than zeroing"),
        Valid("def reset(model):\n    for p in model.encoder.parameters():\n        p.grad.zero_()\n",
              note="a sub-module's parameters: `model.encoder.zero_grad()` would do, but only plain names are rewritten"),
        Valid("def reset(params):\n    for p in params:\n        p.grad.zero_()\n", note="not a module's parameters"),
    )

    def visit_For(self, node: cst.For) -> None:
        var = _loop_var(node)
        if var is None:
            return
        owner: cst.BaseExpression | None = None
        method_owner = False
        it = node.iter
        if (isinstance(it, cst.Call) and not it.args and isinstance(it.func, cst.Attribute)
                and it.func.attr.value == "parameters" and _zeroing_body(node.body, var)):
            owner = it.func.value
        elif (isinstance(it, cst.Attribute) and it.attr.value == "param_groups" and isinstance(node.body, cst.IndentedBlock)
              and len(node.body.body) == 1 and isinstance(node.body.body[0], cst.For)):
            inner = node.body.body[0]
            ivar = _loop_var(inner)
            if (ivar is not None and isinstance(inner.iter, cst.Subscript) and isinstance(inner.iter.value, cst.Name)
                    and inner.iter.value.value == var and len(inner.iter.slice) == 1
                    and isinstance(inner.iter.slice[0].slice, cst.Index)
                    and isinstance(inner.iter.slice[0].slice.value, cst.SimpleString)
                    and inner.iter.slice[0].slice.value.evaluated_value == "params"
                    and _zeroing_body(inner.body, ivar)):
                owner = it.value
                method_owner = True
        if owner is None:
            return
        if not (isinstance(owner, cst.Name) or (isinstance(owner, cst.Attribute) and isinstance(owner.value, cst.Name)
                                                and owner.value.value == "self")):
            return
        modules = module_classes(self)
        kind = receiver_kind(self, owner, modules)
        want = OPTIM if method_owner else MODULE
        owner_src = source(self, owner)
        why = None
        if kind not in (want, UNKNOWN):
            why = f"`{owner_src}` is not a torch.optim optimizer" if method_owner else \
                f"`{owner_src}` is not a torch.nn module"
        else:
            reads = grad_reads(self, exclude=node)
            if reads:
                why = f"`{source(self, reads[0])}` is read where it would be None"
            elif has_comments(node.body):
                why = "a comment would be lost"
        if why:
            self.report(node, message=self.blocked_message, fmt={"owner": owner_src, "why": why})
            return
        call = cst.Call(func=cst.Attribute(value=owner, attr=cst.Name("zero_grad")))
        new = cst.SimpleStatementLine(body=[cst.Expr(call)], leading_lines=node.leading_lines)
        note = "gradients become None instead of zeros: a parameter without a gradient in a step is skipped " \
               "by the optimizer (momentum, weight decay)"
        if kind == UNKNOWN:
            note += f"; assuming `{owner_src}` is a torch {'optimizer' if method_owner else 'module'}"
        self.report(node, fmt={"owner": owner_src, "new": f"{owner_src}.zero_grad()"}, replacement=new,
                    tags=[Tag.SEMANTICS], note=note)
