"""What the optimizer rules need to know about an optimizer call: which modules' parameters it
updates, and whether those modules are moved to a device that may be CUDA."""

from __future__ import annotations

import re

import libcst as cst

from torchopt.analysis.arguments import keyword, positional
from torchopt.analysis.names import callee, dotted, reaching_values
from torchopt.analysis.syntax import walk
from torchopt.analysis.values import matches_device_name, string_value
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

# The optimizers with a fused kernel on CPU and CUDA (PyTorch >= 2.4), by every public name.
FUSED_OPTIMIZERS = {
    "torch.optim.Adam": "Adam",
    "torch.optim.adam.Adam": "Adam",
    "torch.optim.AdamW": "AdamW",
    "torch.optim.adamw.AdamW": "AdamW",
    "torch.optim.SGD": "SGD",
    "torch.optim.sgd.SGD": "SGD",
}
ADAM_OPTIMIZERS = {k: v for k, v in FUSED_OPTIMIZERS.items() if v != "SGD"}

# A program that names another accelerator may put the model there: fused kernels and the memory
# arithmetic below are only argued for CPU and CUDA.
OTHER_BACKENDS = re.compile(r"\b(mps|xla|torch_xla|xpu|hpu|npu|mtia|privateuseone|habana|ipex)\b")
_DEVICE = re.compile(r"^(cuda|cpu|mps|xpu|meta|hpu|npu|xla|mtia|privateuseone)(:\d+)?$")
_WRAPPER_DEPTH = 3


def params_arg(call: cst.Call) -> cst.BaseExpression | None:
    """The optimizer's first argument (``params``), positional or by keyword."""
    pos = positional(call)
    if pos:
        return pos[0].value
    kw = keyword(call, "params")
    return kw.value if kw is not None else None


def seen_through(rule: Rule, expr: cst.BaseExpression) -> cst.BaseExpression:
    """A name assigned exactly once stands for its value (``params = [...]``; ``Adam(params)``)."""
    if isinstance(expr, cst.Name):
        values = reaching_values(rule, expr)
        if values and len(values) == 1 and values[0] is not None:
            return values[0]
    return expr


def parameter_owners(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    """``X`` of every ``X.parameters()`` inside ``expr`` (comprehensions and param groups included)."""
    out = []
    for node in walk(expr, cross_scopes=True):
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "parameters":
            out.append(node.func.value)
    return out


def group_sets(expr: cst.BaseExpression, keys: set[str]) -> bool:
    """Whether a param group inside ``expr`` sets one of ``keys`` itself (or may: ``**extra``)."""
    for node in walk(expr, cross_scopes=True):
        if isinstance(node, cst.Dict):
            for el in node.elements:
                if not isinstance(el, cst.DictElement) or string_value(el.key) in keys:
                    return True
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "dict":
            if any(a.star or (a.keyword is not None and a.keyword.value in keys) for a in node.args):
                return True
    return False


# --------------------------------------------------------------------------- devices


def _device_kinds(rule: Rule, expr: cst.BaseExpression | None, depth: int = 0) -> set[str]:
    """What a device expression may be: "cuda", "cpu", "other" (another backend, or not a device),
    "named" (unknown, but held by a name the device-names setting says is a device), "unknown"."""
    if expr is None or depth > 4:
        return {"unknown"}
    text = string_value(expr)
    if text is not None:
        head = text.split(":")[0]
        return {head} if head in ("cuda", "cpu") and _DEVICE.match(text) else {"other"}
    if isinstance(expr, cst.FormattedString):
        lead = expr.parts[0] if expr.parts else None
        if isinstance(lead, cst.FormattedStringText) and lead.value.startswith("cuda:"):
            return {"cuda"}
        return {"unknown"}
    if isinstance(expr, cst.Integer):
        return {"cuda"}  # a CUDA device index
    if isinstance(expr, cst.IfExp):
        return _device_kinds(rule, expr.body, depth + 1) | _device_kinds(rule, expr.orelse, depth + 1)
    if isinstance(expr, cst.Call):
        name = callee(rule, expr)
        if name == "torch.device":
            first = positional(expr)
            kind = keyword(expr, "type")
            return _device_kinds(rule, first[0].value if first else kind.value if kind else None, depth + 1)
        if name == "torch.cuda.current_device":
            return {"cuda"}
        return {"unknown"}
    if isinstance(expr, cst.Attribute):
        named = expr.attr.value == "device" or matches_device_name(expr.attr.value, rule.ctx.device_names)
        return {"named"} if named else {"unknown"}
    if isinstance(expr, cst.Name):
        conventional = matches_device_name(expr.value, rule.ctx.device_names)
        values = reaching_values(rule, expr)
        if not values:
            return {"named"} if conventional else {"unknown"}
        out: set[str] = set()
        for v in values:
            kinds = _device_kinds(rule, v, depth + 1) if v is not None else {"unknown"}
            if conventional and "unknown" in kinds:
                kinds = (kinds - {"unknown"}) | {"named"}
            out |= kinds
        return out
    return {"unknown"}


def may_be_cuda(rule: Rule, expr: cst.BaseExpression | None) -> bool:
    """A device expression that may be CUDA and can only be CUDA or the CPU."""
    kinds = _device_kinds(rule, expr)
    return not kinds & {"other", "unknown"} and bool(kinds & {"cuda", "named"})


def _move_device(call: cst.Call) -> tuple[bool, cst.BaseExpression | None]:
    """(is a device move, its device) for ``X.cuda(...)`` / ``X.to(...)`` / ``X.to_empty(device=)``."""
    if not isinstance(call.func, cst.Attribute):
        return False, None
    meth = call.func.attr.value
    if meth == "cuda":
        pos = positional(call)
        kw = keyword(call, "device")
        dev = pos[0].value if pos else kw.value if kw is not None else None
        return True, dev if dev is not None else cst.SimpleString('"cuda"')
    if meth in ("to", "to_empty"):
        pos = positional(call)
        kw = keyword(call, "device")
        return True, kw.value if kw is not None else pos[0].value if pos and meth == "to" else None
    return False, None


def _chain_moves(rule: Rule, expr: cst.BaseExpression, region: cst.CSTNode, depth: int) -> bool:
    """``Net().to(device)``, ``Net().cuda().train()``, ``Net(device=device)``, ``DataParallel(net)``
    with ``net`` moved: an expression whose value is a module on a device that may be CUDA."""
    if depth > _WRAPPER_DEPTH or not isinstance(expr, cst.Call):
        if isinstance(expr, (cst.Name, cst.Attribute)) and depth <= _WRAPPER_DEPTH:
            return _moved_in(rule, expr, region, depth + 1)
        return False
    is_move, dev = _move_device(expr)
    if is_move:
        return may_be_cuda(rule, dev)
    if isinstance(expr.func, cst.Attribute) and isinstance(expr.func.value, cst.Call):
        return _chain_moves(rule, expr.func.value, region, depth + 1)  # .train(), .eval(), .float() ...
    kw = keyword(expr, "device")
    if kw is not None:
        return may_be_cuda(rule, kw.value)
    first = positional(expr)
    return bool(first) and _chain_moves(rule, first[0].value, region, depth + 1)  # a wrapper


def _region(rule: Rule, node: cst.CSTNode, owner: str) -> cst.CSTNode:
    """Where facts about ``owner`` are looked for: the class for ``self.x``, else the function or
    module that holds ``node``."""
    cur: cst.CSTNode | None = node
    want_class = owner.split(".")[0] == "self"
    last = node
    while cur is not None:
        if isinstance(cur, cst.ClassDef) and want_class:
            return cur
        if isinstance(cur, (cst.FunctionDef, cst.Lambda)) and not want_class:
            return cur
        if isinstance(cur, cst.Module):
            return cur
        last = cur
        cur = rule.get_metadata(ParentProvider, cur, None)
    return last


def owner_name(owner: cst.BaseExpression) -> str | None:
    """``model.encoder`` for ``model.encoder``; ``net`` for ``net[0]`` or ``net[0].head`` (moving the
    container moves its items); None for anything else."""
    chain: list[str] = []
    node: cst.BaseExpression = owner
    while isinstance(node, (cst.Attribute, cst.Subscript)):
        if isinstance(node, cst.Subscript):
            chain.clear()
        else:
            chain.append(node.attr.value)
        node = node.value
    if not isinstance(node, cst.Name):
        return None
    return ".".join([node.value] + chain[::-1])


def _moved_in(rule: Rule, owner: cst.BaseExpression, at: cst.CSTNode, depth: int) -> bool:
    name = owner_name(owner)
    if name is None:
        return False
    parts = name.split(".")
    wanted = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - {"self"}
    region = _region(rule, at, name)
    for node in walk(region, cross_scopes=isinstance(region, cst.ClassDef)):
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and dotted(node.func.value) in wanted:
            is_move, dev = _move_device(node)
            if is_move and may_be_cuda(rule, dev):
                return True
        elif isinstance(node, (cst.Assign, cst.AnnAssign)) and node.value is not None:
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            if any(dotted(t) in wanted for t in targets):
                value = node.value
                if isinstance(value, (cst.Name, cst.Attribute)) and dotted(value) in wanted:
                    continue  # `model = model`: no news
                if _chain_moves(rule, value, region, depth):
                    return True
    return False


def on_possible_cuda(rule: Rule, owner: cst.BaseExpression, at: cst.CSTNode) -> bool:
    """Whether the module ``owner`` (as written in ``owner.parameters()`` at ``at``) is moved, in the
    same function (or class, for ``self.x``, or module), to a device that may be CUDA."""
    if isinstance(owner, cst.Call):
        return _chain_moves(rule, owner, at, 0)
    return _moved_in(rule, owner, at, 0)


def assigned_value(rule: Rule, owner: cst.BaseExpression, at: cst.CSTNode) -> list[cst.BaseExpression]:
    """Every value assigned to the module ``owner`` in the same function (class, module)."""
    name = owner_name(owner)
    if name is None:
        return []
    region = _region(rule, at, name)
    out = []
    for node in walk(region, cross_scopes=isinstance(region, cst.ClassDef)):
        if isinstance(node, cst.Assign) and any(dotted(t.target) == name for t in node.targets):
            out.append(node.value)
        elif isinstance(node, cst.AnnAssign) and node.value is not None and dotted(node.target) == name:
            out.append(node.value)
    return out
