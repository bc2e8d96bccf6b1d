"""Device placement (TOP1xx, rules.md §2 DEV): create tensors and modules where they are used."""

FAMILY = "device"
