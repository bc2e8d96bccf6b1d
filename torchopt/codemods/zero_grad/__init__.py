"""Gradient zeroing (TOP83x): let `zero_grad()` set gradients to None."""

FAMILY = "zero_grad"
