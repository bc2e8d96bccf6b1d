"""Preallocation for variable-length batches (TOP711)."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.analysis.arguments import has_star, keyword, positional
from torchopt.analysis.names import callee, torch_ref
from torchopt.analysis.step_loops import HotLoop, HotMap, dotted, hot_map
from torchopt.analysis.syntax import walk
from torchopt.codemods.mem import FAMILY
from torchopt.codemods.mem.padded_loader import length_key, may_pad_training_loop, padding_loader
from torchopt.codemods.mem.warmup_insertion import HELPER, WarmupInsertion, WarmupPlan
from torchopt.codemods.mem.warmup_placement import check_names_bound, check_visible, outer_loop, scope_owner
from torchopt.codemods.mem.warmup_step import Refused, check_side_effects, step_optimizers, step_prefix
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid

_DDP = {
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
    "torch.nn.DataParallel",
    "torch.nn.parallel.DataParallel",
}


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
    message = (
        "{where} trains on batches of varying length (`{collate}` pads with `pad_sequence`): every new "
        "length makes the caching allocator find new blocks{extra}"
    )
    fix_title = "Run one forward and backward pass on the longest batch before training (RNG forked, state restored)"
    safety = Safety.SAFE
    prefilter = ("pad_sequence",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.step_loops import hot_check

        # padding_loader: a DataLoader with a collate_fn iterated by a training step loop.
        return (
            super().could_match(text)
            and "DataLoader" in text
            and "collate_fn" in text
            and hot_check(text, may_pad_training_loop)
        )

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
                    """Run one forward and backward pass on the largest batch before training, so the
                    CUDA caching allocator already holds blocks of the maximum size and later, smaller
                    batches reuse them instead of fragmenting memory (PyTorch tuning guide, "Preallocate
                    memory in case of variable input length"). Random streams are forked, buffers
                    (BatchNorm statistics) restored, train/eval modes and gradients put back, so
                    training is bitwise unchanged. The backward goes through torch.autograd.backward:
                    this is not a training step, and hooks or profilers that count Tensor.backward calls
                    should not see it."""
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


                preallocate_for_longest_batch(
                    [criterion, model],
                    [optimizer],
                    lambda: collate(
                        [data[i] for i in sorted(range(len(data)), key=lambda i: len(data[i][0]))[-2:]]
                    ),
                    warmup_loss,
                )
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
        plans: list[WarmupPlan] = []
        for loop in sorted(hm.step_loops.values(), key=lambda h: h.line):
            if loop.kind != "training" or not isinstance(loop.node, cst.For):
                continue
            found = padding_loader(self, loop.node)
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
            new = node.visit(WarmupInsertion(plan, ref.name, self))
            fmt["extra"] = "; run the longest batch once before training"
            self.report(loop.node.iter, fmt=fmt, replacement=new, target=node, imports=ref.imports)
            break  # one insertion per pass; the next pass sees the helper and stops

    def _plan(self, hot: HotMap, loop: HotLoop, call: cst.Call, collate: str) -> WarmupPlan:
        """What the warm-up replays and where it goes; raises Refused with the reason it cannot be written."""
        for n in walk(self.ctx.module, True):
            if isinstance(n, cst.Call) and callee(self, n) in _DDP:
                raise Refused(
                    "the model is wrapped for data parallelism; run the warm-up on every rank or under "
                    "`model.no_sync()`"
                )
        ds_expr, bs_expr = self._dataset_and_batch_size(call)
        key = length_key(self, hot.functions[collate])
        loop_node = cst.ensure_type(loop.node, cst.For)  # (only for loops are planned)
        outer = outer_loop(self, loop_node)
        owner = scope_owner(self, outer)
        target = loop_node.target
        if isinstance(target, cst.Name):
            params, star = [target.value], False
        elif isinstance(target, (cst.Tuple, cst.List)) and all(isinstance(e.value, cst.Name) for e in target.elements):
            params, star = [e.value.value for e in target.elements if isinstance(e.value, cst.Name)], True
        else:
            raise Refused("the loop target is not a name or a tuple of names")
        prefix, loss = step_prefix(loop_node, self.ctx.module)
        check_side_effects(self, hot)
        check_visible(self, prefix, set(params), outer)
        check_names_bound(
            self, {ds_expr.value, collate} | ({bs_expr.value} if isinstance(bs_expr, cst.Name) else set()), outer
        )
        modules = sorted(
            {
                d
                for s in prefix
                for c in walk(s)
                if isinstance(c, cst.Call)
                for d in [dotted(c.func)]
                if d and d in hot.modules and "." not in d
            }
        )
        if not modules:
            raise Refused("no module of this file is called in the step")
        optimizers = step_optimizers(self, loop_node)
        check_names_bound(self, set(modules) | set(optimizers), outer)
        code = self.ctx.module.code_for_node
        data, batch = ds_expr.value, code(bs_expr)
        body = (
            f"{collate}([{data}[i] for i in sorted(range(len({data})), key=lambda i: len({data}[i]{key}))[-{batch}:]])"
        )
        if not star:
            body = f"({body},)"
        return WarmupPlan(loop, outer, owner, params, star, prefix, loss, f"lambda: {body}", modules, optimizers)

    def _dataset_and_batch_size(self, call: cst.Call) -> tuple[cst.Name, cst.Name | cst.Integer]:
        """The DataLoader's dataset name and batch size, which the longest batch is built from."""
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
        return ds_expr, bs_expr
