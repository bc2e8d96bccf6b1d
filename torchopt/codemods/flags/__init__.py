"""Backend switches (TOP5xx): cuDNN auto-tuner, TF32 matmuls, determinism costs."""

FAMILY = "flags"
