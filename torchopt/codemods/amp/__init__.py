"""Automatic mixed precision (TOP2xx, rules.md §3 AMP): autocast and GradScaler, done right."""

FAMILY = "amp"
