"""What the debug rules share: whether a switch is already conditional, unwrapping a `with`, training loops."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import callee
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

SET_ANOMALY = {"torch.autograd.set_detect_anomaly", "torch.autograd.anomaly_mode.set_detect_anomaly"}
DETECT_ANOMALY = {"torch.autograd.detect_anomaly", "torch.autograd.anomaly_mode.detect_anomaly"}
# Profilers with an `enabled=` parameter, and the one without.
PROFILERS_ENABLED = {
    "torch.autograd.profiler.profile",
    "torch.autograd.profiler.emit_nvtx",
    "torch.autograd.profiler.emit_itt",
    "torch.autograd.profiler_legacy.profile",
}
PROFILERS_PLAIN = {"torch.profiler.profile", "torch.profiler.profiler.profile"}
GRADCHECKS = {
    "torch.autograd.gradcheck",
    "torch.autograd.gradgradcheck",
    "torch.autograd.gradcheck.gradcheck",
    "torch.autograd.gradcheck.gradgradcheck",
    "torch.testing.gradcheck",
}
SYNC_DEBUG = {"torch.cuda.set_sync_debug_mode"}


class DebugRule(Rule):
    """Helpers: gating (an enclosing `if` other than the main guard), unwrapping, training loops."""

    def gated(self, node: cst.CSTNode) -> bool:
        cur = self.get_metadata(ParentProvider, node, None)
        while cur is not None:
            if isinstance(cur, (cst.If, cst.IfExp)):
                code = self.ctx.module.code_for_node(cur.test)
                # The main guard and capability checks (`torch.cuda.is_available()`) are not switches.
                if not ("__name__" in code and "__main__" in code) and "is_available" not in code:
                    return True
            cur = self.get_metadata(ParentProvider, cur, None)
        return False

    def as_name_used(self, item: cst.WithItem) -> bool:
        """The `as` target is read somewhere in its scope (unknown targets count as read)."""
        if item.asname is None:
            return False
        target = item.asname.name
        if not isinstance(target, cst.Name):
            return True
        try:
            scope = self.get_metadata(ScopeProvider, target)
        except KeyError:
            return True
        if scope is None:
            return True
        return any(a.node is target and list(a.references) for a in scope[target.value])

    def unwrapped(self, node: cst.With, item: cst.WithItem) -> cst.CSTNode | cst.FlattenSentinel | None:
        """`node` without `item`: the other items kept, or the body dedented in its place.

        None when that would lose a comment libcst keeps in the block footer, or for `async with`.
        """
        if node.asynchronous is not None:
            return None
        if len(node.items) > 1:
            items = [i for i in node.items if i is not item]
            items[-1] = items[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return node.with_changes(items=items)
        header: list[cst.EmptyLine] = []
        if isinstance(node.body, cst.SimpleStatementSuite):
            suite = node.body
            stmts: list[cst.BaseStatement] = [
                cst.SimpleStatementLine(body=suite.body, trailing_whitespace=suite.trailing_whitespace)
            ]
        else:
            block = cst.ensure_type(node.body, cst.IndentedBlock)
            if any(line.comment is not None for line in block.footer):
                return None
            stmts = list(block.body)
            if block.header.comment is not None:
                header.append(cst.EmptyLine(comment=block.header.comment))
        first = stmts[0]
        if isinstance(first, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            stmts[0] = first.with_changes(leading_lines=[*node.leading_lines, *header, *first.leading_lines])
        return cst.FlattenSentinel(stmts)

    def trains(self, body: cst.CSTNode) -> bool:
        for n in walk(body):
            if isinstance(n, cst.Call):
                if isinstance(n.func, cst.Attribute) and n.func.attr.value in ("backward", "step"):
                    return True
                if callee(self, n) in ("torch.autograd.grad", "torch.autograd.backward"):
                    return True
        return False

    def training_loops(self) -> list[cst.For | cst.While]:
        return [
            n
            for n in walk(self.ctx.module, cross_scopes=True)
            if isinstance(n, (cst.For, cst.While)) and self.trains(n.body)
        ]
