"""Record/replay for fixes that change the random stream (docs/validation.md, "Record/replay").

Such a fix draws its numbers elsewhere (on the device's generator, or in another dtype), so the
two runs cannot agree bitwise. To still compare everything else, the rewritten text (exactly what
`torchopt rewrite` writes) gets each such site wrapped, after the rewrite, at the expression the
fix wrote:

    rewrite:     torch.rand(3, device='cuda')
    validated:   __torchopt_site__('s0', lambda: (torch.rand(3, device='cuda')), lambda: (torch.rand(3).cuda()))

The original runs as written. The rewritten run evaluates the new expression under a forked RNG
state (so no generator moves), checks that it has the original's shape, dtype and device and
plausible moments, then returns the value of the original expression: the baseline's numbers,
drawn from the baseline's generator. ``strip`` removes the wrapping again: what is validated is
the rewrite, character for character.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from torchopt.rewrite.textmap import LineIndex, TextMap

SITE = "__torchopt_site__"


@dataclass(frozen=True)
class Site:
    id: str
    line: int  # of the fix, in the original text
    column: int
    code: str  # the original expression
    path: str = ""  # of the file
    end: tuple[int, int] = (0, 0)  # line and column where the original expression ends


# Nodes a lambda would change the meaning of: assignment expressions bind in the lambda's scope,
# yield and await are not allowed there, and super() without arguments needs its function.
_NOT_IN_LAMBDA = (cst.NamedExpr, cst.Yield, cst.Await)
_SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)


@dataclass(frozen=True)
class _Expr:
    code: str
    why_not: str  # why it cannot be wrapped in a lambda ("" when it can)


class _Expressions(cst.CSTVisitor):
    """Every expression by its span (start and end offsets), with whether a lambda can hold it."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, module: cst.Module, index: LineIndex) -> None:
        super().__init__()
        self.module, self.index = module, index
        self.by_span: dict[tuple[int, int], _Expr] = {}
        self.scopes: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.BaseExpression):
            pos = self.get_metadata(PositionProvider, node)
            span = (
                self.index.offset(pos.start.line, pos.start.column + 1),
                self.index.offset(pos.end.line, pos.end.column + 1),
            )
            self.by_span.setdefault(span, _Expr(self.module.code_for_node(node), self._why_not(node)))
        if isinstance(node, _SCOPES):
            self.scopes.append(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        if self.scopes and self.scopes[-1] is original_node:
            self.scopes.pop()

    def _why_not(self, node: cst.CSTNode) -> str:
        if self.scopes and isinstance(self.scopes[-1], cst.ClassDef):
            return "it is in a class body, whose names a function cannot see"
        inner = _Finder()
        node.visit(inner)
        return inner.why


class _Finder(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.why = ""

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, _NOT_IN_LAMBDA):
            self.why = f"it holds a {type(node).__name__} expression, which a function would change"
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "super":
            self.why = "it calls super(), which needs its method"
        return not self.why


def _expressions(text: str) -> dict[tuple[int, int], _Expr]:
    module = cst.parse_module(text)
    visitor = _Expressions(module, LineIndex(text))
    MetadataWrapper(module, unsafe_skip_copy=True).visit(visitor)
    return visitor.by_span


def _next_token(text: str, i: int, skip: str = " \t\r\n\\") -> str:
    while i < len(text) and text[i] in skip:
        i += 1
    return text[i : i + 1]


def _new_span(
    edit: TextMap, original: str, rewritten: str, ends: dict[int, list[int]], a1: int, a2: int
) -> tuple[int, int]:
    """Where the expression written in place of ``original[a1:a2]`` lies in ``rewritten`` ((-1, -1)
    when it cannot be told). It starts where the old one started, and it is followed by what
    followed the old one (the layout may add a trailing comma): the smallest such expression that
    reaches the old end's image. The character diff alone can pair the old closing parenthesis
    with one inside the new arguments."""
    b1, exact_start = edit.start(a1)
    if not exact_start:
        return -1, -1
    b2, exact_end = edit.end(a2)
    follows = _next_token(original, a2)
    for end in sorted(ends.get(b1, ())):
        if end < (b2 if exact_end else b1 + 1):
            continue
        nxt = _next_token(rewritten, end)
        if nxt == follows or (nxt == "," and _next_token(rewritten, end, " \t\r\n\\,") == follows):
            return b1, end
    return (b1, b2) if exact_end else (-1, -1)


def instrument(
    original: str, rewritten: str, fixes: Sequence[Any], prefix: str = "s"
) -> tuple[str, list[Site], list[tuple[Any, str]]]:
    """Wrap, in ``rewritten``, the expression each of ``fixes`` (diagnostics with positions in
    ``original``) wrote in place of an expression of ``original``. Returns the instrumented text,
    its sites (named ``prefix`` and a number), and the fixes that could not be wrapped with the
    reason. A fix inside the expression of another is covered by that one's site."""
    if not fixes:
        return rewritten, [], []
    old_index = LineIndex(original)
    old_exprs, new_exprs = _expressions(original), _expressions(rewritten)
    edit = TextMap(original, rewritten)
    spans: list[tuple[int, int, int, int, Any, _Expr]] = []
    refused: list[tuple[Any, str]] = []
    ends: dict[int, list[int]] = {}
    for start, end in new_exprs:
        ends.setdefault(start, []).append(end)
    for d in sorted(fixes, key=lambda d: (d.line, d.column, -d.end_line, -d.end_column)):
        a1, a2 = old_index.offset(d.line, d.column), old_index.offset(d.end_line, d.end_column)
        while a2 > a1 and original[a2 - 1] in " \t\r\n":
            a2 -= 1  # a span mapped back from a later pass can end past the line's end
        if any(s[0] <= a1 and a2 <= s[1] for s in spans):
            continue  # inside a site already wrapped
        old = old_exprs.get((a1, a2))
        b1, b2 = _new_span(edit, original, rewritten, ends, a1, a2)
        new = new_exprs.get((b1, b2))
        if old is None or new is None:
            refused.append((d, "its change is not one expression replaced by another"))
        elif old.why_not or new.why_not:
            refused.append((d, old.why_not or new.why_not))
        elif any(s[0] < a2 and a1 < s[1] for s in spans):
            refused.append((d, "its expression overlaps that of another random-stream fix"))
        else:
            spans.append((a1, a2, b1, b2, d, old))
    sites: list[Site] = []
    out = rewritten
    for i, (a1, a2, b1, b2, d, old) in sorted(enumerate(spans), key=lambda x: -x[1][2]):
        site = Site(f"{prefix}{i}", d.line, d.column, old.code, d.path, (d.end_line, d.end_column))
        sites.append(site)
        out = f"{out[:b1]}{SITE}({site.id!r}, lambda: ({out[b1:b2]}), lambda: ({old.code})){out[b2:]}"
    return out, sorted(sites, key=lambda s: (s.line, s.column)), refused


class _Sites(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[CodeRange, CodeRange]] = []  # (call, its first lambda)

    def visit_Call(self, node: cst.Call) -> bool:
        if isinstance(node.func, cst.Name) and node.func.value == SITE and len(node.args) >= 2:
            body = node.args[1].value
            if isinstance(body, cst.Lambda):
                self.found.append(
                    (self.get_metadata(PositionProvider, node), self.get_metadata(PositionProvider, body))
                )
                return False
        return True


def strip(text: str) -> str:
    """``text`` with every site call replaced by the expression it wraps: the rewrite as written."""
    module = cst.parse_module(text)
    visitor = _Sites()
    MetadataWrapper(module, unsafe_skip_copy=True).visit(visitor)
    index = LineIndex(text)

    def off(p: cst.metadata.CodePosition) -> int:
        return index.offset(p.line, p.column + 1)

    out = text
    for call, fn in sorted(visitor.found, key=lambda cb: -off(cb[0].start)):
        # `lambda: (NEW)` -> NEW, without the parentheses `instrument` added
        body = text[off(fn.start) : off(fn.end)].split(":", 1)[1].lstrip()
        out = out[: off(call.start)] + body[1:-1] + out[off(call.end) :]
    return out
