"""Tensor-Core-friendly sizes (TOP3xx, rules.md §4 PAD): pad GEMM dimensions to multiples of 8."""

FAMILY = "pad"
