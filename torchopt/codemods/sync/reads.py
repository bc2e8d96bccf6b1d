"""Host reads of device values in hot loops (rules.md SYNC-001, SYNC-002, SYNC-003).

TOP601 flags ``.item()``, ``.tolist()``, ``.numpy()``, ``float(t)``, ``int(t)``, ``bool(t)`` in a
training or evaluation step and rewrites the logging-accumulator pattern (a Python float summed
from ``loss.item()`` every step and read at logging points) into a float64 accumulator on the
device. TOP602 flags printing or formatting tensors, TOP603 device→host copies."""
from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import Assignment, PositionProvider, ScopeProvider

from torchopt.analysis.names import torch_ref
from torchopt.analysis.values import classify_device, string_value
from torchopt.analysis.arguments import has_star, keyword, positional
from torchopt.analysis.syntax import source, walk
from torchopt.codemods.sync import FAMILY
from torchopt.analysis.step_loops import (
    HOST_READS,
    SCOPES,
    HotLoop,
    HotMap,
    Tensors,
    Where,
    calls_in,
    dotted,
    hot_map,
)
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid
from torchopt.analysis.conventions import LOGGER_NAMES, LOG_METHODS

_CLIP = ("clip_grad_norm_", "clip_grad_norm", "get_total_norm")
_BUILTIN_CASTS = ("float", "int", "bool")


def grad_norm_names(hm: HotMap) -> set[str]:
    """Names bound to the result of ``clip_grad_norm_(...)`` (TOP607 reports their reads)."""
    out = set()
    for n in walk(hm.rule.ctx.module, True):
        if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.value, cst.Call):
            d = dotted(n.value.func) or ""
            if d.rsplit(".", 1)[-1] in _CLIP and isinstance(n.targets[0].target, cst.Name):
                out.add(n.targets[0].target.value)
    return out


def builtin_unbound(rule: Rule, name: cst.Name) -> bool:
    """``float``/``print``... that the file does not rebind."""
    try:
        scope = rule.get_metadata(ScopeProvider, name)
    except KeyError:
        return False
    if scope is None:
        return False
    return not any(isinstance(a, Assignment) for a in scope[name.value])


def host_read(hm: HotMap, tz: Tensors, c: cst.Call) -> str | None:
    """The kind of host read ``c`` is (``.item()``...), or None."""
    if isinstance(c.func, cst.Attribute) and c.func.attr.value in HOST_READS and not c.args:
        recv = c.func.value
        while isinstance(recv, (cst.Call, cst.Attribute, cst.Subscript)):  # to the head of the chain
            if isinstance(recv, cst.Call) and (dotted(recv.func) or "").split(".")[0] in ("np", "numpy", "math"):
                return None
            recv = recv.func if isinstance(recv, cst.Call) else recv.value
        return f".{c.func.attr.value}()"
    if isinstance(c.func, cst.Name) and c.func.value in _BUILTIN_CASTS and len(c.args) == 1 \
            and not c.args[0].star and c.args[0].keyword is None:
        if tz.is_tensor(c.args[0].value) and builtin_unbound(hm.rule, c.func):
            return f"{c.func.value}()"
    return None


# --------------------------------------------------------------------------- the accumulator fix


class Refused(Exception):
    pass


@dataclass
class Plan:
    name: str
    loop: HotLoop
    owner: cst.CSTNode  # FunctionDef or Module whose scope holds the accumulator
    augs: list[cst.AugAssign] = field(default_factory=list)
    inits: list[cst.Assign] = field(default_factory=list)
    resets: list[cst.Assign] = field(default_factory=list)
    reads: list[cst.Name] = field(default_factory=list)
    items: list[cst.Call] = field(default_factory=list)
    device: str | None = None


def _zero_literal(v: cst.BaseExpression) -> str | None:
    if isinstance(v, cst.Float) and float(v.evaluated_value) == 0.0 and not v.lpar:
        return "float"
    if isinstance(v, cst.Integer) and int(v.evaluated_value) == 0 and not v.lpar:
        return "int"
    return None


class _Planner:
    def __init__(self, rule: Rule, hm: HotMap, tz: Tensors) -> None:
        self.rule, self.hm, self.tz = rule, hm, tz

    def pos(self, node: cst.CSTNode) -> tuple[int, int]:
        r = self.rule.get_metadata(PositionProvider, node)
        return (r.start.line, r.start.column)

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.rule.get_metadata(ParentProvider, node, None)

    def inside(self, node: cst.CSTNode, container: cst.CSTNode) -> bool:
        cur: cst.CSTNode | None = node
        while cur is not None:
            if cur is container:
                return True
            cur = self.parent(cur)
        return False

    def owner(self, node: cst.CSTNode) -> cst.CSTNode:
        cur = self.parent(node)
        while cur is not None and not isinstance(cur, SCOPES):
            cur = self.parent(cur)
        return cur if cur is not None else self.rule.ctx.module

    def rhs_items(self, expr: cst.BaseExpression) -> list[cst.Call]:
        """``.item()`` leaves of an arithmetic (+ - * /) expression whose other leaves are Python
        numbers; raises Refused otherwise."""
        if isinstance(expr, cst.BinaryOperation) and isinstance(
                expr.operator, (cst.Add, cst.Subtract, cst.Multiply, cst.Divide)):
            return self.rhs_items(expr.left) + self.rhs_items(expr.right)
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "item" \
                and not expr.args:
            if not self.tz.is_tensor(expr.func.value, strict=True):
                raise Refused(f"`{source(self.rule, expr.func.value)}` is not provably a tensor")
            return [expr]
        if self.tz.number(expr):
            return []
        raise Refused(f"`{source(self.rule, expr)}` is not a Python number")

    def plan(self, aug: cst.AugAssign) -> Plan:
        if not isinstance(aug.target, cst.Name) or not isinstance(aug.operator, cst.AddAssign):
            raise Refused("not a `name += ...` accumulation")
        name = aug.target
        loop = self.hm.step_loop_of(aug)
        if loop is None:
            raise Refused("not in the body of the loop")
        try:
            scope = self.rule.get_metadata(ScopeProvider, name)
        except KeyError:
            raise Refused("no scope") from None
        if scope is None:
            raise Refused("no scope")
        plan = Plan(name.value, loop, self.owner(aug))
        kinds = set()
        assignments = list(scope[name.value])
        for a in assignments:
            if not isinstance(a, Assignment) or a.scope is not scope:
                raise Refused(f"`{name.value}` is bound outside this function or by a non-assignment")
            node = a.node
            parent = self.parent(node)
            if isinstance(parent, cst.AugAssign) and parent.target is node:
                if not isinstance(parent.operator, cst.AddAssign):
                    raise Refused(f"`{name.value}` is updated by another operator than `+=`")
                if self.hm.step_loop_of(parent) is not loop:
                    raise Refused(f"`{name.value}` is accumulated outside the loop too")
                items = self.rhs_items(parent.value)
                if not items:
                    raise Refused(f"`{name.value}` accumulates a value that is not read from a tensor")
                plan.augs.append(parent)
                plan.items.extend(items)
                continue
            if isinstance(parent, cst.AssignTarget) and parent.target is node:
                stmt = self.parent(parent)
                if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1:
                    kind = _zero_literal(stmt.value)
                    if kind is None:
                        raise Refused(f"`{name.value}` is assigned something other than 0")
                    kinds.add(kind)
                    if self.inside(stmt, loop.node.body):  # type: ignore[attr-defined]
                        plan.resets.append(stmt)
                    else:
                        plan.inits.append(stmt)
                    continue
            raise Refused(f"`{name.value}` is bound in a way the rewrite cannot follow")
        if not plan.inits or not any(self.pos(i) < self.pos(loop.node) for i in plan.inits):
            raise Refused(f"`{name.value}` is not initialised before the loop")
        if any(self.owner(s) is not plan.owner for s in plan.inits + plan.resets):
            raise Refused("different scopes")
        aug_targets = {id(a.target) for a in plan.augs}
        for a in assignments:
            for ref in a.references:
                node = ref.node
                if id(node) in aug_targets or any(node is r for r in plan.reads):
                    continue
                if ref.scope is not scope or not isinstance(node, cst.Name):
                    raise Refused(f"`{name.value}` is read from a nested function or comprehension")
                self._check_read(node, plan, "int" in kinds)
                plan.reads.append(node)
        plan.device = self.device(plan)
        return plan

    def _check_read(self, node: cst.Name, plan: Plan, int_mode: bool) -> None:
        parent = self.parent(node)
        if isinstance(parent, (cst.Attribute, cst.Subscript)) and parent.value is node:
            raise Refused(f"`{plan.name}` is used as an object, not a number")
        if isinstance(parent, cst.Del):
            raise Refused(f"`{plan.name}` is deleted")
        if int_mode and not (isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Divide)
                             and parent.left is node):
            raise Refused(f"`{plan.name}` starts as the int 0 and is read other than as `{plan.name} / ...`")
        body = plan.loop.node.body  # type: ignore[attr-defined]
        if self.inside(node, body):
            cur = self.parent(node)
            while cur is not None and cur is not body:
                if isinstance(cur, (cst.If, cst.IfExp, cst.For, cst.While, cst.BooleanOperation)):
                    return
                cur = self.parent(cur)
            raise Refused(f"`{plan.name}` is read on every step")

    def device(self, plan: Plan) -> str | None:
        if isinstance(plan.owner, cst.Module):
            raise Refused(f"`{plan.name}` is a module-level global (other modules may import it as a float)")
        """The device expression (code) the accumulator is created on; None: the default (CPU)."""
        found: set[str] = set()
        for c in calls_in(plan.loop.node.body):  # type: ignore[attr-defined]
            d = self._move_target(c)
            if d is not None:
                found.add(d)
        if not found:
            found = set(self._module_moves())
        if len(found) > 1:
            raise Refused("the loop moves data to more than one device")
        if not found:
            if self._mentions_device():
                raise Refused("cannot tell which device the loss is on")
            return None
        dev = found.pop()
        if dev.strip("'\"").split(":")[0] == "mps":
            raise Refused("MPS has no float64")
        self._check_visible(dev, plan)
        return dev

    def _module_moves(self) -> set[str]:
        """Devices the file moves its models to (one walk per planner, not one per accumulator)."""
        moves = self.__dict__.get("_module_moves_memo")
        if moves is None:
            moves = set()
            for c in calls_in(self.rule.ctx.module):
                if isinstance(c.func, cst.Attribute) and dotted(c.func.value) in self.hm.modules:
                    d = self._move_target(c)
                    if d is not None:
                        moves.add(d)
            self._module_moves_memo = moves
        return moves

    def _mentions_device(self) -> bool:
        hit = self.__dict__.get("_mentions_device_memo")
        if hit is None:  # module.code regenerates the whole file: once per planner
            code = self.rule.ctx.module.code
            hit = self._mentions_device_memo = (".cuda(" in code or ".to(" in code or "device" in code
                                                or "accelerator" in code.lower())
        return hit

    def _move_target(self, c: cst.Call) -> str | None:
        if not isinstance(c.func, cst.Attribute) or has_star(c):
            return None
        meth = c.func.attr.value
        if meth == "cuda":
            if c.args:
                return None
            return '"cuda"'
        if meth != "to":
            return None
        arg = keyword(c, "device")
        expr = arg.value if arg is not None else (positional(c)[0].value if positional(c) else None)
        if expr is None:
            return None
        dev = classify_device(self.rule, expr)
        if not dev.is_device or dev.is_cpu or dev.text == "meta":
            return None
        if string_value(expr) is not None:
            return '"' + string_value(expr) + '"'  # type: ignore[operator]
        if isinstance(expr, (cst.Name, cst.Attribute)):
            return self.rule.ctx.module.code_for_node(expr)
        return None

    def _check_visible(self, dev: str, plan: Plan) -> None:
        if dev.startswith('"'):
            return
        root = dev.split(".")[0]
        first = min(plan.inits, key=self.pos)
        target = first.targets[0].target
        try:
            scope = self.rule.get_metadata(ScopeProvider, target)
        except KeyError:
            raise Refused("no scope") from None
        if scope is None or root not in scope:
            raise Refused(f"`{root}` is not visible where `{plan.name}` is initialised")
        for a in scope[root]:
            node = getattr(a, "node", None)
            if isinstance(node, cst.Param):
                continue
            if a.scope is not scope and not isinstance(plan.owner, cst.Module):
                continue  # a global read by a function: bound when the function runs
            if node is None or not isinstance(a, Assignment) or self.pos(node) >= self.pos(first):
                raise Refused(f"`{root}` is bound after `{plan.name}` is initialised")


class _Apply(cst.CSTTransformer):
    def __init__(self, plan: Plan, torch_name: str) -> None:
        super().__init__()
        T = torch_name
        dev = f", device={plan.device}" if plan.device else ""
        self.zeros = cst.parse_expression(f"{T}.zeros((), dtype={T}.float64{dev})")
        self.plan = plan
        self.inits = {id(s) for s in plan.inits}
        self.resets = {id(s) for s in plan.resets}
        self.reads = {id(r) for r in plan.reads}
        self.items = {id(c) for c in plan.items}
        self.simple = {id(a.value) for a in plan.augs if any(a.value is c for c in plan.items)}

    def leave_Assign(self, original_node: cst.Assign, updated_node: cst.Assign):  # type: ignore[override]
        if id(original_node) in self.inits:
            return updated_node.with_changes(value=self.zeros)
        if id(original_node) in self.resets:
            return cst.Expr(cst.parse_expression(f"{self.plan.name}.zero_()"), semicolon=updated_node.semicolon)
        return updated_node

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name):  # type: ignore[override]
        if id(original_node) in self.reads:
            return cst.Call(func=cst.Attribute(value=updated_node, attr=cst.Name("item")),
                            lpar=updated_node.lpar, rpar=updated_node.rpar) if updated_node.lpar else \
                cst.Call(func=cst.Attribute(value=updated_node, attr=cst.Name("item")))
        return updated_node

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call):  # type: ignore[override]
        if id(original_node) not in self.items:
            return updated_node
        recv = updated_node.func.value  # type: ignore[union-attr]
        new: cst.BaseExpression = cst.Call(func=cst.Attribute(value=recv, attr=cst.Name("detach")))
        if id(original_node) not in self.simple:
            new = cst.Call(func=cst.Attribute(value=new, attr=cst.Name("double")))
        return new.with_changes(lpar=updated_node.lpar, rpar=updated_node.rpar)


# --------------------------------------------------------------------------- TOP601


class HostReadInLoop(Rule):
    """## What it does
    Flags reads of tensor values on the host inside a training or evaluation step: `t.item()`,
    `t.tolist()`, `t.numpy()`, `float(t)`, `int(t)`, `bool(t)`. A *step* is the body of a loop that
    runs a backward pass or a module's forward on every iteration, and every function or module
    `forward` of the same file that the loop calls (a custom loss, a model). The message names the
    loop ("in the training loop at line 42").

    The common logging pattern, a Python float summed from `loss.item()` every step and printed
    every N steps, is rewritten: the sum is kept on the device in float64 and read with `.item()`
    only where the program reads it.

    ## Why is this slow
    CUDA kernels run asynchronously: the host queues work and moves on. Reading a value on the host
    must wait until every queued kernel that produces it has finished, so the queue drains and the
    GPU idles while the host prepares the next step. One `.item()` per step is enough to serialise
    the whole loop.

    ## Example
    ```python
    running_loss = 0.0
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
        if i % 100 == 99:
            print(f"loss {running_loss / 100:.4f}")
            running_loss = 0.0
    ```

    ## Use instead
    ```python
    running_loss = torch.zeros((), dtype=torch.float64, device=device)
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        running_loss += loss.detach()
        if i % 100 == 99:
            print(f"loss {running_loss.item() / 100:.4f}")
            running_loss.zero_()
    ```

    ## Fix safety
    Safe: the logged numbers are the same bits. Python adds the float32 `loss.item()` values as
    doubles; a float64 tensor adds the same float32 values, converted exactly, with the same IEEE
    double additions in the same order (rules.md E-17, and tests/test_sync_accumulator.py over
    100 000 random losses). A compound summand (`loss.item() * x.size(0)`) becomes
    `loss.detach().double() * x.size(0)`, a double multiplication as in Python. Each read becomes
    `running_loss.item()` and keeps its arithmetic in Python, so `running_loss.item() / 100` is the
    very division the program did (this differs from rules.md's `(running_loss / 100).item()`, which
    would need a proof that the divisor is a Python number).

    The fix is made only when: every summand's receiver is provably a tensor (a torch call, a
    `torch.nn` loss module, or a function of this file that returns one; a method name alone is
    not proof, G-1/G-2), the other operands are Python numbers; the name is bound only to `0.0`
    (or `0`, then it may only be read as `name / ...`), to `+=` in one loop, and read in the same
    function (a module-level global is left alone: another module may import it as a float); no
    read happens on every step (that would gain nothing); the loop's data goes to one device
    expression visible where the accumulator starts (or the file uses no device at all).
    `t.size(i)`, `t.shape[i]` and `len(...)` are taken to be Python ints.
    Resets inside the loop become `.zero_()`. On Apple MPS (no float64) the fix is not made for a
    literal `'mps'` device, but a device variable that is MPS at run time would fail. Every other
    host read is reported with the sync-free alternative and not changed.
    """

    code = "TOP601"
    name = "host-read-in-loop"
    family = FAMILY
    message = ("`{expr}` {why}, {where}: it waits for every queued kernel, so the GPU idles while the "
               "host prepares the next step{advice}")
    fix_title = "Accumulate `{acc}` on the device in float64 and read it only when it is logged"
    safety = Safety.SAFE
    prefilter = (".item(", ".tolist(", ".numpy(", "float(", "int(", "bool(")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_host_read
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_host_read).
        return super().could_match(text) and hot_check(text, may_host_read)

    _HEAD = ("import torch\n\nmodel = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
             "crit = torch.nn.MSELoss()\ndata = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(6)]\n")
    examples = (
        Invalid(
            _HEAD + "def train():\n    running = 0.0\n    logged = []\n    for i, (x, y) in enumerate(data):\n"
            "        loss = crit(model(x), y)\n        opt.zero_grad()\n        loss.backward()\n        opt.step()\n"
            "        running += loss.item()\n        if i % 3 == 2:\n            logged.append(running / 3)\n"
            "            running = 0.0\n    return logged\n\nlogged = train()\n",
            after=_HEAD + "def train():\n    running = torch.zeros((), dtype=torch.float64)\n    logged = []\n"
            "    for i, (x, y) in enumerate(data):\n"
            "        loss = crit(model(x), y)\n        opt.zero_grad()\n        loss.backward()\n        opt.step()\n"
            "        running += loss.detach()\n        if i % 3 == 2:\n            logged.append(running.item() / 3)\n"
            "            running.zero_()\n    return logged\n\nlogged = train()\n",
            runnable=True,
            note="no device in the file: the accumulator lives on the CPU like the loss",
        ),
        Invalid(
            "import torch\nimport torch.nn.functional as F\n\n"
            "def train(model, loader, opt, device):\n    total = 0.0\n    for x, y in loader:\n"
            "        x, y = x.to(device), y.to(device)\n        loss = F.cross_entropy(model(x), y)\n"
            "        loss.backward()\n        opt.step()\n        total += loss.item() * x.size(0)\n"
            "    return total / len(loader.dataset)\n",
            after="import torch\nimport torch.nn.functional as F\n\n"
            "def train(model, loader, opt, device):\n    total = torch.zeros((), dtype=torch.float64, device=device)\n"
            "    for x, y in loader:\n"
            "        x, y = x.to(device), y.to(device)\n        loss = F.cross_entropy(model(x), y)\n"
            "        loss.backward()\n        opt.step()\n        total += loss.detach().double() * x.size(0)\n"
            "    return total.item() / len(loader.dataset)\n",
            note="weighted sum: a double multiplication on the device as in Python",
        ),
        Invalid(
            "import torch\n\ndef train(model, loader, opt, crit, device):\n    hist = []\n"
            "    for x, y in loader:\n        loss = crit(model(x.to(device)), y.to(device))\n"
            "        loss.backward()\n        opt.step()\n        hist.append(loss.item())\n",
            after=None,
            note="appended every step: reported with advice, not rewritten",
        ),
        Invalid(
            "import torch\n\ndef train(model, loader, opt, crit):\n    for x, y in loader:\n"
            "        loss = crit(model(x), y)\n        loss.backward()\n"
            "        if float(loss) > 100:\n            break\n        opt.step()\n",
            after=None,
            note="control flow on a host value: reported, never rewritten",
        ),
        Invalid(
            "import torch\n\ndef train(model, loader, opt, crit, device):\n    running = 0.0\n"
            "    for x, y in loader:\n        loss = crit(model(x.to(device)), y.to(device))\n"
            "        loss.backward()\n        running += loss.item()\n        print(running)\n",
            after=None,
            note="read on every step: the rewrite would save nothing; `crit` is not provably a tensor function",
        ),
        Valid(
            "import torch\n\nx = torch.randn(3)\nvals = [x.sum().item() for _ in range(3)]\n"
            "print(float(x.mean()))\n",
            runnable=True,
            note="not in a training or forward-pass loop",
        ),
        Valid(
            "import torch\n\ndef train(model, loader, opt):\n    for x, y in loader:\n"
            "        loss = model(x).sum()\n        loss.backward()\n        opt.step()\n"
            "    print(loss.item())\n",
            note="after the loop: once",
        ),
        Valid(
            "import torch\n\nfor epoch in range(3):\n    for x in data:\n        model(x).sum().backward()\n"
            "    print(float(torch.ones(1).sum()), n.item())\n",
            note="per-epoch code of the outer loop is not a step",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.step_loops:
            return
        tz = Tensors(self, hm)
        norms = grad_norm_names(hm)
        planner = _Planner(self, hm, tz)
        plans: dict[tuple[int, str], Plan | str] = {}
        item_plan: dict[int, tuple[int, str]] = {}
        for n in walk(node, True):
            if isinstance(n, cst.AugAssign) and isinstance(n.target, cst.Name) and hm.where(n) is not None:
                key = (id(planner.owner(n)), n.target.value)
                if key not in plans:
                    try:
                        plans[key] = planner.plan(n)
                    except Refused as exc:
                        plans[key] = str(exc)
                for c in calls_in(n.value):
                    item_plan[id(c)] = key
        done: set[tuple[int, str]] = set()
        ref = torch_ref(self)
        for n in walk(node, True):
            if not isinstance(n, cst.Call):
                continue
            kind = host_read(hm, tz, n)
            if kind is None:
                continue
            where = hm.where(n)
            if where is None:
                continue
            if isinstance(n.func, cst.Attribute) and dotted(n.func.value) in norms:
                continue  # TOP607
            parent = self.get_metadata(ParentProvider, n, None)
            grand = self.get_metadata(ParentProvider, parent, None) if parent is not None else None
            if isinstance(parent, cst.Attribute) and parent.value is n and isinstance(grand, cst.Call) \
                    and grand.func is parent and parent.attr.value in HOST_READS:
                continue  # `t.numpy().tolist()`: one read, reported at the outer call
            inner = n.func.value if isinstance(n.func, cst.Attribute) else n.args[0].value
            fmt = {"expr": source(self, n), "where": where.text, "why": _WHY[kind.strip(".()")],
                   "advice": self._advice(n, kind, where), "acc": ""}
            key = item_plan.get(id(n))
            plan = plans.get(key) if key is not None else None
            if isinstance(plan, Plan) and key not in done and ref is not None:
                done.add(key)
                fmt["acc"] = plan.name
                fmt["advice"] = "; keep the running sum on the device and read it when it is logged"
                new = plan.owner.visit(_Apply(plan, ref.name))
                self.report(n, fmt=fmt, replacement=new, target=plan.owner, imports=ref.imports)
                continue
            if isinstance(plan, Plan):
                self.report(n, fmt=fmt)
                continue
            if isinstance(plan, str) and key is not None:
                fmt["advice"] += f" (not rewritten: {plan})"
            del inner
            self.report(n, fmt=fmt)

    def _advice(self, n: cst.Call, kind: str, where: Where) -> str:
        parent = self.get_metadata(ParentProvider, n, None)
        stmt = parent
        while stmt is not None and not isinstance(stmt, (cst.If, cst.While, cst.Assert, cst.IfExp,
                                                         cst.SimpleStatementLine)):
            stmt = self.get_metadata(ParentProvider, stmt, None)
        if isinstance(stmt, (cst.If, cst.While, cst.Assert, cst.IfExp)):
            return ("; decide on the device instead (`torch.where`), check every N steps, or use "
                    "`torch._assert_async`")
        if kind in (".tolist()", ".numpy()"):
            return "; collect the tensors on the device (`torch.cat`) and convert once after the loop"
        return ("; accumulate on the device (`running += t.detach()`) and call `.item()` only every N steps "
                "or after the loop")


_WHY = {
    "item": "copies a device value to the host",
    "tolist": "copies a tensor to the host",
    "numpy": "copies a tensor to the host",
    "float": "copies a device value to the host",
    "int": "copies a device value to the host",
    "bool": "copies a device value to the host",
}


# --------------------------------------------------------------------------- TOP602


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
    """

    code = "TOP602"
    name = "print-tensor-in-loop"
    family = FAMILY
    message = ("`{expr}` formats a tensor on the host {where}: every call waits for the GPU to finish "
               "the step; log every N steps (on rank 0), or move the print out of the step")
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = ("print", "log", "str(", "repr(", "format(", "f\"", "f'")

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
            "        print(f'step {step}')\n    print(loss)\n",
        ),
        Valid("import torch\n\nt = torch.ones(2)\nprint(t)\n", runnable=True),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.step_loops:
            return
        tz = Tensors(self, hm)
        for n in walk(node, True):
            if isinstance(n, cst.Call):
                if self._formats_tensor(n, tz):
                    where = hm.where(n)
                    if where is not None:
                        self.report(n, fmt={"expr": source(self, n), "where": where.text})

    def _formats_tensor(self, c: cst.Call, tz: Tensors) -> bool:
        f = c.func
        args = [a.value for a in c.args if not a.star]
        if isinstance(f, cst.Name) and f.value in ("print", "str", "repr") and builtin_unbound(self, f):
            return any(self._text_of_tensor(a, tz) for a in args)
        if isinstance(f, cst.Attribute) and f.attr.value == "format" and isinstance(
                f.value, (cst.SimpleString, cst.ConcatenatedString)):
            return any(tz.is_tensor(a) for a in args)
        if isinstance(f, cst.Attribute) and f.attr.value in LOG_METHODS and dotted(f.value) in LOGGER_NAMES:
            return any(self._text_of_tensor(a, tz) for a in args)
        return False

    def _text_of_tensor(self, a: cst.BaseExpression, tz: Tensors) -> bool:
        if isinstance(a, cst.FormattedString):
            return any(isinstance(p, cst.FormattedStringExpression) and tz.is_tensor(p.expression)
                       for p in a.parts)
        return tz.is_tensor(a)


# --------------------------------------------------------------------------- TOP603


class DeviceToHostCopyInLoop(Rule):
    """## What it does
    Flags device→host copies inside a training or evaluation step: `t.cpu()`, `t.to("cpu")`,
    `t.to(torch.device("cpu"))`. (`.numpy()`, `.tolist()` and `.item()` are TOP601; a `.cpu()` that
    feeds one of them is reported there once.)

    ## Why is this slow
    A copy to ordinary host memory must wait until the kernels producing the tensor have finished,
    and the host cannot queue the next step meanwhile. Collecting predictions with
    `preds.append(out.argmax(1).cpu())` every step serialises an evaluation loop.

    ## Example
    ```python
    for x, y in loader:
        preds.append(model(x).argmax(1).cpu())
    ```

    ## Use instead
    ```python
    for x, y in loader:
        preds.append(model(x).argmax(1))
    preds = torch.cat(preds).cpu()  # one copy after the loop
    ```

    ## Fix safety
    Display-only. `non_blocking=True` is never added to a device→host copy (DEV-004): the host
    could read the destination before the copy arrives.
    """

    code = "TOP603"
    name = "device-to-host-copy-in-loop"
    family = FAMILY
    message = ("`{expr}` copies a tensor to the host {where} and waits for the GPU; keep the values on the "
               "device and copy once after the loop")
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = (".cpu(", ".to(")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_host_copy
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_host_copy).
        return super().could_match(text) and hot_check(text, may_host_copy)

    examples = (
        Invalid(
            "import torch\n\ndef evaluate(model, loader):\n    model.eval()\n    preds = []\n"
            "    with torch.no_grad():\n        for x, y in loader:\n"
            "            preds.append(model(x).argmax(1).cpu())\n    return preds\n",
            after=None,
        ),
        Invalid(
            "import torch\n\ndef evaluate(model, loader):\n    for x, y in loader:\n"
            "        out = model(x).to('cpu')\n",
            after=None,
        ),
        Valid(
            "import torch\n\ndef evaluate(model, loader):\n    preds = []\n    for x, y in loader:\n"
            "        preds.append(model(x).argmax(1))\n    return torch.cat(preds).cpu()\n",
        ),
        Valid(
            "import torch\n\ndef evaluate(model, loader):\n    for x, y in loader:\n"
            "        v = model(x).cpu().numpy()\n",
            note="reported once, by TOP601, at `.numpy()`",
        ),
        Valid("import torch\n\nfor i in range(2):\n    t = torch.ones(2).cpu()\n", runnable=True),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.step_loops:
            return
        for n in walk(node, True):
            if not isinstance(n, cst.Call) or not isinstance(n.func, cst.Attribute) or has_star(n):
                continue
            meth = n.func.attr.value
            if meth == "cpu" and not n.args:
                pass
            elif meth == "to" and len(n.args) >= 1 and (
                    (positional(n) and classify_device(self, positional(n)[0].value).is_cpu)
                    or (keyword(n, "device") is not None and classify_device(self, keyword(n, "device").value).is_cpu)):
                pass
            else:
                continue
            if dotted(n.func.value) in hm.modules:
                continue  # model.cpu()
            parent = self.get_metadata(ParentProvider, n, None)
            grand = self.get_metadata(ParentProvider, parent, None) if parent is not None else None
            if isinstance(parent, cst.Attribute) and isinstance(grand, cst.Call) and grand.func is parent \
                    and (parent.attr.value in HOST_READS or parent.attr.value in ("detach", "float", "double")):
                if parent.attr.value in HOST_READS:
                    continue
            where = hm.where(n)
            if where is not None:
                self.report(n, fmt={"expr": source(self, n), "where": where.text})
