"""Preallocation for variable-length batches (TOP711)."""
from __future__ import annotations

from dataclasses import dataclass, field
from textwrap import dedent

import libcst as cst
from libcst.metadata import Assignment, PositionProvider, ScopeProvider

from torchopt.analysis.names import callee, torch_ref
from torchopt.analysis.values import string_value
from torchopt.analysis.arguments import has_star, keyword, positional
from torchopt.analysis.syntax import walk
from torchopt.codemods.mem import FAMILY
from torchopt.analysis.step_loops import SCOPES, HotLoop, HotMap, dotted, hot_map
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid
from torchopt.analysis.precheck.step_loops import AstHot
import ast as _ast

HELPER = "preallocate_for_longest_batch"
STEP = "warmup_loss"
_PAD = {"torch.nn.utils.rnn.pad_sequence"}
_DDP = {"torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.nn.DataParallel", "torch.nn.parallel.DataParallel"}
# Calls that must not be replayed in the warm-up: host reads, side effects, optimiser traffic.
_DENY_METHODS = {"item", "tolist", "numpy", "append", "extend", "step", "update", "write", "log", "backward",
                 "zero_grad", "set_postfix", "add_scalar", "send", "put", "insert", "pop", "clear"}
_DENY_FUNCS = {"print", "next", "input", "open", "exec", "eval"}

HELPER_SRC = '''\
def {helper}(modules, optimizers, make_batch, forward_loss):
    """Run one forward and backward pass on the largest batch before training, so the CUDA
    caching allocator already holds blocks of the maximum size and later, smaller batches reuse
    them instead of fragmenting memory (PyTorch tuning guide, "Preallocate memory in case of
    variable input length"). Random streams are forked, buffers (BatchNorm statistics) restored,
    train/eval modes and gradients put back, so training is bitwise unchanged. The backward goes
    through torch.autograd.backward: this is not a training step, and hooks or profilers that
    count Tensor.backward calls should not see it."""
    import random
    import sys

    params = {{}}
    for m in modules:
        for p in m.parameters():
            params[id(p)] = p
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                params[id(p)] = p
    grads = {{k: p.grad for k, p in params.items()}}
    for p in params.values():
        p.grad = None
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    modes = [(sub, sub.training) for m in modules for sub in m.modules()]
    py_state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    devices = [{T}.cuda.current_device()] if {T}.cuda.is_available() else []
    with {T}.random.fork_rng(devices=devices):
        for m in modules:
            m.train()
        {T}.autograd.backward(forward_loss(*make_batch()))
    with {T}.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    for sub, mode in modes:
        sub.training = mode
    for k, p in params.items():
        p.grad = grads[k]
    random.setstate(py_state)
    if np_state is not None:
        np.random.set_state(np_state)
'''


class Refused(Exception):
    pass


@dataclass
class _Plan:
    loop: HotLoop
    outer: cst.BaseStatement  # statement the warm-up goes before
    owner: cst.CSTNode  # FunctionDef or Module holding ``outer``
    params: list[str]
    star: bool  # the loop target is a tuple (forward_loss(*batch))
    prefix: list[cst.BaseStatement]
    loss: str
    make_batch: str
    modules: list[str]
    optimizers: list[str] = field(default_factory=list)


class PreallocateVarLen(Rule):
    """## What it does
    Finds a training loop whose batches vary in length (its `DataLoader`'s `collate_fn` pads with
    `torch.nn.utils.rnn.pad_sequence`) and inserts, before the loop, one forward and backward pass
    on the largest batch the dataset can produce: its `batch_size` longest samples, collated by the
    loader's own `collate_fn`. The forward and loss are the loop's own statements, copied into a
    function.

    ## Why is this slow
    With a new sequence length every batch, PyTorch's caching allocator keeps meeting block sizes it
    has not cached: it calls `cudaMalloc` again, fragments memory, and may have to free its cache
    and retry (a synchronisation) when a long batch finally arrives. Running the largest batch once
    up front makes the allocator reserve blocks that every later, smaller batch fits into.

    ## Example
    ```python
    loader = DataLoader(dataset, batch_size=32, shuffle=True, collate_fn=collate)  # pad_sequence
    for epoch in range(epochs):
        for tokens, labels in loader:
            tokens, labels = tokens.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(model(tokens), labels)
            loss.backward()
            optimizer.step()
    ```

    ## Use instead
    ```python
    def warmup_loss(tokens, labels):
        tokens, labels = tokens.to(device), labels.to(device)
        loss = criterion(model(tokens), labels)
        return loss

    preallocate_for_longest_batch([model, criterion], [optimizer], lambda: collate(
        [dataset[i] for i in sorted(range(len(dataset)), key=lambda i: len(dataset[i][0]))[-32:]]),
        warmup_loss)
    for epoch in range(epochs):
        ...
    ```
    (`preallocate_for_longest_batch` is inserted once, above: `torchopt rewrite --diff` shows it.)

    ## Fix safety
    Safe: training is bitwise identical (tests/test_mem_prealloc.py compares every
    parameter, buffer and optimizer state, and the RNG state, after training). The warm-up never
    calls `optimizer.step`, `scheduler.step` or `scaler.step`/`update`; it runs under
    `torch.random.fork_rng` (CPU and the current CUDA device; Python's `random` and numpy states are
    saved and restored too), so dropout, dummy draws and the loader's shuffling see the same random
    numbers; buffers (BatchNorm running statistics, `num_batches_tracked`) are copied back; each
    submodule's train/eval flag and every parameter's `.grad` (of the modules used and of the
    optimizers) are put back exactly as they were.

    Not made (reported instead) when: the loop's forward reads state carried across iterations, or
    names bound after the insertion point; the forward calls anything with side effects (`print`,
    `.append`, `.item()`, in-place methods); a function or module of this file that the step calls
    assigns a Python attribute (`self.cache = ...`, a step counter): attributes are not restored;
    the model is wrapped in `DistributedDataParallel`/`DataParallel` (the warm-up backward would
    all-reduce; every rank would have to run it, or run it under `model.no_sync()`);
    the loop is under a condition (e.g. a rank guard). The warm-up reads every sample of the dataset
    once to find the longest ones (slow for a dataset that tokenises on the fly), and needs the
    memory of the largest possible batch, which `drop_last=True` or a sampler may never build.
    With `cudnn.benchmark` the warm-up benchmarks the maximum shape only.
    """

    code = "TOP711"
    name = "preallocate-variable-length"
    family = FAMILY
    message = ("{where} trains on batches of varying length (`{collate}` pads with `pad_sequence`): every new "
               "length makes the caching allocator find new blocks{extra}")
    fix_title = "Run one forward and backward pass on the longest batch before training (RNG forked, state restored)"
    safety = Safety.SAFE
    prefilter = ("pad_sequence",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.step_loops import hot_check

        # _loader: a DataLoader with a collate_fn iterated by a training step loop.
        return super().could_match(text) and "DataLoader" in text and "collate_fn" in text \
            and hot_check(text, may_pad_training_loop)

    examples = (
        Invalid(
            dedent("""\
                import torch
                from torch.nn.utils.rnn import pad_sequence
                from torch.utils.data import DataLoader

                torch.manual_seed(0)
                data = [(torch.randn(n, 3), n % 2) for n in (2, 5, 3, 4, 6, 1)]


                def collate(batch):
                    seqs, ys = zip(*batch)
                    return pad_sequence(seqs, batch_first=True), torch.tensor(ys)


                loader = DataLoader(data, batch_size=2, shuffle=True, collate_fn=collate)
                model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 2))
                criterion = torch.nn.CrossEntropyLoss()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in loader:
                    optimizer.zero_grad()
                    loss = criterion(model(x).mean(1), y)
                    loss.backward()
                    optimizer.step()
            """),
            after=dedent('''\
                import torch
                from torch.nn.utils.rnn import pad_sequence
                from torch.utils.data import DataLoader

                torch.manual_seed(0)
                data = [(torch.randn(n, 3), n % 2) for n in (2, 5, 3, 4, 6, 1)]


                def collate(batch):
                    seqs, ys = zip(*batch)
                    return pad_sequence(seqs, batch_first=True), torch.tensor(ys)


                loader = DataLoader(data, batch_size=2, shuffle=True, collate_fn=collate)
                model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 2))
                criterion = torch.nn.CrossEntropyLoss()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


                def preallocate_for_longest_batch(modules, optimizers, make_batch, forward_loss):
                    """Run one forward and backward pass on the largest batch before training, so the CUDA
                    caching allocator already holds blocks of the maximum size and later, smaller batches reuse
                    them instead of fragmenting memory (PyTorch tuning guide, "Preallocate memory in case of
                    variable input length"). Random streams are forked, buffers (BatchNorm statistics) restored,
                    train/eval modes and gradients put back, so training is bitwise unchanged. The backward goes
                    through torch.autograd.backward: this is not a training step, and hooks or profilers that
                    count Tensor.backward calls should not see it."""
                    import random
                    import sys

                    params = {}
                    for m in modules:
                        for p in m.parameters():
                            params[id(p)] = p
                    for opt in optimizers:
                        for group in opt.param_groups:
                            for p in group["params"]:
                                params[id(p)] = p
                    grads = {k: p.grad for k, p in params.items()}
                    for p in params.values():
                        p.grad = None
                    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
                    modes = [(sub, sub.training) for m in modules for sub in m.modules()]
                    py_state = random.getstate()
                    np = sys.modules.get("numpy")
                    np_state = np.random.get_state() if np is not None else None
                    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
                    with torch.random.fork_rng(devices=devices):
                        for m in modules:
                            m.train()
                        torch.autograd.backward(forward_loss(*make_batch()))
                    with torch.no_grad():
                        for b, saved in buffers:
                            b.copy_(saved)
                    for sub, mode in modes:
                        sub.training = mode
                    for k, p in params.items():
                        p.grad = grads[k]
                    random.setstate(py_state)
                    if np_state is not None:
                        np.random.set_state(np_state)


                def warmup_loss(x, y):
                    loss = criterion(model(x).mean(1), y)
                    return loss


                preallocate_for_longest_batch([criterion, model], [optimizer], lambda: collate([data[i] for i in sorted(range(len(data)), key=lambda i: len(data[i][0]))[-2:]]), warmup_loss)
                for x, y in loader:
                    optimizer.zero_grad()
                    loss = criterion(model(x).mean(1), y)
                    loss.backward()
                    optimizer.step()
            '''),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch
                from torch.nn.utils.rnn import pad_sequence
                from torch.utils.data import DataLoader

                torch.manual_seed(0)
                data = [(torch.randn(n, 3), n % 2) for n in (2, 5, 3, 4, 6, 1)]


                def collate(batch):
                    seqs, ys = zip(*batch)
                    return pad_sequence(seqs, batch_first=True), torch.tensor(ys)


                loader = DataLoader(data, batch_size=2, shuffle=True, collate_fn=collate)
                model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 2))
                criterion = torch.nn.CrossEntropyLoss()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                if True:
                    for x, y in loader:
                        optimizer.zero_grad()
                        loss = criterion(model(x).mean(1), y)
                        loss.backward()
                        optimizer.step()
            """),
            note="under a condition (it could be a rank guard): reported, not rewritten",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.nn.utils.rnn import pad_sequence
                from torch.utils.data import DataLoader

                torch.manual_seed(0)
                data = [(torch.randn(4, 3), n % 2) for n in range(6)]


                def collate(batch):
                    seqs, ys = zip(*batch)
                    return pad_sequence(seqs, batch_first=True), torch.tensor(ys)


                loader = DataLoader(data, batch_size=2, shuffle=True, collate_fn=None)
                model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 2))
                criterion = torch.nn.CrossEntropyLoss()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for x, y in loader:
                    optimizer.zero_grad()
                    loss = criterion(model(x).mean(1), y)
                    loss.backward()
                    optimizer.step()
            """),
            note="no padding collate: batches have one length",
        ),
        Valid(
            dedent("""\
                import torch
                from torch.nn.utils.rnn import pad_sequence

                x = pad_sequence([torch.ones(2), torch.ones(3)])
            """),
            runnable=True,
        ),
    )

    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)

    def visit_Module(self, node: cst.Module) -> None:
        hm = hot_map(self)
        if not hm.step_loops:
            return
        if any(isinstance(n, cst.Name) and n.value == HELPER for n in walk(node, True)):
            return  # already preallocated (idempotency)
        plans: list[_Plan] = []
        for loop in sorted(hm.step_loops.values(), key=lambda h: h.line):
            if loop.kind != "training" or not isinstance(loop.node, cst.For):
                continue
            found = self._loader(loop.node)
            if found is None:
                continue
            collate_name, call = found
            fmt = {"where": loop.text[0].upper() + loop.text[1:], "collate": collate_name, "extra": ""}
            try:
                plan = self._plan(hm, loop, call, collate_name)
            except Refused as exc:
                fmt["extra"] = f"; preallocate by running the longest batch once before training (not rewritten: {exc})"
                self.report(loop.node.iter, fmt=fmt)
                continue
            if any(p.outer is plan.outer for p in plans):
                continue
            plans.append(plan)
            ref = torch_ref(self)
            if ref is None:
                continue
            new = node.visit(_Insert(plan, ref.name, self))
            fmt["extra"] = "; run the longest batch once before training"
            self.report(loop.node.iter, fmt=fmt, replacement=new, target=node, imports=ref.imports)
            break  # one insertion per pass; the next pass sees the helper and stops

    # ------------------------------------------------------------------ analysis
    def _loader(self, loop: cst.For) -> tuple[str, cst.Call] | None:
        it = loop.iter
        for _ in range(3):
            if isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value in ("enumerate", "tqdm") \
                    and it.args:
                it = it.args[0].value
        if not isinstance(it, cst.Name):
            return None
        try:
            scope = self.get_metadata(ScopeProvider, it)
        except KeyError:
            return None
        if scope is None or it.value not in scope:
            return None
        calls = []
        for a in scope[it.value]:
            node = getattr(a, "node", None)
            parent = self.get_metadata(ParentProvider, node, None) if node is not None else None
            stmt = self.get_metadata(ParentProvider, parent, None) if isinstance(parent, cst.AssignTarget) else None
            if not isinstance(stmt, cst.Assign) or not isinstance(stmt.value, cst.Call):
                return None
            q = callee(self, stmt.value) or ""
            if not q.endswith("DataLoader") or not q.startswith("torch."):
                return None
            calls.append(stmt.value)
        if len(calls) != 1:
            return None
        call = calls[0]
        cf = keyword(call, "collate_fn")
        if cf is None or not isinstance(cf.value, cst.Name):
            return None
        hm = hot_map(self)
        fn = hm.functions.get(cf.value.value)
        if fn is None or not any(isinstance(c, cst.Call) and callee(self, c) in _PAD for c in walk(fn)):
            return None
        return cf.value.value, call

    def _plan(self, hot: HotMap, loop: HotLoop, call: cst.Call, collate: str) -> _Plan:
        for n in walk(self.ctx.module, True):
            if isinstance(n, cst.Call) and callee(self, n) in _DDP:
                raise Refused("the model is wrapped for data parallelism; run the warm-up on every rank or under "
                              "`model.no_sync()`")
        if has_star(call):
            raise Refused("the DataLoader takes `*args`/`**kwargs`")
        pos = positional(call)
        ds = keyword(call, "dataset")
        ds_expr = ds.value if ds is not None else (pos[0].value if pos else None)
        if not isinstance(ds_expr, cst.Name):
            raise Refused("the dataset is not a plain name")
        if keyword(call, "batch_sampler") is not None:
            raise Refused("a batch sampler chooses the batches")
        bs = keyword(call, "batch_size")
        bs_expr = bs.value if bs is not None else (pos[1].value if len(pos) > 1 else cst.Integer("1"))
        if not isinstance(bs_expr, (cst.Name, cst.Integer)):
            raise Refused("the batch size is not a name or a number")
        key = self._length_key(hot.functions[collate])
        loop_node = cst.ensure_type(loop.node, cst.For)  # (only for loops are planned)
        outer = self._outer(loop_node)
        owner = self._owner(outer)
        target = loop_node.target
        if isinstance(target, cst.Name):
            params, star = [target.value], False
        elif isinstance(target, (cst.Tuple, cst.List)) and all(isinstance(e.value, cst.Name) for e in target.elements):
            params, star = [e.value.value for e in target.elements if isinstance(e.value, cst.Name)], True
        else:
            raise Refused("the loop target is not a name or a tuple of names")
        prefix, loss = self._prefix(loop_node)
        self._check_side_effects(hot)
        self._check_visible(prefix, set(params), outer)
        self._check_names_bound({ds_expr.value, collate} | ({bs_expr.value} if isinstance(bs_expr, cst.Name) else set()),
                                outer)
        modules = sorted({d for s in prefix for c in walk(s) if isinstance(c, cst.Call)
                          for d in [dotted(c.func)] if d and d in hot.modules and "." not in d})
        if not modules:
            raise Refused("no module of this file is called in the step")
        optimizers = self._optimizers(loop_node)
        self._check_names_bound(set(modules) | set(optimizers), outer)
        code = self.ctx.module.code_for_node
        data, batch = ds_expr.value, code(bs_expr)
        body = f"{collate}([{data}[i] for i in sorted(range(len({data})), key=lambda i: len({data}[i]{key}))[-{batch}:]])"
        if not star:
            body = f"({body},)"
        return _Plan(loop, outer, owner, params, star, prefix, loss, f"lambda: {body}", modules, optimizers)

    def _length_key(self, fn: cst.FunctionDef) -> str:
        """``[0]`` / ``["input_ids"]``: where the padded sequence sits in a sample."""
        params = fn.params.params
        if len(params) != 1:
            raise Refused("the collate function does not take one batch argument")
        batch = params[0].name.value
        pads = [c for c in walk(fn) if isinstance(c, cst.Call) and callee(self, c) in _PAD]
        if len(pads) != 1 or not pads[0].args:
            raise Refused("the collate function pads more than one field")
        arg = pads[0].args[0].value
        if isinstance(arg, cst.ListComp):
            return self._comp_key(arg, batch)
        if isinstance(arg, cst.Name):
            for n in walk(fn):
                if isinstance(n, cst.Assign) and len(n.targets) == 1:
                    t, v = n.targets[0].target, n.value
                    if isinstance(t, cst.Name) and t.value == arg.value and isinstance(v, cst.ListComp):
                        return self._comp_key(v, batch)
                    if isinstance(t, (cst.Tuple, cst.List)) and isinstance(v, cst.Call) \
                            and isinstance(v.func, cst.Name) and v.func.value == "zip" and len(v.args) == 1 \
                            and v.args[0].star == "*" and isinstance(v.args[0].value, cst.Name) \
                            and v.args[0].value.value == batch:
                        for i, e in enumerate(t.elements):
                            if isinstance(e.value, cst.Name) and e.value.value == arg.value:
                                return f"[{i}]"
        raise Refused("cannot tell which field of a sample is padded")

    def _comp_key(self, comp: cst.ListComp, batch: str) -> str:
        f = comp.for_in
        if not isinstance(f.iter, cst.Name) or f.iter.value != batch or not isinstance(f.target, cst.Name) \
                or f.inner_for_in is not None or f.ifs:
            raise Refused("cannot tell which field of a sample is padded")
        el = comp.elt
        if isinstance(el, cst.Subscript) and isinstance(el.value, cst.Name) and el.value.value == f.target.value \
                and len(el.slice) == 1 and isinstance(el.slice[0].slice, cst.Index):
            idx = el.slice[0].slice.value
            if isinstance(idx, cst.Integer) or string_value(idx) is not None:
                return "[" + self.ctx.module.code_for_node(idx) + "]"
        raise Refused("cannot tell which field of a sample is padded")

    def _outer(self, loop: cst.For) -> cst.BaseStatement:
        """The outermost loop statement around ``loop`` in its scope (the epoch loop), or ``loop``.
        Raises when a condition guards it."""
        cur: cst.CSTNode = loop
        best: cst.For = loop
        while True:
            parent = self.get_metadata(ParentProvider, cur, None)
            if parent is None or isinstance(parent, SCOPES) or isinstance(parent, cst.Module):
                return best
            if isinstance(parent, (cst.If, cst.Try, cst.With, cst.While, cst.Else, cst.ExceptHandler, cst.Finally)):
                if isinstance(parent, (cst.If, cst.Else, cst.While, cst.ExceptHandler)):
                    raise Refused("the loop runs under a condition (a rank guard?)")
            if isinstance(parent, cst.For):
                best = parent
            cur = parent

    def _owner(self, node: cst.CSTNode) -> cst.CSTNode:
        cur = self.get_metadata(ParentProvider, node, None)
        while cur is not None and not isinstance(cur, SCOPES):
            cur = self.get_metadata(ParentProvider, cur, None)
        if isinstance(cur, (cst.ClassDef, cst.Lambda)):
            raise Refused("the loop is in a class body")
        return cur if cur is not None else self.ctx.module

    def _prefix(self, loop: cst.For) -> tuple[list[cst.BaseStatement], str]:
        if not isinstance(loop.body, cst.IndentedBlock):
            raise Refused("one-line loop body")
        prefix: list[cst.BaseStatement] = []
        for stmt in loop.body.body:
            loss = self._backward_of(stmt)
            if loss is not None:
                if not any(loss in self._assigned(s) for s in prefix):
                    raise Refused("the loss is not computed in the loop before `backward()`")
                return prefix, loss
            if self._is_zero_grad(stmt):
                continue
            self._check_stmt(stmt)
            prefix.append(stmt)
        raise Refused("no `loss.backward()` statement in the loop body")

    def _backward_of(self, stmt: cst.BaseStatement) -> str | None:
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1 \
                or not isinstance(stmt.body[0], cst.Expr):
            return None
        c = stmt.body[0].value
        if not isinstance(c, cst.Call) or not isinstance(c.func, cst.Attribute) or c.func.attr.value != "backward" \
                or c.args:
            return None
        recv = c.func.value
        if isinstance(recv, cst.Name):
            return recv.value
        if isinstance(recv, cst.Call) and isinstance(recv.func, cst.Attribute) and recv.func.attr.value == "scale" \
                and len(recv.args) == 1 and isinstance(recv.args[0].value, cst.Name):
            return recv.args[0].value.value
        raise Refused("the backward call is not `loss.backward()`")

    def _is_zero_grad(self, stmt: cst.BaseStatement) -> bool:
        return isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(
            stmt.body[0], cst.Expr) and isinstance(stmt.body[0].value, cst.Call) and isinstance(
            stmt.body[0].value.func, cst.Attribute) and stmt.body[0].value.func.attr.value == "zero_grad"

    def _check_stmt(self, stmt: cst.BaseStatement) -> None:
        if isinstance(stmt, cst.With):
            for s in stmt.body.body if isinstance(stmt.body, cst.IndentedBlock) else ():
                self._check_stmt(s)
            if not isinstance(stmt.body, cst.IndentedBlock):
                raise Refused("one-line `with` in the step")
            if any(i.asname is not None for i in stmt.items):
                raise Refused("`with ... as` in the step")
            return
        if not isinstance(stmt, cst.SimpleStatementLine):
            raise Refused("the step before `backward()` holds control flow")
        for small in stmt.body:
            if isinstance(small, cst.Assign):
                for t in small.targets:
                    tgt = t.target
                    ok = isinstance(tgt, cst.Name) or (isinstance(tgt, (cst.Tuple, cst.List)) and all(
                        isinstance(e.value, cst.Name) for e in tgt.elements))
                    if not ok:
                        raise Refused("the step assigns to an attribute or an item")
            elif isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name) and small.value is not None:
                pass
            else:
                raise Refused(f"`{self.ctx.module.code_for_node(small).strip()}` in the step has side effects")
            for c in walk(small):
                if isinstance(c, cst.Call):
                    if isinstance(c.func, cst.Attribute):
                        meth = c.func.attr.value
                        if meth in _DENY_METHODS or (meth.endswith("_") and not meth.startswith("_")):
                            raise Refused(f"`.{meth}()` in the step has side effects")
                    elif isinstance(c.func, cst.Name) and c.func.value in _DENY_FUNCS:
                        raise Refused(f"`{c.func.value}()` in the step has side effects")
                if isinstance(c, (cst.Lambda, cst.NamedExpr)):
                    raise Refused("the step uses a lambda or `:=`")

    def _assigned(self, stmt: cst.BaseStatement) -> set[str]:
        out = set()
        for n in walk(stmt):
            if isinstance(n, cst.AssignTarget):
                out |= {x.value for x in walk(n.target) if isinstance(x, cst.Name)}
            elif isinstance(n, cst.AnnAssign):
                out |= {x.value for x in walk(n.target) if isinstance(x, cst.Name)}
        return out

    def _check_side_effects(self, hot: HotMap) -> None:
        for fid, where in hot.hot_funcs.items():
            fn = next((f for f in walk(self.ctx.module, True) if isinstance(f, cst.FunctionDef) and id(f) == fid),
                      None)
            if fn is None:
                continue
            for n in walk(fn):
                if isinstance(n, (cst.Global, cst.Nonlocal)):
                    raise Refused(f"`{where.via}` changes a global")
                targets = []
                if isinstance(n, cst.Assign):
                    targets = [t.target for t in n.targets]
                elif isinstance(n, (cst.AugAssign, cst.AnnAssign)):
                    targets = [n.target]
                for t in targets:
                    for x in walk(t):
                        if isinstance(x, cst.Attribute) and dotted(x.value) == "self":
                            raise Refused(f"`{where.via}` sets `self.{x.attr.value}` (Python attributes are not "
                                          "restored after the warm-up)")

    def _pos(self, node: cst.CSTNode) -> tuple[int, int]:
        r = self.get_metadata(PositionProvider, node)
        return (r.start.line, r.start.column)

    def _check_visible(self, prefix: list[cst.BaseStatement], known: set[str], outer: cst.CSTNode) -> None:
        known = set(known)
        for stmt in prefix:
            stores = set()
            for n in walk(stmt):
                if isinstance(n, cst.AssignTarget):
                    stores |= {id(x) for x in walk(n.target) if isinstance(x, cst.Name)}
                elif isinstance(n, cst.Attribute):
                    stores.add(id(n.attr))
                elif isinstance(n, cst.Arg) and n.keyword is not None:
                    stores.add(id(n.keyword))
            for n in walk(stmt):
                if isinstance(n, cst.Name) and id(n) not in stores and n.value not in known:
                    self._bound_before(n, outer)
            known |= self._assigned(stmt)

    def _bound_before(self, name: cst.Name, outer: cst.CSTNode) -> None:
        try:
            scope = self.get_metadata(ScopeProvider, name)
        except KeyError:
            raise Refused("no scope") from None
        if scope is None:
            raise Refused("no scope")
        at = self._pos(outer)
        for a in scope[name.value]:
            if not isinstance(a, Assignment):
                continue  # builtins
            node = a.node
            if isinstance(node, cst.Param):
                continue
            if a.scope is not scope and not isinstance(self._owner(outer), cst.Module):
                continue  # a global read by a function
            try:
                p = self._pos(node)
            except KeyError:
                raise Refused(f"cannot place `{name.value}`") from None
            if p >= at:
                raise Refused(f"`{name.value}` is bound after the warm-up would run (state carried between steps?)")

    def _check_names_bound(self, names: set[str], outer: cst.CSTNode) -> None:
        for name in names:
            use = next((n for n in walk(outer) if isinstance(n, cst.Name) and n.value == name), None)
            if use is not None:
                self._bound_before(use, outer)

    def _optimizers(self, loop: cst.For) -> list[str]:
        out = []
        for n in walk(loop.body):
            if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "step" \
                    and isinstance(n.func.value, cst.Name):
                name = n.func.value
                try:
                    scope = self.get_metadata(ScopeProvider, name)
                except KeyError:
                    continue
                if scope is None or name.value not in scope:
                    continue
                ok = True
                for a in scope[name.value]:
                    node = getattr(a, "node", None)
                    parent = self.get_metadata(ParentProvider, node, None) if node is not None else None
                    stmt = self.get_metadata(ParentProvider, parent, None) if isinstance(parent, cst.AssignTarget) \
                        else None
                    q = callee(self, stmt.value) if isinstance(stmt, cst.Assign) and isinstance(stmt.value, cst.Call) \
                        else None
                    if not (q and q.startswith("torch.optim.") and ".lr_scheduler" not in q):
                        ok = False
                if ok and name.value not in out:
                    out.append(name.value)
        return out


class _Insert(cst.CSTTransformer):
    """Insert the helper (module level) and the warm-up (before the outer loop)."""

    def __init__(self, plan: _Plan, T: str, rule: Rule) -> None:
        super().__init__()
        self.plan = plan
        self.T = T
        self.rule = rule

    def _warmup(self) -> list[cst.BaseStatement]:
        p = self.plan
        body = [s.deep_clone() for s in p.prefix]
        body[0] = body[0].with_changes(leading_lines=())
        body.append(cst.parse_statement(f"return {p.loss}\n"))
        fn = cst.FunctionDef(
            name=cst.Name(STEP),
            params=cst.Parameters(params=[cst.Param(cst.Name(x)) for x in p.params]),
            body=cst.IndentedBlock(body=body),
            leading_lines=[cst.EmptyLine(), cst.EmptyLine()] if isinstance(p.owner, cst.Module) else [cst.EmptyLine()],
        )
        mods = ", ".join(p.modules)
        opts = ", ".join(p.optimizers)
        call = cst.parse_statement(f"{HELPER}([{mods}], [{opts}], {p.make_batch}, {STEP})\n")
        call = call.with_changes(leading_lines=fn.leading_lines)
        return [fn, call]

    def _helper(self) -> cst.BaseStatement:
        fn = cst.parse_statement(HELPER_SRC.format(helper=HELPER, T=self.T))
        return fn.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])

    def _rebuild(self, original: cst.Module | cst.IndentedBlock, body: list) -> list:
        out = []
        p = self.plan
        top = self._top_statement()
        orig_body = original.body
        for o, u in zip(orig_body, body):
            if o is top:
                out.append(self._helper())
                if top is p.outer:
                    out.extend(self._warmup())
            out.append(u)
        return out

    def _top_statement(self) -> cst.CSTNode:
        cur: cst.CSTNode = self.plan.outer
        while True:
            parent = self.rule.get_metadata(ParentProvider, cur, None)
            if parent is None or isinstance(parent, cst.Module):
                return cur
            cur = parent

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return updated_node.with_changes(body=self._rebuild(original_node, list(updated_node.body)))

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock):
        if any(o is self.plan.outer for o in original_node.body):
            out = []
            for o, u in zip(original_node.body, updated_node.body):
                if o is self.plan.outer:
                    w = self._warmup()
                    w[0] = w[0].with_changes(leading_lines=[])
                    out.extend(w)
                out.append(u)
            return updated_node.with_changes(body=out)
        return updated_node


def may_pad_training_loop(hot: AstHot) -> bool:
    """TOP711: a training step loop ``for ... in <name>`` (through enumerate/tqdm)."""
    for loop in hot.step_loops.values():
        if id(loop) not in hot.training_loops or not isinstance(loop, _ast.For):
            continue
        it = loop.iter
        for _ in range(3):
            if isinstance(it, _ast.Call) and isinstance(it.func, _ast.Name) and it.func.id in ("enumerate", "tqdm") \
                    and (it.args or it.keywords):
                it = it.args[0] if it.args else it.keywords[0].value
        if isinstance(it, _ast.Name):
            return True
    return False
