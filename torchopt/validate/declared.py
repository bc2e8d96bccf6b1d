"""Classes of change a user declares (`--expect`) or that torchopt recognises in a hand-made edit.

`torchopt validate BEFORE AFTER --expect numerics=bf16` judges a change torchopt did not make with
the tolerance of that class, the same one torchopt's own fixes of the class get (docs/validation.md,
"Declared and inferred changes"). Without `--expect`, the two texts are compared with CPython's
`ast`: an edit that adds a `torch.autocast` region, switches TF32 on, asks for a fused or foreach
optimizer, or converts to channels-last is recognised, and its class is used and named with the
reason. Anything else is compared bitwise.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from torchopt.validate.command import Plan

__all__ = ["CLASSES", "KINDS", "Inferred", "parse", "split", "infer", "HOW_TO_DECLARE"]

CLASSES = ("numerics", "rng", "tolerance", "semantics")
KINDS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16", "tf32": "tf32"}
HOW_TO_DECLARE = (
    "if the change is meant to alter the numbers, declare its class: "
    "--expect numerics[=bf16|fp16|tf32] | rng | tolerance | semantics"
)


def parse(values: Iterable[str]) -> list[str]:
    """Normalised `--expect` values (``numerics=bf16``, ``tolerance``, ...); ValueError names a bad one."""
    out = []
    for raw in values:
        for value in raw.split(","):
            name, _, kind = value.strip().lower().partition("=")
            if name not in CLASSES:
                raise ValueError(f"--expect {value!r}: expected one of {', '.join(CLASSES)}")
            if kind and (name != "numerics" or kind not in KINDS):
                raise ValueError(f"--expect {value!r}: only numerics takes a kind (bf16, fp16 or tf32)")
            out.append(f"numerics={KINDS[kind]}" if kind else name)
    return list(dict.fromkeys(out))


def split(declared: Sequence[str]) -> tuple[set[str], list[str]]:
    """(classes, numerics kinds) of normalised declarations: ``["numerics=bf16", "rng"]`` ->
    ``({"numerics", "rng"}, ["bf16"])``; a bare ``numerics`` is the kind "" (autocast in the
    device's default dtype)."""
    classes, kinds = set(), []
    for d in declared:
        name, _, kind = d.partition("=")
        classes.add(name)
        if name == "numerics":
            kinds.append(kind)
    return classes, kinds


@dataclass(frozen=True)
class Inferred:
    """A class recognised in a hand-made edit, and why."""

    declared: str  # as --expect would say it
    reason: str


def _name(node: ast.AST) -> str:
    """`torch.cuda.amp.autocast` for an attribute chain, `autocast` for a name, "" otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _autocast_kind(call: ast.Call) -> str:
    for kw in call.keywords:
        if kw.arg == "dtype":
            text = _name(kw.value).rsplit(".", 1)[-1]
            return KINDS.get(text, "")
    name = _name(call.func)
    return "fp16" if ".cuda." in f".{name}" else ("bf16" if ".cpu." in f".{name}" else "")


def _true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _features(text: str) -> Counter:
    """What the recognisers look for, counted: autocast regions by kind, TF32 switches, fused or
    foreach optimizers, channels-last conversions, gradient scalers."""
    found: Counter = Counter()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                ctx = item.context_expr
                if isinstance(ctx, ast.Call) and _name(ctx.func).rsplit(".", 1)[-1] == "autocast":
                    found[("autocast", _autocast_kind(ctx))] += 1
        elif isinstance(node, ast.Assign) and _true(node.value):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "allow_tf32":
                    found[("tf32", "allow_tf32")] += 1
        elif isinstance(node, ast.Call):
            name = _name(node.func).rsplit(".", 1)[-1]
            if name == "set_float32_matmul_precision" and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and arg.value in ("high", "medium"):
                    found[("tf32", "set_float32_matmul_precision")] += 1
            if name == "GradScaler":
                found[("scaler", "")] += 1
            for kw in node.keywords:
                if kw.arg in ("fused", "foreach") and _true(kw.value):
                    found[("fused", kw.arg)] += 1
                if kw.arg == "memory_format" and _name(kw.value).endswith("channels_last"):
                    found[("channels_last", "")] += 1
    return found


def infer(before: str, after: str) -> list[Inferred]:
    """The classes of the recognisable edits that turn ``before`` into ``after``; [] when none (or
    when either does not parse). Only what AFTER adds counts: a region BEFORE already had is
    part of the program, not of the change."""
    try:
        added = _features(after) - _features(before)
    except (SyntaxError, ValueError, RecursionError):
        return []
    out: list[Inferred] = []
    regions = [(kind, n) for (what, kind), n in added.items() if what == "autocast"]
    if regions:
        kinds = sorted({k for k, _ in regions if k})
        kind = kinds[0] if len(kinds) == 1 else ""
        n = sum(n for _, n in regions)
        dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(kind, "the device's default dtype")
        out.append(Inferred(f"numerics={kind}" if kind else "numerics", f"AFTER adds {n} autocast region(s) ({dtype})"))
    elif added[("scaler", "")]:
        out.append(Inferred("numerics=fp16", "AFTER adds a GradScaler (float16 mixed precision)"))
    tf32 = [k for (what, k) in added if what == "tf32"]
    if tf32:
        out.append(Inferred("numerics=tf32", f"AFTER switches TF32 on ({', '.join(sorted(tf32))})"))
    tolerant = [f"{k}=True" for (what, k) in added if what == "fused"]
    if added[("channels_last", "")]:
        tolerant.append("memory_format=torch.channels_last")
    if tolerant:
        out.append(Inferred("tolerance", f"AFTER asks for other kernels ({', '.join(sorted(tolerant))})"))
    return out


def inferred(plan: "Plan", after_path: str | None) -> list[str]:
    """Two files that torchopt's fixes do not explain: the classes of the recognisable edits
    (infer), each said in the notes with its reason; else a note on how to declare one."""
    if after_path is None or plan.applied or plan.before == plan.after:
        return []
    found = infer(plan.before, plan.after)
    plan.notes[:] = [n for n in plan.notes if not n.startswith("two files given")]
    if not found:
        plan.notes.append(
            "two files given: compared bitwise (no torchopt fix explains the difference and no recognisable "
            f"edit was found); {HOW_TO_DECLARE}"
        )
        return []
    for f in found:
        plan.notes.append(f"inferred --expect {f.declared}: {f.reason} (declare the class with --expect to override)")
    return [f.declared for f in found]
