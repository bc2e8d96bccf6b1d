"""rules.md DBG-001..004: debugging APIs left on in training code."""
from __future__ import annotations

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.analysis.names import callee, torch_ref
from torchopt.analysis.values import string_value
from torchopt.analysis.arguments import keyword, positional, set_kwarg
from torchopt.analysis.syntax import source, walk
from torchopt.codemods.debug import FAMILY
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import ImportSpec, Invalid, Rule, Safety, Valid

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


class AnomalyDetectionLeftOn(DebugRule):
    """## What it does
    Flags anomaly detection switched on unconditionally: `torch.autograd.set_detect_anomaly(True)`
    and `with torch.autograd.detect_anomaly():`. The statement is put under
    `if os.environ.get("TORCHOPT_DEBUG"):`; the context manager becomes
    `torch.autograd.set_detect_anomaly(bool(os.environ.get("TORCHOPT_DEBUG")))`, which is a no-op
    unless the variable is set. Calls already under an `if` are left alone.

    ## Why is this slow
    Anomaly mode records a Python traceback for every operation of the forward pass and checks
    every backward result for NaN, which synchronises with the device: PyTorch itself warns that it
    "will increase the runtime and should only be enabled for debugging" (E-18).

    ## Example
    ```python
    torch.autograd.set_detect_anomaly(True)
    ```

    ## Use instead
    ```python
    if os.environ.get("TORCHOPT_DEBUG"):
        torch.autograd.set_detect_anomaly(True)
    ```

    ## Fix safety
    Safe for the values (rules.md DBG-001, class E): anomaly mode computes nothing differently.
    What changes is error reporting: a backward that produces NaN no longer raises with the
    forward traceback (the run goes on with NaN), unless `TORCHOPT_DEBUG=1` is set to get the check back.
    """

    code = "TOP811"
    name = "anomaly-detection-left-on"
    family = FAMILY
    message = "`{call}` leaves anomaly detection on: every op records a traceback, every backward checks for NaN"
    fix_title = "Turn it on only when `TORCHOPT_DEBUG` is set"
    safety = Safety.SAFE
    prefilter = ("anomaly",)

    examples = (
        Invalid(
            "import torch\n\ntorch.autograd.set_detect_anomaly(True)\nx = torch.ones(2, requires_grad=True)\n"
            "(x * 2).sum().backward()\n",
            after="import torch\nimport os\n\nif os.environ.get(\"TORCHOPT_DEBUG\"):\n    torch.autograd.set_detect_anomaly(True)\n"
            "x = torch.ones(2, requires_grad=True)\n(x * 2).sum().backward()\n",
            runnable=True,
        ),
        Invalid(
            "import os\nimport torch\n\n\ndef step(model, x):\n    with torch.autograd.detect_anomaly():\n"
            "        model(x).sum().backward()\n",
            after="import os\nimport torch\n\n\ndef step(model, x):\n"
            "    with torch.autograd.set_detect_anomaly(bool(os.environ.get(\"TORCHOPT_DEBUG\"))):\n"
            "        model(x).sum().backward()\n",
        ),
        Invalid(
            "import os\nfrom torch.autograd import detect_anomaly\n\nwith detect_anomaly(check_nan=False):\n    run()\n",
            after="import os\nfrom torch.autograd import detect_anomaly\nimport torch\n\n"
            "with torch.autograd.set_detect_anomaly(bool(os.environ.get(\"TORCHOPT_DEBUG\")), check_nan=False):\n    run()\n",
        ),
        Valid("import torch\n\nif args.debug:\n    torch.autograd.set_detect_anomaly(True)\n"),
        Valid("import torch\n\ntorch.autograd.set_detect_anomaly(False)\n", runnable=True),
        Valid("import torch\n\ntorch.autograd.set_detect_anomaly(args.debug)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        q = callee(self, node)
        if q in SET_ANOMALY:
            self._set(node)
        elif q in DETECT_ANOMALY:
            self._detect(node)

    def _set(self, node: cst.Call) -> None:
        mode = keyword(node, "mode") or (positional(node)[0] if positional(node) else None)
        if mode is None or not (isinstance(mode.value, cst.Name) and mode.value.value == "True"):
            return
        if self.gated(node) or not self.os_free():
            return
        parent = self.get_metadata(ParentProvider, node, None)
        if isinstance(parent, cst.WithItem):
            new = node.with_changes(args=[a.with_changes(value=self._gate_bool()) if a is mode else a for a in node.args])
            self.report(node, fmt={"call": source(self, node)}, replacement=new, imports=(ImportSpec("os"),))
            return
        line = self.get_metadata(ParentProvider, parent, None) if isinstance(parent, cst.Expr) else None
        if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
            self.report(node, fmt={"call": source(self, node)})
            return
        gated = cst.If(test=_gate(), body=cst.IndentedBlock(body=[line.with_changes(leading_lines=())]),
                       leading_lines=line.leading_lines)
        self.report(node, fmt={"call": source(self, node)}, replacement=gated, target=line,
                    imports=(ImportSpec("os"),))

    def _gate_bool(self) -> cst.BaseExpression:
        return cst.parse_expression(f"bool({GATE})")

    def _detect(self, node: cst.Call) -> None:
        parent = self.get_metadata(ParentProvider, node, None)
        if not isinstance(parent, cst.WithItem) or self.gated(node) or not self.os_free():
            if not isinstance(parent, cst.WithItem) and not self.gated(node):
                self.report(node, fmt={"call": source(self, node)})
            return
        if any(a.star for a in node.args) or len(node.args) > 1:
            return
        if isinstance(node.func, cst.Attribute):
            func: cst.BaseExpression = node.func.with_changes(attr=cst.Name("set_detect_anomaly"))
            imports: tuple = ()
        else:
            ref = torch_ref(self)
            if ref is None:
                return
            func, imports = ref.attr("autograd.set_detect_anomaly"), ref.imports
        args = [cst.Arg(self._gate_bool())]
        for a in node.args:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            args.append(a.with_changes(keyword=cst.Name("check_nan"), equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
                if a.keyword is None else a)
        new = cst.Call(func=func, args=args)
        self.report(node, fmt={"call": source(self, node)}, replacement=new,
                    imports=(*imports, ImportSpec("os")))


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
    profiles as before. Deprecated arguments such as `use_cuda=True` are left to TOP821 (DEP-001).
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
        Valid("import torch\n\nif args.profile:\n    with torch.profiler.profile():\n" + _LOOP.replace("\n    ", "\n        ").replace("    for", "        for", 1)),
    )

    def visit_With(self, node: cst.With) -> None:
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


class GradcheckInTraining(DebugRule):
    """## What it does
    Reports `torch.autograd.gradcheck` / `gradgradcheck` calls reachable from a training loop: in a
    loop that calls `backward`/`step`, in a function that trains, or in a function of the file that
    such a loop calls.

    ## Why is this slow
    `gradcheck` compares the analytical gradient with finite differences: it re-runs the function
    twice per input element, usually in float64, and synchronises to compare. It is a unit-test
    tool; inside the training loop it can cost more than the training step itself.

    ## Example
    ```python
    for x, y in loader:
        torch.autograd.gradcheck(my_op, (x.double().requires_grad_(),))
        loss = loss_fn(model(x), y); loss.backward(); opt.step()
    ```

    ## Use instead
    ```python
    # tests/test_my_op.py
    def test_my_op_gradient():
        assert torch.autograd.gradcheck(my_op, (torch.randn(4, dtype=torch.float64, requires_grad=True),))
    ```

    ## Fix safety
    Display-only: moving a check into the test suite is a decision about the project's layout.
    """

    code = "TOP813"
    name = "gradcheck-in-training"
    family = FAMILY
    message = "`{call}` runs in the training loop (line {line}): a finite-difference check per input element every step"
    safety = Safety.DISPLAY
    prefilter = ("gradcheck",)

    examples = (
        Invalid(
            "import torch\n\nfor x in batches:\n    torch.autograd.gradcheck(op, (x,))\n    op(x).sum().backward()\n    opt.step()\n",
        ),
        Invalid(
            "from torch.autograd import gradgradcheck\n\n\ndef check(op, x):\n    gradgradcheck(op, (x,))\n\n\n"
            "def train(loader, op, opt):\n    for x in loader:\n        check(op, x)\n        op(x).sum().backward()\n        opt.step()\n",
            note="through a function the loop calls",
        ),
        Valid("import torch\n\n\ndef test_op_grad():\n    assert torch.autograd.gradcheck(op, (x,))\n"),
        Valid("import torch\n\nfor op in ops:\n    torch.autograd.gradcheck(op, (x,))\n", note="a loop of checks, no training"),
    )

    def visit_Module(self, node: cst.Module) -> None:
        self._checks: list[cst.Call] = []

    def visit_Call(self, node: cst.Call) -> None:
        if callee(self, node) in GRADCHECKS:
            self._checks.append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        if not self._checks:
            return
        loops = self.training_loops()
        fns = {n.name.value: n for n in walk(self.ctx.module, cross_scopes=True) if isinstance(n, cst.FunctionDef)}
        # Functions reachable from a training loop, two calls deep.
        reach: dict[str, cst.CSTNode] = {}
        frontier = [(loop, loop) for loop in loops]
        for _ in range(2):
            nxt = []
            for body, loop in frontier:
                for n in walk(body, cross_scopes=True):
                    if isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value in fns \
                            and n.func.value not in reach:
                        reach[n.func.value] = loop
                        nxt.append((fns[n.func.value], loop))
            frontier = nxt
        for check in self._checks:
            where = self._where(check, loops, fns, reach)
            if where is not None:
                line = self.get_metadata(PositionProvider, where).start.line
                self.report(check, fmt={"call": source(self, check), "line": str(line)})

    def _where(self, check, loops, fns, reach):  # type: ignore[no-untyped-def]
        cur = self.get_metadata(ParentProvider, check, None)
        while cur is not None:
            if isinstance(cur, (cst.For, cst.While)) and any(cur is lp for lp in loops):
                return cur
            if isinstance(cur, cst.FunctionDef):
                if self.trains(cur.body):
                    return cur
                if cur.name.value in reach:
                    return reach[cur.name.value]
                return None
            cur = self.get_metadata(ParentProvider, cur, None)
        return None


class SyncDebugLeftOn(DebugRule):
    """## What it does
    Reports synchronous-CUDA debugging switched on by the script: `torch.cuda.set_sync_debug_mode(...)`
    with a non-zero mode (`1`, `2`, `"warn"`, `"error"`), and `CUDA_LAUNCH_BLOCKING=1` set through
    `os.environ[...] = "1"`, `os.environ.setdefault(...)`, `os.environ.update(...)` or `os.putenv(...)`.
    Settings under an `if` (a debug flag) are left alone.

    ## Why is this slow
    `CUDA_LAUNCH_BLOCKING=1` makes every kernel launch wait until the kernel has finished, so the
    host can never run ahead of the device: no overlap at all between Python, data loading and
    GPU work. `set_sync_debug_mode` checks every operation for synchronisation and warns or raises.

    ## Example
    ```python
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    torch.cuda.set_sync_debug_mode("warn")
    ```

    ## Use instead
    ```python
    # set them from the shell when debugging:  CUDA_LAUNCH_BLOCKING=1 python train.py
    if args.debug_sync:
        torch.cuda.set_sync_debug_mode("warn")
    ```

    ## Fix safety
    Display-only: the setting may be there on purpose while a crash is investigated.
    """

    code = "TOP814"
    name = "sync-debug-left-on"
    family = FAMILY
    message = "`{code}` makes CUDA synchronous: {why}"
    safety = Safety.DISPLAY
    prefilter = ("CUDA_LAUNCH_BLOCKING", "set_sync_debug_mode")
    _LAUNCH = "every kernel launch waits for the kernel to finish, so the host never runs ahead of the GPU"
    _MODE = "every operation is checked for synchronisation, and warns or raises"

    examples = (
        Invalid("import os\n\nos.environ[\"CUDA_LAUNCH_BLOCKING\"] = \"1\"\n", runnable=True),
        Invalid("import os\n\nos.environ.setdefault('CUDA_LAUNCH_BLOCKING', '1')\n"),
        Invalid("import torch\n\ntorch.cuda.set_sync_debug_mode('warn')\n"),
        Invalid("import torch\n\nif torch.cuda.is_available():\n    torch.cuda.set_sync_debug_mode(1)\n",
                note="a capability check is not a debug switch"),
        Valid("import torch\n\ntorch.cuda.set_sync_debug_mode(0)\n"),
        Valid("import os\n\nif args.debug:\n    os.environ['CUDA_LAUNCH_BLOCKING'] = '1'\n"),
        Valid("import os\n\nos.environ['CUDA_LAUNCH_BLOCKING'] = '0'\n", runnable=True),
    )

    def visit_Call(self, node: cst.Call) -> None:
        q = callee(self, node)
        if q in SYNC_DEBUG:
            arg = positional(node)[0].value if positional(node) else (
                keyword(node, "debug_mode").value if keyword(node, "debug_mode") else None)
            if arg is None:
                return
            s = string_value(arg)
            if (isinstance(arg, cst.Integer) and int(arg.evaluated_value) == 0) or s == "default":
                return
            if isinstance(arg, cst.Integer) or s in ("warn", "error"):
                if not self.gated(node):
                    self.report(node, fmt={"code": source(self, node), "why": self._MODE})
            return
        d = cst.helpers.get_full_name_for_node(node.func) or ""
        args = [a.value for a in node.args]
        if d in ("os.environ.setdefault", "os.putenv") and len(args) == 2:
            if string_value(args[0]) == "CUDA_LAUNCH_BLOCKING" and self._on(args[1]) and not self.gated(node):
                self.report(node, fmt={"code": source(self, node), "why": self._LAUNCH})
        elif d == "os.environ.update":
            kw = keyword(node, "CUDA_LAUNCH_BLOCKING")
            if kw is not None and self._on(kw.value) and not self.gated(node):
                self.report(node, fmt={"code": source(self, node), "why": self._LAUNCH})
            for a in args:
                if isinstance(a, cst.Dict):
                    for e in a.elements:
                        if isinstance(e, cst.DictElement) and string_value(e.key) == "CUDA_LAUNCH_BLOCKING" \
                                and self._on(e.value) and not self.gated(node):
                            self.report(node, fmt={"code": source(self, node), "why": self._LAUNCH})

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            tgt = t.target
            if isinstance(tgt, cst.Subscript) and cst.helpers.get_full_name_for_node(tgt.value) == "os.environ" \
                    and len(tgt.slice) == 1 and isinstance(tgt.slice[0].slice, cst.Index) \
                    and string_value(tgt.slice[0].slice.value) == "CUDA_LAUNCH_BLOCKING" and self._on(node.value) \
                    and not self.gated(node):
                self.report(node, fmt={"code": source(self, node), "why": self._LAUNCH})

    def _on(self, value: cst.BaseExpression) -> bool:
        s = string_value(value)
        return s is not None and s.strip() not in ("", "0")
