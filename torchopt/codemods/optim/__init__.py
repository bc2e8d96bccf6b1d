"""Optimizers (TOP96x): the optimizer implementation a training step runs (fused kernels)."""

FAMILY = "optim"
