"""TOP302: GEMM dimensions that are not multiples of 8: the layers, activations and size checks it uses."""

from __future__ import annotations

import libcst as cst


# Layer -> [(parameter name, positional index)] of the sizes that become GEMM dimensions.
LAYERS: dict[str, tuple[tuple[str, int], ...]] = {
    "Linear": (("in_features", 0), ("out_features", 1)),
    "MultiheadAttention": (("embed_dim", 0),),
    "TransformerEncoderLayer": (("d_model", 0), ("dim_feedforward", 2)),
    "TransformerDecoderLayer": (("d_model", 0), ("dim_feedforward", 2)),
    "LSTM": (("input_size", 0), ("hidden_size", 1)),
    "GRU": (("input_size", 0), ("hidden_size", 1)),
    "RNN": (("input_size", 0), ("hidden_size", 1)),
    "LSTMCell": (("input_size", 0), ("hidden_size", 1)),
    "GRUCell": (("input_size", 0), ("hidden_size", 1)),
    "RNNCell": (("input_size", 0), ("hidden_size", 1)),
}
# Convolutions whose channels are padded as a fix only, inside an nn.Sequential chain (the outer
# channels stay): (parameter name, positional index) of in and out channels.
CONVS: dict[str, tuple[tuple[str, int], ...]] = {
    name: (("in_channels", 0), ("out_channels", 1)) for name in ("Conv1d", "Conv2d", "Conv3d")
}
# Elementwise modules with f(0) == 0: a padded hidden unit (zero weights in and out) stays exactly
# zero in the forward pass and gets exactly zero gradients, so training keeps it at zero.
ZERO_PRESERVING = {
    "ReLU",
    "ReLU6",
    "LeakyReLU",
    "GELU",
    "SiLU",
    "Tanh",
    "ELU",
    "SELU",
    "CELU",
    "Mish",
    "Hardswish",
    "Softsign",
    "Tanhshrink",
    "Softshrink",
    "Hardshrink",
    "Identity",
}
NO_ARGS_ONLY = {"Hardtanh"}  # f(0) == 0 with the default bounds only
DROPOUT = {"Dropout", "Dropout1d"}
# Smaller sizes (a score head `Linear(h, 1)`, a 2-way classifier, 2-D coordinates) are not reported:
# such a GEMM is bound by memory traffic, and padding it gains nothing.
MIN_SIZE = 8
# Functional forms with f(0) == 0 (first positional argument is the tensor).
ZERO_PRESERVING_FN = {
    "torch.relu",
    "torch.tanh",
    "torch.nn.functional.relu",
    "torch.nn.functional.relu6",
    "torch.nn.functional.gelu",
    "torch.nn.functional.silu",
    "torch.nn.functional.tanh",
    "torch.nn.functional.elu",
    "torch.nn.functional.selu",
    "torch.nn.functional.celu",
    "torch.nn.functional.leaky_relu",
    "torch.nn.functional.mish",
    "torch.nn.functional.hardswish",
    "torch.nn.functional.softsign",
    "torch.nn.functional.tanhshrink",
}
DROPOUT_FN = {"torch.dropout", "torch.nn.functional.dropout"}
ZERO_PRESERVING_METHODS = {"relu", "tanh"}


def _self_attr(node: cst.CSTNode, self_name: str) -> str | None:
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == self_name:
        return node.attr.value
    return None


def _ast_int_const(text: str, expr, depth: int = 0) -> int | None:
    """pad._common.int_const on CPython's ast (names through ast_reaching_values)."""
    import ast as _ast

    from torchopt.analysis.precheck.scopes import ast_reaching_values

    if expr is None or depth > 6:
        return None
    if isinstance(expr, _ast.Constant):
        return expr.value if type(expr.value) is int else None
    if isinstance(expr, _ast.UnaryOp) and isinstance(expr.op, _ast.USub):
        v = _ast_int_const(text, expr.operand, depth + 1)
        return None if v is None else -v
    if isinstance(expr, _ast.BinOp):
        a = _ast_int_const(text, expr.left, depth + 1)
        b = _ast_int_const(text, expr.right, depth + 1)
        if a is None or b is None:
            return None
        if isinstance(expr.op, _ast.Add):
            return a + b
        if isinstance(expr.op, _ast.Sub):
            return a - b
        if isinstance(expr.op, _ast.Mult):
            return a * b
        if isinstance(expr.op, _ast.FloorDiv) and b != 0:
            return a // b
        return None
    if isinstance(expr, _ast.Name):
        values = ast_reaching_values(text, expr)
        if not values or any(v is None for v in values):
            return None
        known = {_ast_int_const(text, v, depth + 1) for v in values}
        if len(known) == 1:
            return known.pop()
    return None


def _bad_size_possible(text: str) -> bool:
    """visit_Call may find a size to pad: a layer call (by last name, no star) with an argument
    int_const evaluates to at least MIN_SIZE and not a multiple of 64 (so of neither allowed
    `multiple`), or a MultiheadAttention whose head_dim is such. True when the text does not parse."""
    import ast as _ast

    from torchopt.analysis.precheck.tree import ast_index

    index = ast_index(text)
    if index is None:
        return True
    for c in index.get(_ast.Call, ()):
        f = c.func
        last = f.attr if isinstance(f, _ast.Attribute) else f.id if isinstance(f, _ast.Name) else None
        if (
            (last not in LAYERS and last not in CONVS)
            or any(isinstance(a, _ast.Starred) for a in c.args)
            or any(k.arg is None for k in c.keywords)
        ):
            continue
        vals = [_ast_int_const(text, a) for a in [*c.args, *(k.value for k in c.keywords)]]
        if any(v is not None and v >= MIN_SIZE and v % 64 for v in vals):
            return True
        if last == "MultiheadAttention":

            def get(i: int, name: str):
                kw = next((k.value for k in c.keywords if k.arg == name), None)
                return kw if kw is not None else c.args[i] if i < len(c.args) else None

            e, h = _ast_int_const(text, get(0, "embed_dim")), _ast_int_const(text, get(1, "num_heads"))
            if e and h and e % h == 0 and (e // h) % 64:
                return True
    return False
