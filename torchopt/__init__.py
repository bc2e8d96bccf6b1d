"""torchopt: rewrite PyTorch code into its fast form, and prove the rewrite computes the same thing."""

__version__ = "0.1.0"
