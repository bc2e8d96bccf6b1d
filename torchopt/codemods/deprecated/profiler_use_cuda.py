"""TOP821: the autograd profiler's deprecated ``use_cuda=``."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import callee, torch_ref
from torchopt.analysis.arguments import drop_kwarg, has_star, keyword, keywords, positional, set_kwarg
from torchopt.analysis.syntax import in_version_guard
from torchopt.codemods.deprecated import FAMILY
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Option, Rule, Safety, Tag, Valid

LEGACY = "torch.autograd.profiler.profile"
# Keywords `torch.profiler.profile` accepts with the same meaning as the legacy profiler.
_SHARED_KWARGS = {"use_cuda", "record_shapes", "profile_memory", "with_stack", "with_flops", "with_modules"}
# Methods both profiler objects have: code that only uses these keeps working after the migration.
_SHARED_METHODS = {"key_averages", "export_chrome_trace", "export_stacks"}


class ProfilerUseCuda(Rule):
    """## What it does
    Migrates `torch.autograd.profiler.profile(use_cuda=...)`, which PyTorch deprecates
    ("The attribute `use_cuda` will be deprecated soon, please use ``use_device = 'cuda'``
    instead."). When the profiler object is only used through methods both profilers share
    (`key_averages()`, `export_chrome_trace()`, `export_stacks()`), the call moves to the current
    profiler, `torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])`;
    otherwise `use_cuda=` becomes `use_device=`.

    ## Why is this slow
    The legacy autograd profiler records CUDA time by synchronising around every op; the current
    `torch.profiler` collects device activity through Kineto/CUPTI with much lower overhead, and the
    deprecated keyword will stop working in a future release.

    ## Example
    ```python
    import torch

    with torch.autograd.profiler.profile(use_cuda=True) as prof:
        model(x)
    print(prof.key_averages().table())
    ```

    ## Use instead
    ```python
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        model(x)
    print(prof.key_averages().table())
    ```

    ## Fix safety
    `use_cuda=True` → `use_device="cuda"`, `use_cuda=False` → dropped, and `use_cuda=flag` →
    `use_device=("cuda" if flag else None)` are safe: the same profiler records the same events.

    The move to `torch.profiler.profile` is unsafe (tag semantics): the program computes the same
    values, but the profiler is another implementation, so its tables and traces are laid out
    differently. It is only offered for a literal `use_cuda=True`, keyword arguments both profilers
    accept, and a profiler object used through their shared methods; set the rule option
    `api = "use_device"` to always get the safe `use_device=` form. Calls inside a version guard
    (`try/except`, `hasattr`, a version test) are left alone.
    """

    code = "TOP821"
    name = "profiler-use-cuda"
    family = FAMILY
    message = "`use_cuda=` of `torch.autograd.profiler.profile` is deprecated"
    fix_title = "{title}"
    safety = Safety.SAFE
    prefilter = ("use_cuda",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.torch_imports import may_call_torch

        return super().could_match(text) and may_call_torch(text, (LEGACY,))

    min_torch = (2, 1)
    options = (
        Option(
            "api",
            str,
            "auto",
            "`auto`: move to torch.profiler.profile where the profiler object allows it (unsafe), "
            "else `use_device=`; `use_device`: always the safe `use_device=` form",
            choices=("auto", "use_device"),
        ),
    )

    examples = (
        Invalid(
            "import torch\n\nwith torch.autograd.profiler.profile(use_cuda=True, record_shapes=True) as prof:\n"
            "    torch.ones(3).sum()\nprint(prof.key_averages().table())\n",
            after="import torch\n\nwith torch.profiler.profile(\n    record_shapes=True,\n    activities=[\n        torch.profiler.ProfilerActivity.CPU,\n        torch.profiler.ProfilerActivity.CUDA,\n    ],\n) as prof:\n    torch.ones(3).sum()\nprint(prof.key_averages().table())\n",
            unsafe="semantics",
        ),
        Invalid(
            "import torch\n\nwith torch.autograd.profiler.profile(use_cuda=True) as prof:\n"
            "    torch.ones(3).sum()\nprint(prof.table())\n",
            after='import torch\n\nwith torch.autograd.profiler.profile(use_device="cuda") as prof:\n'
            "    torch.ones(3).sum()\nprint(prof.table())\n",
            runnable=True,
            note="`table()` exists on the legacy profiler only: keep it, with `use_device=`",
        ),
        Invalid(
            "from torch.autograd import profiler\n\n\ndef run(f, gpu):\n"
            "    with profiler.profile(use_cuda=gpu, profile_memory=True) as p:\n        f()\n    return p.total_average()\n",
            after='from torch.autograd import profiler\n\n\ndef run(f, gpu):\n    with profiler.profile(\n        use_device=("cuda" if gpu else None), profile_memory=True\n    ) as p:\n        f()\n    return p.total_average()\n',
        ),
        Invalid(
            "import torch\n\nwith torch.autograd.profiler.profile(use_cuda=False) as prof:\n    torch.ones(3).sum()\n"
            "print(prof.self_cpu_time_total >= 0)\n",
            after="import torch\n\nwith torch.autograd.profiler.profile() as prof:\n    torch.ones(3).sum()\n"
            "print(prof.self_cpu_time_total >= 0)\n",
            runnable=True,
        ),
        Valid("import torch\n\nwith torch.autograd.profiler.profile(use_device='cuda') as prof:\n    pass\n"),
        Valid(
            "import torch\n\ntry:\n    prof = torch.autograd.profiler.profile(use_device='cuda')\n"
            "except TypeError:\n    prof = torch.autograd.profiler.profile(use_cuda=True)\n",
            note="a version guard: the old spelling is deliberate",
        ),
        Valid(
            "class profiler:\n    @staticmethod\n    def profile(use_cuda=False):\n        return use_cuda\n\n"
            "profiler.profile(use_cuda=True)\n",
            runnable=True,
        ),
        Valid("import torch\n\ndef f(**kw):\n    return torch.autograd.profiler.profile(**kw)\n"),
    )

    def visit_Call(self, node: cst.Call) -> None:
        arg = keyword(node, "use_cuda")
        if arg is None or callee(self, node) != LEGACY:
            return
        if any(a.star == "**" for a in node.args) or keyword(node, "use_device") is not None:
            return
        if in_version_guard(self, node):
            return
        value = arg.value
        literal = value.value if isinstance(value, cst.Name) and value.value in ("True", "False") else None
        if literal == "True" and self.option("api") == "auto" and self._can_move(node):
            ref = torch_ref(self)
            if ref is not None:
                act = f"{ref.name}.profiler.ProfilerActivity"
                new = drop_kwarg(node, "use_cuda").with_changes(func=ref.attr("profiler.profile"))
                new = set_kwarg(new, "activities", cst.parse_expression(f"[{act}.CPU, {act}.CUDA]"))
                self.report(
                    node,
                    replacement=new,
                    safety=Safety.UNSAFE,
                    tags=(Tag.SEMANTICS,),
                    fmt={"title": "Use `torch.profiler.profile(activities=[CPU, CUDA])`"},
                    note="the Kineto profiler records the same ops; its tables and traces are laid out differently",
                    imports=ref.imports,
                )
                return
        if literal == "False":
            new = drop_kwarg(node, "use_cuda")
            title = "Drop `use_cuda=False`"
        else:
            dev = '"cuda"' if literal == "True" else f'("cuda" if {self.ctx.module.code_for_node(value)} else None)'
            new = node.with_changes(
                args=[
                    a.with_changes(keyword=cst.Name("use_device"), value=cst.parse_expression(dev)) if a is arg else a
                    for a in node.args
                ]
            )
            title = f"Use `use_device={dev}`"
        self.report(node, replacement=new, fmt={"title": title})

    def _can_move(self, node: cst.Call) -> bool:
        """Only the shared keywords, and a profiler object used only through the shared methods."""
        if has_star(node) or positional(node) or set(keywords(node)) - _SHARED_KWARGS:
            return False
        item = self.get_metadata(ParentProvider, node, None)
        if isinstance(item, cst.WithItem):
            if item.asname is None:
                return True
            target = item.asname.name
            if not isinstance(target, cst.Name):
                return False
            return self._used_only_via_shared(target)
        return False

    def _used_only_via_shared(self, name: cst.Name) -> bool:
        scope = self.get_metadata(ScopeProvider, name, None)
        if scope is None:
            return False
        for assignment in scope.assignments[name.value]:
            for access in assignment.references:
                parent = self.get_metadata(ParentProvider, access.node, None)
                if not (
                    isinstance(parent, cst.Attribute)
                    and parent.value is access.node
                    and parent.attr.value in _SHARED_METHODS
                ):
                    return False
        return True
