"""torchopt's own findings about its suppression comments (TOP001)."""

FAMILY = "suppression"
