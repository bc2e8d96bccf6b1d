"""The sync rules' pre-checks: what a step loop must contain (on CPython's ast) for each rule to have anything to report."""

from __future__ import annotations

import ast as _ast
import re as _re

from torchopt.analysis.precheck.step_loops import AstHot, calls_in_step
from torchopt.analysis.precheck.tree import ast_dotted
from torchopt.analysis.step_loops import HOST_READS


def _args(c: _ast.Call) -> list:
    """The argument values cst's ``Call.args`` holds, without ``*``/``**`` ones."""
    return [a for a in c.args if not isinstance(a, _ast.Starred)] + [k.value for k in c.keywords if k.arg]


def _has_star(c: _ast.Call) -> bool:
    return any(isinstance(a, _ast.Starred) for a in c.args) or any(k.arg is None for k in c.keywords)


def _nargs(c: _ast.Call) -> int:
    return len(c.args) + len(c.keywords)


def _aliases(hot: AstHot, names: set[str]) -> set[str]:
    out = set(names)
    for n in hot.index.get(_ast.ImportFrom, ()):
        for a in n.names:
            if a.asname and a.name in names:
                out.add(a.asname)
    return out


def _last(func: _ast.AST) -> str | None:
    if isinstance(func, _ast.Attribute):
        return func.attr
    if isinstance(func, _ast.Name):
        return func.id
    return None


def _has_cpu_literal(hot: AstHot) -> bool:
    hit = hot.__dict__.get("_cpu_literal")
    if hit is None:
        hit = hot.__dict__["_cpu_literal"] = any(
            isinstance(n.value, str) and n.value.split(":")[0] == "cpu" for n in hot.index.get(_ast.Constant, ())
        )
    return hit


def may_host_read(hot: AstHot) -> bool:
    """TOP601: ``x.item()``/``.tolist()``/``.numpy()`` or ``float/int/bool(tensor)`` in a step."""
    for c in hot.index.get(_ast.Call, ()):
        f = c.func
        if isinstance(f, _ast.Attribute) and f.attr in HOST_READS and not _nargs(c):
            if hot.in_step(c):
                return True
        elif (
            isinstance(f, _ast.Name)
            and f.id in ("float", "int", "bool")
            and len(c.args) == 1
            and not c.keywords
            and not isinstance(c.args[0], _ast.Starred)
            and hot.in_step(c)
            and hot.maybe_tensor(c.args[0], hot.owner(c))
        ):
            return True
    return False


def _text_of_tensor(hot: AstHot, expr: _ast.AST, own) -> bool:
    if isinstance(expr, _ast.JoinedStr):
        return any(isinstance(p, _ast.FormattedValue) and hot.maybe_tensor(p.value, own) for p in expr.values)
    return hot.maybe_tensor(expr, own)


def may_print_tensor(hot: AstHot) -> bool:
    """TOP602: print/str/repr/str.format/logger calls formatting a tensor in a step."""
    from torchopt.analysis.conventions import LOG_METHODS, LOGGER_NAMES

    for c in hot.index.get(_ast.Call, ()):
        f = c.func
        if not (isinstance(f, _ast.Name) and f.id in ("print", "str", "repr")) and not (
            isinstance(f, _ast.Attribute) and (f.attr == "format" or f.attr in LOG_METHODS)
        ):
            continue
        if not hot.in_step(c):
            continue
        own = hot.owner(c)
        if isinstance(f, _ast.Name) and f.id in ("print", "str", "repr"):
            if any(_text_of_tensor(hot, a, own) for a in _args(c)):
                return True
        elif (
            isinstance(f, _ast.Attribute)
            and f.attr == "format"
            and isinstance(f.value, _ast.Constant)
            and isinstance(f.value.value, (str, bytes))
        ):
            if any(hot.maybe_tensor(a, own) for a in _args(c)):
                return True
        elif isinstance(f, _ast.Attribute) and f.attr in LOG_METHODS and ast_dotted(f.value) in LOGGER_NAMES:
            if any(_text_of_tensor(hot, a, own) for a in _args(c)):
                return True
    return False


def _maybe_cpu(hot: AstHot, e: _ast.AST | None, own=None, depth: int = 0) -> bool:
    """classify_device(e).is_cpu is possible: a "cpu" literal, ``torch.device("cpu")``, a conditional
    of those, or a name every binding of which is one."""
    if e is None or not _has_cpu_literal(hot):
        return False
    if isinstance(e, _ast.Constant):
        return isinstance(e.value, str) and e.value.split(":")[0] == "cpu"
    if isinstance(e, _ast.Call):
        first = e.args[0] if e.args else (e.keywords[0].value if e.keywords else None)
        return (
            _last(e.func) == "device"
            and isinstance(first, _ast.Constant)
            and isinstance(first.value, str)
            and first.value.split(":")[0] == "cpu"
        )
    if isinstance(e, _ast.IfExp):
        return _maybe_cpu(hot, e.body, own, depth + 1) and _maybe_cpu(hot, e.orelse, own, depth + 1)
    if isinstance(e, _ast.Name):
        if depth >= 4:
            return True
        found = hot.bindings(e.id, own)
        if found is None:
            return False
        scope, binds = found
        for kind, value, _ in binds:
            if kind == "global":
                return True
            if kind != "value" or not _maybe_cpu(hot, value, scope, depth + 1):
                return False
        return True
    return False


def may_host_copy(hot: AstHot) -> bool:
    """TOP603: ``t.cpu()`` / ``t.to(<cpu>)`` in a step, not read by ``.item()/.tolist()/.numpy()``."""
    calls = hot.index.get(_ast.Call, ())
    reads = {id(c.func.value) for c in calls if isinstance(c.func, _ast.Attribute) and c.func.attr in HOST_READS}
    for c in calls:
        f = c.func
        if (
            not isinstance(f, _ast.Attribute)
            or f.attr not in ("cpu", "to")
            or _has_star(c)
            or id(c) in reads
            or not hot.in_step(c)
        ):
            continue
        if f.attr == "cpu" and not _nargs(c):
            return True
        if f.attr == "to" and _nargs(c):
            dev = [k.value for k in c.keywords if k.arg == "device"]
            own = hot.owner(c)
            if (c.args and _maybe_cpu(hot, c.args[0], own)) or (dev and _maybe_cpu(hot, dev[0], own)):
                return True
    return False


_SHAPE_CALLS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}


_BOOL_FUNCS_AST = {
    "isnan",
    "isinf",
    "isfinite",
    "logical_not",
    "logical_and",
    "logical_or",
    "logical_xor",
    "eq",
    "ne",
    "gt",
    "lt",
    "ge",
    "le",
    "isin",
    "isclose",
    "signbit",
}


def _maybe_mask(hot: AstHot, e: _ast.AST, own, depth: int = 0) -> bool:
    if isinstance(e, _ast.Compare):
        return hot.maybe_tensor(e, own)
    if isinstance(e, _ast.UnaryOp) and isinstance(e.op, _ast.Invert):
        return _maybe_mask(hot, e.operand, own, depth)
    if isinstance(e, _ast.BinOp) and isinstance(e.op, (_ast.BitAnd, _ast.BitOr, _ast.BitXor)):
        return _maybe_mask(hot, e.left, own, depth) and _maybe_mask(hot, e.right, own, depth)
    if isinstance(e, _ast.Call):
        f = e.func
        if _last(f) in _BOOL_FUNCS_AST and (hot.torch_rooted(f) or isinstance(f, _ast.Name)):
            return True
        return isinstance(f, _ast.Attribute) and f.attr in _BOOL_FUNCS_AST | {"bool"} and hot.maybe_tensor(f.value, own)
    if isinstance(e, _ast.Name):
        if depth >= 3:
            return True
        found = hot.bindings(e.id, own)
        if found is None:
            return False
        scope, binds = found
        for kind, value, _ in binds:
            if kind == "global":
                return True
            if kind != "value" or not _maybe_mask(hot, value, scope, depth + 1):
                return False
        return True
    return False


def may_dynamic_shape(hot: AstHot) -> bool:
    """TOP604: nonzero/argwhere/masked_select/unique/one-argument where/repeat_interleave without
    ``output_size``, or indexing a tensor with a boolean mask, in a step."""
    wanted = _SHAPE_CALLS | {"where", "repeat_interleave"}
    alias = {}
    for n in hot.index.get(_ast.ImportFrom, ()):
        for a in n.names:
            if a.asname and a.name in wanted:
                alias[a.asname] = a.name
    stores = set()
    for n in hot.index.get(_ast.Assign, ()):
        stores |= {id(t) for t in n.targets}
    for n in hot.index.get(_ast.AugAssign, ()):
        stores.add(id(n.target))
    for n in [*hot.index.get(_ast.Call, ()), *hot.index.get(_ast.Subscript, ())]:
        if isinstance(n, _ast.Call):
            f = n.func
            last = _last(f)
            kinds = {k for k in (last, alias.get(last) if isinstance(f, _ast.Name) else None) if k in wanted}
            if not kinds or not hot.in_step(n):
                continue
            root = f
            while isinstance(root, _ast.Attribute):
                root = root.value
            if (
                isinstance(f, _ast.Attribute)
                and isinstance(root, _ast.Name)
                and root.id in ("np", "numpy")
                and not hot.torch_rooted(f)
            ):
                continue
            if kinds & _SHAPE_CALLS:
                return True
            if "where" in kinds and _nargs(n) == 1:
                return True
            if "repeat_interleave" in kinds:
                if any(k.arg == "output_size" for k in n.keywords) or _has_star(n):
                    continue
                pos = n.args
                # torch.repeat_interleave(x, repeats) or x.repeat_interleave(repeats): an int literal
                # repeat count needs no sync (either reading may apply to an attribute call).
                forms = []
                if isinstance(f, _ast.Name) or hot.torch_rooted(f):
                    forms.append(pos[1] if len(pos) > 1 else None)
                if isinstance(f, _ast.Attribute):
                    forms.append(pos[0] if pos else None)
                if any(not (isinstance(r, _ast.Constant) and type(r.value) is int) for r in forms):
                    return True
        elif isinstance(n, _ast.Subscript) and id(n) not in stores:
            idx = n.slice
            if isinstance(idx, (_ast.Slice, _ast.Tuple, _ast.Constant)) or not hot.in_step(n):
                continue
            own = hot.owner(n)
            if _maybe_mask(hot, idx, own) and hot.maybe_tensor(n.value, own):
                return True
    return False


def _truth(hot: AstHot, e: _ast.AST, own) -> bool:
    if isinstance(e, _ast.BoolOp):
        return any(_truth(hot, v, own) for v in e.values)
    if isinstance(e, _ast.UnaryOp) and isinstance(e.op, _ast.Not):
        return _truth(hot, e.operand, own)
    return hot.maybe_tensor(e, own)


def may_tensor_branch(hot: AstHot) -> bool:
    """TOP605: ``if``/``while``/``x if c else y``/``assert`` on a tensor's truth value in a step."""
    for n in hot.hot(_ast.If, _ast.While, _ast.IfExp, _ast.Assert):
        if _truth(hot, n.test, hot.owner(n)):
            return True
    return False


def may_torch_call(hot: AstHot, qualified: set[str]) -> bool:
    """TOP606: a call in a step whose callee may resolve to one of ``qualified``."""
    from torchopt.analysis.precheck.torch_imports import ast_torch_names

    lasts = {q.rsplit(".", 1)[1] for q in qualified}
    for c in hot.index.get(_ast.Call, ()):
        if hot.imports is None:
            if _last(c.func) in lasts and hot.in_step(c):
                return True
        elif ast_torch_names(hot.imports, c.func) & qualified and hot.in_step(c):
            return True
    return False


_CLIP_AST = ("clip_grad_norm_", "clip_grad_norm", "get_total_norm")


def may_grad_norm_read(hot: AstHot) -> bool:
    """TOP607: clip_grad_norm_(..., error_if_nonfinite=...) or a host read of its result in a step."""
    norms = set()
    for n in hot.index.get(_ast.Assign, ()):
        if (
            len(n.targets) == 1
            and isinstance(n.value, _ast.Call)
            and isinstance(n.targets[0], _ast.Name)
            and (ast_dotted(n.value.func) or "").rsplit(".", 1)[-1] in _CLIP_AST
        ):
            norms.add(n.targets[0].id)
    for c in (
        hot.hot(_ast.Call)
        if norms or "error_if_nonfinite" in {k.arg for c in hot.index.get(_ast.Call, ()) for k in c.keywords}
        else ()
    ):
        f = c.func
        d = ast_dotted(f) or ""
        if d.rsplit(".", 1)[-1] in ("clip_grad_norm_", "clip_grad_norm"):
            if any(
                k.arg == "error_if_nonfinite" and not (isinstance(k.value, _ast.Constant) and k.value.value is False)
                for k in c.keywords
            ):
                return True
            continue
        if isinstance(f, _ast.Attribute) and ast_dotted(f.value) in norms and f.attr in HOST_READS and not _nargs(c):
            return True
        if isinstance(f, _ast.Name) and f.id in ("float", "print") and any(ast_dotted(a) in norms for a in _args(c)):
            return True
    return False


def may_scaler_sync(hot: AstHot) -> bool:
    """TOP608: ``scaler.get_scale()`` or ``scaler.step(opt)`` in a step, scaler a GradScaler."""
    names = _aliases(hot, {"GradScaler"})
    scalers = set()
    for n in hot.index.get(_ast.Assign, ()):
        if len(n.targets) == 1 and isinstance(n.value, _ast.Call) and _last(n.value.func) in names:
            d = ast_dotted(n.targets[0])
            if d:
                scalers.add(d)
    return any(
        isinstance(c.func, _ast.Attribute)
        and c.func.attr in ("get_scale", "step")
        and ast_dotted(c.func.value) in scalers
        and hot.in_step(c)
        for c in hot.index.get(_ast.Call, ())
    )


def _maybe_device(e: _ast.AST) -> bool:
    """classify_device(e).is_device and not cpu/meta is possible."""
    if isinstance(e, _ast.Constant):
        if type(e.value) is int:
            return True
        return (
            isinstance(e.value, str)
            and bool(_DEVICE_RE.match(e.value))
            and e.value.split(":")[0] not in ("cpu", "meta")
        )
    return isinstance(e, (_ast.Call, _ast.IfExp, _ast.Name, _ast.Attribute))


def may_pageable_copy(hot: AstHot) -> bool:
    """TOP609: ``batch.cuda()`` / ``batch.to(device)`` without non_blocking on a step loop's target."""
    for loop in hot.step_loops.values():
        # The loop's target and the names bound to `next(it)` in its body (pageable_batch_copy._drawn).
        names = (
            {n.id for n in _ast.walk(loop.target) if isinstance(n, _ast.Name)} if isinstance(loop, _ast.For) else set()
        )
        body: list = getattr(loop, "body", [])  # a For or a While
        for stmt in body:
            for a in _ast.walk(stmt):
                if (
                    isinstance(a, _ast.Assign)
                    and isinstance(a.value, _ast.Call)
                    and isinstance(a.value.func, _ast.Name)
                    and a.value.func.id == "next"
                ):
                    names |= {n.id for t in a.targets for n in _ast.walk(t) if isinstance(n, _ast.Name)}
        for c in calls_in_step(body, into_loops=True):
            f = c.func
            if (
                not isinstance(f, _ast.Attribute)
                or _has_star(c)
                or not isinstance(f.value, _ast.Name)
                or f.value.id not in names
                or any(k.arg == "non_blocking" for k in c.keywords)
            ):
                continue
            if f.attr == "cuda" and not _nargs(c):
                return True
            if f.attr == "to" and c.args and _nargs(c) == 1 and _maybe_device(c.args[0]):
                return True
    return False


_DEVICE_RE = _re.compile(r"^(cuda|cpu|mps|xpu|meta|hpu|npu|xla|privateuseone)(:\d+)?$")
