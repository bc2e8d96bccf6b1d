"""Compilation: `model.compile()` (TOP911), CUDA graphs through `mode="reduce-overhead"` (TOP921)
and hand-made CUDA graphs (TOP922), activation checkpointing advice (TOP931). The rewrites are opt-in: select them by code."""

FAMILY = "compile"
