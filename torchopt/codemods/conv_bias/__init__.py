"""Convolution bias before normalisation (TOP84x): drop the bias a norm cancels."""

FAMILY = "conv_bias"
