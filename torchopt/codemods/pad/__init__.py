"""Tensor-Core-friendly sizes (TOP3xx): pad GEMM dimensions to multiples of 8."""

FAMILY = "pad"
