"""The edits of TOP101's fix: the factory call that creates the tensor on the device, and the
check that no comment sits in a part of the code that call removes."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import drop_kwarg, keyword, set_kwarg
from torchopt.analysis.names import TorchRef
from torchopt.analysis.syntax import has_comments
from torchopt.codemods.device.factory_analysis import TrailingCall, _removed_has_comments
from torchopt.codemods.device.factory_tables import LEGACY, SPELLING
from torchopt.rewrite.rule import ImportSpec


def fix_drops_comment(
    node: cst.Call, inner: cst.Call, kind: str, dtype: cst.BaseExpression | None, same_device: bool
) -> bool:
    """A comment sits in a part of the code the fix removes or replaces."""
    existing = keyword(inner, "device")
    pin = keyword(inner, "pin_memory")
    dtype_kw = keyword(inner, "dtype") if dtype is not None else None
    return (
        _removed_has_comments(node)
        or (existing is not None and has_comments(existing.value))
        or (pin is not None and not same_device and has_comments(pin))
        or ((kind in LEGACY or kind == "from_numpy") and has_comments(inner.func))
        or (dtype_kw is not None and has_comments(dtype_kw.value))
    )


def moved_factory(
    inner: cst.Call, kind: str, ref: TorchRef | None, tr: TrailingCall, dev_expr: cst.BaseExpression, same_device: bool
) -> tuple[cst.Call, tuple[ImportSpec, ...]]:
    """The factory call with ``device=`` (and the folded ``dtype=``), and the imports it needs;
    legacy constructors and ``from_numpy`` become ``empty``/``as_tensor`` (``ref`` is set then)."""
    imports: tuple[ImportSpec, ...] = ()
    new = inner
    if kind == "from_numpy" or kind in LEGACY:
        assert ref is not None  # (reported without a fix before)
        imports = ref.imports
        new = new.with_changes(func=ref.attr("as_tensor" if kind == "from_numpy" else "empty"))
        if kind in LEGACY and (legacy_dtype := LEGACY[kind]) is not None:
            new = set_kwarg(new, "dtype", ref.attr(SPELLING[legacy_dtype]))
    if isinstance(dev_expr, cst.Call) and dev_expr is not tr.device and ref is not None:
        imports = ref.imports
    if keyword(inner, "pin_memory") is not None and not same_device:
        new = drop_kwarg(new, "pin_memory")
    before = ("requires_grad", "pin_memory")
    new = set_kwarg(new, "device", dev_expr, before=before)
    if tr.dtype is not None:
        new = set_kwarg(new, "dtype", tr.dtype, before=before)
    return new, imports
