"""CPU-GPU synchronisation (TOP6xx, rules.md §7 SYNC): keep the GPU's queue full inside hot loops."""

FAMILY = "sync"
