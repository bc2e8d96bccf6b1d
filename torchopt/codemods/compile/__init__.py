"""Compilation (rules.md §16): `model.compile()` (TOP911, CMP-001), CUDA graphs through
`mode="reduce-overhead"` (TOP921, CG-001) and hand-made CUDA graphs (TOP922, CG-002), activation
checkpointing advice (TOP931, CKPT-001). The rewrites are opt-in: select them by code."""

FAMILY = "compile"
