"""TOP812 `profiler-left-on`: a profiler left around a whole training loop."""
from __future__ import annotations

from textwrap import dedent

import os.path

from libcst.metadata import ScopeProvider
import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.arguments import set_kwarg
from torchopt.analysis.names import callee
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.debug import FAMILY
from torchopt.codemods.debug.debug_switches import DebugRule, GATE, PROFILERS_ENABLED, PROFILERS_PLAIN, _gate
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import ImportSpec
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class ProfilerLeftOn(DebugRule):
    """## What it does
    Flags a profiler that wraps training (its `with` block holds a loop that calls `backward` or
    `step`, or a call to a `train`/`fit` function): `torch.profiler.profile(...)`,
    `torch.autograd.profiler.profile(...)`, `emit_nvtx()`, `emit_itt()`. When nothing reads the
    profile (no `schedule=`, no `on_trace_ready=`, no use of the `as` name) the profiler is pure
    overhead and the fix gates it on the `TORCHOPT_DEBUG` environment variable:
    `enabled=bool(os.environ.get("TORCHOPT_DEBUG"))` where the profiler has that parameter, and
    `(torch.profiler.profile(...) if os.environ.get("TORCHOPT_DEBUG") else contextlib.nullcontext())`
    otherwise. A profiler whose results are used (scheduled, exported, printed) is only reported.
    Profiling on purpose is left alone: inside a test (`test_*` functions, files named `test_*.py`
    or `*_test.py`) or a benchmark function (`bench*`, `*benchmark*`).

    ## Why is this slow
    Profilers record every operator (with shapes, stacks or memory when asked) and, with CUDA
    activities, every kernel; `emit_nvtx` pushes a range per operator. Left around a whole training
    run they slow every step and grow memory with the trace.

    ## Example
    ```python
    with torch.autograd.profiler.profile():
        for x, y in loader:
            loss_fn(model(x), y).backward()
            opt.step()
    ```

    ## Use instead
    ```python
    with torch.autograd.profiler.profile(enabled=bool(os.environ.get("TORCHOPT_DEBUG"))):
        for x, y in loader:
            ...
    ```

    ## Fix safety
    Safe: profilers observe and do not change what is computed. With the variable set the program
    profiles as before. Deprecated arguments such as `use_cuda=True` are left to TOP821.
    """

    code = "TOP812"
    name = "profiler-left-on"
    family = FAMILY
    message = "`{call}` profiles the whole training loop: every step pays for recording"
    used_message = ("`{call}` profiles the whole training loop and its results are used: keep it for profiling "
                    "runs only (e.g. behind a command-line flag or `if os.environ.get(\"TORCHOPT_DEBUG\"):`)")
    fix_title = "Profile only when `TORCHOPT_DEBUG` is set"
    safety = Safety.SAFE
    prefilter = ("profile", "emit_nvtx", "emit_itt")

    @classmethod
    def could_match(cls, text: str) -> bool:
        # visit_With: a `with` item calling something that may resolve to a profiler (through the
        # file's torch imports, on CPython's ast). True when the text does not parse.
        if not super().could_match(text):
            return False
        import ast

        from torchopt.analysis.precheck.torch_imports import ast_torch_names, torch_import_map
        from torchopt.analysis.precheck.tree import ast_index

        index = ast_index(text)
        imports = torch_import_map(text)
        if index is None or imports is None:
            return True
        wanted = PROFILERS_ENABLED | PROFILERS_PLAIN
        return any(isinstance(i.context_expr, ast.Call) and ast_torch_names(imports, i.context_expr.func) & wanted
                   for w in [*index.get(ast.With, ()), *index.get(ast.AsyncWith, ())] for i in w.items)

    _LOOP = ("    for x, y in loader:\n        loss = (model(x) - y).pow(2).mean()\n        loss.backward()\n"
             "        opt.step()\n")
    examples = (
        Invalid(
            "import os\nimport torch\n\n\ndef train(model, loader, opt):\n    with torch.autograd.profiler.profile():\n"
            + "    " + _LOOP.replace("\n    ", "\n        "),
            after="import os\nimport torch\n\n\ndef train(model, loader, opt):\n"
            "    with torch.autograd.profiler.profile(enabled=bool(os.environ.get(\"TORCHOPT_DEBUG\"))):\n"
            + "    " + _LOOP.replace("\n    ", "\n        "),
        ),
        Invalid(
            "import torch\n\nwith torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):\n"
            "    trainer.fit(model)\n",
            after="import torch\nimport contextlib\nimport os\n\nwith (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) "
            "if os.environ.get(\"TORCHOPT_DEBUG\") else contextlib.nullcontext()):\n    trainer.fit(model)\n",
        ),
        Invalid(
            "import torch\n\nwith torch.autograd.profiler.emit_nvtx():\n" + _LOOP,
            after="import torch\nimport os\n\nwith torch.autograd.profiler.emit_nvtx(enabled=bool(os.environ.get(\"TORCHOPT_DEBUG\"))):\n"
            + _LOOP,
        ),
        Invalid(
            "import torch\n\nwith torch.profiler.profile() as prof:\n" + _LOOP
            + "print(prof.key_averages().table())\n",
            after=None,
            note="the profile is read: reported, not gated",
        ),
        Valid("import torch\n\nwith torch.profiler.profile() as prof:\n    y = model(x)\n", note="one forward, not training"),
        Valid("import torch\n\nwith torch.autograd.profiler.profile(enabled=args.profile):\n" + _LOOP),
        Valid(dedent("""\
            import torch.profiler as tp

            def test_step_is_profiled(model, loader, opt):
                with tp.profile():
                    for x, y in loader:
                        (model(x) - y).pow(2).mean().backward()
                        opt.step()
            """), note="a test that profiles on purpose"),
        Valid(dedent("""\
            from torch.autograd import profiler

            class Runner:
                def benchmark_training(self, loader):
                    with profiler.profile():
                        for x, y in loader:
                            self.loss(x, y).backward()
                            self.opt.step()
            """), note="a benchmark method: measuring is its job"),
        Valid("import torch\n\nif args.profile:\n    with torch.profiler.profile():\n" + _LOOP.replace("\n    ", "\n        ").replace("    for", "        for", 1)),
    )

    def visit_With(self, node: cst.With) -> None:
        if self._profiles_on_purpose(node):
            return
        for item in node.items:
            call = item.item
            if not isinstance(call, cst.Call):
                continue
            q = callee(self, call)
            if q not in PROFILERS_ENABLED and q not in PROFILERS_PLAIN:
                continue
            if not self._wraps_training(node.body) or self.gated(node):
                continue
            enabled = keyword(call, "enabled") or (positional(call)[0] if q in PROFILERS_ENABLED and positional(call) else None)
            if enabled is not None and not (isinstance(enabled.value, cst.Name) and enabled.value.value == "True"):
                continue  # already switched by the program
            fmt = {"call": source(self, call)}
            if self._results_used(call, item):
                self.report(call, message=self.used_message, fmt=fmt)
                continue
            if any(a.star for a in call.args) or not self.os_free():
                self.report(call, fmt=fmt)
                continue
            if q in PROFILERS_ENABLED:
                gate = cst.parse_expression(f"bool({GATE})")
                new = set_kwarg(call, "enabled", gate) if enabled is None or enabled.keyword is not None else \
                    call.with_changes(args=[a.with_changes(value=gate) if a is enabled else a for a in call.args])
                self.report(call, fmt=fmt, replacement=new, imports=(ImportSpec("os"),))
            else:
                new = cst.IfExp(test=_gate(), body=call.with_changes(lpar=(), rpar=()),
                                orelse=cst.parse_expression("contextlib.nullcontext()"),
                                lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
                self.report(call, fmt=fmt, replacement=new, imports=(ImportSpec("os"), ImportSpec("contextlib")))

    def _profiles_on_purpose(self, node: cst.CSTNode) -> bool:
        """A test or a benchmark measures by design: its profiler is the point, not an oversight."""
        base = os.path.basename(self.ctx.path)
        if base.endswith(".py") and (base.startswith("test_") or base.endswith("_test.py")):
            return True
        cur = self.get_metadata(ParentProvider, node, None)
        while cur is not None:
            if isinstance(cur, cst.FunctionDef):
                name = cur.name.value.lower()
                if name.startswith(("test", "bench")) or "benchmark" in name:
                    return True
            cur = self.get_metadata(ParentProvider, cur, None)
        return False

    def _wraps_training(self, body: cst.CSTNode) -> bool:
        if self.trains(body):
            return True
        for n in walk(body):
            if isinstance(n, cst.Call):
                name = n.func.value if isinstance(n.func, cst.Name) else (
                    n.func.attr.value if isinstance(n.func, cst.Attribute) else "")
                if "train" in name.lower() or name in ("fit", "fit_one_epoch"):
                    return True
        return False

    def _results_used(self, call: cst.Call, item: cst.WithItem) -> bool:
        if keyword(call, "schedule") is not None or keyword(call, "on_trace_ready") is not None:
            return True
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
        for a in scope[target.value]:
            if a.node is target and list(a.references):
                return True
        return False
