"""Gradient zeroing (TOP83x, rules.md §13 ZG): let `zero_grad()` set gradients to None."""

FAMILY = "zero_grad"
