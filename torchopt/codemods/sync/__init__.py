"""CPU-GPU synchronisation (TOP6xx): keep the GPU's queue full inside hot loops."""

FAMILY = "sync"
