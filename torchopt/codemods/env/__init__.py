"""Launcher and environment advice for scripts that run on the CPU (TOP951).
Display-only: these are settings of the process, not of the source."""

FAMILY = "env"
