"""Backend switches (TOP5xx, rules.md §6 FLAG): cuDNN auto-tuner, TF32 matmuls, determinism costs."""

FAMILY = "flags"
