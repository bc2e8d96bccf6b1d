"""Device placement (TOP1xx): create tensors and modules where they are used."""

FAMILY = "device"
