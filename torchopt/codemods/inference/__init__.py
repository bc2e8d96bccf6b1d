"""Inference and evaluation (TOP80x): no autograd where nothing is trained.

TOP801 adds `torch.no_grad()` to evaluation code, TOP802 turns `no_grad` into `inference_mode` in
pure inference scripts (opt-in), TOP803 reports evaluation without `model.eval()` and training
loops that are not switched back with `model.train()`."""

FAMILY = "inference"
