"""Which names of a function hold tensors, for TOP610: parameters not typed or defaulted as
Python values, and the locals computed from them with tensor operations. A host read or a
branch only syncs on a tensor, so these facts decide what the rule reports."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst

from torchopt.analysis.names import callee
from torchopt.analysis.syntax import walk
from torchopt.analysis.placement import placements
from torchopt.rewrite.rule import Rule

# Tensor methods whose result is a Python value (no tensor, so no device work).
_HOST_METHODS = {
    "item",
    "tolist",
    "dim",
    "ndimension",
    "size",
    "numel",
    "nelement",
    "stride",
    "is_contiguous",
    "is_floating_point",
    "is_complex",
    "get_device",
    "data_ptr",
    "element_size",
    "storage_offset",
}
# Methods only a tensor has: a name used with one of them holds a tensor (a list or dict has none).
TENSOR_METHODS = {
    "size",
    "shape",
    "dim",
    "view",
    "reshape",
    "unsqueeze",
    "squeeze",
    "permute",
    "transpose",
    "contiguous",
    "flatten",
    "float",
    "half",
    "long",
    "sum",
    "mean",
    "softmax",
    "log_softmax",
    "exp",
    "log",
    "abs",
    "pow",
    "clamp",
    "sigmoid",
    "masked_fill",
    "gather",
    "norm",
    "detach",
    "argmax",
    "new_zeros",
    "new_ones",
    "new_full",
    "numel",
    "dtype",
    "ndim",
}
# torch functions that return no tensor, or a tuple of them.
_NOT_TENSOR = {
    "is_tensor",
    "numel",
    "is_floating_point",
    "is_complex",
    "is_grad_enabled",
    "split",
    "chunk",
    "unbind",
    "is_autocast_enabled",
    "is_nonzero",
}
# Methods and torch functions that cut a tensor into a few pieces (not `unbind`, whose pieces are its rows).
_SPLITS = {"chunk", "split", "tensor_split", "hsplit", "vsplit", "dsplit"}
_NOT_TENSOR_ANNOTATION = re.compile(
    r"\b(int|float|bool|str|List|list|Tuple|tuple|Dict|dict|Sequence|Iterable|"
    r"Callable|Mapping|Module)\b"
)


@dataclass
class FunctionScope:
    """One function the rule reads: where it is, and which of its names hold tensors."""

    fn: cst.FunctionDef
    where: str
    loss_module: bool
    method: bool = False  # defined directly in a class body: its first parameter is `self`
    tensors: set[str] = field(default_factory=set)  # names that may hold a tensor
    sure: set[str] = field(default_factory=set)  # names that surely hold one (annotated, used as one)


def collect_tensors(rule: Rule, scope: FunctionScope) -> None:
    """Parameters (not `self`, not Python-typed or defaulted to a Python literal) and the locals
    computed from them with tensor operations; `sure` adds the evidence that they are tensors."""
    params = list(scope.fn.params.params) + list(scope.fn.params.kwonly_params)
    if scope.method and params:
        params = params[1:]
    for p in params:
        if p.default is not None and not (isinstance(p.default, cst.Name) and p.default.value == "None"):
            continue
        ann = _annotation_text(rule, p.annotation.annotation) if p.annotation else ""
        if _NOT_TENSOR_ANNOTATION.search(ann):
            continue
        scope.tensors.add(p.name.value)
        if "Tensor" in ann:
            scope.sure.add(p.name.value)
    body = list(walk(scope.fn.body))
    for _ in range(2):
        for n in body:
            if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.targets[0].target, cst.Name):
                name = n.targets[0].target.value
                if tensor_valued(rule, n.value, scope):
                    scope.tensors.add(name)
                    scope.sure.add(name)
    for n in body:
        if (
            isinstance(n, cst.Attribute)
            and isinstance(n.value, cst.Name)
            and n.attr.value in TENSOR_METHODS
            and n.value.value in scope.tensors
        ):
            scope.sure.add(n.value.value)
    # A name rebound to the pieces of a split (`out = out.chunk(n)`) holds a tuple of tensors: a loop
    # over it visits a few pieces, each a whole batch, not the rows of one tensor.
    for n in body:
        if (
            isinstance(n, cst.Assign)
            and len(n.targets) == 1
            and isinstance(n.targets[0].target, cst.Name)
            and isinstance(n.value, cst.Call)
            and isinstance(n.value.func, (cst.Attribute, cst.Name))
            and _called_name(n.value.func) in _SPLITS
        ):
            scope.tensors.discard(n.targets[0].target.value)
            scope.sure.discard(n.targets[0].target.value)


def _annotation_text(rule: Rule, annotation: cst.BaseExpression) -> str:
    """The code of an annotation. A plain dotted name (`int`, `torch.Tensor`) is spelled from its
    parts, the very text code generation would give, without generating code for each parameter."""
    parts = []
    node = annotation
    while isinstance(node, cst.Attribute) and not node.lpar and not node.rpar and _bare(node.dot):
        parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name) and not node.lpar and not node.rpar:
        return ".".join([node.value, *reversed(parts)])
    return rule.ctx.module.code_for_node(annotation)


def _bare(dot: cst.Dot) -> bool:
    """A dot with no whitespace either side (the usual `a.b`)."""
    return all(
        isinstance(ws, cst.SimpleWhitespace) and ws.value == "" for ws in (dot.whitespace_before, dot.whitespace_after)
    )


def _called_name(func: cst.Attribute | cst.Name) -> str:
    return func.attr.value if isinstance(func, cst.Attribute) else func.value


def tensor_valued(rule: Rule, e: cst.BaseExpression, scope: FunctionScope) -> bool:
    """Whether `e` computes a tensor from the function's tensors (so its truth or `.item()` syncs)."""
    if isinstance(e, cst.Name):
        return e.value in scope.tensors
    if isinstance(e, cst.Attribute):
        return e.attr.value in ("T", "data", "mT") and tensor_valued(rule, e.value, scope)
    if isinstance(e, cst.Subscript):
        return tensor_valued(rule, e.value, scope)
    if isinstance(e, cst.BinaryOperation):
        return tensor_valued(rule, e.left, scope) or tensor_valued(rule, e.right, scope)
    if isinstance(e, cst.UnaryOperation):
        return tensor_valued(rule, e.expression, scope)
    if isinstance(e, cst.Call):
        if isinstance(e.func, cst.Attribute) and not placements(rule).value(e).on_host:
            qualified = callee(rule, e)
            if qualified is None:
                return e.func.attr.value not in _HOST_METHODS and tensor_valued(rule, e.func.value, scope)
        qualified = callee(rule, e)
        if qualified is not None and qualified.startswith("torch.") and qualified.rsplit(".", 1)[1] not in _NOT_TENSOR:
            return any(tensor_valued(rule, a.value, scope) for a in e.args)
    return False


def truth_of_tensor(rule: Rule, test: cst.BaseExpression, scope: FunctionScope) -> bool:
    """`bool()` of a tensor: a comparison of a tensor value, `t.any()`, `not t`..., never `x is None`."""
    if isinstance(test, cst.BooleanOperation):
        return truth_of_tensor(rule, test.left, scope) or truth_of_tensor(rule, test.right, scope)
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return truth_of_tensor(rule, test.expression, scope)
    if isinstance(test, cst.Comparison):
        if any(isinstance(c.operator, (cst.Is, cst.IsNot, cst.In, cst.NotIn)) for c in test.comparisons):
            return False
        sides = [test.left, *(c.comparator for c in test.comparisons)]
        return any(tensor_valued(rule, s, scope) for s in sides) and not all(
            placements(rule).value(s).on_host for s in sides
        )
    return isinstance(test, cst.Call) and tensor_valued(rule, test, scope)
