"""Incremental checking for the language server: after an edit, analyse only the part of the module
the edit can affect, and reuse earlier results for the rest.

The module is cut into its top-level statements (a def or class with its decorators is one chunk;
blank lines and comments go with the statement above). Chunks that only import, or that refer to no
name bound by a def, a class or another such chunk, form the *header*: every analysis sees them.
The other chunks are linked when one uses a name another binds (a call, a class used as a type, a
global assigned by a module-level statement); each connected group is checked on its own, as the
header followed by the group's chunks in their original order, with line numbers mapped back. A rule
that declares ``locality = "file"`` (it reads facts from anywhere in the file, like "this script calls
``init_process_group``") runs on the whole text instead.

Results are memoised by the text of each group, so an edit inside one function re-analyses only that
function's group. When the "file" rules must run again and the edited group holds most of the module
(a script whose ``main()`` reaches every function), the whole text is analysed once for every rule
instead: ``check_source`` itself, cheaper than both. Under a ``LiveScope`` (the language server) each
result also remembers what it read of other modules through the project index, and is kept only
while those facts hold. ``tests/test_incremental.py`` checks that the result equals ``check_source`` on every
fixture and rule example; ``benchmarks/incremental_audit.py`` does the same over a corpus.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from torchopt.rewrite import suppress
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import Diagnostic, active_rules, check_source, drop_yielded, parse, _run_rules
from torchopt.rewrite.facts import analysing
from torchopt.rewrite.projectscope import LiveScope, current_scope
from torchopt.rewrite.registry import all_rules

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


@dataclass(frozen=True)
class Chunk:
    start: int  # first line, 1-based
    end: int  # last line, inclusive
    binds: frozenset[str]
    refs: frozenset[str]
    kind: str  # "import" | "def" | "stmt"
    text: str = ""  # its lines, each ending in "\n"


def _binds(stmt: ast.stmt) -> set[str]:
    """Module-level names a top-level statement may bind (a superset)."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    out: set[str] = set()
    if isinstance(stmt, _DEFS):
        out.add(stmt.name)
        for n in ast.walk(stmt):  # `global X` inside binds X at module level
            if isinstance(n, ast.Global):
                out.update(n.names)
        return out
    stack: list[ast.AST] = [stmt]
    while stack:
        cur = stack.pop()
        if isinstance(cur, ast.Name) and isinstance(cur.ctx, (ast.Store, ast.Del)):
            out.add(cur.id)
        elif isinstance(cur, _DEFS):
            out.add(cur.name)  # a def nested in a top-level `if`/`try`
        elif isinstance(cur, (ast.Import, ast.ImportFrom)):
            out |= _binds(cur)
        elif isinstance(cur, ast.Global):
            out.update(cur.names)
        elif isinstance(cur, (ast.MatchAs, ast.MatchStar)) and cur.name:
            out.add(cur.name)
        elif isinstance(cur, ast.MatchMapping) and cur.rest:
            out.add(cur.rest)
        stack.extend(ast.iter_child_nodes(cur))
    return out


def _refs(stmt: ast.stmt) -> set[str]:
    """Every bare name used anywhere in the statement (a superset of the module-level names it reads)."""
    return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def _parse(text: str) -> list[ast.stmt] | None:
    try:
        return ast.parse(text).body
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None


def _cut(body: list[ast.stmt], lines: list[str], lo: int, hi: int, first_at_lo: bool) -> list[Chunk]:
    """Chunks of the statements ``body`` parsed from ``lines[lo:hi]`` (0-based, half-open): each from
    its first line (decorators included) to the line before the next one; the first starts at ``lo``
    when ``first_at_lo`` (the module's first chunk keeps the leading comments), the last ends at ``hi``."""
    starts: list[tuple[int, list[ast.stmt]]] = []
    for stmt in body:
        first = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", ())]) + lo
        if starts and first <= starts[-1][0]:
            starts[-1][1].append(stmt)  # `a = 1; b = 2` on one line
        elif starts and (starts[-1][1][-1].end_lineno or 0) + lo >= first:  # (ast.parse always sets it)
            starts[-1][1].append(stmt)  # a statement ending on the line the next one starts
        else:
            starts.append((first, [stmt]))
    chunks = []
    for i, (first, stmts) in enumerate(starts):
        start = lo + 1 if i == 0 and first_at_lo else first
        end = starts[i + 1][0] - 1 if i + 1 < len(starts) else hi
        binds: set[str] = set()
        refs: set[str] = set()
        for st in stmts:
            binds |= _binds(st)
            refs |= _refs(st)
        if all(isinstance(st, (ast.Import, ast.ImportFrom)) for st in stmts):
            kind = "import"
        elif any(isinstance(st, _DEFS) for st in stmts):
            kind = "def"
        else:
            kind = "stmt"
        body_text = "".join(line + "\n" for line in lines[start - 1 : end])
        chunks.append(Chunk(start, end, frozenset(binds), frozenset(refs), kind, body_text))
    return chunks


def split(text: str) -> list[Chunk] | None:
    """The top-level chunks of ``text``; None when it cannot be cut safely (does not parse, has a
    carriage return, or has no statements): the caller checks it whole."""
    if "\r" in text:
        return None
    body = _parse(text)
    if not body:
        return None
    lines = _lines(text)
    return _cut(body, lines, 0, len(lines), True)


def resplit(old_lines: list[str], old: list[Chunk], text: str) -> tuple[list[str], list[Chunk] | None]:
    """``split(text)`` computed from the previous text's lines and chunks: only the chunks the edit
    touches are parsed again (the rest are shifted). Falls back to ``split`` when the edited region
    does not parse on its own."""
    if "\r" in text:
        return [], None
    lines = _lines(text)
    n_old, n_new = len(old_lines), len(lines)
    p = 0
    limit = min(n_old, n_new)
    while p < limit and old_lines[p] == lines[p]:
        p += 1
    if p == n_old == n_new:
        return lines, old
    q = 0
    while q < limit - p and old_lines[n_old - 1 - q] == lines[n_new - 1 - q]:
        q += 1
    lo, hi = p, n_old - q  # changed old lines, 0-based half-open
    if lo == hi:  # a pure insertion: the chunks on both sides may take it
        lo, hi = max(0, lo - 1), min(n_old, hi + 1)
    touched = [i for i, c in enumerate(old) if c.start - 1 < hi and c.end > lo]
    if not touched or not old:
        return lines, split(text)
    a, b = touched[0], touched[-1]
    delta = n_new - n_old
    r0, r1 = old[a].start - 1, old[b].end + delta  # the region in new lines, 0-based half-open
    if r1 < r0:
        return lines, split(text)
    body = _parse("".join(line + "\n" for line in lines[r0:r1]))
    if body is None:
        return lines, split(text)
    before = list(old[:a])
    after = [replace(c, start=c.start + delta, end=c.end + delta) for c in old[b + 1 :]] if delta else old[b + 1 :]
    mid = _cut(body, lines, r0, r1, first_at_lo=(a == 0)) if body else []
    if mid and mid[0].start > r0 + 1 and before:
        # Lines before the region's first statement are comments or blank: the chunk above owns them.
        prev = before[-1]
        end = mid[0].start - 1
        before[-1] = replace(prev, end=end, text="".join(line + "\n" for line in lines[prev.start - 1 : end]))
    elif not mid:
        if before:
            prev = before[-1]
            before[-1] = replace(prev, end=r1, text="".join(line + "\n" for line in lines[prev.start - 1 : r1]))
        elif after:
            nxt = after[0]
            after[0] = replace(nxt, start=1, text="".join(line + "\n" for line in lines[0 : nxt.end]))
        else:
            return lines, None
    return lines, before + mid + after


def groups(chunks: list[Chunk]) -> tuple[list[int], list[list[int]]]:
    """(header chunk indexes, connected groups of the other chunks), each sorted by position."""
    defs = {i for i, c in enumerate(chunks) if c.kind == "def"}
    linked = set(defs)  # chunks that are not header
    changed = True
    while changed:  # a statement using a name bound by a linked chunk is linked too
        changed = False
        bound = set().union(*(chunks[i].binds for i in linked)) if linked else set()
        for i, c in enumerate(chunks):
            if i not in linked and c.kind == "stmt" and c.refs & bound:
                linked.add(i)
                changed = True
    header = [i for i in range(len(chunks)) if i not in linked]
    by_name: dict[str, list[int]] = {}
    for i in linked:
        for name in chunks[i].binds:
            by_name.setdefault(name, []).append(i)
    parent = {i: i for i in linked}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in linked:
        for name in chunks[i].refs:
            for j in by_name.get(name, ()):
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    comps: dict[int, list[int]] = {}
    for i in sorted(linked):
        comps.setdefault(find(i), []).append(i)
    return header, sorted(comps.values())


_LINE_REF = re.compile(r"\b(line )(\d+)\b")


@dataclass
class _Group:
    """One analysed group: its diagnostics as (member, line offset, end member, end offset,
    diagnostic in the group's own coordinates), and the last mapping to the document."""

    found: list[tuple[int, int, int, int, Diagnostic]]
    starts: tuple[int, ...] = ()
    mapped: list[tuple[int, Diagnostic]] = field(default_factory=list)  # (member, diagnostic)
    deps: list = field(default_factory=list)  # what it read of other files (LiveScope.recording)


@contextlib.contextmanager
def _reads(scope: LiveScope | None):
    """Record what an analysis reads of other files, when the scope is one whose files change."""
    if scope is None:
        yield []
        return
    with scope.recording() as deps:
        yield deps


def _map_refs(s: str, sizes: list[tuple[int, int]], starts: tuple[int, ...]) -> str:
    """Messages name other lines ("the training loop at line 42"): map those too."""
    if "line " not in s:
        return s

    def sub(m: re.Match) -> str:
        line = int(m.group(2))
        for k, (at, n) in enumerate(sizes):
            if at <= line < at + n:
                return m.group(1) + str(line - at + starts[k])
        return m.group(0)

    return _LINE_REF.sub(sub, s)


class Stale(Exception):
    """Raised by :meth:`IncrementalChecker.check` when its ``stale`` callback says the text is no
    longer wanted (the groups analysed so far stay remembered)."""


class IncrementalChecker:
    """``check_source`` with memory: call :meth:`check` with each new text of a document. Not
    thread-safe: one checker per document, used by one thread at a time."""

    def __init__(self, capacity: int = 512) -> None:
        self._memo: OrderedDict[tuple, _Group] = OrderedDict()
        self.capacity = capacity
        self._docs: OrderedDict[str, tuple[list[str], list[Chunk]]] = OrderedDict()
        self._settings: tuple[Settings, str | None, str] | None = None  # (settings, path, hash)
        self._codes: frozenset[str] = frozenset()
        self.last_misses = 0  # groups analysed by the last call (for tests and benchmarks)
        self.last_whole = False  # whether the last call ran the "file" rules on the whole text
        self.last_deps: list = []  # what the last call's results read of other files (LiveScope)
        self._scope: LiveScope | None = None  # the scope of the call under way, when its files change

    def _chunks(self, text: str, path: str) -> list[Chunk] | None:
        prev = self._docs.pop(path, None)
        if prev is None:
            chunks = split(text)
            lines = _lines(text) if chunks else []
        else:
            lines, chunks = resplit(prev[0], prev[1], text)
        if chunks:
            self._docs[path] = (lines, chunks)
            while len(self._docs) > 32:
                self._docs.popitem(last=False)
        return chunks

    def _group(
        self,
        key: tuple,
        chunks: list[Chunk],
        members: list[int],
        settings: Settings,
        path: str,
        codes: frozenset[str],
        stale: Callable[[], bool] | None = None,
    ) -> _Group:
        hit = self._hit(key)
        if hit is not None:
            return hit
        if stale is not None and stale():
            raise Stale
        self.last_misses += 1
        synth = "".join(chunks[i].text for i in members)
        bounds, at = [], 1
        for i in members:
            n = chunks[i].end - chunks[i].start + 1
            bounds.append((at, n))
            at += n

        def where(line: int) -> tuple[int, int]:
            for k, (first, n) in enumerate(bounds):
                if first <= line < first + n:
                    return k, line - first
            return -1, 0

        found = []
        with _reads(self._scope) as deps:
            part = _check_part(synth, settings, path, codes)
        for d in part:
            k, off = where(d.line)
            k2, off2 = where(d.end_line)
            if k >= 0 and k2 >= 0:
                found.append((k, off, k2, off2, d))
        return self._keep(key, _Group(found, deps=deps))

    def _hit(self, key: tuple) -> _Group | None:
        """The remembered result for ``key``, while what it read of other files still holds."""
        hit = self._memo.get(key)
        if hit is None:
            return None
        if hit.deps and self._scope is not None and not self._scope.unchanged(hit.deps):
            del self._memo[key]
            return None
        self._memo.move_to_end(key)
        self.last_deps += hit.deps
        return hit

    def _keep(self, key: tuple, group: _Group) -> _Group:
        self._memo[key] = group
        self.last_deps += group.deps
        if len(self._memo) > self.capacity:
            self._memo.popitem(last=False)
        return group

    def _whole(
        self,
        key: tuple,
        text: str,
        settings: Settings,
        path: str,
        codes: frozenset[str],
        stale: Callable[[], bool] | None,
    ) -> _Group:
        """``check_source`` of the whole text for ``codes``, remembered under ``key``."""
        hit = self._hit(key)
        if hit is None:
            if stale is not None and stale():
                raise Stale
            self.last_whole = True
            with _reads(self._scope) as deps:
                diags = check_source(text, settings, path, codes).diagnostics
            hit = self._keep(key, _Group([(0, 0, 0, 0, d) for d in diags], deps=deps))
        return hit

    @staticmethod
    def _mapped(group: _Group, chunks: list[Chunk], members: list[int]) -> list[tuple[int, Diagnostic]]:
        starts = tuple(chunks[i].start for i in members)
        if starts == group.starts:
            return group.mapped
        sizes = []
        at = 1
        for i in members:
            n = chunks[i].end - chunks[i].start + 1
            sizes.append((at, n))
            at += n
        out = []
        for k, off, k2, off2, d in group.found:
            fix = d.fix
            if fix is not None and ("line " in fix.title or "line " in fix.note):
                fix = replace(fix, title=_map_refs(fix.title, sizes, starts), note=_map_refs(fix.note, sizes, starts))
            out.append(
                (
                    members[k],
                    replace(
                        d,
                        line=starts[k] + off,
                        end_line=starts[k2] + off2,
                        message=_map_refs(d.message, sizes, starts),
                        fix=fix,
                    ),
                )
            )
        group.starts, group.mapped = starts, out
        return out

    def check(
        self,
        text: str,
        settings: Settings,
        path: str = "<stdin>",
        codes: Iterable[str] | None = None,
        stale: Callable[[], bool] | None = None,
    ) -> list[Diagnostic]:
        """Every diagnostic for ``text``: the same list ``check_source`` returns (sorted the same way).
        Raises ParseError for text that does not parse, and Stale when ``stale()`` turns true before
        a part of the text still to analyse (a newer text is waiting)."""
        from torchopt.rewrite.cache import settings_hash

        self.last_misses, self.last_whole = 0, False
        if self._settings is None or self._settings[0] is not settings or self._settings[1] != path:
            self._settings = (settings, path, settings_hash(settings))
            self._codes = frozenset(settings.enabled_codes(path))
        codes = self._codes if codes is None else frozenset(codes)
        scope = current_scope()
        self._scope = scope if isinstance(scope, LiveScope) else None
        self.last_deps = []
        base = (self._settings[2], path)
        # Results of the whole text are remembered by its hash (an undo finds them), not the text.
        whole_key = base + ("whole", codes, _digest(text))
        chunks = self._chunks(text, path)
        if chunks is None or len(chunks) < 2:
            return [d for *_, d in self._whole(whole_key, text, settings, path, codes, stale).found]
        rules = all_rules()
        file_codes = frozenset(c for c in codes if getattr(rules[c], "locality", "component") == "file")
        local_codes = codes - file_codes
        parts: list[tuple[list[int], tuple]] = []
        if local_codes:
            header, comps = groups(chunks)
            for members in [header] + [sorted(header + comp) for comp in comps]:
                if members:
                    parts.append((members, base + ("part", local_codes) + tuple(chunks[i].text for i in members)))
        out: list[Diagnostic] = []
        if file_codes and (active_rules(file_codes, text) or suppress.UNUSED_CODE in file_codes):
            key: tuple = base + ("file", file_codes, whole_key[-1])
            hit = self._hit(key)
            if hit is None:
                # The file rules analyse the whole text again: when a part to analyse again holds
                # most of it too (an edit in a connected program), one analysis of the whole text
                # for every rule costs less than both, and gives check_source's diagnostics by
                # definition. (Parts that are each a small share are analysed and remembered.)
                todo = [m for m, k in parts if self._hit(k) is None]
                if any(2 * sum(chunks[i].end - chunks[i].start + 1 for i in m) > chunks[-1].end for m in todo):
                    whole = self._whole(whole_key, text, settings, path, codes, stale)
                    return [d for *_, d in whole.found]
                hit = self._whole(key, text, settings, path, file_codes, stale)
            out += [d for *_, d in hit.found]
        if parts:
            # Findings in the header come from every group's analysis (a module-level DataLoader is
            # reported because a function of some group feeds the device from it), once each.
            heads = set(header)
            seen_head: set[Diagnostic] = set()
            for members, key in parts:
                group = self._group(key, chunks, members, settings, path, local_codes, stale)
                only_header = members is header
                for owner, d in self._mapped(group, chunks, members):
                    if owner in heads:
                        if d not in seen_head:
                            seen_head.add(d)
                            out.append(d)
                    elif not only_header:
                        out.append(d)
        out = drop_yielded(out)  # the rules that own a problem may have run in other groups
        out.sort(key=lambda d: d.sort_key())
        return out


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _check_part(text: str, settings: Settings, path: str, codes: frozenset[str]) -> list[Diagnostic]:
    with analysing(text):  # the prefilters and the rules share the text's SourceFacts
        rules = active_rules(codes, text)
        if not rules:
            return []
        return [d for _, d in _run_rules(parse(text), rules, settings, path, text).findings]
