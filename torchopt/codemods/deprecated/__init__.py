"""DEP: deprecated PyTorch APIs migrated to their replacements (TOP820–TOP829)."""

FAMILY = "deprecated"
