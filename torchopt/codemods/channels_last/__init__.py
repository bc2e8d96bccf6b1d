"""channels_last memory format for CNNs (TOP901). Opt-in: select it by code."""

FAMILY = "channels_last"
