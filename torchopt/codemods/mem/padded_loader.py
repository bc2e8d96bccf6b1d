"""Which loader of a training loop pads its batches (its ``collate_fn`` calls ``pad_sequence``),
and where the padded sequence sits in a sample, so TOP711 can rebuild the longest batch."""

from __future__ import annotations

import ast

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.arguments import keyword
from torchopt.analysis.names import callee
from torchopt.analysis.precheck.step_loops import AstHot
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import walk
from torchopt.analysis.values import string_value
from torchopt.codemods.mem.warmup_step import Refused
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

PAD_CALLS = {"torch.nn.utils.rnn.pad_sequence"}


def padding_loader(rule: Rule, loop: cst.For) -> tuple[str, cst.Call] | None:
    """(collate function name, DataLoader call) when ``loop`` iterates (through enumerate/tqdm)
    a name bound only to a torch ``DataLoader`` whose ``collate_fn`` is a function of this file
    calling ``pad_sequence``."""
    it = loop.iter
    for _ in range(3):
        if (
            isinstance(it, cst.Call)
            and isinstance(it.func, cst.Name)
            and it.func.value in ("enumerate", "tqdm")
            and it.args
        ):
            it = it.args[0].value
    if not isinstance(it, cst.Name):
        return None
    try:
        scope = rule.get_metadata(ScopeProvider, it)
    except KeyError:
        return None
    if scope is None or it.value not in scope:
        return None
    calls = []
    for a in scope[it.value]:
        node = getattr(a, "node", None)
        parent = rule.get_metadata(ParentProvider, node, None) if node is not None else None
        stmt = rule.get_metadata(ParentProvider, parent, None) if isinstance(parent, cst.AssignTarget) else None
        if not isinstance(stmt, cst.Assign) or not isinstance(stmt.value, cst.Call):
            return None
        q = callee(rule, stmt.value) or ""
        if not q.endswith("DataLoader") or not q.startswith("torch."):
            return None
        calls.append(stmt.value)
    if len(calls) != 1:
        return None
    call = calls[0]
    cf = keyword(call, "collate_fn")
    if cf is None or not isinstance(cf.value, cst.Name):
        return None
    hm = hot_map(rule)
    fn = hm.functions.get(cf.value.value)
    if fn is None or not any(isinstance(c, cst.Call) and callee(rule, c) in PAD_CALLS for c in walk(fn)):
        return None
    return cf.value.value, call


def length_key(rule: Rule, fn: cst.FunctionDef) -> str:
    """``[0]`` / ``["input_ids"]``: where the padded sequence sits in a sample."""
    params = fn.params.params
    if len(params) != 1:
        raise Refused("the collate function does not take one batch argument")
    batch = params[0].name.value
    pads = [c for c in walk(fn) if isinstance(c, cst.Call) and callee(rule, c) in PAD_CALLS]
    if len(pads) != 1 or not pads[0].args:
        raise Refused("the collate function pads more than one field")
    arg = pads[0].args[0].value
    if isinstance(arg, cst.ListComp):
        return _comp_key(rule, arg, batch)
    if isinstance(arg, cst.Name):
        for n in walk(fn):
            if isinstance(n, cst.Assign) and len(n.targets) == 1:
                t, v = n.targets[0].target, n.value
                if isinstance(t, cst.Name) and t.value == arg.value and isinstance(v, cst.ListComp):
                    return _comp_key(rule, v, batch)
                if (
                    isinstance(t, (cst.Tuple, cst.List))
                    and isinstance(v, cst.Call)
                    and isinstance(v.func, cst.Name)
                    and v.func.value == "zip"
                    and len(v.args) == 1
                    and v.args[0].star == "*"
                    and isinstance(v.args[0].value, cst.Name)
                    and v.args[0].value.value == batch
                ):
                    for i, e in enumerate(t.elements):
                        if isinstance(e.value, cst.Name) and e.value.value == arg.value:
                            return f"[{i}]"
    raise Refused("cannot tell which field of a sample is padded")


def _comp_key(rule: Rule, comp: cst.ListComp, batch: str) -> str:
    """The subscript of ``[s[KEY] for s in batch]``."""
    f = comp.for_in
    if (
        not isinstance(f.iter, cst.Name)
        or f.iter.value != batch
        or not isinstance(f.target, cst.Name)
        or f.inner_for_in is not None
        or f.ifs
    ):
        raise Refused("cannot tell which field of a sample is padded")
    el = comp.elt
    if (
        isinstance(el, cst.Subscript)
        and isinstance(el.value, cst.Name)
        and el.value.value == f.target.value
        and len(el.slice) == 1
        and isinstance(el.slice[0].slice, cst.Index)
    ):
        idx = el.slice[0].slice.value
        if isinstance(idx, cst.Integer) or string_value(idx) is not None:
            return "[" + rule.ctx.module.code_for_node(idx) + "]"
    raise Refused("cannot tell which field of a sample is padded")


def may_pad_training_loop(hot: AstHot) -> bool:
    """TOP711: a training step loop ``for ... in <name>`` (through enumerate/tqdm)."""
    for loop in hot.step_loops.values():
        if id(loop) not in hot.training_loops or not isinstance(loop, ast.For):
            continue
        it = loop.iter
        for _ in range(3):
            if (
                isinstance(it, ast.Call)
                and isinstance(it.func, ast.Name)
                and it.func.id in ("enumerate", "tqdm")
                and (it.args or it.keywords)
            ):
                it = it.args[0] if it.args else it.keywords[0].value
        if isinstance(it, ast.Name):
            return True
    return False
