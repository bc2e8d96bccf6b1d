"""The validator: runs a program before and after a rewrite under the same seeds and compares what
they computed. Imports torch (the engine never does)."""
