"""Debugging APIs left on (TOP81x, rules.md §10 DBG): anomaly detection (TOP811), profilers around
training (TOP812), gradcheck in the training loop (TOP813), synchronous CUDA debugging (TOP814).

DBG-005 (reproducibility switches) has no code of its own: it is FLAG-003, implemented as TOP503."""

FAMILY = "debug"
