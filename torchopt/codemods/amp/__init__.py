"""Automatic mixed precision (TOP2xx): autocast and GradScaler, done right."""

FAMILY = "amp"
