"""TOP921: CUDA graphs through ``mode="reduce-overhead"`` on an existing compile;
TOP922: constraints of hand-made CUDA graphs (display-only)."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.syntax import walk


def _kept_outputs(module: cst.Module) -> cst.Call | None:
    """A ``list.append(x)`` of a bare tensor name/attribute/item (not a copy or a Python number)."""
    for node in walk(module, cross_scopes=True):
        if (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "append"
            and len(node.args) == 1
            and isinstance(node.args[0].value, (cst.Name, cst.Attribute, cst.Subscript))
        ):
            return node
    return None
