"""Distributed data parallel (TOP4xx): DataParallel and single-process scripts to
DistributedDataParallel launched by torchrun, and the per-rank details DDP programs need."""

FAMILY = "ddp"
