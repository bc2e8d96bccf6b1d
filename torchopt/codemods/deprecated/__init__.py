"""DEP: deprecated PyTorch APIs migrated to their replacements (rules.md §11, TOP820–TOP829)."""

FAMILY = "deprecated"
