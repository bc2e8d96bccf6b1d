"""Debugging APIs left on (TOP81x): anomaly detection (TOP811), profilers around training (TOP812),
gradcheck in the training loop (TOP813), synchronous CUDA debugging (TOP814).

Reproducibility switches that cost speed have no code here: they are TOP503 (flags family)."""

FAMILY = "debug"
