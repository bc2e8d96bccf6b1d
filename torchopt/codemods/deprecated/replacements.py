"""Deprecated functions: ``torch.range`` (TOP826), ``torch.autograd.Variable``
(TOP829) and the linear-algebra functions ``torch.linalg`` replaced (TOP820)."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.values import int_value


def _signed_int(expr: cst.BaseExpression) -> int | None:
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        inner = int_value(expr.expression)
        return None if inner is None else -inner
    return int_value(expr)


# Removed or deprecated functions and what replaces them (TorchFix TOR001/TOR101 cover these too).
REPLACED = {
    "torch.solve": "torch.linalg.solve(A, B) (note: arguments swapped, torch.solve(B, A))",
    "torch.symeig": "torch.linalg.eigh (or eigvalsh)",
    "torch.eig": "torch.linalg.eig (or eigvals)",
    "torch.lstsq": "torch.linalg.lstsq(A, B) (note: arguments swapped)",
    "torch.matrix_rank": "torch.linalg.matrix_rank",
    "torch.chain_matmul": "torch.linalg.multi_dot([...])",
    "torch.cholesky": "torch.linalg.cholesky (upper=True: .mH of the result)",
    "torch.qr": "torch.linalg.qr (some=False: mode='complete')",
    "torch.lu": "torch.linalg.lu_factor",
    "torch.norm": "torch.linalg.vector_norm / matrix_norm",
    "torch.ger": "torch.outer",
}
