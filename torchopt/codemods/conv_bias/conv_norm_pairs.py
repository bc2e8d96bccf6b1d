"""TOP841: ``bias=False`` on a convolution whose output goes straight into a normalisation that
cancels a per-channel constant."""

from __future__ import annotations

import ast as _ast

import libcst as cst

from torchopt.analysis.arguments import keyword, positional
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

_CONVS = {f"{p}{d}d": d for p in ("Conv", "ConvTranspose") for d in (1, 2, 3)}
# Normalisations that subtract a per-channel mean: name -> spatial dims (0: any).
_NORMS = {
    **{f"BatchNorm{d}d": d for d in (1, 2, 3)},
    **{f"InstanceNorm{d}d": d for d in (1, 2, 3)},
    "SyncBatchNorm": 0,
    "GroupNorm": 0,
}
# Positional index of `bias` in Conv*d / ConvTranspose*d: (in, out, kernel, stride, padding,
# dilation | output_padding, groups, bias, ...).
_BIAS_POS = 7


def _torch_nn_class(q: str | None, table: dict[str, int]) -> str | None:
    if not q:
        return None
    parts = q.split(".")
    if parts[:2] != ["torch", "nn"]:
        return None
    if len(parts) == 3 or (len(parts) == 5 and parts[2] == "modules"):
        return parts[-1] if parts[-1] in table else None
    return None


def _arg(call: cst.Call, pos: int, name: str) -> cst.BaseExpression | None:
    kw = keyword(call, name)
    if kw is not None:
        return kw.value
    pos_args = positional(call)
    return pos_args[pos].value if pos < len(pos_args) else None


def _text(rule: Rule, expr: cst.BaseExpression | None) -> str | None:
    return None if expr is None else " ".join(rule.ctx.module.code_for_node(expr).split())


def _ast_key(node) -> str:
    """A key that two expressions whose _text is equal share (string constants compared with
    their whitespace runs collapsed; parentheses and comments ignored): a coarser equality."""
    if isinstance(node, _ast.Constant):
        v = node.value
        if isinstance(v, str):
            return "s" + repr(" ".join(v.split()))
        if isinstance(v, bytes):
            return "b" + repr(b" ".join(v.split()))
        return "c" + repr(v)
    if isinstance(node, _ast.AST):
        return (
            type(node).__name__
            + "("
            + ",".join(_ast_key(getattr(node, f, None)) for f in node._fields if f != "ctx")
            + ")"
        )
    if isinstance(node, list):
        return "[" + ",".join(_ast_key(x) for x in node) + "]"
    return repr(node)


def _ast_arg(call: _ast.Call, pos: int, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return call.args[pos] if pos < len(call.args) else None


def _could_match(text: str) -> bool:
    """ConvBiasBeforeNorm's cheap necessary condition on CPython's ast: a torch.nn convolution call
    _flag could fix or report (no star, no bias other than `True`, at most _BIAS_POS positional
    arguments) and a torch.nn normalisation call (no star) that _cancels it (same spatial dims, the
    channel counts spelled alike), either consecutive arguments of a call (the nn.Sequential form)
    or both assigned to `self.<attr>` in the `__init__` of a class with a `forward`. True when the
    text does not parse or star-imports from torch."""
    from torchopt.analysis.precheck.torch_imports import ast_torch_names, torch_import_map
    from torchopt.analysis.precheck.tree import ast_index

    index, imports = ast_index(text), torch_import_map(text)
    if index is None or imports is None:
        return True
    if not imports:
        return False
    convs: dict[int, str] = {}
    norms: dict[int, str] = {}
    for c in index.get(_ast.Call, ()):
        names = ast_torch_names(imports, c.func)
        if not names or any(isinstance(a, _ast.Starred) for a in c.args) or any(k.arg is None for k in c.keywords):
            continue
        for q in names:
            if (conv := _torch_nn_class(q, _CONVS)) is not None:
                bias = next((k.value for k in c.keywords if k.arg == "bias"), None)
                if (
                    (bias is None or (isinstance(bias, _ast.Constant) and bias.value is True))
                    and len(c.args) <= _BIAS_POS
                    and _ast_arg(c, 1, "out_channels") is not None
                ):
                    convs[id(c)] = conv
            elif (norm := _torch_nn_class(q, _NORMS)) is not None:
                norms[id(c)] = norm
    if not convs or not norms:
        return False

    def cancels(conv: _ast.expr, norm: _ast.expr) -> bool:
        if not (isinstance(conv, _ast.Call) and isinstance(norm, _ast.Call)):
            return False  # (only calls are in convs and norms)
        cname, nname = convs[id(conv)], norms[id(norm)]
        if _NORMS[nname] and _NORMS[nname] != _CONVS[cname]:
            return False
        out = _ast_key(_ast_arg(conv, 1, "out_channels"))
        if nname == "GroupNorm":
            g, ch = _ast_arg(norm, 0, "num_groups"), _ast_arg(norm, 1, "num_channels")
            return g is not None and ch is not None and _ast_key(g) == _ast_key(ch) == out
        f = _ast_arg(norm, 0, "num_features")
        return f is not None and _ast_key(f) == out

    for c in index.get(_ast.Call, ()):  # nn.Sequential(conv, norm, ...)
        for a, b in zip(c.args, c.args[1:]):
            if id(a) in convs and id(b) in norms and cancels(a, b):
                return True
    for cls in index.get(_ast.ClassDef, ()):
        methods = {s.name: s for s in cls.body if isinstance(s, (_ast.FunctionDef, _ast.AsyncFunctionDef))}
        if "__init__" not in methods or "forward" not in methods:
            continue
        built = {
            attr: n.value
            for n in _ast.walk(methods["__init__"])
            if isinstance(n, _ast.Assign) and len(n.targets) == 1 and (attr := _ast_self_attr(n.targets[0])) is not None
        }
        cs = {k: v for k, v in built.items() if id(v) in convs}
        ns = {k: v for k, v in built.items() if id(v) in norms}
        if not any(cancels(a, b) for a in cs.values() for b in ns.values()):
            continue
        uses: dict[str, int] = {}
        for n in _ast.walk(cls):
            if (attr := _ast_self_attr(n)) is not None:
                uses[attr] = uses.get(attr, 0) + 1
        for c_attr, n_attr in _ast_pairs(methods["forward"]):
            if c_attr in cs and n_attr in ns and uses.get(c_attr) == 2 and cancels(cs[c_attr], ns[n_attr]):
                return True
    return False


def _ast_self_attr(node) -> str | None:
    if isinstance(node, _ast.Attribute) and isinstance(node.value, _ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _ast_self_call(expr) -> tuple[str, _ast.AST] | None:
    """``self.x(arg)`` -> ("x", arg) (_self_call)."""
    if (
        isinstance(expr, _ast.Call)
        and len(expr.args) == 1
        and not expr.keywords
        and not isinstance(expr.args[0], _ast.Starred)
        and (attr := _ast_self_attr(expr.func)) is not None
    ):
        return attr, expr.args[0]
    return None


def _ast_pairs(forward) -> list[tuple[str, str]]:
    """(conv attr, norm attr) candidates of _pairs: ``self.n(self.c(x))``, or ``v = self.c(x)``
    directly followed by ``w = self.n(v)`` in one block (crossing nested scopes: a superset)."""
    out = []
    for n in _ast.walk(forward):
        if (outer := _ast_self_call(n)) is not None and (inner := _ast_self_call(outer[1])) is not None:
            out.append((inner[0], outer[0]))
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(n, field, None)
            if not isinstance(stmts, list):
                continue
            for a, b in zip(stmts, stmts[1:]):
                if not (
                    isinstance(a, _ast.Assign)
                    and isinstance(b, _ast.Assign)
                    and len(a.targets) == 1
                    and len(b.targets) == 1
                    and isinstance(a.targets[0], _ast.Name)
                    and isinstance(b.targets[0], _ast.Name)
                ):
                    continue
                c1, c2 = _ast_self_call(a.value), _ast_self_call(b.value)
                if c1 is not None and c2 is not None and isinstance(c2[1], _ast.Name) and c2[1].id == a.targets[0].id:
                    out.append((c1[0], c2[0]))
    return out


def _self_attr(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == "self":
        return node.attr.value
    return None


def _self_call(expr: cst.BaseExpression | None) -> tuple[str, cst.BaseExpression] | None:
    """``self.x(arg)`` -> ("x", arg)."""
    if isinstance(expr, cst.Call) and len(expr.args) == 1 and expr.args[0].keyword is None and not expr.args[0].star:
        attr = _self_attr(expr.func)
        if attr is not None:
            return attr, expr.args[0].value
    return None


def _pairs(forward: cst.FunctionDef, convs: dict[str, cst.Call], built: dict[str, cst.Call]):
    """(conv attr, norm attr) pairs that ``forward`` applies back to back."""
    out = []
    for n in walk(forward):
        outer = _self_call(n) if isinstance(n, cst.Call) else None
        if outer is not None:
            inner = _self_call(outer[1])
            if inner is not None and inner[0] in convs and outer[0] in built:
                out.append((inner[0], outer[0]))
        if isinstance(n, cst.IndentedBlock):
            stmts = list(n.body)
            for a, b in zip(stmts, stmts[1:]):
                first, second = _simple_assign(a), _simple_assign(b)
                if first is None or second is None:
                    continue
                call1, call2 = _self_call(first[1]), _self_call(second[1])
                if call1 is None or call2 is None or call1[0] not in convs or call2[0] not in built:
                    continue
                var = first[0]
                if not (isinstance(call2[1], cst.Name) and call2[1].value == var):
                    continue
                # The intermediate must die here: rebound by the norm's result, or never read again.
                if second[0] == var or _reads(forward, var) == 1:
                    out.append((call1[0], call2[0]))
    return out


def _simple_assign(stmt: cst.CSTNode) -> tuple[str, cst.BaseExpression] | None:
    if (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Assign)
        and len(stmt.body[0].targets) == 1
        and isinstance(stmt.body[0].targets[0].target, cst.Name)
    ):
        return stmt.body[0].targets[0].target.value, stmt.body[0].value
    return None


def _reads(func: cst.FunctionDef, var: str) -> int:
    """Occurrences of the name ``var`` in ``func`` outside assignment targets."""
    targets = set()
    for n in walk(func):
        if isinstance(n, cst.AssignTarget):
            targets.add(id(n.target))
    return sum(1 for n in walk(func) if isinstance(n, cst.Name) and n.value == var and id(n) not in targets)


def _bias_reads(rule: Rule, conv_attr: str | None) -> cst.Attribute | None:
    """A ``.bias`` read that may be this convolution's and is not guarded by
    ``if x.bias is not None`` / ``x.bias is None`` tests: ``self.<conv>.bias``, or ``.bias`` of
    anything other than another named ``self.<attr>``."""
    module = rule.ctx.module
    hit = rule.__dict__.get("_bias_attrs_memo")
    if hit is None or hit[0] is not module:  # the file's `.bias` attributes, collected once per parse
        hit = rule.__dict__["_bias_attrs_memo"] = (
            module,
            [n for n in walk(module, cross_scopes=True) if isinstance(n, cst.Attribute) and n.attr.value == "bias"],
        )
    for n in hit[1]:
        parent = rule.get_metadata(ParentProvider, n, None)
        if isinstance(parent, cst.Call) and parent.func is n:
            continue
        if (
            isinstance(parent, cst.Comparison)
            and len(parent.comparisons) == 1
            and isinstance(parent.comparisons[0].operator, (cst.Is, cst.IsNot))
        ):
            continue
        other = _self_attr(n.value)
        if other is not None and other != conv_attr:
            continue
        if (
            isinstance(n.value, cst.Attribute)
            and _self_attr(n.value) is None
            and isinstance(n.value.value, cst.Attribute)
        ):
            continue  # e.g. self.head.fc.bias: a named sub-layer
        if _guarded(rule, n):
            continue
        return n
    return None


def _guarded(rule: Rule, attr: cst.Attribute) -> bool:
    code = rule.ctx.module.code_for_node(attr)
    cur: cst.CSTNode = attr
    while True:
        parent = rule.get_metadata(ParentProvider, cur, None)
        if parent is None or isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return False
        if isinstance(parent, cst.If) and cur is parent.body:
            test = parent.test
            if (
                isinstance(test, cst.Comparison)
                and len(test.comparisons) == 1
                and isinstance(test.comparisons[0].operator, cst.IsNot)
                and rule.ctx.module.code_for_node(test.left) == code
            ):
                return True
        cur = parent
