"""Exit statuses of `torchopt validate`, one per verdict (docs/validation.md, "Exit codes"); a CI
workflow gates on them."""

from __future__ import annotations

__all__ = ["EQUIVALENT", "DIVERGED", "COULD_NOT_RUN", "INCONCLUSIVE", "UNVALIDATED", "exit_code"]

EQUIVALENT = 0
DIVERGED = 1  # including a crash or timeout in one version only
COULD_NOT_RUN = 2  # both versions failed, or a usage/config error
INCONCLUSIVE = 3  # fewer probes compared by value than a verdict needs
UNVALIDATED = 4  # fixes the run could not check, and the user did not accept that (--allow-unvalidated)

_BY_VERDICT = {"equivalent": EQUIVALENT, "diverged": DIVERGED, "inconclusive": INCONCLUSIVE}


def exit_code(verdict: str) -> int:
    """The status for a comparison's verdict; anything else could not run."""
    return _BY_VERDICT.get(verdict, COULD_NOT_RUN)
