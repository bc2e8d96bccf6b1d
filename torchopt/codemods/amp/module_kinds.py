"""``torch.nn`` modules that hold no parameters: a call of one is a function of its inputs (a
similarity, an activation), never the model a training step trains, so it neither starts the
autocast block nor stands for the forward."""

from __future__ import annotations

PARAMETER_FREE = frozenset(
    {
        "CosineSimilarity",
        "PairwiseDistance",
        "Softmax",
        "LogSoftmax",
        "Softmin",
        "Sigmoid",
        "Tanh",
        "ReLU",
        "ReLU6",
        "LeakyReLU",
        "GELU",
        "SiLU",
        "ELU",
        "Mish",
        "Hardswish",
        "Hardsigmoid",
        "Softplus",
        "Flatten",
        "Unflatten",
        "Dropout",
        "Dropout1d",
        "Dropout2d",
        "Dropout3d",
        "AdaptiveAvgPool1d",
        "AdaptiveAvgPool2d",
        "AdaptiveAvgPool3d",
        "AvgPool1d",
        "AvgPool2d",
        "AvgPool3d",
        "MaxPool1d",
        "MaxPool2d",
        "MaxPool3d",
        "Upsample",
        "PixelShuffle",
    }
)


def parameter_free(qualified: str | None) -> bool:
    """``torch.nn.CosineSimilarity`` (any public path): a torch.nn module without parameters."""
    if qualified is None:
        return False
    return qualified.startswith("torch.nn.") and qualified.rsplit(".", 1)[-1] in PARAMETER_FREE
