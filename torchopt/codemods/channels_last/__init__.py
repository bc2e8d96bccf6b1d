"""channels_last memory format for CNNs (TOP901, rules.md §15 CL-001). Opt-in: select it by code."""

FAMILY = "channels_last"
