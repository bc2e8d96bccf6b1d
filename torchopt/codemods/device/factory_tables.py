"""The torch tensor factories TOP101 and TOP102 fold a trailing call into, grouped by how their
values depend on the device and dtype they are created with, and the legacy typed constructors."""

from __future__ import annotations

DETERMINISTIC = frozenset(
    {
        "zeros",
        "ones",
        "empty",
        "empty_strided",
        "empty_permuted",
        "full",
        "eye",
        "scalar_tensor",
        "tril_indices",
        "triu_indices",
        "sparse_coo_tensor",
        "tensor",
        "as_tensor",
        "asarray",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
    }
)
#: Draw from the generator of the device they are created on.
RANDOM = frozenset({"rand", "randn", "randint", "randperm", "normal", "rand_like", "randn_like", "randint_like"})
RANDOM_INT = frozenset({"randint", "randperm", "randint_like"})
#: Computed by a device kernel when created on the device (T, 1 ulp).
COMPUTED = frozenset(
    {
        "linspace",
        "logspace",
        "range",
        "hann_window",
        "hamming_window",
        "bartlett_window",
        "blackman_window",
        "kaiser_window",
    }
)
#: Values are 0, 1 or uninitialised: exact in every dtype.
CONSTANT = frozenset(
    {"zeros", "ones", "empty", "empty_strided", "empty_permuted", "zeros_like", "ones_like", "empty_like", "eye"}
)
FACTORIES = DETERMINISTIC | RANDOM | COMPUTED | {"arange"}

#: Legacy typed constructors and the dtype they mean.
LEGACY = {
    "Tensor": None,
    "FloatTensor": "float32",
    "DoubleTensor": "float64",
    "HalfTensor": "float16",
    "BFloat16Tensor": "bfloat16",
    "LongTensor": "int64",
    "IntTensor": "int32",
    "ShortTensor": "int16",
    "CharTensor": "int8",
    "ByteTensor": "uint8",
    "BoolTensor": "bool",
}
CUDA_LEGACY = {k: v for k, v in LEGACY.items() if v is not None}  # all but the dtype-less "Tensor"

#: How generated code spells a canonical dtype.
SPELLING = {
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float64": "float64",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "bool": "bool",
}


def factory_kind(qname: str | None) -> str | None:
    """``zeros`` for ``torch.zeros``; None if not a factory we handle."""
    if not qname or not qname.startswith("torch."):
        return None
    short = qname[len("torch.") :]
    return short if short in FACTORIES else None


# Factories that make an index (integer positions) and so are used inside a subscript, `x[torch.arange(n), i]`.
INDEX_FACTORIES = frozenset({"arange", "randperm", "randint", "tensor", "as_tensor", "tril_indices", "triu_indices"})
