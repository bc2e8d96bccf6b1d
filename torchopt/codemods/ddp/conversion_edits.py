"""The DataParallel / single-process -> DistributedDataParallel conversion (TOP401, TOP402) and the
per-rank edits that the other DDP rules also make on their own (set_epoch, rank-0 guards, checkpoint
portability)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Sequence

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.names import torch_ref
from torchopt.analysis.values import int_value, string_value
from torchopt.analysis.arguments import has_star, keyword, keywords, positional, set_kwarg
from torchopt.analysis.syntax import walk
from torchopt.analysis.statement_edits import ApplyEdits, Edits, Refusal, fresh_name, statement
from torchopt.codemods.ddp.program_analysis import (
    LAUNCH_NOTE,
    MODULE_METHODS,
    TQDM,
    WRITERS,
    Analysis,
    Loop,
    calls,
    collective_free,
    dotted,
    has_backward,
    is_docstring,
    is_import,
    side_effects,
)
from torchopt.codemods.ddp.save_groups import group_with_save, race_free_folders
from torchopt.rewrite.rule import ImportSpec

_CUDA_INDEX = re.compile(r"^cuda:\d+$")


@dataclass
class Names:
    """How generated code spells things, and the imports that make the spellings true."""

    T: str
    dist: str
    os: str
    ddp: str = ""
    sampler: str = ""
    consume: str = ""
    imports: list[ImportSpec] = field(default_factory=list)


def need(found, node: cst.CSTNode, what: str):
    if found is None:
        raise Refusal(node, f"the name `{what}` is bound to something else in this file")
    return found


def base_names(rule, analysis: Analysis, node: cst.CSTNode) -> Names:
    ref = torch_ref(rule)
    if ref is None:
        raise Refusal(node, "`torch` is bound to something else in this file")
    dist, imp1 = need(analysis.dist_alias(), node, "dist")
    os_, imp2 = need(analysis.plain_import("os"), node, "os")
    return Names(ref.name, dist, os_, imports=list(ref.imports) + list(imp1) + list(imp2))


def setup_def(fn: str, n: Names) -> cst.BaseStatement:
    T, d, o = n.T, n.dist, n.os
    return cst.parse_statement(
        f"def {fn}():\n"
        f'    """Join the process group that torchrun describes in the environment (RANK,\n'
        f"    LOCAL_RANK, WORLD_SIZE); started with plain `python`, the program is a group of\n"
        f'    one process."""\n'
        f"    if not {d}.is_initialized():\n"
        f'        backend = "nccl" if {T}.cuda.is_available() else "gloo"\n'
        f'        if "WORLD_SIZE" in {o}.environ:\n'
        f"            {d}.init_process_group(backend=backend)\n"
        f"        else:\n"
        f"            {d}.init_process_group(backend=backend, store={d}.HashStore(), rank=0, world_size=1)\n"
        f'    local_rank = int({o}.environ.get("LOCAL_RANK", "0"))\n'
        f"    if {T}.cuda.is_available():\n"
        f"        {T}.cuda.set_device(local_rank)  # before any CUDA allocation\n"
        f"    return local_rank, {d}.get_rank(), {d}.get_world_size()\n"
    )


# --------------------------------------------------------------------------- per-rank edits


class Context:
    """Where the rank and world size can be read from in generated code."""

    def __init__(
        self,
        analysis: Analysis,
        dist: str,
        scope: cst.CSTNode | None = None,
        rank: str | None = None,
        world: str | None = None,
    ) -> None:
        self.a, self.dist, self.scope, self.rank, self.world = analysis, dist, scope, rank, world

    def visible(self, node: cst.CSTNode) -> bool:
        if self.scope is None or self.rank is None:
            return False
        if self.block is not None:
            return any(anc is self.block for anc in self.a.ancestors(node))
        if isinstance(self.scope, cst.Module):
            return True
        return any(anc is self.scope for anc in self.a.ancestors(node))

    def rank_expr(self, node: cst.CSTNode) -> str:
        return self.rank if self.visible(node) and self.rank is not None else f"{self.dist}.get_rank()"

    def rank0(self, node: cst.CSTNode) -> str:
        return f"{self.rank_expr(node)} == 0"

    def not_rank0(self, node: cst.CSTNode) -> str:
        return f"{self.rank_expr(node)} != 0"

    def world_expr(self, node: cst.CSTNode) -> str:
        return self.world if self.visible(node) and self.world is not None else f"{self.dist}.get_world_size()"

    block: cst.CSTNode | None = None  # the `if __name__ == "__main__":` that holds the set-up

    def before_setup(self, node: cst.CSTNode) -> str | None:
        """Why a rank guard that reads the process group would not work at ``node`` (it runs before
        the group is set up), or None."""
        return None

    def may_edit(self, node: cst.CSTNode) -> bool:
        """Module-level code outside the setup function may run before the group exists."""
        if self.block is not None and isinstance(self.a.scope_owner(node), cst.Module):
            return any(anc is self.block for anc in self.a.ancestors(node))
        if self.scope is None or isinstance(self.scope, cst.Module):
            return True
        owner = self.a.scope_owner(node)
        return not isinstance(owner, cst.Module)


def guard_edits(analysis: Analysis, e: Edits, ctx: Context, skipped: list[str]) -> int:
    """Rank-0 guards for output side effects. Returns how many statements were guarded."""
    n = 0
    saves: list[tuple[cst.CSTNode, cst.BaseExpression]] = []
    for se in side_effects(analysis):
        s = se.stmt
        if analysis.under_rank_guard(s) or analysis.only_called_on_rank(s) or not ctx.may_edit(s):
            continue
        early = ctx.before_setup(s)
        if early is not None:
            skipped.append(f"line {analysis.pos(s)[0]}: {se.what} {early}; not guarded")
            continue
        if se.unknown:
            where = analysis.module.code_for_node(se.path) if se.path is not None else "its file argument"
            skipped.append(
                f"line {analysis.pos(s)[0]}: `torch.save` writes to `{where}`, not known to be a file path "
                "(a buffer saved on rank 0 only would be read back empty on the others); not guarded"
            )
            continue
        why = collective_free(analysis, s, ctx.dist)
        if why is not None:
            skipped.append(f"line {analysis.pos(s)[0]}: {se.what} calls {why}; not guarded")
            continue
        e.guard(s, ctx.rank0(s))
        n += 1
        if se.path is not None:
            n += _follow_written_file(analysis, e, ctx, s, se.path)
            saves.append((s, se.path))
    for saved, path in saves:  # the folder each file is written to, now that the log lines have their guards
        n += group_with_save(analysis, e, saved, path, e.guards[id(saved)])
    n -= e.drop_nested_guards(analysis.parent)  # a log line inside a guarded `try` needs no guard of its own
    for c in calls(analysis.module, True):
        if not isinstance(c.func, (cst.Name, cst.Attribute)) or not ctx.may_edit(c):
            continue
        q = analysis.call_name(c)
        if q not in TQDM and q not in WRITERS or ctx.before_setup(c):
            continue
        if q in TQDM and keyword(c, "disable") is None and not has_star(c) and not analysis.under_rank_guard(c):
            test = ctx.not_rank0(c)
            e.replace_node(c, lambda upd, test=test: set_kwarg(upd, "disable", cst.parse_expression(test)))  # type: ignore[misc]  # mypy infers no lambda with a default, which binds this call's test
            n += 1
        elif q in WRITERS and not analysis.under_rank_guard(c):
            parent = analysis.parent(c)
            if isinstance(parent, cst.Assign) and parent.value is c:
                test = ctx.rank0(c)
                e.replace_node(
                    c,
                    lambda upd, test=test: cst.IfExp(  # type: ignore[misc]  # mypy infers no lambda with a default (above)
                        test=cst.parse_expression(test), body=upd, orelse=cst.Name("None")
                    ),
                )
                n += 1
    return n


_FILE_READS = {"torch.load", "builtins.open", "open", "torch.jit.load", "numpy.load", "json.load", "pickle.load"}


def _follow_written_file(
    analysis: Analysis, e: Edits, ctx: Context, write: cst.BaseStatement, path: cst.BaseExpression
) -> int:
    """Statements after a guarded file write, in the same block, that name the written path: a
    copy, move or upload of the file runs on rank 0 with the write (same guard); a read of it by
    every process waits for the write (``barrier()`` before it). Returns how many were guarded."""
    names = {x.value for x in walk(path) if isinstance(x, cst.Name)}
    text = analysis.module.code_for_node(path)
    block = analysis.parent(write)
    body = list(block.body) if isinstance(block, (cst.IndentedBlock, cst.Module)) else []
    n = 0
    for later in body[body.index(write) + 1 :] if write in body else []:
        mentioned = text in analysis.module.code_for_node(later) or any(
            isinstance(x, cst.Name) and x.value in names for x in walk(later, True)
        )
        if not mentioned or id(later) in e.guards:
            continue
        reads = any(
            (analysis.call_name(c) or dotted(c.func) or "") in _FILE_READS
            for c in calls(later, True)
            if isinstance(c.func, (cst.Name, cst.Attribute))
        )
        binds = isinstance(later, cst.SimpleStatementLine) and any(
            isinstance(b, (cst.Assign, cst.AugAssign, cst.AnnAssign)) for b in later.body
        )
        if reads or binds or collective_free(analysis, later, ctx.dist) is not None:
            e.add_before(later, [statement(f"{ctx.dist}.barrier()  # the file is written by rank 0 only\n")])
            return n
        e.guard(later, e.guards[id(write)])
        n += 1
    return n


def checkpoint_edits(
    analysis: Analysis,
    e: Edits,
    models: set[str],
    consume: str | None,
    saves: bool = True,
    loads: bool = True,
    wraps: dict[str, list[cst.CSTNode]] | None = None,
    leave: frozenset[int] = frozenset(),
) -> tuple[int, int]:
    """``M.state_dict()`` -> ``M.module.state_dict()``; ``M.load_state_dict(x)`` ->
    ``consume_prefix_in_state_dict_if_present(x, "module."); M.module.load_state_dict(x)``, only where
    ``M`` surely holds the wrapper (``wraps``: the statements that wrap each model, default its DDP
    bindings), and not the calls whose ids are in ``leave``."""
    n_save = n_load = 0
    taken = set(analysis.names)
    for c in calls(analysis.module, True):
        if not isinstance(c.func, cst.Attribute) or id(c) in leave:
            continue
        recv = dotted(c.func.value)
        if recv not in models or not analysis.wrapped_at(recv, c, None if wraps is None else wraps.get(recv, [])):
            continue
        meth = c.func.attr.value
        if meth == "state_dict" and saves:
            e.replace_node(
                c.func, lambda upd: upd.with_changes(value=cst.Attribute(value=upd.value, attr=cst.Name("module")))
            )
            n_save += 1
        elif meth == "load_state_dict" and loads and consume is not None:
            s = analysis.statement(c)
            if not isinstance(s, cst.SimpleStatementLine) or len(s.body) != 1 or has_star(c) or not c.args:
                continue
            small = s.body[0]
            top = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
            if top is not c:
                continue
            arg = c.args[0]
            if arg.keyword is not None and arg.keyword.value != "state_dict":
                continue
            code = analysis.module.code_for_node(arg.value)
            pre: list[cst.BaseStatement] = []
            if not isinstance(arg.value, (cst.Name, cst.Attribute, cst.Subscript)):
                var = fresh_name(taken, "state_dict")
                pre.append(statement(f"{var} = {code}\n"))
                code = var
                e.replace_node(arg.value, cst.Name(var))
            pre.append(statement(f'{consume}({code}, "module.")  # also load checkpoints saved from the wrapper\n'))
            e.add_before(s, pre)
            e.replace_node(
                c.func, lambda upd: upd.with_changes(value=cst.Attribute(value=upd.value, attr=cst.Name("module")))
            )
            n_load += 1
    return n_save, n_load


def set_epoch_edits(analysis: Analysis, e: Edits, samplers: dict[str, str], notes: list[str]) -> int:
    """``sampler.set_epoch(epoch)`` first in the epoch loop around each training loop.
    ``samplers``: loader name -> code of its sampler (``None``-able when it ends in ``?``)."""
    done: set[tuple[int, str]] = set()
    n = 0
    for loop in analysis.training_loops():
        code = samplers.get(loop.loader)
        if code is None:
            continue
        ep = loop.epoch
        if ep is None:
            continue
        if loop.within is not None and analysis.is_global(code.split(".")[0].rstrip("?")):
            n += _set_epoch_within(analysis, e, loop, code, done)
            continue
        if isinstance(ep, cst.While) or not isinstance(ep.target, cst.Name):
            notes.append(f"line {analysis.pos(ep)[0]}: no epoch counter to pass to `set_epoch`: add one")
            continue
        key = (id(ep), code)
        if key in done:
            continue
        done.add(key)
        body = ep.body.body if isinstance(ep.body, cst.IndentedBlock) else None
        if not body:
            continue
        epoch = ep.target.value
        unbound = _unbound_here(analysis, body[0], loop.loader, code.rstrip("?"))
        if unbound is not None:
            notes.append(f"line {analysis.pos(ep)[0]}: {unbound}; call `set_epoch` where the sampler is in scope")
            continue
        if code.endswith("?"):
            s = code[:-1]
            new = statement(f"if {s} is not None:\n    {s}.set_epoch({epoch})  # a new shuffle every epoch\n")
        else:
            new = statement(f"{code}.set_epoch({epoch})  # a new shuffle every epoch\n")
        e.add_before(body[0], [new])
        n += 1
    return n


def _unbound_here(analysis: Analysis, at: cst.CSTNode, loader: str, code: str) -> str | None:
    """Why ``code`` (``sampler`` or ``loader.sampler``) written before ``at`` would not name the
    loader's sampler (None when it does): its root name, read at ``at``, must resolve (scope analysis)
    to the binding the analysis found, not to another variable of the same name in another function."""
    root = code.split(".")[0]
    binding: cst.CSTNode | None
    if root == loader:
        binding = analysis.loaders[loader][0][0] if analysis.loaders.get(loader) else None
    elif root in analysis.samplers:
        binding = analysis.statement(analysis.samplers[root])
    else:
        return None  # a name the rewrite itself binds (the DDP conversion's sampler)
    try:
        scope = analysis.rule.get_metadata(ScopeProvider, at)
    except KeyError:
        scope = None
    found = scope is not None and root in scope
    for a in scope[root] if found and scope is not None else ():
        node = getattr(a, "node", None)
        if node is not None and binding is not None and any(x is binding for x in analysis.ancestors(node)):
            return None
    owner = analysis.scope_owner(binding) if binding is not None else None
    where = f"a local of `{owner.name.value}()`" if isinstance(owner, cst.FunctionDef) else "bound elsewhere"
    kind = "the loader" if root == loader else "the sampler"
    return f"{kind} `{root}` is {where}, not a name of this loop's scope"


def _set_epoch_within(analysis: Analysis, e: Edits, loop: Loop, code: str, done: set[tuple[int, str]]) -> int:
    """``sampler.set_epoch(epoch)`` in the function that iterates the loader (``def train(epoch):``),
    with that function's epoch, before the statement that holds the loop."""
    assert loop.within is not None
    fn, epoch = loop.within
    key = (id(fn), code)
    if key in done or not isinstance(fn.body, cst.IndentedBlock):
        return 0
    done.add(key)
    top: cst.CSTNode | None = loop.node
    while top is not None and analysis.parent(top) is not fn.body:
        top = analysis.parent(top)
    if top is None:
        return 0
    if code.endswith("?"):
        s = code[:-1]
        new = statement(f"if {s} is not None:\n    {s}.set_epoch({epoch})  # a new shuffle every epoch\n")
    else:
        new = statement(f"{code}.set_epoch({epoch})  # a new shuffle every epoch\n")
    e.add_before(top, [new])
    return 1


# --------------------------------------------------------------------------- the conversion


def _hardcoded_device(analysis: Analysis) -> cst.CSTNode | None:
    for n in walk(analysis.module, True):
        s = string_value(n) if isinstance(n, (cst.SimpleString, cst.ConcatenatedString)) else None
        if s is not None and _CUDA_INDEX.match(s):
            return n
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value in ("cuda", "to"):
            pos = positional(n)
            if pos and int_value(pos[0].value) is not None:
                return n
        if (
            isinstance(n, cst.Call)
            and isinstance(n.func, (cst.Name, cst.Attribute))
            and analysis.call_name(n) == "torch.device"
            and len(positional(n)) > 1
        ):
            return n
    return None


def _sum_reduction(analysis: Analysis) -> cst.CSTNode | None:
    """A `reduction="sum"` loss where gradients are taken (a loop or function that calls backward)."""
    for c in calls(analysis.module, True):
        r = keyword(c, "reduction")
        if r is None or string_value(r.value) != "sum":
            continue
        loop = analysis.enclosing_loop(c)
        owner = analysis.scope_owner(c)
        if (loop is not None and has_backward(loop.body)) or (
            not isinstance(owner, cst.Module) and has_backward(owner)
        ):
            return c
    return None


def _setup_scope(analysis: Analysis, anchors: list[cst.CSTNode]) -> cst.CSTNode:
    owners = {id(analysis.scope_owner(x)): analysis.scope_owner(x) for x in anchors}
    if len(owners) != 1:
        raise Refusal(anchors[0], "the models are created in different functions")
    owner = next(iter(owners.values()))
    if isinstance(owner, cst.Module):
        return owner
    if not isinstance(owner, cst.FunctionDef) or not isinstance(analysis.parent(owner), cst.Module):
        raise Refusal(anchors[0], "the model is created in a nested function or a class")
    return owner


def _is_main_guard(s: cst.If) -> bool:
    t = s.test
    return (
        isinstance(t, cst.Comparison)
        and isinstance(t.left, cst.Name)
        and t.left.value == "__name__"
        and len(t.comparisons) == 1
        and isinstance(t.comparisons[0].operator, cst.Equal)
        and string_value(t.comparisons[0].comparator) == "__main__"
    )


def _first_exec(body, skip_defs: bool):
    for s in body:
        if is_docstring(s) or is_import(s):
            continue
        if isinstance(s, cst.SimpleStatementLine) and any(
            isinstance(b, cst.ImportFrom) and dotted(b.module) == "__future__" for b in s.body
        ):
            continue
        if skip_defs and isinstance(s, (cst.FunctionDef, cst.ClassDef)):
            continue
        return s
    return None


def _gpu_count_gate(analysis: Analysis, s: cst.BaseStatement) -> cst.If | None:
    """The ``if torch.cuda.device_count() > 1:`` (no ``else``) whose body holds the wrap ``s``.
    DDP runs one process per device, so its wrap must not depend on the GPUs one process sees."""
    block = analysis.parent(s)
    gate = analysis.parent(block) if isinstance(block, cst.IndentedBlock) else None
    if isinstance(gate, cst.If) and gate.orelse is None and "device_count" in analysis.module.code_for_node(gate.test):
        return gate
    return None


def _hoist_out_of_gate(e: Edits, gate: cst.If, s: cst.BaseStatement, new: list[cst.BaseStatement]) -> None:
    """Replace ``gate`` by its other statements (still gated) followed by the unconditional wrap."""
    index = list(gate.body.body).index(s)

    def rep(upd: cst.If) -> list[cst.BaseStatement]:
        rest = [x for i, x in enumerate(upd.body.body) if i != index]
        head = [upd.with_changes(body=upd.body.with_changes(body=rest))] if rest else []
        out = head + list(new)
        if not head:
            out[0] = out[0].with_changes(leading_lines=upd.leading_lines)
        return out

    e.replace_statement(gate, rep)  # type: ignore[arg-type]  # gate is an If, so its rewritten form is one too


def convert(
    rule,
    analysis: Analysis,
    wraps: Sequence[tuple[cst.SimpleStatementLine, str, cst.BaseExpression | None]],
    node: cst.CSTNode,
    mode: str,
):
    """Build the converted module. ``wraps``: (statement, model name, wrapped expression) — for
    DataParallel the statement is replaced; for a single-process script (expression None) the wrap
    is inserted before the statement. Returns (module, imports, note). Raises Refusal."""
    if analysis.inits:
        raise Refusal(
            analysis.inits[0],
            "the program already initialises a process group (no second set-up is "
            "added); wrap the model in DistributedDataParallel by hand",
        )
    bad = _hardcoded_device(analysis)
    if bad is not None:
        raise Refusal(
            bad,
            f"`{' '.join(analysis.module.code_for_node(bad).split())[:40]}` names a fixed device index: "
            "under DDP every process must use its own GPU (`cuda` after "
            "`torch.cuda.set_device(local_rank)`); use the device variable",
        )
    for c in calls(analysis.module, True):
        if isinstance(c.func, (cst.Name, cst.Attribute)) and (analysis.call_name(c) or "").startswith("torch.nn.Lazy"):
            raise Refusal(
                c,
                "a lazy module creates its parameters at the first forward, after DDP has registered "
                "them: run one forward before wrapping, then convert",
            )
    bad = _sum_reduction(analysis)
    if bad is not None:
        raise Refusal(
            bad,
            "a loss with reduction='sum': DDP averages gradients over processes, so they would "
            "be world_size times smaller (multiply the loss by the world size, or use 'mean')",
        )
    n = base_names(rule, analysis, node)
    n.ddp, imp = need(
        analysis.import_name("torch.nn.parallel", "DistributedDataParallel"), node, "DistributedDataParallel"
    )
    n.imports += imp
    n.sampler, imp = need(
        analysis.import_name("torch.utils.data.distributed", "DistributedSampler"), node, "DistributedSampler"
    )
    n.imports += imp
    scope = _setup_scope(analysis, [w[0] for w in wraps])
    loops = analysis.training_loops()
    if not loops:
        other = analysis.unknown_data_loop()
        if other is not None:  # a loop exists; what it iterates is not known here: say which fact is missing
            raise Refusal(
                node,
                f"the loop over `{other[1]}` (line {analysis.pos(other[0])[0]}) iterates no `DataLoader` "
                "this file builds, so which loader to shard across processes is not known here",
            )
        raise Refusal(
            node, "no training loop over a `DataLoader` was found, so the data could not be sharded across processes"
        )
    taken = set(analysis.names)
    fn = fresh_name(taken, "setup_distributed")
    lr, rank, world = fresh_name(taken, "local_rank"), fresh_name(taken, "rank"), fresh_name(taken, "world_size")
    ctx = Context(analysis, n.dist, scope, rank, world)
    e = Edits()
    notes: list[str] = []
    # set-up: the helper after the imports, its call first in the scope that builds the model
    top = _first_exec(analysis.module.body, skip_defs=False)
    if top is None:
        raise Refusal(node, "nothing to insert the set-up before")
    helper = setup_def(fn, n).with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    comment = [
        cst.EmptyLine(comment=cst.Comment("# launch with `torchrun --standalone --nproc_per_node=N <script>`;")),
        cst.EmptyLine(comment=cst.Comment("# `python <script>` runs one process")),
    ]
    call = statement(f"{lr}, {rank}, {world} = {fn}()\n")
    if isinstance(scope, cst.Module):
        first = _first_exec(analysis.module.body, skip_defs=True)
        if first is None:
            raise Refusal(node, "no module-level code to set the process group up for")
    else:
        body = suite.body if isinstance(suite := getattr(scope, "body", None), cst.IndentedBlock) else []
        first = next((s for s in body if not is_docstring(s)), None)
        if first is None:
            raise Refusal(node, "empty function")
    main_block = None
    if (
        isinstance(scope, cst.Module)
        and isinstance(first, cst.If)
        and _is_main_guard(first)
        and isinstance(first.body, cst.IndentedBlock)
        and all(any(anc is first for anc in analysis.ancestors(w[0])) for w in wraps)
    ):
        main_block = first
        ctx.block = first
        first = first.body.body[0]
    if first is top:
        e.add_before(top, [helper, call.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine(), *comment])])
    else:
        e.add_before(top, [helper])
        e.replace_statement(
            top,
            lambda upd: [
                upd.with_changes(
                    leading_lines=[cst.EmptyLine(), cst.EmptyLine()]
                    + [ll for ll in upd.leading_lines if ll.comment is not None]
                )
            ],
        )
        e.add_before(first, [call.with_changes(leading_lines=comment)])
    # the model wraps
    anchors: dict[str, list[cst.CSTNode]] = {}
    for s, name, expr in wraps:
        wrap_src = f"{name} = {n.ddp}({name}, device_ids=[{lr}] if next({name}.parameters()).is_cuda else None)\n"
        if expr is None:  # single-process script: wrap before the optimizer is built
            e.add_before(s, [statement(wrap_src)])
            anchors.setdefault(name, []).append(s)
        else:
            pre = (
                []
                if isinstance(expr, cst.Name) and expr.value == name
                else [statement(f"{name} = {analysis.module.code_for_node(expr)}\n")]
            )
            new = pre + [statement(wrap_src)]
            gate = _gpu_count_gate(analysis, s)
            if gate is not None:
                _hoist_out_of_gate(e, gate, s, new)
                anchors.setdefault(name, []).append(gate)
                continue

            def rep(upd, new=new):
                return [new[0].with_changes(leading_lines=upd.leading_lines)] + new[1:]

            e.replace_statement(s, rep)
            anchors.setdefault(name, []).append(s)
    # the training loaders
    samplers: dict[str, str] = {}
    seen: set[str] = set()
    for loop in loops:
        L = loop.loader
        if L in seen:
            continue
        seen.add(L)
        bindings = analysis.loaders[L]
        if len(bindings) != 1:
            raise Refusal(loop.node, f"`{L}` is bound to more than one DataLoader")
        ls, lc = bindings[0]
        if has_star(lc):
            raise Refusal(lc, f"`{L}` is built with *args/**kwargs")
        kws = keywords(lc)
        if "sampler" in kws or "batch_sampler" in kws or len(positional(lc)) > 3:
            raise Refusal(
                lc,
                f"`{L}` already has a sampler: shard it across processes by hand "
                "(a DistributedSampler, or a sampler that takes rank and world size)",
            )
        pos = positional(lc)
        ds = kws["dataset"].value if "dataset" in kws else (pos[0].value if pos else None)
        if not isinstance(ds, (cst.Name, cst.Attribute)):
            raise Refusal(lc, f"bind the dataset of `{L}` to a name first (the sampler needs it too)")
        shuffle = kws["shuffle"].value if "shuffle" in kws else (pos[2].value if len(pos) > 2 else None)
        bs_arg = kws.get("batch_size") or (pos[1] if len(pos) > 1 else None)
        base = L[: -len("loader")] if L.endswith("loader") else f"{L}_"
        sname = fresh_name(taken, f"{base}sampler")
        ws = ctx.world_expr(ls)
        ds_code = analysis.module.code_for_node(ds)
        sh_code = analysis.module.code_for_node(shuffle) if shuffle is not None else "False"
        pre = []
        if bs_arg is not None:
            bcode = analysis.module.code_for_node(bs_arg.value)
            atom = isinstance(bs_arg.value, (cst.Name, cst.Attribute, cst.Integer))
            pre.append(
                statement(
                    f"assert {bcode if atom else '(' + bcode + ')'} % {ws} == 0, "
                    f'"the global batch size must divide by the number of processes"\n'
                )
            )
        pre.append(statement(f"{sname} = {n.sampler}({ds_code}, shuffle={sh_code}) if {ws} > 1 else None\n"))
        pre[0] = pre[0].with_changes(
            leading_lines=[
                cst.EmptyLine(comment=cst.Comment("# each process loads its own shard; batch_size is per process"))
            ]
        )

        def fix_loader(upd: cst.Call, bs_arg=bs_arg, shuffle=shuffle, sname=sname, ws=ws) -> cst.Call:
            args = list(upd.args)
            orig_pos = [x for x in args if x.keyword is None]
            for i, x in enumerate(args):
                if bs_arg is not None and (
                    x.keyword is not None
                    and x.keyword.value == "batch_size"
                    or (x.keyword is None and len(orig_pos) > 1 and x is orig_pos[1])
                ):
                    v = x.value
                    if not isinstance(v, (cst.Name, cst.Attribute, cst.Integer)):
                        v = v.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
                    args[i] = x.with_changes(
                        value=cst.BinaryOperation(
                            left=v,
                            operator=cst.FloorDivide(
                                whitespace_before=cst.SimpleWhitespace(" "), whitespace_after=cst.SimpleWhitespace(" ")
                            ),
                            right=cst.parse_expression(ws),
                        )
                    )
                if shuffle is not None and (
                    x.keyword is not None
                    and x.keyword.value == "shuffle"
                    or (x.keyword is None and len(orig_pos) > 2 and x is orig_pos[2])
                ):
                    v = x.value
                    if isinstance(v, cst.Name) and v.value == "True":
                        nv = cst.parse_expression(f"{sname} is None")
                    elif isinstance(v, cst.Name) and v.value == "False":
                        nv = v
                    else:
                        nv = cst.parse_expression(f"({analysis.module.code_for_node(shuffle)}) and {sname} is None")
                    args[i] = x.with_changes(value=nv)
            out = upd.with_changes(args=args)
            return set_kwarg(out, "sampler", cst.Name(sname))

        e.replace_node(lc, fix_loader)
        e.add_before(ls, pre)
        samplers[L] = sname + "?"
    set_epoch_edits(analysis, e, samplers, notes)
    others = sorted(set(analysis.loaders) - seen)
    if others:
        notes.append(
            f"{', '.join(f'`{x}`' for x in others)} left alone (not a training loader): every process "
            "iterates all of it"
        )
    workers = [L for L in seen if any(keyword(c, "num_workers") is not None for _, c in analysis.loaders[L])]
    if workers:
        notes.append(
            'with NCCL and DataLoader workers, consider `multiprocessing_context="forkserver"` (NCCL is not fork-safe)'
        )
    # per-rank side effects and checkpoints
    skipped: list[str] = []
    guard_edits(analysis, e, ctx, skipped)
    race_free_folders(analysis, e, n.os, ctx.may_edit, ctx.rank0)
    models = {w[1] for w in wraps}
    uses_load = any(
        isinstance(c.func, cst.Attribute) and c.func.attr.value == "load_state_dict" and dotted(c.func.value) in models
        for c in calls(analysis.module, True)
    )
    consume = None
    if uses_load:
        consume, imp = need(
            analysis.import_name("torch.nn.modules.utils", "consume_prefix_in_state_dict_if_present"),
            node,
            "consume_prefix_in_state_dict_if_present",
        )
        n.imports += imp
    checkpoint_edits(analysis, e, models, consume, wraps=anchors)
    names = {
        analysis.call_name(c) for c in calls(analysis.module, True) if isinstance(c.func, (cst.Name, cst.Attribute))
    }
    if "torch.save" in names and "torch.load" in names:
        notes.append(
            f"if other ranks read a checkpoint that rank 0 writes in the same run, call "
            f"`{n.dist}.barrier()` after the save"
        )
    # leave the process group on the way out
    destroy = statement(f"{n.dist}.destroy_process_group()\n")
    if isinstance(scope, cst.FunctionDef):
        returns = [r for r in walk(scope.body) if isinstance(r, cst.Return)]
        body = scope.body.body if isinstance(scope.body, cst.IndentedBlock) else []  # (a one-line body has no return)
        last_ret = body and isinstance(body[-1], cst.SimpleStatementLine) and isinstance(body[-1].body[0], cst.Return)
        if len(returns) > (1 if last_ret else 0):
            notes.append(f"`{scope.name.value}` returns early: call `{n.dist}.destroy_process_group()` before exit")
        else:
            e.append_to_body(scope, [destroy])
    elif main_block is not None:
        e.append_to_body(main_block.body, [destroy])
    else:
        e.append_to_body(scope, [destroy.with_changes(leading_lines=[cst.EmptyLine()])])
    converted = analysis.module.visit(ApplyEdits(e))
    fname = os.path.basename(rule.ctx.path) if rule.ctx.path not in ("<string>", "<stdin>", "-") else "train.py"
    note = LAUNCH_NOTE.format(file=fname)
    extra = notes + skipped
    if extra:
        note += "; " + "; ".join(extra)
    return converted, n.imports, note


def single_model(analysis: Analysis, node: cst.CSTNode) -> tuple[cst.SimpleStatementLine, str]:
    """The one model of a single-process script and the statement that builds its optimizer."""
    opts = []
    for oname, s in analysis.optimizers.items():
        for c in calls(s):
            if isinstance(c.func, cst.Attribute) and c.func.attr.value in ("parameters", "named_parameters"):
                m = dotted(c.func.value)
                if m:
                    opts.append((s, m))
    ms = {m for _, m in opts}
    if not opts:
        raise Refusal(node, "no optimizer built from a model's `.parameters()`")
    if len(ms) != 1 or len(opts) != 1:
        raise Refusal(node, "more than one model or optimizer: wrap each in DistributedDataParallel by hand")
    s, m = opts[0]
    if m not in analysis.models or analysis.bindings.get(m, 0) > 3:
        raise Refusal(node, f"`{m}` is not built from a torch.nn module in this file")
    if analysis.scope_owner(analysis.models[m]) is not analysis.scope_owner(s):
        raise Refusal(node, f"`{m}` and its optimizer are built in different scopes")
    for n in walk(analysis.module, True):
        if (
            isinstance(n, cst.Attribute)
            and isinstance(n.value, cst.Name)
            and n.value.value == m
            and n.attr.value not in MODULE_METHODS
        ):
            raise Refusal(
                n,
                f"`{m}.{n.attr.value}` reads an attribute of the model; on the DDP wrapper it is "
                f"`{m}.module.{n.attr.value}`",
            )
    return s, m
