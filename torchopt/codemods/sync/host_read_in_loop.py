"""TOP601 `host-read-in-loop`: Flags reads of tensor values on the host inside a training or evaluation step: `t.item()`,."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.names import torch_ref
from torchopt.analysis.step_loops import HOST_READS
from torchopt.analysis.step_loops import Tensors
from torchopt.analysis.step_loops import Where
from torchopt.analysis.step_loops import calls_in
from torchopt.analysis.step_loops import dotted
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.sync import FAMILY
from torchopt.analysis.control import QUIET_GUARDS, Guard, control_of
from torchopt.analysis.needed_reads import needed_read
from torchopt.analysis.placement import placements
from torchopt.analysis.statement_edits import Refusal
from torchopt.codemods.sync.host_read_planning import Plan, _Apply, _Planner, grad_norm_names, host_read
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


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
    double additions in the same order (tests/test_sync_accumulator.py checks it over
    100 000 random losses). A compound summand (`loss.item() * x.size(0)`) becomes
    `loss.detach().double() * x.size(0)`, a double multiplication as in Python. Each read becomes
    `running_loss.item()` and keeps its arithmetic in Python, so `running_loss.item() / 100` is the
    very division the program did (`(running_loss / 100).item()` would need a proof that the
    divisor is a Python number).

    The fix is made only when: every summand's receiver is provably a tensor (a torch call, a
    `torch.nn` loss module, or a function of this file that returns one; a method name alone is
    not proof), the other operands are Python numbers; the name is bound only to `0.0`
    (or `0`, then it may only be read as `name / ...`), to `+=` in one loop, and read in the same
    function or, for a script whose loop is at module level (the PyTorch tutorial's
    `running_loss`), at module level; no read happens on every step (that would gain nothing); the
    loop's data goes to one device expression visible where the accumulator starts (or the file
    uses no device at all). `t.size(i)`, `t.shape[i]` and `len(...)` are taken to be Python ints.
    Resets inside the loop become `.zero_()`. Apple MPS has no float64: the fix is not made for a
    literal `'mps'` device, nor for a device chosen at run time in a file that names MPS or asks
    `torch.accelerator` (or an accelerate `Accelerator`) for its device. A device that comes from
    outside the file (a command-line string, a caller's argument) is assumed not to be MPS.

    Not reported: reads that already run only now and then (under `if i % log_interval == 0`, also
    `and`-ed with `rank == 0`, once under `if i == 0`, on a branch that exits or raises, after the
    batch loop of a function an outer loop calls, in an exception handler), under a device check
    inside the step, and reads of host data (`torch.randint(16, 128, ()).item()` on
    a tensor made on the CPU, `.tolist()` of a tensor moved with `.cpu()`, `float(i)` of an
    `enumerate` counter, any tensor of a program that never selects an accelerator), and a read that
    decides whether a `while True:` loop goes on on a flag a collective of the loop shares with
    every rank (`dist.broadcast(done, src=0)`, then `if done.item() == 0: break`: the ranks decide
    together, at every iteration, whether to go on), and a read the loop
    exists for: a value sent to host code whose answer is the next iteration's input (an action
    given to an environment's `step()`, which returns the next observation), or the output of an
    inference loop written to its own file (`scipy.io.wavfile.write(path, rate, audio.cpu().numpy())`;
    see `analysis/needed_reads.py`). A read at every
    step on rank 0 only is reported: rank 0 waits at every step and the other ranks wait for it at
    the next collective. Every other host read is reported with the sync-free alternative and not
    changed.

    The accumulator is created on the device the program moves its data to. When the program
    picks that device only on some paths (`if args.gpu: x = x.cuda()`) and has no device
    expression of its own, the fix is not made (a literal `"cuda"` would crash a CPU-only run);
    the message says so.
    """

    code = "TOP601"
    name = "host-read-in-loop"
    family = FAMILY
    message = (
        "`{expr}` {why}, {where}: it waits for every queued kernel, so the GPU idles while the "
        "host prepares the next step{advice}"
    )
    fix_title = "Accumulate `{acc}` on the device in float64 and read it only when it is logged"
    safety = Safety.SAFE
    prefilter = (".item(", ".tolist(", ".numpy(", "float(", "int(", "bool(")

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.codemods.sync.step_prechecks import may_host_read
        from torchopt.analysis.precheck.step_loops import hot_check

        # The trigger in a step: a superset of HotMap.where on CPython's ast (sync._hot.may_host_read).
        return super().could_match(text) and hot_check(text, may_host_read)

    examples = (
        Invalid(
            dedent("""\
                import torch

                model = torch.nn.Linear(4, 1)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                crit = torch.nn.MSELoss()
                data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(6)]
                def train():
                    running = 0.0
                    logged = []
                    for i, (x, y) in enumerate(data):
                        loss = crit(model(x), y)
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        running += loss.item()
                        if i % 3 == 2:
                            logged.append(running / 3)
                            running = 0.0
                    return logged

                logged = train()
            """),
            after=dedent("""\
                import torch

                model = torch.nn.Linear(4, 1)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                crit = torch.nn.MSELoss()
                data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(6)]
                def train():
                    running = torch.zeros((), dtype=torch.float64)
                    logged = []
                    for i, (x, y) in enumerate(data):
                        loss = crit(model(x), y)
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        running += loss.detach()
                        if i % 3 == 2:
                            logged.append(running.item() / 3)
                            running.zero_()
                    return logged

                logged = train()
            """),
            runnable=True,
            note="no device in the file: the accumulator lives on the CPU like the loss",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn.functional as F

                def train(model, loader, opt, device):
                    total = 0.0
                    for x, y in loader:
                        x, y = x.to(device), y.to(device)
                        loss = F.cross_entropy(model(x), y)
                        loss.backward()
                        opt.step()
                        total += loss.item() * x.size(0)
                    return total / len(loader.dataset)
            """),
            after=dedent("""\
                import torch
                import torch.nn.functional as F

                def train(model, loader, opt, device):
                    total = torch.zeros((), dtype=torch.float64, device=device)
                    for x, y in loader:
                        x, y = x.to(device), y.to(device)
                        loss = F.cross_entropy(model(x), y)
                        loss.backward()
                        opt.step()
                        total += loss.detach().double() * x.size(0)
                    return total.item() / len(loader.dataset)
            """),
            note="weighted sum: a double multiplication on the device as in Python",
        ),
        Invalid(
            dedent("""\
                import torch

                def train(model, loader, opt, crit, device):
                    hist = []
                    for x, y in loader:
                        loss = crit(model(x.to(device)), y.to(device))
                        loss.backward()
                        opt.step()
                        hist.append(loss.item())
            """),
            note="appended every step: reported with advice, not rewritten",
        ),
        Invalid(
            dedent("""\
                import torch

                def train(model, loader, opt, crit):
                    for x, y in loader:
                        loss = crit(model(x), y)
                        loss.backward()
                        if float(loss) > 100:
                            break
                        opt.step()
            """),
            note="control flow on a host value: reported, never rewritten",
        ),
        Invalid(
            dedent("""\
                import torch

                def train(model, loader, opt, crit, device):
                    running = 0.0
                    for x, y in loader:
                        loss = crit(model(x.to(device)), y.to(device))
                        loss.backward()
                        running += loss.item()
                        print(running)
            """),
            note="read on every step: the rewrite would save nothing; `crit` is not provably a tensor function",
        ),
        Valid(
            dedent("""\
                import torch

                x = torch.randn(3)
                vals = [x.sum().item() for _ in range(3)]
                print(float(x.mean()))
            """),
            note="not in a training or forward-pass loop",
            runnable=True,
        ),
        Valid(
            dedent("""\
                import torch

                def train(model, loader, opt):
                    for x, y in loader:
                        loss = model(x).sum()
                        loss.backward()
                        opt.step()
                    print(loss.item())
            """),
            note="after the loop: once",
        ),
        Valid(
            dedent("""\
                import torch

                for epoch in range(3):
                    for x in data:
                        model(x).sum().backward()
                    print(float(torch.ones(1).sum()), n.item())
            """),
            note="per-epoch code of the outer loop is not a step",
        ),
    )

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.any_hot:
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
                    except Refusal as exc:
                        plans[key] = exc.reason
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
            if id(n) not in item_plan and control_of(self).not_every_step(n, guards=QUIET_GUARDS):
                continue
            if control_of(self).decides_exit(n) or needed_read(self, n) is not None:
                continue  # the loop cannot go on without the value
            if _reads_host_data(self, n):
                continue
            parent = self.get_metadata(ParentProvider, n, None)
            grand = self.get_metadata(ParentProvider, parent, None) if parent is not None else None
            if (
                isinstance(parent, cst.Attribute)
                and parent.value is n
                and isinstance(grand, cst.Call)
                and grand.func is parent
                and parent.attr.value in HOST_READS
            ):
                continue  # `t.numpy().tolist()`: one read, reported at the outer call
            inner = n.func.value if isinstance(n.func, cst.Attribute) else n.args[0].value
            fmt = {
                "expr": source(self, n),
                "where": where.text,
                "why": _WHY[kind.strip(".()")],
                "advice": self._advice(n, kind, where) + _rank0_note(self, n),
                "acc": "",
            }
            plan_key = item_plan.get(id(n))
            plan = plans.get(plan_key) if plan_key is not None else None
            if isinstance(plan, Plan) and plan_key is not None and plan_key not in done and ref is not None:
                done.add(plan_key)
                fmt["acc"] = plan.name
                fmt["advice"] = "; keep the running sum on the device and read it when it is logged"
                new = plan.owner.visit(_Apply(plan, ref.name))
                self.report(n, fmt=fmt, replacement=new, target=plan.owner, imports=ref.imports)
                continue
            if isinstance(plan, Plan):
                self.report(n, fmt=fmt)
                continue
            if isinstance(plan, str) and plan_key is not None:
                fmt["advice"] += f" (not rewritten: {plan})"
            del inner
            self.report(n, fmt=fmt)

    def _advice(self, n: cst.Call, kind: str, where: Where) -> str:
        parent = self.get_metadata(ParentProvider, n, None)
        stmt = parent
        while stmt is not None and not isinstance(
            stmt, (cst.If, cst.While, cst.Assert, cst.IfExp, cst.SimpleStatementLine)
        ):
            stmt = self.get_metadata(ParentProvider, stmt, None)
        if isinstance(stmt, (cst.If, cst.While, cst.Assert, cst.IfExp)):
            return "; decide on the device instead (`torch.where`), check every N steps, or use `torch._assert_async`"
        if kind in (".tolist()", ".numpy()"):
            return "; collect the tensors on the device (`torch.cat`) and convert once after the loop"
        return (
            "; accumulate on the device (`running += t.detach()`) and call `.item()` only every N steps "
            "or after the loop"
        )


def _rank0_note(rule: Rule, read: cst.Call) -> str:
    if Guard.RANK0 in control_of(rule).guards(read):
        return " (it runs on rank 0 only, and the other ranks wait for rank 0 at the next collective)"
    return ""


def _reads_host_data(rule: Rule, read: cst.Call) -> bool:
    """`.tolist()` of a tensor moved with `.cpu()` or made on the CPU, `float(n)` of a Python number
    (an `enumerate` counter, a list element): no device involved (the value facts). A copy written
    in the same expression (`t.cpu().numpy()`) is where this read waits: TOP603 leaves it to this
    rule, so the value read is the one before that chain of methods."""
    read_of = read.func.value if isinstance(read.func, cst.Attribute) else read.args[0].value if read.args else None
    while (
        isinstance(read_of, cst.Call)
        and isinstance(read_of.func, cst.Attribute)
        and (read_of.func.attr.value in HOST_READS or read_of.func.attr.value in _CHAIN)
    ):
        read_of = read_of.func.value
    return read_of is not None and placements(rule).value(read_of).on_host


# Methods a read chain passes through on its way to the host (`t.detach().cpu().numpy().ravel()`).
_CHAIN = frozenset(("cpu", "to", "detach", "clone", "contiguous", "ravel", "flatten", "float", "double", "squeeze"))


_WHY = {
    "item": "copies a device value to the host",
    "tolist": "copies a tensor to the host",
    "numpy": "copies a tensor to the host",
    "float": "copies a device value to the host",
    "int": "copies a device value to the host",
    "bool": "copies a device value to the host",
}
