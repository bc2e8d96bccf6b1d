"""TOP302 on two ``nn.Linear`` attributes of one module used one after the other: ``self.fc2(act(self.fc1(x)))``,
or the same flow written as statements in ``forward`` (``x = F.relu(self.fc1(x))``, ``x = self.fc2(x)``).

The hidden width between them is padded on both sides when the first layer's output reaches the
second only through elementwise functions with ``f(0) == 0`` (or dropout) and is read nowhere else:
each intermediate value is bound to a name that exactly one later statement of the same straight-line
block reads, before that name is bound again."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.syntax import walk
from torchopt.codemods.pad.gemm_layers import (
    DROPOUT,
    DROPOUT_FN,
    NO_ARGS_ONLY,
    ZERO_PRESERVING,
    ZERO_PRESERVING_FN,
    ZERO_PRESERVING_METHODS,
    _self_attr,
)
from torchopt.codemods.pad.sizes import arg, code, int_const, nn_class, pad_formula, padded
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule


class ModulePairs:
    """The paddable Linear pairs of each class of one file (worked out once per class)."""

    def __init__(self, rule: Rule, multiple: int) -> None:
        self.rule = rule
        self.multiple = multiple
        self._pairs: dict[int, list] = {}

    def fix(self, linear: cst.Call):
        """Like _sequential_fix, for ``self.a = nn.Linear(i, H)`` / ``self.b = nn.Linear(H, o)`` of one
        class whose only use is ``self.b(act(self.a(x)))`` (activations: zero-preserving modules held
        in attributes, their functional forms, ``.relu()``/``.tanh()``, dropout)."""
        init = self._enclosing_init(linear)
        if init is None:
            return None
        cls, fn = init
        pairs = self._pairs.get(id(cls))
        if pairs is None:
            pairs = self._pairs[id(cls)] = self._pairs_of(cls, fn)
        mine = [p for p in pairs if linear is p[0] or linear is p[1]]
        if not mine:
            return None
        m = self.multiple
        edits: dict[int, cst.BaseExpression] = {}
        for l1, l2, h, _ in pairs:
            for call, index, name in ((l1, 1, "out_features"), (l2, 0, "in_features")):
                a = arg(call, index, name)
                assert a is not None
                edits[id(a)] = (
                    cst.Integer(str(padded(h, m)))
                    if isinstance(a.value, cst.Integer)
                    else cst.parse_expression(pad_formula(code(self.rule, a.value), m))
                )

        class _Edit(cst.CSTTransformer):
            def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
                new = edits.get(id(original_node))
                return updated_node if new is None else updated_node.with_changes(value=new)

        h = mine[0][2]
        return fn, fn.visit(_Edit()), str(h), str(padded(h, m)), any(p[3] for p in pairs)

    def _enclosing_init(self, node: cst.CSTNode):
        fn = None
        cur = self.rule.get_metadata(ParentProvider, node, None)
        while cur is not None:
            if isinstance(cur, cst.FunctionDef):
                if fn is not None:
                    return None
                fn = cur
            elif isinstance(cur, cst.ClassDef):
                if fn is None or fn.name.value != "__init__" or not fn.params.params:
                    return None
                return cur, fn
            elif isinstance(cur, cst.Lambda):
                return None
            cur = self.rule.get_metadata(ParentProvider, cur, None)
        return None

    def _pairs_of(self, cls: cst.ClassDef, init: cst.FunctionDef) -> list:
        self_name = init.params.params[0].name.value
        linears: dict[str, cst.Call] = {}
        acts: dict[str, bool] = {}  # attribute -> is dropout
        counts: dict[str, int] = {}
        for n in walk(init.body):
            if isinstance(n, cst.Assign) and len(n.targets) == 1:
                attr = _self_attr(n.targets[0].target, self_name)
                if attr is None:
                    continue
                counts[attr] = counts.get(attr, 0) + 1
                if isinstance(n.value, cst.Call) and not has_star(n.value):
                    c = nn_class(self.rule, n.value)
                    if c == "Linear":
                        linears[attr] = n.value
                    elif c in ZERO_PRESERVING or (c in NO_ARGS_ONLY and not n.value.args) or c in DROPOUT:
                        acts[attr] = c in DROPOUT
        linears = {a: c for a, c in linears.items() if counts.get(a) == 1}
        acts = {a: d for a, d in acts.items() if counts.get(a) == 1}
        if len(linears) < 2:
            return []
        # Every reference to a Linear attribute: it must be exactly one call, self.<attr>(x).
        refs: dict[str, list[cst.CSTNode]] = {a: [] for a in linears}
        for n in walk(cls, cross_scopes=True):
            if (
                isinstance(n, cst.Attribute)
                and isinstance(n.value, cst.Name)
                and n.value.value == "self"
                and n.attr.value in refs
            ):
                refs[n.attr.value].append(n)
        calls: dict[str, cst.Call] = {}
        for a, rs in refs.items():
            uses = [r for r in rs if not self._is_own_assignment(r, linears[a])]
            if len(uses) != 1:
                continue
            parent = self.rule.get_metadata(ParentProvider, uses[0], None)
            if (
                isinstance(parent, cst.Call)
                and parent.func is uses[0]
                and len(parent.args) == 1
                and not parent.args[0].star
                and parent.args[0].keyword is None
            ):
                calls[a] = parent
        by_call = {id(c): a for a, c in calls.items()}
        m = self.multiple
        out = []
        for a, c1 in calls.items():
            out_arg = arg(linears[a], 1, "out_features")
            h = int_const(self.rule, out_arg.value) if out_arg else None
            if h is None or h <= 0 or h % m == 0:
                continue
            cur: cst.CSTNode = c1
            dropout = False
            while True:
                parent = self.rule.get_metadata(ParentProvider, cur, None)
                if (
                    isinstance(parent, cst.Attribute)
                    and parent.value is cur
                    and parent.attr.value in ZERO_PRESERVING_METHODS
                ):
                    call = self.rule.get_metadata(ParentProvider, parent, None)
                    if isinstance(call, cst.Call) and call.func is parent and not call.args:
                        cur = call
                        continue
                    break
                if isinstance(parent, cst.Assign) and parent.value is cur:
                    read = self._only_read(parent)  # `x = F.relu(self.fc1(x))`, then `x = self.fc2(x)`
                    if read is None:
                        break
                    cur = read
                    continue
                if not isinstance(parent, cst.Arg) or parent.keyword is not None or parent.star:
                    break
                call = self.rule.get_metadata(ParentProvider, parent, None)
                if not isinstance(call, cst.Call) or not call.args or call.args[0] is not parent or has_star(call):
                    break
                b = by_call.get(id(call))
                if b is not None:  # reached the second Linear
                    inp = arg(linears[b], 0, "in_features")
                    if inp is not None and int_const(self.rule, inp.value) == h and b != a:
                        out.append((linears[a], linears[b], h, dropout))
                    break
                attr = _self_attr(call.func, "self")
                name = None if attr else self._fn_name(call)
                if attr in acts and len(call.args) == 1:
                    dropout = dropout or acts[attr]
                elif name in ZERO_PRESERVING_FN:
                    pass
                elif name in DROPOUT_FN:
                    dropout = True
                else:
                    break
                cur = call
        return out

    def _fn_name(self, call: cst.Call) -> str | None:
        from torchopt.analysis.names import callee

        return callee(self.rule, call)

    def _is_own_assignment(self, ref: cst.CSTNode, ctor: cst.Call) -> bool:
        parent = self.rule.get_metadata(ParentProvider, ref, None)
        if not isinstance(parent, cst.AssignTarget):
            return False
        stmt = self.rule.get_metadata(ParentProvider, parent, None)
        return isinstance(stmt, cst.Assign) and stmt.value is ctor

    def _only_read(self, assign: cst.Assign) -> cst.Name | None:
        """The one read of the name ``assign`` binds, when the value goes nowhere else: ``assign`` is a
        statement of its own in a function body, and the next mention of the name after it is a read
        in a later simple statement of that body, followed by no other read before the name is bound
        again (``x = act(x)`` binds it again in the same statement)."""
        if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name):
            return None
        name = assign.targets[0].target.value
        line = self.rule.get_metadata(ParentProvider, assign, None)
        block = self.rule.get_metadata(ParentProvider, line, None) if line is not None else None
        if (
            not isinstance(line, cst.SimpleStatementLine)
            or len(line.body) != 1
            or not isinstance(block, cst.IndentedBlock)
            or not isinstance(self.rule.get_metadata(ParentProvider, block, None), cst.FunctionDef)
        ):
            return None
        stmts = list(block.body)
        read: cst.Name | None = None
        for stmt in stmts[stmts.index(line) + 1 :]:
            mentions = [
                n
                for n in walk(stmt, cross_scopes=True)
                if isinstance(n, cst.Name) and n.value == name and not self._attribute_name(n)
            ]
            loads = [n for n in mentions if not self._stored(n)]
            if loads:  # a statement reads before it binds (`x = self.fc2(x)`)
                if read is not None or len(loads) > 1 or not isinstance(stmt, cst.SimpleStatementLine):
                    return None  # read twice, or read where it may run or not (a branch, a loop)
                read = loads[0]
            if len(loads) < len(mentions):
                return read  # bound again: what follows reads another value
        return read

    def _attribute_name(self, n: cst.Name) -> bool:
        parent = self.rule.get_metadata(ParentProvider, n, None)
        return isinstance(parent, cst.Attribute) and parent.attr is n

    def _stored(self, n: cst.Name) -> bool:
        cur: cst.CSTNode = n
        parent = self.rule.get_metadata(ParentProvider, cur, None)
        while isinstance(parent, (cst.Element, cst.StarredElement, cst.Tuple, cst.List)):
            cur, parent = parent, self.rule.get_metadata(ParentProvider, parent, None)
        return isinstance(parent, cst.AssignTarget) and parent.target is cur
