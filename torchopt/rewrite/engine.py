"""Pure functions from source text to diagnostics and fixed text. No I/O, no torch.

One parse per pass; every enabled rule runs in one batched traversal; fixes that overlap wait for
the next pass; passes repeat until nothing changes (capped). The output of every pass is re-parsed
and compiled, and a pass that breaks either is rolled back and reported.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper

from torchopt.rewrite import budget, newsyntax, pyast, suppress
from torchopt.rewrite.config import Settings
from torchopt.rewrite.facts import SourceFacts, analysing
from torchopt.rewrite.positions import file_positions
from torchopt.rewrite.registry import all_rules, info_of
from torchopt.rewrite.rule import TAG_MEANING, Finding, Replacement, Rule, RuleContext, Safety
from torchopt.rewrite.style import Style
from torchopt.rewrite.textmap import TextMap

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
    cell: int | None = None  # in a notebook: the cell (1-based, all cells counted); line is then in the cell

    def sort_key(self) -> tuple:
        return (self.path, self.cell or 0, self.line, self.column, self.code)

    def to_json(self, edits: list[dict] | None = None) -> dict:
        """The diagnostic as a JSON object; ``edits`` (from ``fix_edits``) go with its fix."""
        d = asdict(self)
        if self.fix is not None:
            d["fix"] = {
                "safety": self.fix.safety,
                "title": self.fix.title,
                "tags": list(self.fix.tags),
                # what an unsafe fix changes, in words (a safe one changes no result)
                "changes": self.fix.changes() if self.fix.safety == "unsafe" else "",
            }
            if edits is not None:
                d["fix"]["edits"] = edits
        return d


@dataclass
class CheckResult:
    diagnostics: list[Diagnostic]


@dataclass
class FixResult:
    text: str
    applied: list[Diagnostic] = field(default_factory=list)  # positions in the original text
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
        return [rules[code] for code in sorted(codes) if could_match(rules, code, text)]


def could_match(rules: Mapping[str, type[Rule]], code: str, text: str) -> bool:
    """The engine's text test of one rule: its declared substrings, read from the registry's index
    (a rule whose substrings do not occur is not even imported), then its own ``could_match``."""
    return info_of(rules, code).declared_match(text) and rules[code].could_match(text)


def syntax_check(text: str) -> None:
    """For files no rule needs to parse: CPython's parser is fast and still reports broken files."""
    exc = pyast.parse(text)  # usually parsed already, by some rule's prefilter
    if isinstance(exc, SyntaxError):
        if budget.over_budget(text) is None:  # LibCST may read it: syntax of a newer Python?
            try:
                _refuse_newer_syntax(cst.parse_module(text), exc)
            except (cst.ParserSyntaxError, RecursionError, MemoryError):
                pass
        raise ParseError(_cpython_message(exc)) from None
    if isinstance(exc, BaseException):
        raise ParseError(f"cannot parse: {' '.join(str(exc).split()) or type(exc).__name__}") from None


def _cpython_message(exc: SyntaxError) -> str:
    col = f", column {exc.offset}" if exc.offset else ""
    return f"syntax error at line {exc.lineno}{col}: {exc.msg}"


def parse(text: str) -> cst.Module:
    # LibCST's native parser crashes the process on input it cannot survive: refuse that first
    refusal = budget.over_budget(text)
    if refusal is not None:
        raise ParseError(refusal)
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        # Where CPython (and ruff, and the user's editor) puts the error: LibCST's own position is
        # often the token after it, a line or more further on.
        cpython = pyast.parse(text)
        if isinstance(cpython, SyntaxError):
            raise ParseError(_cpython_message(cpython)) from None
        msg = " ".join(str(exc.message).split())
        raise ParseError(f"syntax error at line {exc.raw_line}, column {exc.raw_column + 1}: {msg}") from None
    except (RecursionError, MemoryError) as exc:  # pathological nesting
        raise ParseError(f"cannot parse: {type(exc).__name__}") from None
    python = pyast.parse(text)  # parsed already by the rules' prefilters
    if isinstance(python, SyntaxError):
        _refuse_newer_syntax(module, python)
    return module


def _refuse_newer_syntax(module: cst.Module, error: SyntaxError) -> None:
    """LibCST parsed what this Python cannot: a newer Python's syntax is said to be that."""
    why = newsyntax.needs_newer_python(module, error)
    if why is not None:
        raise ParseError(why)


@dataclass
class _Pass:
    module: cst.Module
    findings: list[tuple[Finding, Diagnostic]]
    positions: Mapping[cst.CSTNode, CodeRange]
    used: set[tuple[int, str]] = field(default_factory=set)  # (line, code) of suppressions that silenced a finding


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
    used: set[tuple[int, str]] = set()
    for f, also in one_per_problem(findings, positions):
        rng = positions[f.node]
        start, end = rng.start, rng.end
        code = f.rule.code
        hits = [suppress.matching(table, c, (start.line, end.line)) for c in (code, *also)]
        if any(hits):
            used.update(h for h in hits if h is not None)
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
    return _Pass(module=module, findings=out, positions=positions, used=used)


def one_per_problem(
    findings: list[Finding], positions: Mapping[cst.CSTNode, CodeRange]
) -> list[tuple[Finding, tuple[str, ...]]]:
    """Each finding with the codes that yielded to it, less the findings of a rule that yields
    (``Rule.yields_to``) to a rule reporting on the same span: two rules describing the same change
    on the same code give one finding, and a suppression of either code silences it."""
    if not any(f.rule.yields_to for f in findings):
        return [(f, ()) for f in findings]
    by_span: dict[tuple[int, int, int, int], set[str]] = {}
    spans = []
    for f in findings:
        r = positions[f.node]
        span = (r.start.line, r.start.column, r.end.line, r.end.column)
        spans.append(span)
        by_span.setdefault(span, set()).add(f.rule.code)
    out = []
    for f, span in zip(findings, spans):
        here = by_span[span]
        if here & f.rule.yields_to.keys():
            continue
        also = tuple(sorted(c for c in here if f.rule.code in all_rules()[c].yields_to))
        out.append((f, also))
    return out


def drop_yielded(diags: list[Diagnostic]) -> list[Diagnostic]:
    """``one_per_problem`` on diagnostics gathered from separate analyses (the language server's
    incremental check)."""
    rules = all_rules()
    spans: dict[tuple, set[str]] = {}
    for d in diags:
        spans.setdefault((d.path, d.line, d.column, d.end_line, d.end_column), set()).add(d.code)
    return [
        d
        for d in diags
        if not (spans[(d.path, d.line, d.column, d.end_line, d.end_column)] & rules[d.code].yields_to.keys())
    ]


def check_source(
    text: str, settings: Settings, path: str = "<stdin>", codes: Iterable[str] | None = None
) -> CheckResult:
    """Every diagnostic (fixable or not) for ``text``."""
    codes = settings.enabled_codes(path) if codes is None else frozenset(codes)
    with analysing(text):  # the prefilters, the syntax check and the rules share one SourceFacts
        rules = active_rules(codes, text)
        if not rules:
            syntax_check(text)
            return CheckResult(unused_suppressions(text, set(), codes, settings, path)[0])
        p = _run_rules(parse(text), rules, settings, path, text)
    diags = [d for _, d in p.findings] + unused_suppressions(text, p.used, codes, settings, path)[0]
    return CheckResult(sorted(diags, key=Diagnostic.sort_key))


def unused_suppressions(
    text: str, used: set[tuple[int, str]], codes: frozenset[str], settings: Settings, path: str
) -> tuple[list[Diagnostic], list[suppress.Unused]]:
    """The suppressions of ``text`` that silenced nothing in this run (``used``: those that did),
    as diagnostics of ``suppress.UNUSED_CODE`` when it is enabled, with their edits."""
    if suppress.UNUSED_CODE not in codes:
        return [], []
    rules = all_rules()
    found = suppress.unused(text, used, codes, lambda c: any(r.startswith(c) for r in rules))
    rule = rules[suppress.UNUSED_CODE]
    safe = settings.fix_is_safe(rule.code, True)
    fix = FixInfo(title=rule.fix_title or "", safety="safe" if safe else "unsafe")
    diags = [
        Diagnostic(rule.code, rule.name, u.message(), path, u.line, u.column + 1, u.line, u.end_column + 1, fix)
        for u in found
    ]
    return diags, found


def _remove_unused(
    result: FixResult,
    text: str,
    used: set[tuple[int, str]],
    codes: frozenset[str],
    settings: Settings,
    path: str,
    unsafe: bool,
    only: Callable[[Diagnostic], bool] | None,
) -> str:
    """The last step of a fix: the suppressions left unused go (a comment-only edit)."""
    diags, found = unused_suppressions(text, used, codes, settings, path)
    take = [i for i, d in enumerate(diags) if _applicable(d, unsafe) and (only is None or only(d))]
    result.remaining += [d for i, d in enumerate(diags) if i not in take]
    if not take:
        return text
    new = suppress.remove_unused(text, [found[i] for i in take])
    try:
        verify(new, path)
    except FixError as exc:
        raise FixError(f"fix by {suppress.UNUSED_CODE} produced invalid code ({exc}); file left unchanged") from None
    result.applied += [diags[i] for i in take]
    return new


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
    p: _Pass,
    unsafe: bool,
    only: Callable[[Diagnostic], bool] | None = None,
    original: Callable[[Diagnostic], Diagnostic] | None = None,
) -> list[tuple[Finding, Diagnostic]]:
    """Non-overlapping applicable fixes, outermost first; the rest wait for the next pass. A finding
    whose fix is the very edit of one chosen (same rule, same target, same replacement: one fix
    resolves several findings) comes along with it, so that it is counted as fixed. With
    ``original``, the diagnostics (those ``only`` sees, and those returned) are moved by it."""
    chosen: list[tuple[Finding, Diagnostic, tuple[int, int, int, int]]] = []
    riders: list[tuple[Finding, Diagnostic]] = []
    for f, d in p.findings:
        if not _applicable(d, unsafe):
            continue
        d = original(d) if original is not None else d
        if only is not None and not only(d):
            continue
        r = p.positions[f.target or f.node]
        span = (r.start.line, r.start.column + 1, r.end.line, r.end.column + 1)
        if any(_overlap(span, s) for _, _, s in chosen):
            if any(_same_edit(f, g) for g, _, _ in chosen):
                riders.append((f, d))
            continue
        chosen.append((f, d, span))
    return [(f, d) for f, d, _ in chosen] + riders


def _same_edit(f: Finding, g: Finding) -> bool:
    if f.rule is not g.rule or (f.target or f.node) is not (g.target or g.node) or f.imports != g.imports:
        return False
    a, b = f.fixed_node(), g.fixed_node()
    return a is b or (isinstance(a, cst.CSTNode) and isinstance(b, cst.CSTNode) and a.deep_equals(b))


def _overlap(span: tuple[int, int, int, int], other: tuple[int, int, int, int]) -> bool:
    start, end = (span[0], span[1]), (span[2], span[3])
    other_start, other_end = (other[0], other[1]), (other[2], other[3])
    return start < other_end and other_start < end


def _apply(module: cst.Module, chosen: list[tuple[Finding, Diagnostic]], style: Style) -> cst.Module:
    repl: dict[int, Replacement] = {}
    for f, _ in chosen:  # a finding riding on another's edit replaces the same node the same way
        fixed = f.fixed_node()
        if fixed is not None:
            repl.setdefault(id(f.target or f.node), fixed)
    new = module.visit(_Apply(repl))
    imports = [imp for f, _ in chosen for imp in f.imports]
    if imports:
        from torchopt.rewrite.imports import add_imports  # (fixes only: `check` never loads it)

        new = add_imports(new, imports, style)
    return new


def _to_original(d: Diagnostic, back: Sequence[TextMap]) -> Diagnostic:
    """``d``, found on a later pass's text, at its place in the original text. A place inside text
    an earlier fix wrote is named by where that fix's change starts."""
    from dataclasses import replace

    (line, column), (end_line, end_column) = (d.line, d.column), (d.end_line, d.end_column)
    for m in back:
        line, column = m.position(line, column)
        end_line, end_column = m.end_position(end_line, end_column)
    if (end_line, end_column) < (line, column):
        end_line, end_column = line, column
    return replace(d, line=line, column=column, end_line=end_line, end_column=end_column)


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
    used: set[tuple[int, str]] = set()
    back: list[TextMap] = []  # each later pass's text back to the one before it
    for n in range(MAX_PASSES + 1):
        with analysing(current):  # each pass's text has its own SourceFacts
            rules = active_rules(codes, current)
            if not rules:
                if n == 0:
                    syntax_check(current)
                break
            module = module or parse(current)
            p = _run_rules(module, rules, settings, path, current)
        remaining = [d for _, d in p.findings]  # on this pass's text
        # a later pass names its fixes by their place in the original text
        original = (lambda d, back=tuple(back): _to_original(d, back)) if back else None
        chosen = _choose(p, unsafe, only, original) if n < MAX_PASSES else []
        used = p.used
        if not chosen:
            result.remaining = remaining
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
            result.remaining = remaining
            break
        back.insert(0, TextMap(new_text, current))
        current = new_text
        # Re-parse from text so positions and metadata are fresh for the next pass.
        module = None
        used = set()
    result.text = _remove_unused(result, current, used, codes, settings, path, unsafe, only)
    return result


def fix_edits(text: str, settings: Settings, path: str, diag: Diagnostic) -> list[dict]:
    """The edits ``diag``'s fix makes to ``text`` (with the imports it needs), as ruff's JSON
    writes them: ``{"content", "location": {"row", "column"}, "end_location": {...}}``, 1-based,
    columns in characters, end exclusive. Found by making that one fix and comparing the texts."""
    import difflib

    after = fix_source(text, settings, path, unsafe=True, only=lambda d: d == diag).text
    old, new = text.splitlines(keepends=True), after.splitlines(keepends=True)
    edits = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        a, b = "".join(old[i1:i2]), "".join(new[j1:j2])
        head = len(os.path.commonprefix([a, b]))
        tail = len(os.path.commonprefix([a[head:][::-1], b[head:][::-1]]))
        start, end = _row_col(old, i1, a[:head]), _row_col(old, i1, a[: len(a) - tail])
        edits.append({"content": b[head : len(b) - tail], "location": start, "end_location": end})
    return edits


def _row_col(lines: list[str], first: int, before: str) -> dict:
    """The position after ``before``, text that starts at the beginning of line ``first`` (0-based)."""
    rows = before.split("\n")
    row = first + len(rows)
    column = len(rows[-1]) + 1
    return {"row": row, "column": column}
