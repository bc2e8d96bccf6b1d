"""Data loading (TOP70x): DataLoaders that keep the device fed.

TOP701 worker processes (`num_workers`), TOP702 pinned batches (`pin_memory`) for loaders whose
batches reach the device in ways TOP104 does not see, TOP703 `persistent_workers` for loaders
iterated once per epoch. The `non_blocking=True` copies of the batches are TOP104's;
sharding a loader across processes is part of the DDP rewrite (TOP401, TOP403)."""

FAMILY = "data"
