"""Naming conventions rules rely on: what a model, an evaluation function or a held-out loader is usually called."""

from __future__ import annotations

import re

MODULE_ONLY_METHODS = {
    "parameters",
    "named_parameters",
    "train",
    "eval",
    "modules",
    "named_modules",
    "buffers",
    "requires_grad_",
}


CONVENTIONAL_MODEL_NAMES = {
    "model",
    "net",
    "network",
    "module",
    "encoder",
    "decoder",
    "generator",
    "discriminator",
    "backbone",
    "classifier",
}


_OPTIMIZER_WORDS = {"opt", "optim", "optimizer", "optimiser", "optimizers", "optimisers"}


def optimizer_name(name: str) -> bool:
    """An optimizer by its name: a word of ``optimizer``, ``g_optim``, ``optimizerD``, ``opt_g``."""
    return any(p.lower() in _OPTIMIZER_WORDS for p in re.split(r"[_\d]+|(?<=[a-z])(?=[A-Z])", name) if p)


def optimizer_step(func_attr: str, receiver: str | None, args: list[str | None]) -> bool:
    """``optimizer.step()`` or ``scaler.step(optimizer)``: the call updates the parameters (a
    training step), from the called attribute, the receiver's dotted name and the arguments' dotted
    names."""
    if func_attr != "step":
        return False
    if receiver is not None and optimizer_name(receiver.rsplit(".", 1)[-1]):
        return True
    return bool(args) and args[0] is not None and optimizer_name(args[0].rsplit(".", 1)[-1])


EVAL_FUNCTION = re.compile(
    r"^_*(?:(?:evaluate|eval|validate|validation|val|predict|infer|inference)(?:_\w+)?|test"
    r"|\w+_(?:evaluate|eval|validate|validation|predict|infer|inference))$"
)


EVAL_WORDS = {"val", "valid", "validation", "test", "testing", "eval", "evaluation", "dev", "holdout"}


EVAL_PREFIXES = ("val", "valid", "test", "eval", "dev")


LOADER_SUFFIXES = ("loader", "dl", "dataloader", "iter", "batches", "data", "set", "ds")


MODEL_WORDS = (
    "model",
    "net",
    "encoder",
    "decoder",
    "classifier",
    "backbone",
    "teacher",
    "student",
    "generator",
    "discriminator",
    "head",
    "policy",
    "critic",
)


def eval_loader_name(name: str) -> bool:
    low = name.lower()
    parts = [p for p in re.split(r"[_\d]+", low) if p]
    if any(p in EVAL_WORDS for p in parts):
        return True
    return any(low.startswith(p) and low[len(p) :] in LOADER_SUFFIXES for p in EVAL_PREFIXES)


def model_name(name: str) -> bool:
    low = name.lower()
    return any(w in low for w in MODEL_WORDS)


# Names of routines that do something *to* a model (`unwrap_model(m)`, `build_model(cfg)`,
# `save_pretrained_model(m, path)`): a verb, then a name that ends in a model word. Calling one
# builds, fetches or stores a model, it does not run one (`get_decoder_features(x)` ends in no model
# word: it may run one).
MODEL_ACTION = re.compile(
    r"^_*(?:unwrap|get|build|load|create|make|init|initialize|prepare|save|export|wrap|setup|set|freeze"
    r"|unfreeze|print|count|copy|clone|convert|summarize|log|register|resume|restore|move|compile|to)_"
    r"(?:\w*_)?(?:" + "|".join(MODEL_WORDS) + r")s?$",
    re.IGNORECASE,
)
# Of those, the ones that return the very module they are given (accelerate's and DeepSpeed's
# `unwrap_model(model)`): `accelerator.unwrap_model(model)(x)` runs `model`.
MODEL_UNWRAP = frozenset({"unwrap_model"})


LOG_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "log", "exception"}


LOGGER_NAMES = {"logging", "logger", "log", "LOGGER", "_logger", "LOG"}
