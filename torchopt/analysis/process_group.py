"""Process-group facts: is the process group set up when a statement runs?

A rank test that reads the process group (``dist.get_rank()``, ``dist.is_initialized()``) only does
what it says once the group exists: before ``dist.init_process_group(...)``,
``deepspeed.init_distributed()`` or ``Accelerator()``, every process is still a lone process, so
``not dist.is_initialized() or dist.get_rank() == 0`` is true on all of them (and ``dist.get_rank()``
alone raises). :func:`process_group_at` answers, for any node, a :class:`PGState`:

* ``Setup.DONE``: every way the file reaches the node runs a setup call before it: one earlier in
  the same block or an enclosing one (an ``if`` counts when both branches set up), or a call of a
  function of the file that sets up unconditionally; a function's statement counts when every call
  site of the function (resolved through the program model, ``program.py``) is after the setup.
* ``Setup.NOT_YET``: it runs before any setup wherever the file tells: nothing that may set up
  runs before it in its function, and the function's entry is before the setup at the call sites
  the file shows (a spawned worker starts in a new process, the module starts without a group when
  the file is a script), no call site being known to run after a setup. ``PGState.setup_call``
  names the setup the program makes later (``deepspeed.init_distributed()``), for messages.
* ``Setup.UNKNOWN``: anything else: a setup under a condition (``if args.distributed:``), a call of
  a project helper of another file that may set up (``init_distributed_mode(args)``, read through
  the project index), a function referenced other than by a call, a method with no known caller.

Calls that may set up: the known setup calls (resolved through imports, never by spelling), the
file's functions that make one (transitively), and the project's functions whose summary says they
call one (``Unit.pg_setup``); library and builtin calls never do. Built once per file and kept in
its SourceFacts (``process_group_of(rule)``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import libcst as cst

from torchopt.analysis.names import bindings_of, dotted, qualified_names
from torchopt.analysis.project_summary import PG_SETUPS
from torchopt.analysis.program import Function, Program, program_of
from torchopt.analysis.syntax import walk
from torchopt.rewrite.rule import Rule

SETUPS = PG_SETUPS  # the calls that create the default process group
_SETUP_LAST = frozenset(q.rsplit(".", 1)[-1] for q in SETUPS)


class Setup(enum.Enum):
    DONE = "yes"
    NOT_YET = "no"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class PGState:
    setup: Setup
    setup_call: str | None = None  # NOT_YET: the setup the program makes later, as written


_DEFINITE, _MAY, _NONE = 2, 1, 0
_UNKNOWN = PGState(Setup.UNKNOWN)


class ProcessGroup:
    """See the module docstring."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.module = rule.ctx.module
        self.program: Program = program_of(rule)
        self._calls: dict[int, int] = {}
        self._stmts: dict[int, int] = {}
        self._functions: dict[int, int] = {}
        self._entries: dict[str, PGState] = {}
        self._at: dict[int, tuple[cst.CSTNode, PGState]] = {}
        self._pending: set[str] = set()
        self._written: list[str] = []
        self._script = self.program.entry.kind == "main-guard"
        self._setup_calls: list[cst.Call] = []
        # How the file may spell a setup: its name, or the alias it is imported as
        self._setup_spellings = set(_SETUP_LAST)
        for imp in walk(self.module, True):
            if isinstance(imp, (cst.Import, cst.ImportFrom)) and not isinstance(imp.names, cst.ImportStar):
                for alias in imp.names:
                    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                        self._setup_spellings.add(alias.asname.name.value)
        for n in walk(self.module, True):
            if isinstance(n, cst.Call) and self._is_setup(n):
                self._setup_calls.append(n)
                if self.program.function_of(n) is None:
                    self._script = True

    def parent(self, node: cst.CSTNode | None) -> cst.CSTNode | None:
        return self.program.parent(node)

    def _is_setup(self, call: cst.Call) -> bool:
        """A call of a known setup, resolved through the file's imports (``from accelerate import
        Accelerator``, ``import deepspeed``, ``import torch.distributed as dist``)."""
        func = call.func
        last = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
        if last not in self._setup_spellings:
            return False  # resolved only when the spelling may be one (an alias keeps the last part)
        while isinstance(func, cst.Attribute):
            func = func.value
        if not isinstance(func, cst.Name):
            return False  # `f(a)(b)`, a method of a call's result
        return not qualified_names(self.rule, call.func).isdisjoint(SETUPS)

    # ----------------------------------------------------------------- what a call or statement does
    def _call(self, call: cst.Call) -> int:
        hit = self._calls.get(id(call))
        if hit is None:
            self._calls[id(call)] = _NONE  # a recursive call: what the function does elsewhere decides
            hit = self._calls[id(call)] = self._classify(call)
        return hit

    def _classify(self, call: cst.Call) -> int:
        if not isinstance(call.func, (cst.Name, cst.Attribute)):
            return _NONE
        if self._is_setup(call):
            return _DEFINITE
        fn, _how = self.program.resolve_callable(call.func, call)
        if fn is not None:
            return self._function(fn)
        written = dotted(call.func)
        if written is None or written.partition(".")[0] not in self._imports():
            return _NONE  # a builtin, a local value's method: not the project's code
        from torchopt.analysis.project import Definition, Unknown, index_of

        got = index_of(self.rule).resolve(written)
        if isinstance(got, Unknown):
            return _MAY
        if isinstance(got, Definition) and got.kind in ("function", "class"):
            runs = index_of(self.rule).runs(got, "pg_setup")
            return _NONE if runs is False else _MAY
        return _NONE

    def _imports(self) -> dict:
        from torchopt.analysis.project import index_of

        return index_of(self.rule).own.imports

    def _function(self, fn: Function) -> int:
        key = id(fn.node)
        hit = self._functions.get(key)
        if hit is None:
            self._functions[key] = _NONE
            block = fn.node.body
            hit = self._functions[key] = self._block(block.body if isinstance(block, cst.IndentedBlock) else ())
        return hit

    def _block(self, body) -> int:
        out = _NONE
        for s in body:
            out = max(out, self._stmt(s))
            if out == _DEFINITE:
                break
        return out

    def _stmt(self, s: cst.CSTNode) -> int:
        hit = self._stmts.get(id(s))
        if hit is None:
            hit = self._stmts[id(s)] = self._statement(s)
        return hit

    def _statement(self, s: cst.CSTNode) -> int:
        if isinstance(s, (cst.FunctionDef, cst.ClassDef)):
            return _NONE  # a definition runs nothing (a decorator could: left alone)
        if isinstance(s, cst.If):
            test = self._expr(s.test)
            body = self._block(_body(s.body))
            other = self._stmt(s.orelse) if isinstance(s.orelse, cst.If) else self._block(_body(s.orelse))
            if test == _DEFINITE or (body == _DEFINITE and other == _DEFINITE):
                return _DEFINITE
            return max(test, body, other, _NONE) and _MAY
        if isinstance(s, cst.With):
            items = max((self._expr(i.item) for i in s.items), default=_NONE)
            return max(items, self._block(_body(s.body)))
        if isinstance(s, (cst.SimpleStatementLine, cst.BaseSmallStatement)):
            return self._expr(s)
        # loops (may not iterate), try (a handler may skip the rest), match: whatever they hold may run
        return _MAY if self._expr(s) else _NONE

    def _expr(self, node: cst.CSTNode) -> int:
        out = _NONE
        for n in walk(node, True):
            if isinstance(n, (cst.FunctionDef, cst.ClassDef, cst.Lambda)) and n is not node:
                continue
            if isinstance(n, cst.Call):
                out = max(out, self._call(n))
        return out

    # ----------------------------------------------------------------- program order
    def at(self, node: cst.CSTNode) -> PGState:
        """Whether the process group is set up when ``node`` runs (see the module docstring)."""
        hit = self._at.get(id(node))
        if hit is None or hit[0] is not node:
            hit = self._at[id(node)] = (node, self._state_at(node))
        return hit[1]

    def _state_at(self, node: cst.CSTNode) -> PGState:
        may = False
        below: cst.CSTNode = node
        cur = self.parent(node)
        while cur is not None:
            if isinstance(cur, (cst.IndentedBlock, cst.Module)):
                for s in cur.body:
                    if s is below:
                        break
                    k = self._stmt(s)
                    if k == _DEFINITE:
                        return PGState(Setup.DONE)
                    may = may or k == _MAY
            elif isinstance(cur, cst.Try) and below is not cur.body:
                may = may or bool(self._block(_body(cur.body)))  # a handler or else: the body ran first, partly
            elif isinstance(cur, (cst.FunctionDef, cst.Lambda)):
                break
            below, cur = cur, self.parent(cur)
        if may:
            return _UNKNOWN
        if isinstance(cur, cst.FunctionDef):
            fn = self.program.function_of(cur.body)
            entry = self._entry(fn) if fn is not None and fn.node is cur else _UNKNOWN
        elif cur is None:
            entry = PGState(Setup.NOT_YET) if self._script else _UNKNOWN
        else:
            entry = _UNKNOWN
        if entry.setup is Setup.NOT_YET:
            here = self._later_setup(node)
            if here is not None or entry.setup_call is None:
                entry = PGState(Setup.NOT_YET, here or self._first_setup())
        return entry

    def _entry(self, fn: Function) -> PGState:
        """The state when ``fn`` starts, from its call sites."""
        hit = self._entries.get(fn.qualname)
        if hit is not None:
            return hit
        if fn.qualname in self._pending:
            return _UNKNOWN
        self._pending.add(fn.qualname)
        try:
            got = self._entry_from_callers(fn)
        finally:
            self._pending.discard(fn.qualname)
        self._entries[fn.qualname] = got
        return got

    def _entry_from_callers(self, fn: Function) -> PGState:
        if not fn.callers or self._referenced_otherwise(fn):
            return _UNKNOWN
        states: list[PGState] = []
        for edge in fn.callers:
            if edge.how == "spawn":
                states.append(PGState(Setup.NOT_YET))  # a new process: no group until it makes one
                continue
            states.append(self.at(edge.call))
        if all(s.setup is Setup.DONE for s in states):
            return PGState(Setup.DONE)
        if any(s.setup is Setup.DONE for s in states):
            return _UNKNOWN  # before the setup on one path, after it on another
        early = [s for s in states if s.setup is Setup.NOT_YET]
        if early:
            named = [s for s in early if s.setup_call is not None]
            return named[0] if named else early[0]
        return _UNKNOWN

    def _referenced_otherwise(self, fn: Function) -> bool:
        """``fn`` is named other than in the calls of its edges (a callback, a bound method handed on):
        it may run from code the file does not show."""
        name = fn.name
        if name.startswith("__") and name != "__init__":
            return True  # called by Python itself
        edges = {id(e.call.func) for e in fn.callers} | {
            id(e.call.args[0].value) for e in fn.callers if e.how == "spawn" and e.call.args
        }
        for n in self.program.nodes:
            if not isinstance(n, cst.Name) or n.value != name or n is fn.node.name or id(n) in edges:
                continue
            parent = self.parent(n)
            if isinstance(parent, cst.Attribute) and parent.attr is n:
                if id(parent) in edges or fn.cls is None:
                    continue  # the method call of an edge; another object's attribute
                return True  # `self.log` handed on
            if fn.cls is None and any(getattr(a, "node", None) is fn.node for a in bindings_of(self.rule, n) or ()):
                return True
        return False

    def _later_setup(self, node: cst.CSTNode) -> str | None:
        """The first setup call after ``node`` in its function (or module level), as written."""
        fn = self.program.function_of(node)
        pos = self._line(node)
        for c in self.program.nodes:  # in text order
            if isinstance(c, cst.Call) and self.program.function_of(c) is fn and self._line(c) > pos:
                if self._call(c) == _DEFINITE:
                    return _written(c)
        return None

    def _first_setup(self) -> str | None:
        return _written(self._setup_calls[0]) if self._setup_calls else None

    def _line(self, node: cst.CSTNode) -> int:
        from libcst.metadata import PositionProvider

        return self.rule.get_metadata(PositionProvider, node).start.line


def _written(call: cst.Call) -> str | None:
    func = dotted(call.func)
    return f"{func}()" if func else None


def _body(suite: cst.CSTNode | None) -> tuple:
    if suite is None:
        return ()
    if isinstance(suite, (cst.Else, cst.Finally)):
        suite = suite.body
    if isinstance(suite, cst.IndentedBlock):
        return tuple(suite.body)
    if isinstance(suite, cst.SimpleStatementSuite):
        return tuple(suite.body)
    return ()


def process_group_of(rule: Rule) -> ProcessGroup:
    """The file's process-group facts, made once per analysed text and kept in its SourceFacts."""
    make: Callable[[], ProcessGroup] = lambda: ProcessGroup(rule)  # noqa: E731
    found = rule.ctx.facts.about_node(("process group",), rule.ctx.module, make)
    found.rule = rule
    return found


def process_group_at(rule: Rule, node: cst.CSTNode) -> PGState:
    """Whether the process group is set up when ``node`` runs: see :class:`PGState`."""
    return process_group_of(rule).at(node)
