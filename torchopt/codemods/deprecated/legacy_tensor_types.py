"""Legacy tensor-type APIs: ``set_default_tensor_type`` (TOP823) and the typed
constructors ``torch.cuda.FloatTensor(n)`` / ``torch.Tensor(sizes).cuda()`` (TOP828)."""

from __future__ import annotations


import libcst as cst

from torchopt.analysis.names import torch_name
from torchopt.rewrite.rule import Rule

# Legacy tensor type name -> the dtype attribute of torch it stands for.
TENSOR_TYPES = {
    "FloatTensor": "float32",
    "DoubleTensor": "float64",
    "HalfTensor": "float16",
    "BFloat16Tensor": "bfloat16",
    "ByteTensor": "uint8",
    "CharTensor": "int8",
    "ShortTensor": "int16",
    "IntTensor": "int32",
    "LongTensor": "int64",
    "BoolTensor": "bool",
}


def legacy_type(qualified: str | None) -> tuple[str, bool] | None:
    """(type name, is CUDA) for ``torch.FloatTensor`` / ``torch.cuda.FloatTensor``; else None."""
    if not qualified:
        return None
    for prefix, cuda in (("torch.cuda.", True), ("torch.", False)):
        if qualified.startswith(prefix) and qualified[len(prefix) :] in TENSOR_TYPES:
            return qualified[len(prefix) :], cuda
    return None


def callee_name(rule: Rule, expr: cst.BaseExpression) -> str | None:
    return torch_name(rule, expr) if isinstance(expr, (cst.Name, cst.Attribute)) else None
