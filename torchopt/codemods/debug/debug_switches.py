"""What the debug rules share: gating on an environment variable, `os` availability, training loops."""
from __future__ import annotations

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import callee
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

GATE = 'os.environ.get("TORCHOPT_DEBUG")'
SET_ANOMALY = {"torch.autograd.set_detect_anomaly", "torch.autograd.anomaly_mode.set_detect_anomaly"}
DETECT_ANOMALY = {"torch.autograd.detect_anomaly", "torch.autograd.anomaly_mode.detect_anomaly"}
# Profilers with an `enabled=` parameter, and the one without.
PROFILERS_ENABLED = {"torch.autograd.profiler.profile", "torch.autograd.profiler.emit_nvtx",
                     "torch.autograd.profiler.emit_itt", "torch.autograd.profiler_legacy.profile"}
PROFILERS_PLAIN = {"torch.profiler.profile", "torch.profiler.profiler.profile"}
GRADCHECKS = {"torch.autograd.gradcheck", "torch.autograd.gradgradcheck", "torch.autograd.gradcheck.gradcheck",
              "torch.autograd.gradcheck.gradgradcheck", "torch.testing.gradcheck"}
SYNC_DEBUG = {"torch.cuda.set_sync_debug_mode"}


class DebugRule(Rule):
    """Helpers: gating (an enclosing `if` other than the main guard), `os` availability, training loops."""

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

    def os_free(self) -> bool:
        """`os` names the os module or nothing at module level (so `import os` may be added)."""
        for stmt in self.ctx.module.body:
            try:
                scope = self.get_metadata(ScopeProvider, stmt)
            except KeyError:
                continue
            if scope is None or "os" not in scope:
                return True
            for a in scope["os"]:
                node = getattr(a, "node", None)
                if not (isinstance(node, cst.Import) and any(
                        cst.helpers.get_full_name_for_node(n.name) == "os" and n.asname is None for n in node.names)):
                    return False
            return True
        return True

    def trains(self, body: cst.CSTNode) -> bool:
        for n in walk(body):
            if isinstance(n, cst.Call):
                if isinstance(n.func, cst.Attribute) and n.func.attr.value in ("backward", "step"):
                    return True
                if callee(self, n) in ("torch.autograd.grad", "torch.autograd.backward"):
                    return True
        return False

    def training_loops(self) -> list[cst.For | cst.While]:
        return [n for n in walk(self.ctx.module, cross_scopes=True)
                if isinstance(n, (cst.For, cst.While)) and self.trains(n.body)]


def _gate() -> cst.BaseExpression:
    return cst.parse_expression(GATE)
