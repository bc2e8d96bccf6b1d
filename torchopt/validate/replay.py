"""Record/replay for fixes that change the random stream (docs/validation.md, "Record/replay").

Such a fix draws its numbers elsewhere (on the device's generator, or in another dtype), so the
two runs cannot agree bitwise. To still compare everything else, each such site is wrapped:

    before:  __torchopt_site__("s0", lambda: torch.rand(3).cuda())
    after:   __torchopt_site__("s0", lambda: torch.rand(3, device='cuda'), lambda: torch.rand(3).cuda())

The rewritten run evaluates the new expression under a forked RNG state (so no generator moves),
checks that it has the original's shape, dtype and device and plausible moments, then returns the
value of the original expression: the baseline's numbers, drawn from the baseline's generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

SITE = "__torchopt_site__"


@dataclass(frozen=True)
class Site:
    id: str
    line: int
    column: int
    code: str  # the original expression


def _span(d) -> tuple[int, int, int, int]:
    return (d.line, d.column - 1, d.end_line, d.end_column - 1)


class _Wrap(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, spans: dict[tuple[int, int, int, int], str], module: cst.Module) -> None:
        super().__init__()
        self.spans = spans
        self.module = module
        self.sites: list[Site] = []
        self.positions: Mapping[cst.CSTNode, Any] = {}

    def on_leave(self, original_node, updated_node):
        pos = self.positions.get(original_node)
        if pos is None or not isinstance(updated_node, cst.BaseExpression):
            return updated_node
        key = (pos.start.line, pos.start.column, pos.end.line, pos.end.column)
        site_id = self.spans.pop(key, None)
        if site_id is None:
            return updated_node
        self.sites.append(Site(site_id, pos.start.line, pos.start.column + 1, self.module.code_for_node(original_node)))
        return cst.Call(
            func=cst.Name(SITE),
            args=[
                cst.Arg(cst.SimpleString(repr(site_id))),
                cst.Arg(cst.Lambda(params=cst.Parameters(), body=updated_node.with_changes(lpar=[], rpar=[]))),
            ],
            lpar=updated_node.lpar,
            rpar=updated_node.rpar,
        )


def wrap_sites(text: str, diagnostics) -> tuple[str, list[Site]]:
    """Wrap the nodes the given diagnostics point at; returns the new text and the sites."""
    spans = {_span(d): f"s{i}" for i, d in enumerate(diagnostics)}
    if not spans:
        return text, []
    module = cst.parse_module(text)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    t = _Wrap(spans, module)
    t.positions = wrapper.resolve(PositionProvider)
    new = module.visit(t)
    return new.code, t.sites


class _AddOriginal(cst.CSTTransformer):
    def __init__(self, originals: dict[str, str]) -> None:
        super().__init__()
        self.originals = originals

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if not (isinstance(updated_node.func, cst.Name) and updated_node.func.value == SITE):
            return updated_node
        first = updated_node.args[0].value if updated_node.args else None
        if not isinstance(first, cst.SimpleString) or len(updated_node.args) != 2:
            return updated_node
        code = self.originals.get(first.evaluated_value)  # type: ignore[arg-type]  # a bytes literal finds nothing, as it should
        if code is None:
            return updated_node
        orig = cst.Lambda(params=cst.Parameters(), body=cst.parse_expression(code))
        args = list(updated_node.args)
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        return updated_node.with_changes(args=[*args, cst.Arg(orig)])


def add_originals(after_text: str, sites: list[Site]) -> str:
    """Give every wrapped site of the rewritten text its original expression as a third argument."""
    if not sites:
        return after_text
    return cst.parse_module(after_text).visit(_AddOriginal({s.id: s.code for s in sites})).code


def unwrap_check(after_text: str, sites: list[Site]) -> list[str]:
    """Site ids that did not survive the rewrite (their fix was not applied there)."""
    return [s.id for s in sites if f"{SITE}({s.id!r}" not in after_text]
