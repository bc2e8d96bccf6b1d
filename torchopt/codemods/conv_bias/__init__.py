"""Convolution bias before normalisation (TOP84x, rules.md §14 CBN): drop the bias a norm cancels."""

FAMILY = "conv_bias"
