"""How close "the same" has to be, by what the applied fixes are allowed to change (the table in docs/validation.md, "Tolerances").

A safe fix must keep every bit; a fix tagged ``tolerance``/``numerics``/``rng``/``semantics`` buys a
looser criterion.  This module only maps tags to numbers, so the table lives in one place; the
comparison itself is in ``compare.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

__all__ = ["Bound", "Precision", "Tolerance", "tolerance_for", "precision_for", "TRAINING_KINDS", "FLOOR_K"]

# Probes whose error accumulates over optimizer steps (rather than one forward pass).
TRAINING_KINDS = frozenset({"loss", "param", "optim"})

# The fp32 defaults of torch.testing.assert_close.
_FP32_RTOL, _FP32_ATOL = 1.3e-6, 1e-5
# Parameters after N steps of a reassociating fix (e.g. a compiled model): rtol 1e-5.  Used for every training probe
# under `tolerance`, since reassociation error compounds step by step.
_STEP_RTOL = 1e-5
# AMP outputs: (rtol, atol as a fraction of max|ref|, rel-L2 bound).
_AMP = {"float16": (1e-2, 1e-3, 1e-2), "bfloat16": (5e-2, 1e-2, 5e-2)}
# Per-loss bounds of AMP training (first 20 steps, later steps), as fractions of the loss scale:
# the largest loss the original had computed up to that one. A loss that falls towards zero keeps
# the absolute error of the trajectory, so its error relative to itself means nothing.
# bfloat16, measured on the CPU (docs/validation.md, "On real programs"): at most 3.4 % in the
# first 20 steps (pytorch/examples mnist, the loss right after Adadelta's first step; the dcgan
# GAN 2.3 %), 10 % at steps 20-39 (a CNN memorising 64 images, SGD momentum 0.9); the bounds
# leave a factor 1.5 over those. float16 keeps 3 more mantissa bits: 1 %, then 2 % (not measured
# on real programs here: no GPU).
_AMP_LOSS = {"float16": (1e-2, 2e-2), "bfloat16": (5e-2, 1.5e-1)}
_DTYPE_ALIASES = {
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
}
_TAGS = ("semantics", "tolerance", "numerics", "rng")

# Noise floor of a numerics-changing fix (docs/validation.md, "The noise floor"): the rewrite may be
# at most FLOOR_K times as far from the float32 original as the original itself run at the reduced
# precision (the reference run), plus the fp32 assert_close floor for values near zero. A correct
# rewrite reduces the precision of the same operations as the reference does, so its distance is
# the reference's or very near it (ratios up to 1.0 measured on the CPU); a mistake (a changed
# learning rate, a loss scaled twice, weights kept in bfloat16) moves the run by an amount
# unrelated to rounding: 25x the floor and more in the smallest one measured.
FLOOR_K = 4.0
# Fixes whose reduced precision is TF32 matmuls rather than autocast.
_TF32_CODES = frozenset({"TOP502"})


@dataclass(frozen=True)
class Precision:
    """What the harness applies to the original to measure the noise floor (the reference run)."""

    autocast: str | None = None  # "bfloat16" | "float16": the whole run inside one torch.autocast
    tf32: bool = False  # TF32 matmuls and convolutions

    def describe(self) -> str:
        parts = ([f"autocast {self.autocast}"] if self.autocast else []) + (["TF32"] if self.tf32 else [])
        return " + ".join(parts) or "nothing"

    def spec(self, device: str) -> dict:
        """The harness's ``precision`` entry (runner.RunOptions.precision)."""
        return {"autocast": self.autocast, "tf32": self.tf32, "device": "cuda" if device == "cuda" else "cpu"}


def precision_for(codes: Iterable[str], dtype: str, declared: Iterable[str] = ()) -> Precision:
    """The reduced precision that numerics fixes ``codes`` (rule codes) and declared ``numerics=``
    kinds (``bf16``, ``fp16``, ``tf32``; "" for a bare ``numerics``) stand for; ``dtype``: the
    autocast dtype of an AMP fix or a bare declaration."""
    codes, declared = set(codes), set(declared)
    autocast = None
    if codes - _TF32_CODES:
        autocast = dtype
    for d in declared:
        if d != "tf32":
            autocast = _DTYPE_ALIASES.get(d, dtype)
    return Precision(autocast=autocast, tf32=bool(codes & _TF32_CODES) or "tf32" in declared)


@dataclass(frozen=True)
class Bound:
    """The effective criterion for one probe (after kind- and step-specific adjustments)."""

    bitwise: bool
    rtol: float = 0.0
    atol: float = 0.0
    atol_relative: bool = False  # atol is a fraction of max|ref| (the AMP rows)
    rel_l2: float | None = None
    scale_fraction: float | None = None  # AMP losses: atol is this fraction of the loss scale
    floor: float | None = None  # noise floor: atol is this multiple of the reference distance (+ fp32 floor)

    def describe(self) -> str:
        if self.bitwise:
            return "bitwise"
        if self.floor is not None:
            return f"{self.floor:g}×ref ({self.atol:.3g})"
        if self.scale_fraction is not None:
            return f"{self.scale_fraction:g}·max|loss so far|"
        atol = f"{self.atol:g}·max|ref|" if self.atol_relative else f"{self.atol:g}"
        if self.rtol == float("inf"):
            return f"relL2≤{self.rel_l2:g}" if self.rel_l2 is not None else "reported (AMP: losses bound training)"
        text = f"rtol={self.rtol:g} atol={atol}"
        return text + (f" relL2≤{self.rel_l2:g}" if self.rel_l2 is not None else "")


@dataclass(frozen=True)
class Tolerance:
    """Acceptance criterion for a whole before/after comparison.

    ``rtol``/``atol``/``rel_l2`` apply to outputs, globals and returns; training probes (losses,
    params, optimizer state) may be loosened by ``step_rtol`` and losses by ``loss_rtol`` /
    ``late_loss_rtol`` (AMP rows: each loss of the first ``loss_window`` steps within that fraction
    of the largest loss so far, later ones within the late fraction).  Integer and bool tensors are
    always exact.
    """

    rtol: float
    atol: float
    bitwise: bool
    rel_l2: float | None = None
    reason: str = ""
    compare_values: bool = True  # False for un-replayed RNG changes: only structure is comparable
    atol_relative: bool = False
    step_rtol: float | None = None
    loss_rtol: float | None = None
    late_loss_rtol: float | None = None
    loss_window: int = 20
    allow_dtype_change: bool = False  # numerics may change a probe's dtype; recorded, not failed
    check_requires_grad: bool = True  # semantics fixes may change leaf-ness / requires_grad
    transplant: bool = False  # padded tensors are compared on their leading slice (transplant.py)
    tags: tuple[str, ...] = ()
    reference: Precision | None = None  # numerics: measure the noise floor with this reference run
    floor_k: float = FLOOR_K

    def floor_bound(self, ref_distance: float, ref_scale: float) -> Bound:
        """The noise-floor criterion of one probe: at most ``floor_k`` times the reference run's
        distance from the original, plus the fp32 floor (``ref_scale``: max|original|)."""
        return Bound(False, 0.0, self.floor_k * ref_distance + _FP32_ATOL + _FP32_RTOL * ref_scale, floor=self.floor_k)

    def bound(self, kind: str, step: int | None = None, trained: bool = False, scale: float | None = None) -> Bound:
        """The criterion for one probe of ``kind`` ("loss", "param", ...), at ``step`` for losses;
        ``trained``: both runs took optimizer steps (the outputs come from trained weights);
        ``scale``: for a loss, the largest loss of the original up to it (AMP rows)."""
        if self.bitwise:
            return Bound(bitwise=True)
        rtol, atol, rel_l2 = self.rtol, self.atol, self.rel_l2
        if kind in TRAINING_KINDS and self.step_rtol is not None:
            rtol = max(rtol, self.step_rtol)
        if kind == "loss" and self.loss_rtol is not None:
            late = step is not None and step >= self.loss_window and self.late_loss_rtol is not None
            frac = self.late_loss_rtol if late and self.late_loss_rtol is not None else self.loss_rtol
            if scale is None or not math.isfinite(scale):
                return Bound(False, frac, 0.0, False, None)  # a loss on its own: relative to itself
            return Bound(False, 0.0, frac * scale, False, None, scale_fraction=frac)
        if self.loss_rtol is not None and (kind in ("param", "optim", "global") or (kind == "output" and trained)):
            # AMP training state: after steps in lower precision, momentum and Adam moments drift by
            # more than any output bound while the losses agree. AMP training is bounded by its
            # losses, so parameters, optimizer state and the globals that hold or alias them (lists
            # of parameters, checkpoints) are reported (errors shown), not failed. The probe batch's
            # outputs after training come from those parameters, so they follow the same rule; an
            # inference program (no steps) keeps the output bound.
            return Bound(False, float("inf"), 0.0, False, None)
        return Bound(False, rtol, atol, self.atol_relative, rel_l2)

    def describe(self) -> str:
        if not self.compare_values:
            return "values not compared"
        if self.reference is not None:
            return f"{self.floor_k:g}× the noise floor (reference: {self.reference.describe()})"
        return self.bound("output").describe()


SAFE = Tolerance(0.0, 0.0, True, reason="safe fixes only: every probe must keep its bits")


def _for_tag(tag: str, dtype: str, replayed: bool) -> Tolerance:
    if tag == "semantics":
        return replace(
            SAFE, check_requires_grad=False, reason="semantics: values bitwise; leaf-ness and requires_grad may change"
        )
    if tag == "tolerance":
        return Tolerance(
            _FP32_RTOL,
            _FP32_ATOL,
            False,
            step_rtol=_STEP_RTOL,
            reason="tolerance: fp32 assert_close defaults; training probes rel 1e-5 "
            "(compile row, error compounds over steps)",
        )
    if tag == "numerics":
        rtol, atol_frac, rel_l2 = _AMP[dtype]
        early, late = _AMP_LOSS[dtype]
        return Tolerance(
            rtol,
            atol_frac,
            False,
            rel_l2=rel_l2,
            atol_relative=True,
            loss_rtol=early,
            late_loss_rtol=late,
            allow_dtype_change=True,
            reason=f"numerics ({dtype}): AMP row; losses within {early:.0%} of the largest loss so far "
            f"for the first 20 steps, {late:.0%} after; parameters, optimizer state and outputs after "
            "training reported",
        )
    if tag == "rng":
        if replayed:
            return replace(SAFE, reason="rng (replayed): random values replayed, rest bitwise")
        return replace(
            SAFE,
            bitwise=False,
            compare_values=False,
            reason="rng: random values come from another stream; without replay only "
            "structure (names, shapes, dtypes, loss count) is comparable",
        )
    raise ValueError(f"unknown fix tag {tag!r}; expected one of {list(_TAGS)}")


def _merge(a: Tolerance, b: Tolerance) -> Tolerance:
    """Loosest of two: numeric bounds of the looser one, flags each at their loosest."""
    if not a.tags:
        return b
    loose, other = (a, b) if _rank(a) >= _rank(b) else (b, a)
    return replace(
        loose,
        compare_values=a.compare_values and b.compare_values,
        allow_dtype_change=a.allow_dtype_change or b.allow_dtype_change,
        check_requires_grad=a.check_requires_grad and b.check_requires_grad,
        reason="; ".join(r for r in (loose.reason, other.reason) if r),
        tags=tuple(dict.fromkeys(a.tags + b.tags)),
    )


def _rank(t: Tolerance) -> int:
    """Looseness: values skipped > AMP (relative atol) > fp32 tolerance > bitwise."""
    if not t.compare_values:
        return 3
    return 2 if t.atol_relative else (1 if not t.bitwise else 0)


def tolerance_for(
    tags: Iterable[str], dtype: str | None = None, *, replayed: bool = False, reference: Precision | None = None
) -> Tolerance:
    """The tolerance a set of applied fix tags buys; no tags means bitwise.

    ``dtype`` picks the AMP row for ``numerics`` ("float16"/"bfloat16"; default bfloat16, the CPU
    autocast dtype).  ``replayed`` says the harness replayed recorded random values, so
    ``rng`` is held to bitwise instead of skipping value comparison. ``reference``: the reduced
    precision of the numerics fixes; their probes are then held to the noise floor it measures
    (the flat AMP bands remain as a fallback when that run fails, and as reported figures).
    """
    key = _DTYPE_ALIASES.get(str(dtype) if dtype is not None else "bfloat16")
    if key is None:
        raise ValueError(f"unknown autocast dtype {dtype!r}; expected float16 or bfloat16")
    result = SAFE
    for tag in dict.fromkeys(str(getattr(t, "value", t)) for t in tags):
        result = _merge(result, replace(_for_tag(tag, key, replayed), tags=(tag,)))
    if "numerics" in result.tags and result.compare_values:
        floor = reference or Precision(autocast=key)
        result = replace(
            result,
            reference=floor,
            reason=f"numerics ({key}): every probe within {FLOOR_K:g}× the distance of the original run with "
            f"{floor.describe()} from the original (its noise floor; should that run fail: "
            + result.reason.removeprefix(f"numerics ({key}): ")
            + ")",
        )
    return result
