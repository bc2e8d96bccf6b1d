"""TOP812 `profiler-left-on`: a profiler left around a whole training loop."""

from __future__ import annotations

import os.path
from textwrap import dedent

import libcst as cst

from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.debug import FAMILY
from torchopt.codemods.debug.debug_switches import DebugRule, PROFILERS_ENABLED, PROFILERS_PLAIN
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class ProfilerLeftOn(DebugRule):
    """## What it does
    Flags a profiler that wraps training (its `with` block holds a loop that calls `backward` or
    `step`, or a call to a `train`/`fit` function): `torch.profiler.profile(...)`,
    `torch.autograd.profiler.profile(...)`, `emit_nvtx()`, `emit_itt()`. When nothing reads the
    profile (no `schedule=`, no `on_trace_ready=`, no use of the `as` name) the profiler is pure
    overhead and the fix removes it: the `with` is unwrapped (its body dedented in place, comments
    kept), or only the profiler's item is dropped from a `with` that has others. A profiler whose
    results are used (scheduled, exported, printed) is only reported: turning it off would leave
    the `as` name `None` (a disabled `torch.autograd.profiler.profile` yields nothing) and break
    the code that reads it.
    Profiling on purpose is left alone: inside a test (`test_*` functions, files named `test_*.py`
    or `*_test.py`) or a benchmark function (`bench*`, `*benchmark*`), or under an `if`.

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
    for x, y in loader:
        loss_fn(model(x), y).backward()
        opt.step()
    ```

    ## Fix safety
    Safe: profilers observe and do not change what is computed, and the fix only removes one whose
    results nothing reads. Deprecated arguments such as `use_cuda=True` are left to TOP821.
    """

    code = "TOP812"
    name = "profiler-left-on"
    family = FAMILY
    message = "`{call}` profiles the whole training loop: every step pays for recording"
    kept_message = (
        "`{call}` profiles the whole training loop; not removed automatically because {why}: "
        "keep it for profiling runs only (e.g. behind a command-line flag)"
    )
    fix_title = "Remove the profiler and keep the body of its `with`"
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
        return any(
            isinstance(i.context_expr, ast.Call) and ast_torch_names(imports, i.context_expr.func) & wanted
            for w in [*index.get(ast.With, ()), *index.get(ast.AsyncWith, ())]
            for i in w.items
        )

    examples = (
        Invalid(
            dedent("""\
                import torch


                def train(model, loader, opt):
                    with torch.autograd.profiler.profile():
                        for x, y in loader:
                            loss = (model(x) - y).pow(2).mean()
                            loss.backward()
                            opt.step()
            """),
            after=dedent("""\
                import torch


                def train(model, loader, opt):
                    for x, y in loader:
                        loss = (model(x) - y).pow(2).mean()
                        loss.backward()
                        opt.step()
            """),
        ),
        Invalid(
            dedent("""\
                import torch

                # one epoch
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                    # the trainer owns the loop
                    trainer.fit(model)
            """),
            after=dedent("""\
                import torch

                # one epoch
                # the trainer owns the loop
                trainer.fit(model)
            """),
        ),
        Invalid(
            dedent("""\
                import torch

                with torch.autograd.profiler.emit_nvtx(), torch.random.fork_rng():
                    for x, y in loader:
                        loss = (model(x) - y).pow(2).mean()
                        loss.backward()
                        opt.step()
            """),
            after=dedent("""\
                import torch

                with torch.random.fork_rng():
                    for x, y in loader:
                        loss = (model(x) - y).pow(2).mean()
                        loss.backward()
                        opt.step()
            """),
        ),
        Invalid(
            dedent("""\
                import torch

                with torch.profiler.profile() as prof:
                    for x, y in loader:
                        loss = (model(x) - y).pow(2).mean()
                        loss.backward()
                        opt.step()
                print(prof.key_averages().table())
            """),
            note="the profile is read: reported, not removed",
        ),
        Valid(
            dedent("""\
                import torch

                with torch.profiler.profile() as prof:
                    y = model(x)
            """),
            note="one forward, not training",
        ),
        Valid(
            dedent("""\
                import torch

                with torch.autograd.profiler.profile(enabled=args.profile):
                    for x, y in loader:
                        loss = (model(x) - y).pow(2).mean()
                        loss.backward()
                        opt.step()
            """)
        ),
        Valid(
            dedent("""\
                import torch.profiler as tp

                def test_step_is_profiled(model, loader, opt):
                    with tp.profile():
                        for x, y in loader:
                            (model(x) - y).pow(2).mean().backward()
                            opt.step()
            """),
            note="a test that profiles on purpose",
        ),
        Valid(
            dedent("""\
                from torch.autograd import profiler

                class Runner:
                    def benchmark_training(self, loader):
                        with profiler.profile():
                            for x, y in loader:
                                self.loss(x, y).backward()
                                self.opt.step()
            """),
            note="a benchmark method: measuring is its job",
        ),
        Valid(
            dedent("""\
                import torch

                if args.profile:
                    with torch.profiler.profile():
                        for x, y in loader:
                            loss = (model(x) - y).pow(2).mean()
                            loss.backward()
                            opt.step()
            """)
        ),
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
            enabled = keyword(call, "enabled") or (
                positional(call)[0] if q in PROFILERS_ENABLED and positional(call) else None
            )
            if enabled is not None and not (isinstance(enabled.value, cst.Name) and enabled.value.value == "True"):
                continue  # already switched by the program
            self._unwrap(node, item, call)

    def _unwrap(self, node: cst.With, item: cst.WithItem, call: cst.Call) -> None:
        fmt = {"call": source(self, call)}
        why = None
        if keyword(call, "schedule") is not None or keyword(call, "on_trace_ready") is not None:
            why = "a `schedule=` or `on_trace_ready=` handler reads its results"
        elif self.as_name_used(item):
            why = "its `as` name is read (disabled, the profiler would leave that name `None`)"
        new = None if why else self.unwrapped(node, item)
        if new is None:
            why = why or (
                "a comment at the end of the `with` block would be lost"
                if node.asynchronous is None
                else "it is an `async with`"
            )
            self.report(call, message=self.kept_message, fmt={**fmt, "why": why})
            return
        self.report(call, fmt=fmt, replacement=new, target=node)

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
                name = (
                    n.func.value
                    if isinstance(n.func, cst.Name)
                    else (n.func.attr.value if isinstance(n.func, cst.Attribute) else "")
                )
                if "train" in name.lower() or name in ("fit", "fit_one_epoch"):
                    return True
        return False
