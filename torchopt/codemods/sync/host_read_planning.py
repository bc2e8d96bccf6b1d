"""Host reads of device values in hot loops: what counts as a read, and the accumulator rewrite.

TOP601 flags ``.item()``, ``.tolist()``, ``.numpy()``, ``float(t)``, ``int(t)``, ``bool(t)`` in a
training or evaluation step and rewrites the logging-accumulator pattern (a Python float summed
from ``loss.item()`` every step and read at logging points) into a float64 accumulator on the
device. TOP602 flags printing or formatting tensors, TOP603 device→host copies."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import Assignment, PositionProvider, ScopeProvider

from torchopt.analysis.placement import Kind, placements
from torchopt.analysis.values import classify_device, string_value
from torchopt.analysis.arguments import has_star, keyword, positional
from torchopt.analysis.statement_edits import Refusal
from torchopt.analysis.syntax import source, walk
from torchopt.analysis.step_loops import HOST_READS, SCOPES, HotLoop, HotMap, Tensors, calls_in, dotted
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

_CLIP = ("clip_grad_norm_", "clip_grad_norm", "get_total_norm")
_BUILTIN_CASTS = ("float", "int", "bool")


def grad_norm_names(hot: HotMap) -> set[str]:
    """Names bound to the result of ``clip_grad_norm_(...)`` (TOP607 reports their reads)."""
    out = set()
    for n in walk(hot.rule.ctx.module, True):
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


def host_read(hot: HotMap, tensors: Tensors, c: cst.Call) -> str | None:
    """The kind of host read ``c`` is (``.item()``...), or None."""
    if isinstance(c.func, cst.Attribute) and c.func.attr.value in HOST_READS and not c.args:
        recv = c.func.value
        while isinstance(recv, (cst.Call, cst.Attribute, cst.Subscript)):  # to the head of the chain
            if isinstance(recv, cst.Call) and (dotted(recv.func) or "").split(".")[0] in ("np", "numpy", "math"):
                return None
            recv = recv.func if isinstance(recv, cst.Call) else recv.value
        return f".{c.func.attr.value}()"
    if (
        isinstance(c.func, cst.Name)
        and c.func.value in _BUILTIN_CASTS
        and len(c.args) == 1
        and not c.args[0].star
        and c.args[0].keyword is None
    ):
        if tensors.is_tensor(c.args[0].value) and builtin_unbound(hot.rule, c.func):
            return f"{c.func.value}()"
    return None


# --------------------------------------------------------------------------- the accumulator fix


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
    def __init__(self, rule: Rule, hot: HotMap, tensors: Tensors) -> None:
        self.rule, self.hm, self.tz = rule, hot, tensors

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
        numbers; raises Refusal otherwise."""
        if isinstance(expr, cst.BinaryOperation) and isinstance(
            expr.operator, (cst.Add, cst.Subtract, cst.Multiply, cst.Divide)
        ):
            return self.rhs_items(expr.left) + self.rhs_items(expr.right)
        if (
            isinstance(expr, cst.Call)
            and isinstance(expr.func, cst.Attribute)
            and expr.func.attr.value == "item"
            and not expr.args
        ):
            if not self.tz.is_tensor(expr.func.value, strict=True):
                raise Refusal(None, f"`{source(self.rule, expr.func.value)}` is not provably a tensor")
            return [expr]
        if self.tz.number(expr):
            return []
        value, text = placements(self.rule).value(expr), source(self.rule, expr)
        if value.kind is Kind.UNKNOWN:
            raise Refusal(None, f"`{text}` is not known to be a Python number ({value.why})")
        raise Refusal(None, f"`{text}` is {value.kind.value}, not a Python number")

    def plan(self, aug: cst.AugAssign) -> Plan:
        if not isinstance(aug.target, cst.Name) or not isinstance(aug.operator, cst.AddAssign):
            raise Refusal(None, "not a `name += ...` accumulation")
        name = aug.target
        loop = self.hm.step_loop_of(aug)
        if loop is None:
            raise Refusal(None, "not in the body of the loop")
        try:
            scope = self.rule.get_metadata(ScopeProvider, name)
        except KeyError:
            raise Refusal(None, "no scope") from None
        if scope is None:
            raise Refusal(None, "no scope")
        plan = Plan(name.value, loop, self.owner(aug))
        kinds = set()
        assignments = list(scope[name.value])
        for a in assignments:
            if not isinstance(a, Assignment) or a.scope is not scope:
                raise Refusal(None, f"`{name.value}` is bound outside this function or by a non-assignment")
            node = a.node
            parent = self.parent(node)
            if isinstance(parent, cst.AugAssign) and parent.target is node:
                if not isinstance(parent.operator, cst.AddAssign):
                    raise Refusal(None, f"`{name.value}` is updated by another operator than `+=`")
                if self.hm.step_loop_of(parent) is not loop:
                    raise Refusal(None, f"`{name.value}` is accumulated outside the loop too")
                items = self.rhs_items(parent.value)
                if not items:
                    raise Refusal(None, f"`{name.value}` accumulates a value that is not read from a tensor")
                plan.augs.append(parent)
                plan.items.extend(items)
                continue
            if isinstance(parent, cst.AssignTarget) and parent.target is node:
                stmt = self.parent(parent)
                if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1:
                    kind = _zero_literal(stmt.value)
                    if kind is None:
                        raise Refusal(None, f"`{name.value}` is assigned something other than 0")
                    kinds.add(kind)
                    if self.inside(stmt, loop.node.body):
                        plan.resets.append(stmt)
                    else:
                        plan.inits.append(stmt)
                    continue
            raise Refusal(None, f"`{name.value}` is bound in a way the rewrite cannot follow")
        if not plan.inits or not any(self.pos(i) < self.pos(loop.node) for i in plan.inits):
            raise Refusal(None, f"`{name.value}` is not initialised before the loop")
        if any(self.owner(s) is not plan.owner for s in plan.inits + plan.resets):
            raise Refusal(None, "different scopes")
        aug_targets = {id(a.target) for a in plan.augs}
        for a in assignments:
            for ref in a.references:
                node = ref.node
                if id(node) in aug_targets or any(node is r for r in plan.reads):
                    continue
                if ref.scope is not scope or not isinstance(node, cst.Name):
                    raise Refusal(None, f"`{name.value}` is read from a nested function or comprehension")
                self._check_read(node, plan, "int" in kinds)
                plan.reads.append(node)
        plan.device = self.device(plan)
        return plan

    def _check_read(self, node: cst.Name, plan: Plan, int_mode: bool) -> None:
        parent = self.parent(node)
        if isinstance(parent, (cst.Attribute, cst.Subscript)) and parent.value is node:
            raise Refusal(None, f"`{plan.name}` is used as an object, not a number")
        if isinstance(parent, cst.Del):
            raise Refusal(None, f"`{plan.name}` is deleted")
        if int_mode and not (
            isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Divide) and parent.left is node
        ):
            raise Refusal(None, f"`{plan.name}` starts as the int 0 and is read other than as `{plan.name} / ...`")
        body = plan.loop.node.body
        if self.inside(node, body):
            cur = self.parent(node)
            while cur is not None and cur is not body:
                if isinstance(cur, (cst.If, cst.IfExp, cst.For, cst.While, cst.BooleanOperation)):
                    return
                cur = self.parent(cur)
            raise Refusal(None, f"`{plan.name}` is read on every step")

    def device(self, plan: Plan) -> str | None:
        """The device expression (code) the accumulator is created on; None: the default (CPU).

        A module-level accumulator is fine: its loop is at module level too, so the file is a
        script someone runs, not a library whose float another module imports."""
        found: set[str] = set()
        guarded: dict[str, cst.Call] = {}  # a literal target moved to only on some paths
        for c in calls_in(plan.loop.node.body):
            d = self._move_target(c)
            if d is not None:
                found.add(d)
                if d.startswith('"') and self._conditional(c, plan.loop.node):
                    guarded.setdefault(d, c)
        if not found:
            found = set(self._module_moves())
            guarded = {d: c for d, c in self._guarded_module_moves().items() if d in found}
        if len(found) > 1:
            raise Refusal(None, "the loop moves data to more than one device")
        if not found:
            if self._mentions_device():
                raise Refusal(None, "cannot tell which device the loss is on")
            return None
        dev = found.pop()
        if dev in guarded:
            # The program picks this device only on some paths (`if args.gpu: x = x.cuda()`): writing
            # the literal would create the accumulator there on a CPU-only run too.
            raise Refusal(
                None,
                f"the program moves to {dev} only under a condition and has no device expression of its "
                "own to create the accumulator on",
            )
        if dev.strip("'\"").split(":")[0] == "mps":
            raise Refusal(None, "MPS has no float64")
        if not dev.startswith('"') and self._may_pick_mps():
            raise Refusal(None, f"`{dev}` is chosen at run time and may be Apple MPS, which has no float64")
        self._check_visible(dev, plan)
        return dev

    def _conditional(self, call: cst.Call, top: cst.CSTNode | None) -> bool:
        """``call`` runs only on some paths below ``top`` (or its function): a branch, a conditional
        expression, a short-circuit operand or an exception handler holds it."""
        cur = self.parent(call)
        while cur is not None and cur is not top and not isinstance(cur, (cst.FunctionDef, cst.Module)):
            if isinstance(cur, (cst.IfExp, cst.BooleanOperation, cst.ExceptHandler, cst.Else)):
                return True
            if isinstance(cur, cst.If) and not _main_guard(cur.test):
                return True
            cur = self.parent(cur)
        return False

    def _guarded_module_moves(self) -> dict[str, cst.Call]:
        out: dict[str, cst.Call] = {}
        for c in calls_in(self.rule.ctx.module):
            if isinstance(c.func, cst.Attribute) and dotted(c.func.value) in self.hm.modules:
                d = self._move_target(c)
                if d is not None and d.startswith('"') and self._conditional(c, None):
                    out.setdefault(d, c)
        return out

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

    def _may_pick_mps(self) -> bool:
        """The file can choose MPS at run time: it names it, or asks `torch.accelerator` (or an
        accelerate `Accelerator`) which device to use."""
        code = self.rule.ctx.text
        return "mps" in code.lower() or "accelerator" in code.lower()

    def _mentions_device(self) -> bool:
        hit = self.__dict__.get("_mentions_device_memo")
        if hit is None:  # module.code regenerates the whole file: once per planner
            code = self.rule.ctx.text
            hit = self._mentions_device_memo = (
                ".cuda(" in code or ".to(" in code or "device" in code or "accelerator" in code.lower()
            )
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
        if (text := string_value(expr)) is not None:
            return '"' + text + '"'
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
            raise Refusal(None, "no scope") from None
        if scope is None or root not in scope:
            raise Refusal(None, f"`{root}` is not visible where `{plan.name}` is initialised")
        for a in scope[root]:
            node = getattr(a, "node", None)
            if isinstance(node, cst.Param):
                continue
            if a.scope is not scope and not isinstance(plan.owner, cst.Module):
                continue  # a global read by a function: bound when the function runs
            if node is None or not isinstance(a, Assignment) or self.pos(node) >= self.pos(first):
                raise Refusal(None, f"`{root}` is bound after `{plan.name}` is initialised")


def _main_guard(test: cst.BaseExpression) -> bool:
    """`__name__ == "__main__"`: the script's own entry, which runs whenever the script does."""
    return (
        isinstance(test, cst.Comparison)
        and len(test.comparisons) == 1
        and isinstance(test.comparisons[0].operator, cst.Equal)
        and {dotted(test.left), string_value(test.comparisons[0].comparator)} == {"__name__", "__main__"}
    )


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

    def leave_Assign(self, original_node: cst.Assign, updated_node: cst.Assign):
        if id(original_node) in self.inits:
            return updated_node.with_changes(value=self.zeros)
        if id(original_node) in self.resets:
            return cst.Expr(cst.parse_expression(f"{self.plan.name}.zero_()"), semicolon=updated_node.semicolon)
        return updated_node

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name):
        if id(original_node) in self.reads:
            return (
                cst.Call(
                    func=cst.Attribute(value=updated_node, attr=cst.Name("item")),
                    lpar=updated_node.lpar,
                    rpar=updated_node.rpar,
                )
                if updated_node.lpar
                else cst.Call(func=cst.Attribute(value=updated_node, attr=cst.Name("item")))
            )
        return updated_node

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call):
        if id(original_node) not in self.items:
            return updated_node
        recv = cst.ensure_type(updated_node.func, cst.Attribute).value  # (the planned reads are method calls)
        new: cst.BaseExpression = cst.Call(func=cst.Attribute(value=recv, attr=cst.Name("detach")))
        if id(original_node) not in self.simple:
            new = cst.Call(func=cst.Attribute(value=new, attr=cst.Name("double")))
        return new.with_changes(lpar=updated_node.lpar, rpar=updated_node.rpar)


# --------------------------------------------------------------------------- TOP601


# --------------------------------------------------------------------------- TOP602


# --------------------------------------------------------------------------- TOP603
