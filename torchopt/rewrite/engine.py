"""Pure functions from source text to diagnostics and fixed text. No I/O, no torch.

One parse per pass; every enabled rule runs in one batched traversal; fixes that overlap wait for
the next pass; passes repeat until nothing changes (capped). The output of every pass is re-parsed
and compiled, and a pass that breaks either is rolled back and reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Mapping

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper

from torchopt.rewrite import budget, pyast, suppress
from torchopt.rewrite.config import Settings
from torchopt.rewrite.facts import SourceFacts, analysing
from torchopt.rewrite.positions import file_positions
from torchopt.rewrite.registry import all_rules
from torchopt.rewrite.rule import TAG_MEANING, Finding, Replacement, Rule, RuleContext, Safety
from torchopt.rewrite.style import Style

MAX_PASSES = 8

# Importing the engine leaves LibCST as it is: the entry points install the faster LibCST internals
# explicitly (torchopt.rewrite.speedups.install), and the engine gives the same results either way.


class ParseError(Exception):
    """The source does not parse; message is one line with the position."""


class FixError(Exception):
    """A fix produced code that does not parse or compile; nothing is written."""


@dataclass(frozen=True)
class FixInfo:
    title: str
    safety: str  # "safe" | "unsafe"
    tags: tuple[str, ...] = ()
    note: str = ""

    def changes(self) -> str:
        """What an unsafe fix changes, in words."""
        from torchopt.rewrite.rule import Tag

        parts = [f"{t}: {TAG_MEANING[Tag(t)]}" for t in self.tags]
        if self.note:
            parts.append(self.note)
        return "; ".join(parts)


@dataclass(frozen=True)
class Diagnostic:
    code: str
    name: str
    message: str
    path: str
    line: int
    column: int  # 1-based, in characters
    end_line: int
    end_column: int
    fix: FixInfo | None = None

    def sort_key(self) -> tuple:
        return (self.path, self.line, self.column, self.code)

    def to_json(self) -> dict:
        d = asdict(self)
        if self.fix is not None:
            d["fix"] = {
                "safety": self.fix.safety,
                "title": self.fix.title,
                "tags": list(self.fix.tags),
                "changes": self.fix.changes() if self.fix.safety == "unsafe" else "",
            }
        return d


@dataclass
class CheckResult:
    diagnostics: list[Diagnostic]


@dataclass
class FixResult:
    text: str
    applied: list[Diagnostic] = field(default_factory=list)  # positions refer to the pass they were applied in
    remaining: list[Diagnostic] = field(default_factory=list)  # on the final text
    passes: int = 0

    @property
    def unsafe_hidden(self) -> list[Diagnostic]:
        return [d for d in self.remaining if d.fix is not None and d.fix.safety == "unsafe"]


def active_rules(codes: Iterable[str], text: str | None = None) -> list[type[Rule]]:
    """Enabled rules that could match ``text`` by their cheap text test (``Rule.could_match``: the
    ``prefilter``/``requires`` substrings or an override); all of them when ``text`` is None.
    A file no rule could match is never parsed by LibCST (only syntax-checked by CPython)."""
    rules = all_rules()
    if text is None:
        return [rules[code] for code in sorted(codes)]
    with analysing(text):  # every rule's test reads the same SourceFacts (one CPython parse)
        return [rules[code] for code in sorted(codes) if rules[code].could_match(text)]


def syntax_check(text: str) -> None:
    """For files no rule needs to parse: CPython's parser is fast and still reports broken files."""
    exc = pyast.parse(text)  # usually parsed already, by some rule's prefilter
    if isinstance(exc, SyntaxError):
        col = f", column {exc.offset}" if exc.offset else ""
        raise ParseError(f"syntax error at line {exc.lineno}{col}: {exc.msg}") from None
    if isinstance(exc, BaseException):
        raise ParseError(f"cannot parse: {' '.join(str(exc).split()) or type(exc).__name__}") from None


def parse(text: str) -> cst.Module:
    # LibCST's native parser crashes the process on input it cannot survive: refuse that first
    refusal = budget.over_budget(text)
    if refusal is not None:
        raise ParseError(refusal)
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        msg = " ".join(str(exc.message).split())
        raise ParseError(f"syntax error at line {exc.raw_line}, column {exc.raw_column + 1}: {msg}") from None
    except (RecursionError, MemoryError) as exc:  # pathological nesting
        raise ParseError(f"cannot parse: {type(exc).__name__}") from None


@dataclass
class _Pass:
    module: cst.Module
    findings: list[tuple[Finding, Diagnostic]]
    positions: Mapping[cst.CSTNode, CodeRange]


def _run_rules(module: cst.Module, rules: list[type[Rule]], settings: Settings, path: str, text: str) -> _Pass:
    with analysing(text, module) as facts:
        return _run_rules_on(facts, module, rules, settings, path)


def _run_rules_on(
    facts: SourceFacts, module: cst.Module, rules: list[type[Rule]], settings: Settings, path: str
) -> _Pass:
    text = facts.text
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    findings: list[Finding] = []
    visitors = []
    for rule in rules:
        ctx = RuleContext(
            module=module,
            options=settings.options_for(rule.code),
            device_names=settings.device_names,
            path=path,
            findings=findings,
            text=text,
            facts=facts,
        )
        visitors.append(rule(ctx))
    if visitors:
        wrapper.visit_batched(visitors)
    # the statements holding reported nodes (and the nodes their fixes replace) are generated, not the file
    positions = file_positions(facts, wrapper) if findings else {}
    table = suppress.parse(text)
    out: list[tuple[Finding, Diagnostic]] = []
    for f in findings:
        rng = positions[f.node]
        start, end = rng.start, rng.end
        code = f.rule.code
        if suppress.is_suppressed(table, code, (start.line, end.line)):
            continue
        fix = None
        if f.replacement is not None and f.safety is not Safety.DISPLAY:
            safe = settings.fix_is_safe(code, f.safety is Safety.SAFE)
            fix = FixInfo(
                title=f.fix_title or "",
                safety="safe" if safe else "unsafe",
                tags=tuple(t.value for t in f.tags),
                note=f.note,
            )
        diag = Diagnostic(
            code=code,
            name=f.rule.name,
            message=f.message,
            path=path,
            line=start.line,
            column=start.column + 1,
            end_line=end.line,
            end_column=end.column + 1,
            fix=fix,
        )
        out.append((f, diag))
    out.sort(key=lambda fd: fd[1].sort_key())
    return _Pass(module=module, findings=out, positions=positions)


def check_source(
    text: str, settings: Settings, path: str = "<stdin>", codes: Iterable[str] | None = None
) -> CheckResult:
    """Every diagnostic (fixable or not) for ``text``."""
    codes = settings.enabled_codes(path) if codes is None else codes
    with analysing(text):  # the prefilters, the syntax check and the rules share one SourceFacts
        rules = active_rules(codes, text)
        if not rules:
            syntax_check(text)
            return CheckResult([])
        p = _run_rules(parse(text), rules, settings, path, text)
    return CheckResult([d for _, d in p.findings])


def _applicable(diag: Diagnostic, unsafe: bool) -> bool:
    return diag.fix is not None and (diag.fix.safety == "safe" or unsafe)


class _Apply(cst.CSTTransformer):
    def __init__(self, replacements: dict[int, Replacement]) -> None:
        super().__init__()
        self.replacements = replacements

    def on_visit(self, node: cst.CSTNode) -> bool:
        return id(node) not in self.replacements

    def on_leave(self, original_node, updated_node):
        return self.replacements.get(id(original_node), updated_node)


def _choose(
    p: _Pass, unsafe: bool, only: Callable[[Diagnostic], bool] | None = None
) -> list[tuple[Finding, Diagnostic]]:
    """Non-overlapping applicable fixes, outermost first; the rest wait for the next pass."""
    chosen: list[tuple[Finding, Diagnostic, tuple[int, int, int, int]]] = []
    for f, d in p.findings:
        if not _applicable(d, unsafe) or (only is not None and not only(d)):
            continue
        r = p.positions[f.target or f.node]
        span = (r.start.line, r.start.column + 1, r.end.line, r.end.column + 1)
        if any(_overlap(span, s) for _, _, s in chosen):
            continue
        chosen.append((f, d, span))
    return [(f, d) for f, d, _ in chosen]


def _overlap(span: tuple[int, int, int, int], other: tuple[int, int, int, int]) -> bool:
    start, end = (span[0], span[1]), (span[2], span[3])
    other_start, other_end = (other[0], other[1]), (other[2], other[3])
    return start < other_end and other_start < end


def _apply(module: cst.Module, chosen: list[tuple[Finding, Diagnostic]], style: Style) -> cst.Module:
    repl = {id(f.target or f.node): f.replacement for f, _ in chosen if f.replacement is not None}
    new = module.visit(_Apply(repl))
    imports = [imp for f, _ in chosen for imp in f.imports]
    if imports:
        from torchopt.rewrite.imports import add_imports  # (fixes only: `check` never loads it)

        new = add_imports(new, imports, style)
    return new


def verify(text: str, path: str) -> None:
    """The output must parse with LibCST and compile with CPython."""
    try:
        cst.parse_module(text)
        compile(text, path, "exec", dont_inherit=True)
    except (cst.ParserSyntaxError, SyntaxError, ValueError) as exc:
        raise FixError(" ".join(str(exc).split())) from None


def fix_source(
    text: str,
    settings: Settings,
    path: str = "<stdin>",
    unsafe: bool | None = None,
    codes: Iterable[str] | None = None,
    only: Callable[[Diagnostic], bool] | None = None,
) -> FixResult:
    """Apply fixes until a fix-point. Safe fixes always; unsafe ones when ``unsafe`` (default: the
    settings' ``unsafe_fixes``). Raises ParseError for bad input, FixError if a pass breaks the code.
    ``only`` (the language server's quick fix for one diagnostic): apply only the fixes whose
    diagnostic it accepts."""
    unsafe = settings.unsafe_fixes if unsafe is None else unsafe
    codes = settings.enabled_codes(path) if codes is None else frozenset(codes)
    result = FixResult(text=text)
    current = text
    module: cst.Module | None = None
    for n in range(MAX_PASSES + 1):
        with analysing(current):  # each pass's text has its own SourceFacts
            rules = active_rules(codes, current)
            if not rules:
                if n == 0:
                    syntax_check(current)
                break
            module = module or parse(current)
            p = _run_rules(module, rules, settings, path, current)
        chosen = _choose(p, unsafe, only) if n < MAX_PASSES else []
        if not chosen:
            result.remaining = [d for _, d in p.findings]
            break
        new_module = _apply(p.module, chosen, settings.style)
        from torchopt.rewrite.layout import restyle  # (fixes only: `check` never loads it)

        new_text = restyle(current, new_module.code, settings.style, new_module.default_indent)
        try:
            verify(new_text, path)
        except FixError as exc:
            rules_used = ", ".join(sorted({d.code for _, d in chosen}))
            raise FixError(f"fix by {rules_used} produced invalid code ({exc}); file left unchanged") from None
        result.applied.extend(d for _, d in chosen)
        result.passes = n + 1
        if new_text == current:
            result.remaining = [d for _, d in p.findings]
            break
        current = new_text
        # Re-parse from text so positions and metadata are fresh for the next pass.
        module = None
    result.text = current
    return result
