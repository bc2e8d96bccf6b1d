"""TOP205 `inference-autocast`: In an inference-only script (no `backward()` anywhere in the file), wraps the model forward."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.names import torch_name
from torchopt.analysis.syntax import SCOPE_NODES
from torchopt.codemods.amp import FAMILY
from torchopt.codemods.amp import prechecks
from torchopt.analysis.statement_edits import ApplyEdits, Edits, Refusal, body_list
from torchopt.codemods.amp.autocast_insertion import OPTION_DTYPE, Region, _AmpBase, _Analysis, _NO_GRAD, wrap_region
from torchopt.codemods.amp.step_analysis import StepSite, _escapes, _excluded
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class InferenceAutocast(_AmpBase):
    """## What it does
    In an inference-only script (no `backward()` anywhere in the file), wraps the model forward
    of a loop that runs under `torch.no_grad()` / `torch.inference_mode()` in `torch.autocast`
    with the same device-agnostic dtype as TOP202 and no scaler.
    Names assigned by the forward and used afterwards are upcast with `.float()` so metric code
    (`.numpy()`, matmuls with float32 tensors) keeps working. Evaluation loops in training
    scripts are left alone (the training rewrite is TOP202). Option `dtype` as for TOP202.

    ## Why is this slow
    The forward's matmuls and convolutions run in float32 instead of on float16/bfloat16 Tensor
    Cores, at a fraction of the throughput and twice the memory traffic.

    ## Example
    ```python
    with torch.no_grad():
        for x in batches:
            out = model(x)
            preds.append(out.argmax(1))
    ```

    ## Use instead
    ```python
    with torch.no_grad():
        for x in batches:
            with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                out = model(x)
            out = out.float()
            preds.append(out.argmax(1))
    ```

    ## Fix safety
    Unsafe (numerics): the forward computes in float16 (CUDA) or bfloat16 (elsewhere); outputs
    differ from float32 by about rel-L2 3.7e-4 (fp16) / 3.5e-3 (bf16) on a small MLP and an
    `argmax` can flip on near ties. `torchopt validate` tolerates the AMP tolerances: rtol 1e-2,
    atol 1e-3·max|ref|, rel-L2 1e-2 for float16; rtol 5e-2, atol 1e-2·max|ref|, rel-L2 5e-2 for
    bfloat16. A CPU run uses bfloat16 CPU autocast, whose op lists differ from CUDA's.
    """

    code = "TOP205"
    min_torch = (1, 10)  # `torch.autocast(device_type)`
    name = "inference-autocast"
    family = FAMILY
    message = "inference forward runs in float32: wrap it in `torch.autocast`"
    refuse_message = "inference forward not rewritten to mixed precision: {reason}"
    fix_title = "Insert `torch.autocast` around the forward"
    safety = Safety.UNSAFE
    tags = (Tag.NUMERICS,)
    prefilter = ("no_grad", "inference_mode")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and prechecks.inference_autocast_possible(text)

    options = (OPTION_DTYPE,)
    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                with torch.no_grad():
                    for x in batches:
                        out = model(x)
                        results.append(out.cpu())
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == 'cuda' else torch.bfloat16
                with torch.no_grad():
                    for x in batches:
                        with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                            out = model(x)
                        out = out.float()
                        results.append(out.cpu())
            """),
            unsafe="numerics",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == "cuda" else torch.bfloat16
                with torch.no_grad():
                    for x in batches:
                        with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                            out = model(x)
                        out = out.float()
                        results.append(out.cpu())
            """),
            note="already under autocast",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn

                device = 'cuda' if torch.cuda.is_available() else 'cpu'
                model = nn.Linear(4, 2).to(device)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                amp_device_type = torch.device(device).type
                amp_dtype = torch.float16 if amp_device_type == "cuda" else torch.bfloat16
                scaler = torch.amp.GradScaler(amp_device_type, enabled=amp_dtype == torch.float16)
                for x, y in batches:
                    optimizer.zero_grad()
                    with torch.autocast(device_type=amp_device_type, dtype=amp_dtype):
                        out = model(x)
                        loss = nn.functional.mse_loss(out, y)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                with torch.no_grad():
                    for x in batches:
                        out = model(x)
            """),
            note="eval loops of training scripts are left to the training rewrite",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        a = _Analysis(self)
        if not a.models:
            return
        for n in a.all_nodes:
            if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "backward":
                return
        if a.autocast_with(a.module):
            return
        e = Edits()
        regions: list[Region] = []
        first = None
        used: list[str] = []
        loops = []
        for n in a.all_nodes:
            if not isinstance(n, (cst.For, cst.While)):
                continue
            lists = []
            body = body_list(n.body)
            if body is None:
                continue
            if self._under_no_grad(a, n):
                lists.append(body)
            for s in body:
                if isinstance(s, cst.With) and any(self._no_grad(i.item) for i in s.items):
                    inner = body_list(s.body)
                    if inner:
                        lists.append(inner)
            for lst in lists:
                idx = [j for j, s in enumerate(lst) if a.calls_model(s, a.models)]
                if not idx:
                    continue
                j0 = idx[0]
                j1 = j0
                while j1 + 1 < len(lst) and a.calls_model(lst[j1 + 1], a.models):
                    j1 += 1
                region = list(lst[j0 : j1 + 1])
                bad = [s for s in region if _excluded(s) or not isinstance(s, cst.SimpleStatementLine)]
                if bad:
                    self.report(
                        bad[0],
                        message=self.refuse_message.format(
                            reason="the forward shares its statement with metric or host-conversion code"
                        ),
                    )
                    continue
                r = Region(region)
                site = StepSite(lst, n, a.models, set(), {}, n)
                r.upcasts = _escapes(a, site, region, set())
                regions.append(r)
                first = first or region[0]
                loops.append(n)
                for s in region:
                    used += [m for m in a.model_of_stmt(s, a.models) if m not in used]
        if first is None:
            return
        anchors: list[cst.CSTNode] = [a.model_stmt[m] for m in used if m in a.model_stmt]
        if not anchors:
            return
        try:
            names, setup, anchor, item, imports = self._setup(
                a, a.scope_owner(loops[0]), used, anchors, min(loops, key=a.pos), False, first
            )
        except Refusal as r:
            self.report(r.node or a.module, message=self.refuse_message.format(reason=r.reason))
            return
        # The model may be moved to its device by a later statement: set up after the last one.
        e.add_after(anchor, setup)
        for planned in regions:
            wrap_region(e, planned, item)
        new = a.module.visit(ApplyEdits(e))
        self.report(
            first,
            replacement=new,
            target=a.module,
            tags=[Tag.NUMERICS],
            imports=imports,
            note="the forward runs in float16 on CUDA / bfloat16 elsewhere (the AMP tolerances of `torchopt validate`)",
        )

    def _no_grad(self, item: cst.BaseExpression) -> bool:
        return isinstance(item, cst.Call) and callee(self, item) in _NO_GRAD

    def _under_no_grad(self, analysis: _Analysis, node: cst.CSTNode) -> bool:
        cur = analysis.parent(node)
        while cur is not None and not isinstance(cur, SCOPE_NODES):
            if isinstance(cur, cst.With) and any(self._no_grad(i.item) for i in cur.items):
                return True
            cur = analysis.parent(cur)
        if isinstance(cur, cst.FunctionDef):
            for d in cur.decorators:
                dec = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
                if isinstance(dec, (cst.Name, cst.Attribute)) and torch_name(self, dec) in _NO_GRAD:
                    return True
        return False
