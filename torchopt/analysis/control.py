"""Control facts: how often a statement runs relative to the step loop, and what guards it.

* :meth:`Control.frequency` answers a :class:`Frequency` for any node: every step, every few steps
  (`if step % log_every == 0:`, also `and`-ed with other terms), once (`if i == 0:`, `if i < 1:`, a
  branch that leaves the loop), once per call of a function whose own batch loop it follows, once per
  epoch (with ``epochs``), only after an error (an ``except`` handler), or outside every step loop.
  Inside a function, a statement runs as often as the most frequent call of the function in a step
  (`if step % eval_every == 0: evaluate(...)`), or after an early `if step % n != 0: return`
  (`if not should_log: return`). A counter equal to a name the loop never changes
  (`if i == warmup_steps:`) holds once. An evaluation loop runs as often as the loop itself: under
  `if i % eval_every == 0:` of a training loop (or of a loop that runs one step per iteration through
  a micro-batch loop), or in a plain function every call of which is such a rare one; a function
  also called outside every step, handed on as a value or exported keeps its loop's own rate.
* :meth:`Control.guards` answers the :class:`Guards` around a node, read from the real conditions
  of the ``if`` statements that hold it (and the early ``return`` of its function): rank 0 or the
  main process (`rank == 0`, `local_rank in (-1, 0)`, `dist.get_rank() == 0`, `is_main_process()`,
  `accelerator.is_main_process`, `if rank != 0: return` before it), a device branch
  (`torch.cuda.is_available()`, `if args.gpu:`, `device == "cuda"`, `x.is_cuda`), an exception
  handler (an out-of-memory handler is told apart) and an opt-in switch (`if args.profile:`). A
  switch that is a command-line option of the file off by default (`add_argument("--seed",
  default=None)` read as `if args.seed is not None:`, a `store_true` flag read as `if args.augment:`,
  a dataclass field `target_kl: float = None`, a module-level `profile = False`) is also told apart:
  its code does not run in the program's default run, even when the switch holds a whole step loop. So is a parameter of a plain function of the file off by default
  (`def run(save_json=False)`) when every use of the function leaves it so: a call without it, with
  its default, with an option off by default (`run(**vars(opt))`, `set_seed(args.seed)`), or the
  function handed to a command-line runner (`fire.Fire(main)`). The left side of an ``and`` guards
  its right side the same way. A plain function of the file that only its calls use runs under the
  guards every one of its calls runs under (`if save_json: save_one_json(...)`).
* :meth:`Control.prints_rank_aware` says whether the program replaces ``builtins.print`` (the
  ``setup_for_distributed`` idiom that silences prints on every rank but 0).

A test of a shape this module does not know sets no guard, and leaves the frequency at "every step":
the facts never claim a statement is rare without reading it in the condition. Built once per text
and kept in its ``SourceFacts`` (``control_of(rule)``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.conditions import (
    RANK_NAMES,
    assigns,
    assigns_attr,
    counted,
    ends_program,
    first_step,
    first_steps,
    int_value,
    leaves_loop,
    negated,
    one_off,
    only_returns,
    periodic,
)
from torchopt.analysis.names import callee, dotted, qualified_names
from torchopt.analysis.options import Options, exported
from torchopt.analysis.program import program_of
from torchopt.analysis.step_loops import LOOPS, SCOPES, HotMap, Where, calls_in, hot_map
from torchopt.analysis.syntax import walk
from torchopt.rewrite.rule import Rule

_RANK_CALLS = {"get_rank", "get_local_rank", "get_global_rank", "get_process_index"}
# A call or attribute that is true on the main process only.
_MAIN_NAMES = {
    "is_main_process",
    "is_local_main_process",
    "is_master",
    "is_rank_zero",
    "is_global_zero",
    "is_local_zero",
    "is_world_process_zero",
    "is_local_process_zero",
    "main_process",
    "master_process",
}
_DEVICE_WORDS = ("cuda", "gpu")
_OOM = ("OutOfMemoryError", "torch.cuda.OutOfMemoryError", "torch.OutOfMemoryError")


class Rate(enum.Enum):
    EVERY_STEP = "every step"
    EVERY_N = "every few steps"
    ONCE = "once"
    PER_CALL = "once per call"
    PER_EPOCH = "once per epoch"
    ON_ERROR = "only after an error"
    OUTSIDE = "outside every step loop"


@dataclass(frozen=True)
class Frequency:
    rate: Rate
    why: str = ""  # the phrase a message uses ("it already runs only every few steps")
    where: Where | None = None


class Guard(enum.Flag):
    NONE = 0
    RANK0 = enum.auto()
    DEVICE = enum.auto()
    EXCEPT = enum.auto()
    OOM = enum.auto()
    OPT_IN = enum.auto()
    # ... of an OPT_IN switch, one read from a command-line option (or options dataclass field) of the
    # file that is off by default: the guarded code does not run unless the user asks for it.
    OFF_BY_DEFAULT = enum.auto()
    # ... of a DEVICE check, the branch that runs when no accelerator is used (`if not use_gpu:`,
    # `if device == "cpu":`, the `else` of `if torch.cuda.is_available():`); the other branch, the
    # accelerator path, is the one that runs every step on a GPU.
    HOST_PATH = enum.auto()


# Guards under which a sync rule reports nothing: code that runs under a device check, only after
# an error, or only when the user turns on an option that is off by default (the default run never
# pays it; with the option on, the host copy is usually the purpose: `--save_val_results`). A rank-0
# guard is not one: a wait on rank 0 at every step holds back every other rank at the next
# collective, so the whole job runs at rank 0's pace.
QUIET_GUARDS = Guard.DEVICE | Guard.EXCEPT | Guard.OFF_BY_DEFAULT


@dataclass(frozen=True)
class Guards:
    flags: Guard = Guard.NONE
    why: str = ""  # the condition that sets the first flag found, innermost first
    switch: str | None = None  # the option an opt-in guard reads (`args.profile`)

    def __contains__(self, flag: Guard) -> bool:
        return bool(self.flags & flag)


class Control:
    """The control facts of one file (see the module's docstring)."""

    def __init__(self, rule: Rule, hot: HotMap) -> None:
        self.rule = rule
        self.hot = hot
        self._visiting: set[int] = set()  # functions whose calls are being read (recursion)
        self.opts = Options(rule, hot)

    def parent(self, node: cst.CSTNode | None) -> cst.CSTNode | None:
        return self.hot.parent(node)

    # ------------------------------------------------------------------ frequency
    def frequency(self, node: cst.CSTNode, epochs: bool = False) -> Frequency:
        """How often ``node`` runs relative to its step loop. With ``epochs``, the body of a loop that
        calls a function iterating its own batches counts as per-epoch code (a batch loop calling a
        gradient-accumulation helper looks the same, so only rules about rare work ask for it)."""
        where = self.hot.where(node)
        if where is None:
            return Frequency(Rate.OUTSIDE)
        loop_body = getattr(where.loop.node, "body", None)
        cur = node
        while True:
            parent = self.parent(cur)
            if parent is None or cur is loop_body:
                break
            if isinstance(parent, cst.If) and cur is parent.body:
                found = self._rare_branch(parent)
                if found is not None:
                    return Frequency(found[0], found[1], where)
            if isinstance(parent, cst.ExceptHandler):
                return Frequency(Rate.ON_ERROR, "it runs only after an error (a retry path)", where)
            if isinstance(parent, cst.IndentedBlock) and self._returns_unless_periodic(parent, cur):
                return Frequency(
                    Rate.EVERY_N, "it already runs only every few steps (the function returns early otherwise)", where
                )
            if isinstance(parent, cst.FunctionDef):
                if self._after_inner_loop(node, parent):
                    return Frequency(
                        Rate.PER_CALL, "it runs once per call, outside the batch loop of the function", where
                    )
                rare = self._rare_calls(parent, epochs)
                if rare is not None:
                    return Frequency(rare.rate, rare.why, where)
                break
            cur = parent
        if cur is loop_body and where.loop.kind == "forward-pass":
            outer = self._nested_loop_rate(where.loop.node, epochs)
            if outer is not None:
                return Frequency(
                    outer.rate, f"it runs in an evaluation loop that itself runs {outer.rate.value}", where
                )
        if epochs and self._epoch_loop(where.loop.node):
            why = "it runs once per epoch; the batches are iterated by a function the loop calls"
            return Frequency(Rate.PER_EPOCH, why, where)
        return Frequency(Rate.EVERY_STEP, "", where)

    def _nested_loop_rate(self, loop: cst.CSTNode, epochs: bool) -> Frequency | None:
        """Of a forward-pass (evaluation) loop: how often the loop itself runs, when that is rarer
        than every step of a step loop around it: under `if i % eval_every == 0:` of a training loop,
        or in a plain function of the file every call of which is such a rare one (a helper called
        from elsewhere as well, or handed over as a value, may run its loop as the program's own
        evaluation loop: None)."""
        if id(loop) in self._visiting:
            return None
        if self.hot.where(loop) is None:
            return self._rare_in_outer_loop(loop)
        fn = self.parent(loop)
        while fn is not None and not isinstance(fn, (cst.FunctionDef, cst.Module)):
            if isinstance(fn, LOOPS) and id(fn) in self.hot.step_loops:
                break  # the loop around it is in the same function
            fn = self.parent(fn)
        if isinstance(fn, cst.FunctionDef) and not self._only_called(fn):
            return None
        found = program_of(self.rule).function_of(fn) if isinstance(fn, cst.FunctionDef) else None
        if found is not None and any(self.hot.where(e.call) is None for e in found.callers):
            return None  # also called outside every step: there the loop is the evaluation itself
        self._visiting.add(id(loop))
        try:
            freq = self.frequency(loop, epochs)
        finally:
            self._visiting.discard(id(loop))
        # an evaluation over its loader once per epoch is the program's evaluation: its batches are hot
        if freq.rate in (Rate.EVERY_STEP, Rate.OUTSIDE, Rate.PER_CALL, Rate.PER_EPOCH):
            return None
        return freq

    def _rare_in_outer_loop(self, loop: cst.CSTNode) -> Frequency | None:
        """A loop under a rare branch (`if i % validate_every == 0:`) of an outer loop that is no step
        loop itself but runs training steps in a loop nested in it (gradient accumulation over
        micro-batches): the loop runs every few training steps, not at each."""
        cur, parent = loop, self.parent(loop)
        found: tuple[Rate, str] | None = None
        while parent is not None and not isinstance(parent, SCOPES):
            if isinstance(parent, cst.If) and cur is parent.body and found is None:
                found = self._rare_branch(parent)
            if isinstance(parent, LOOPS) and cur is parent.body:
                inner = [
                    n
                    for n in walk(parent.body)
                    if isinstance(n, LOOPS)
                    and id(n) in self.hot.step_loops
                    and self.hot.step_loops[id(n)].kind == "training"
                ]
                # each inner training loop counts micro-batches (`for _ in range(accumulate):`): one
                # outer iteration is one step; an inner loop over a loader makes the outer an epoch loop
                if found is None or not inner or not all(counted(n) for n in inner) or found[0] is Rate.PER_CALL:
                    return None
                return Frequency(found[0], found[1])
            cur, parent = parent, self.parent(parent)
        return None

    def _only_called(self, fn: cst.FunctionDef) -> bool:
        """``fn`` is a plain function of the file, called in it, that every use of its name calls
        (no other module's call, no call through a value handed on, is left unread)."""
        if id(fn) in self.hot.method_class or fn.name.value in exported(self.rule.ctx.module):
            return False
        found = program_of(self.rule).function_of(fn)
        if found is None or not found.callers:
            return False
        calls = {id(e.call.func) for e in found.callers}
        try:
            scope = self.rule.get_metadata(ScopeProvider, fn)
        except KeyError:
            return False
        if scope is None:
            return False
        uses = [r.node for a in scope.assignments[fn.name.value] for r in a.references]
        return bool(uses) and all(id(u) in calls for u in uses)

    def _rare_calls(self, fn: cst.FunctionDef, epochs: bool) -> Frequency | None:
        """A function of the file every call of which, in a step, is rare (`if i % n == 0: log(x)`):
        its body runs as often as its most frequent call."""
        if id(fn) in self._visiting:
            return None
        found = program_of(self.rule).function_of(fn)
        calls = [e.call for e in found.callers] if found is not None else []
        hot = [c for c in calls if self.hot.where(c) is not None]
        if not hot:
            return None
        self._visiting.add(id(fn))
        try:
            rates = [self.frequency(c, epochs) for c in hot]
        finally:
            self._visiting.discard(id(fn))
        if any(f.rate in (Rate.EVERY_STEP, Rate.OUTSIDE) for f in rates):
            return None
        # the most frequent of the calls: every few steps over once, once per epoch or after an error
        return next((f for f in rates if f.rate is Rate.EVERY_N), rates[0])

    def not_every_step(self, node: cst.CSTNode, epochs: bool = False, guards: Guard = Guard.NONE) -> str | None:
        """Why ``node`` does not cost every step (a phrase), or None: its frequency, or one of
        ``guards`` around it (rank 0, a device branch, an error handler)."""
        freq = self.frequency(node, epochs)
        if freq.rate is Rate.OUTSIDE:
            return None
        if freq.rate is not Rate.EVERY_STEP:
            return freq.why
        stop = getattr(freq.where.loop.node, "body", None) if freq.where and freq.where.via is None else None
        g = self.guards(node, stop)
        if g.flags & guards:
            return g.why
        if stop is not None and guards & Guard.OFF_BY_DEFAULT:
            # a switch off by default around the whole loop (`if profile:` before a profiled loop):
            # the loop runs every step when it runs, but not in the program's default run
            outer = self.guards(node)
            if Guard.OFF_BY_DEFAULT in outer:
                return outer.why
        return None

    def decides_exit(self, node: cst.CSTNode) -> bool:
        """``node`` is in the test of an ``if`` that leaves a ``while True:`` loop (``break``, ``return``)
        on a value a collective of the loop shares with every rank (`dist.broadcast(flag, src=0)`):
        the ranks decide together, at every iteration, whether the loop goes on."""
        cur, parent = node, self.parent(node)
        while parent is not None and not (isinstance(parent, cst.If) and cur is parent.test):
            if isinstance(parent, (cst.BaseSuite, cst.FunctionDef, cst.Lambda)):
                return False
            cur, parent = parent, self.parent(parent)
        if not isinstance(parent, cst.If):
            return False
        body = parent.body
        last = body.body[-1] if isinstance(body, cst.IndentedBlock) and body.body else None
        if not (isinstance(last, cst.SimpleStatementLine) and isinstance(last.body[-1], (cst.Break, cst.Return))):
            return False
        loop = self.parent(parent)
        while loop is not None and not isinstance(loop, (cst.For, cst.While, cst.FunctionDef)):
            loop = self.parent(loop)
        if not isinstance(loop, cst.While):
            return False
        test = loop.test
        if not (
            (isinstance(test, cst.Name) and test.value == "True")
            or (isinstance(test, cst.Integer) and test.value != "0")
        ):
            return False
        # The value is a decision every rank shares: a collective fills it in the loop.
        read = {n.value for n in walk(parent.test) if isinstance(n, cst.Name)}
        return any(
            isinstance(c, cst.Call)
            and c.args
            and isinstance(c.args[0].value, cst.Name)
            and c.args[0].value.value in read
            and (callee(self.rule, c) or "").startswith("torch.distributed.")
            for c in walk(loop.body)
        )

    def _rare_branch(self, branch: cst.If) -> tuple[Rate, str] | None:
        test = branch.test
        flags, named = self._test_flags(branch)
        if periodic(test, flags, named):
            return Rate.EVERY_N, "it already runs only every few steps"
        if first_step(test):
            return Rate.ONCE, "it runs once, on the first step"
        if first_steps(test, self._counters(branch)):
            return Rate.ONCE, "it runs only on the first few iterations"
        reached = self._counter_reaches(test, branch)
        if reached is not None:
            return Rate.ONCE, f"it runs once, when the loop counter reaches `{reached}`"
        if leaves_loop(branch.body):
            return Rate.ONCE, "it runs only on the path that leaves the loop"
        return None

    def _returns_unless_periodic(self, block: cst.IndentedBlock, stmt: cst.CSTNode) -> bool:
        """An early `if step % log_every != 0: return` (`if not should_log: return`, with `should_log`
        assigned a periodic test in the function) before ``stmt`` in a function's body: what follows
        runs only every few steps."""
        fn = self.parent(block)
        if not isinstance(fn, cst.FunctionDef):
            return False
        for s in block.body:
            if s is stmt:
                return False
            if isinstance(s, cst.If) and s.orelse is None and only_returns(s.body):
                flags, named = self._test_flags(s)
                if periodic(negated(s.test), flags, named):
                    return True
        return False

    def _counters(self, node: cst.CSTNode) -> frozenset[str]:
        """The counters of the loops around ``node`` in its function: `i` of `for i in range(...)` or
        `for i, x in enumerate(...)`, when the loop's body never assigns it."""
        return frozenset(self._counter_loops(node))

    def _counter_reaches(self, test: cst.BaseExpression, branch: cst.If) -> str | None:
        """`i == warmup_steps` (also `and`-ed): a loop counter, which takes each value once, equal to a
        name (or attribute) the loop never assigns: the branch runs at most once per run of the loop.
        The name compared with, or None."""
        if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
            return self._counter_reaches(test.left, branch) or self._counter_reaches(test.right, branch)
        if not (
            isinstance(test, cst.Comparison)
            and len(test.comparisons) == 1
            and isinstance(test.comparisons[0].operator, cst.Equal)
        ):
            return None
        loops = self._counter_loops(branch)
        sides = (test.left, test.comparisons[0].comparator)
        for counter, other in (sides, sides[::-1]):
            if not (isinstance(counter, cst.Name) and counter.value in loops):
                continue
            if not isinstance(other, (cst.Name, cst.Attribute)) or _lower_last(other) in RANK_NAMES:
                continue
            name = dotted(other)
            root: cst.BaseExpression = other
            while isinstance(root, cst.Attribute):
                root = root.value
            if name is None or not isinstance(root, cst.Name) or root.value == counter.value:
                continue
            body = loops[counter.value].body
            if assigns(body, root.value) or (isinstance(other, cst.Attribute) and assigns_attr(body, name)):
                continue
            return name
        return None

    def _counter_loops(self, node: cst.CSTNode) -> dict[str, cst.For]:
        """The counters of the loops around ``node`` in its function (see ``_counters``), each with
        its loop."""
        out: dict[str, cst.For] = {}
        cur = self.parent(node)
        while cur is not None and not isinstance(cur, (cst.FunctionDef, cst.Module)):
            if isinstance(cur, cst.For) and isinstance(cur.iter, cst.Call):
                target: cst.BaseExpression | None = cur.target
                func = dotted(cur.iter.func)
                if isinstance(target, cst.Tuple) and target.elements and func == "enumerate":
                    target = target.elements[0].value
                elif func != "range":
                    target = None
                if isinstance(target, cst.Name) and not assigns(cur.body, target.value):
                    out.setdefault(target.value, cur)
            cur = self.parent(cur)
        return out

    def _test_flags(self, node: cst.CSTNode) -> tuple[frozenset[str], frozenset[str]]:
        """Names the enclosing function assigns a one-off test (`last_batch = batch_idx == last_idx`),
        and names it assigns a periodic one (`log_step = i % log_every == 0 or last_batch`), in order."""
        fn = self.parent(node)
        while fn is not None and not isinstance(fn, (cst.FunctionDef, cst.Module)):
            fn = self.parent(fn)
        if fn is None:
            return frozenset(), frozenset()
        once: set[str] = set()
        every: set[str] = set()
        other: set[str] = set()
        for n in walk(fn.body if isinstance(fn, cst.FunctionDef) else fn):
            if isinstance(n, (cst.AugAssign, cst.AnnAssign)) and isinstance(n.target, cst.Name):
                other.add(n.target.value)
            if not isinstance(n, cst.Assign):
                continue
            if not (len(n.targets) == 1 and isinstance(n.targets[0].target, cst.Name)):
                other.update(t.value for a in n.targets for t in walk(a.target) if isinstance(t, cst.Name))
                continue
            name = n.targets[0].target.value
            if periodic(n.value, frozenset(once), frozenset(every)):
                every.add(name)
            elif one_off(n.value, frozenset(once)):
                once.add(name)
            else:
                other.add(name)
        # A name assigned tests of both kinds, or anything else, is neither.
        return frozenset(once - every - other), frozenset(every - once - other)

    def _after_inner_loop(self, node: cst.CSTNode, fn: cst.FunctionDef) -> bool:
        """A function called from a step loop that iterates its own batches: code outside that inner
        loop runs once per call, not once per batch."""
        if not any(id(n) in self.hot.step_loops for n in walk(fn.body) if isinstance(n, LOOPS)):
            return False
        if id(node) in self.hot.step_loops:
            return False  # the batch loop itself
        cur = self.parent(node)
        while cur is not None and cur is not fn:
            if isinstance(cur, LOOPS):
                return False
            cur = self.parent(cur)
        return True

    def _epoch_loop(self, loop: cst.CSTNode) -> bool:
        """A loop that calls a function of this file with a step loop of its own is an epoch loop."""
        for call in calls_in(getattr(loop, "body", loop), into_loops=False):
            for fn, _ in self.hot.resolve(call, None):
                if any(id(n) in self.hot.step_loops for n in walk(fn.body) if isinstance(n, LOOPS)):
                    return True
        return False

    # ------------------------------------------------------------------ guards
    def guards(self, node: cst.CSTNode, stop: cst.CSTNode | None = None) -> Guards:
        """The guards around ``node`` up to its function (or the module), or up to ``stop`` (a loop's
        body: a guard around a whole step loop does not make its steps rare)."""
        flags = Guard.NONE
        why = ""
        switch: str | None = None
        cur = node
        while True:
            parent = self.parent(cur)
            if parent is None or cur is stop:
                break
            found: tuple[Guard, str] | None = None
            if isinstance(parent, cst.If) and cur is parent.body:
                found = self._test_guard(parent.test, negated=False)
                if found is not None and found[0] & Guard.OPT_IN and switch is None:
                    switch = _switch(parent.test)
            elif isinstance(parent, cst.Else):
                owner = self.parent(parent)
                if isinstance(owner, cst.If):
                    found = self._test_guard(owner.test, negated=True)
                    if found is not None and found[0] & Guard.OPT_IN and not found[0] & Guard.OFF_BY_DEFAULT:
                        found = None  # the `else` of a switch is the default path
                    # (of `if not args.evolve:`, with the option off by default, it is the opt-in one)
            elif isinstance(parent, cst.ExceptHandler):
                oom = parent.type is not None and self._oom(parent.type)
                found = (
                    (Guard.EXCEPT | Guard.OOM, "it runs only after an out-of-memory error")
                    if oom
                    else (Guard.EXCEPT, "it runs only after an error (a retry path)")
                )
            elif isinstance(parent, (cst.IndentedBlock, cst.Module)):
                found = self._early_return(parent, cur)
            elif isinstance(parent, cst.BooleanOperation) and cur is parent.right:
                # `a and b`: b is evaluated only when a holds (`or`: only when it does not)
                found = self._test_guard(parent.left, negated=isinstance(parent.operator, cst.Or))
                if found is not None and found[0] & Guard.OPT_IN and switch is None:
                    switch = _switch(parent.left)
            if isinstance(parent, (cst.If, cst.Else)) and cur is parent.body and ends_program(cur):
                # `if header[0] != MAGIC: print(...); exit(1)`: an error report, once, then the end
                error = "it runs only on an error path that ends the program"
                found = (found[0] | Guard.EXCEPT, found[1]) if found is not None else (Guard.EXCEPT, error)
            if found is not None:
                if not why:
                    why = found[1]
                flags |= found[0]
            if isinstance(parent, cst.FunctionDef) and stop is None:
                inherited = self._caller_guards(parent)
                if inherited is not None:
                    flags |= inherited.flags
                    why = why or inherited.why
                    switch = switch or inherited.switch
            if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                break
            cur = parent
        return Guards(flags, why, switch)

    def _caller_guards(self, fn: cst.FunctionDef) -> Guards | None:
        """The guards every call of ``fn`` runs under (`if save_json: save_one_json(...)`), when ``fn``
        is a plain function of the file that only its calls use: its body runs under them too."""
        if id(fn) in self._visiting or not self._only_called(fn):
            return None
        found = program_of(self.rule).function_of(fn)
        if found is None:
            return None
        self._visiting.add(id(fn))
        try:
            around = [self.guards(e.call) for e in found.callers]
        finally:
            self._visiting.discard(id(fn))
        if not around:
            return None
        common: Guard = around[0].flags
        for g in around[1:]:
            common = Guard(common & g.flags)
        if not common:
            return None
        first = next(g for g in around if g.flags & common)
        return Guards(common, first.why, first.switch)

    def _early_return(self, block: cst.IndentedBlock | cst.Module, stmt: cst.CSTNode) -> tuple[Guard, str] | None:
        """`if rank != 0: return` (or `if not is_main_process(): return`) earlier in a function's body."""
        if not isinstance(block, cst.IndentedBlock) or not isinstance(self.parent(block), cst.FunctionDef):
            return None
        for s in block.body:
            if s is stmt:
                return None
            if isinstance(s, cst.If) and s.orelse is None and only_returns(s.body):
                found = self._test_guard(s.test, negated=True)
                if found is not None and found[0] is Guard.RANK0:
                    return Guard.RANK0, "it runs only on rank 0 (the function returns early on the others)"
        return None

    def _test_guard(self, test: cst.BaseExpression, negated: bool) -> tuple[Guard, str] | None:
        if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
            return self._test_guard(test.expression, not negated)
        if isinstance(test, cst.BooleanOperation):
            left = self._test_guard(test.left, negated)
            right = self._test_guard(test.right, negated)
            both_needed = isinstance(test.operator, cst.And) != negated  # a conjunction (De Morgan)
            if both_needed:
                if left is not None and right is not None:
                    return left[0] | right[0], left[1]
                return left or right
            return left if left is not None and right is not None and left[0] == right[0] else None
        rank = self._rank_test(test)
        if rank is not None and rank == (not negated):
            return Guard.RANK0, "it runs only on rank 0"
        if self._device_test(test):  # either branch of a device check is device-specific
            accelerator = self._accelerator_test(test)
            if accelerator is not None and accelerator == negated:
                return Guard.DEVICE | Guard.HOST_PATH, "it runs only when no accelerator is used"
            return Guard.DEVICE, "it runs only under a device check"
        if negated:
            return None
        off = self.opts.off_by_default(test)
        if off is not None:
            what = "the option" if "." in off else "the parameter"  # `args.seed`; `save_json` of `main`
            return Guard.OPT_IN | Guard.OFF_BY_DEFAULT, f"it runs only when {what} `{off}` (off by default) is set"
        if isinstance(test, cst.Attribute) and dotted(test) is not None:
            return Guard.OPT_IN, f"it runs only when `{dotted(test)}` is set"
        return None

    def options(self) -> dict[str, frozenset[str]]:
        """The command-line options of the file and the fields of its dataclasses, each with the
        defaults it is given (``Options.declared``)."""
        return self.opts.declared()

    def prints_rank_aware(self) -> bool:
        """The file replaces ``builtins.print`` (`builtins.print = print_pass`, `__builtin__.print =
        print` in ``setup_for_distributed``): the program itself decides which ranks print."""
        for node in walk(self.rule.ctx.module, cross_scopes=True):
            if isinstance(node, cst.Assign) and any(
                (dotted(t.target) or "") in ("builtins.print", "__builtin__.print", "__builtins__.print")
                or "builtins.print" in qualified_names(self.rule, t.target)
                for t in node.targets
                if isinstance(t.target, cst.Attribute)
            ):
                return True
        return False

    def _rank_test(self, test: cst.BaseExpression) -> bool | None:
        """True: the test holds on rank 0 only; False: on every rank but 0; None: not a rank test."""
        if isinstance(test, (cst.Name, cst.Attribute)) and _lower_last(test) in _MAIN_NAMES:
            return True
        if isinstance(test, cst.Call) and _lower_last(test.func) in _MAIN_NAMES and not test.args:
            return True
        if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
            return None
        op = test.comparisons[0].operator
        left, right = test.left, test.comparisons[0].comparator
        if not self._is_rank(left):
            if self._is_rank(right) and isinstance(op, (cst.Equal, cst.NotEqual)):
                left, right = right, left
            else:
                return None
        if isinstance(op, (cst.In, cst.NotIn)) and isinstance(right, (cst.Tuple, cst.List, cst.Set)):
            values = {int_value(e.value) for e in right.elements}
            if values and values <= {-1, 0}:
                return isinstance(op, cst.In)
            return None
        n = int_value(right)
        if n is None:
            return None
        if isinstance(op, cst.Equal) and n == 0:
            return True
        if isinstance(op, cst.NotEqual) and n == 0:
            return False
        if (isinstance(op, cst.LessThanEqual) and n == 0) or (isinstance(op, cst.LessThan) and n == 1):
            return True
        if isinstance(op, cst.GreaterThan) and n == 0:
            return False
        return None

    def _is_rank(self, expr: cst.BaseExpression) -> bool:
        if isinstance(expr, cst.Call):
            return not expr.args and _last(expr.func) in _RANK_CALLS
        # `RANK = int(os.getenv("RANK", -1))` as much as `rank`
        return isinstance(expr, (cst.Name, cst.Attribute)) and _lower_last(expr) in RANK_NAMES

    def _device_test(self, test: cst.BaseExpression) -> bool:
        if isinstance(test, cst.Call):
            q = callee(self.rule, test) or ""
            return q in ("torch.cuda.is_available", "torch.backends.mps.is_available", "torch.xpu.is_available")
        if isinstance(test, (cst.Name, cst.Attribute)):
            last = (_last(test) or "").lower()
            return last == "is_cuda" or any(w in last.split("_") for w in _DEVICE_WORDS)
        if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
            sides = (test.left, test.comparisons[0].comparator)
            strings = [s.evaluated_value for s in sides if isinstance(s, cst.SimpleString)]
            return any(isinstance(s, str) and s.split(":")[0] in ("cuda", "cpu", "mps", "xpu") for s in strings)
        return False

    def _accelerator_test(self, test: cst.BaseExpression) -> bool | None:
        """Of a device test: True when it holds on the accelerator path (`use_gpu`,
        `torch.cuda.is_available()`, `x.is_cuda`, `device == "cuda"`), False when on the host path
        (`device == "cpu"`, `args.no_cuda`), None when that cannot be read."""
        if isinstance(test, (cst.Name, cst.Attribute)):
            words = (_last(test) or "").lower().split("_")
            return not any(w in ("no", "not", "disable", "disabled", "without", "cpu") for w in words)
        if not isinstance(test, cst.Comparison):
            return True
        op = test.comparisons[0].operator
        sides = (test.left, test.comparisons[0].comparator)
        strings = [s.evaluated_value for s in sides if isinstance(s, cst.SimpleString)]
        if len(strings) != 1 or not isinstance(strings[0], str) or not isinstance(op, (cst.Equal, cst.NotEqual)):
            return None
        return (strings[0].split(":")[0] != "cpu") == isinstance(op, cst.Equal)

    def _oom(self, kind: cst.BaseExpression) -> bool:
        if isinstance(kind, cst.Tuple):
            return any(self._oom(e.value) for e in kind.elements)
        d = dotted(kind) or ""
        return d in _OOM or d.endswith(".OutOfMemoryError")


def _last(expr: cst.BaseExpression) -> str | None:
    d = dotted(expr)
    return d.rsplit(".", 1)[-1] if d else None


def _lower_last(expr: cst.BaseExpression) -> str:
    return (_last(expr) or "").lower()


def _switch(test: cst.BaseExpression) -> str | None:
    """The option an opt-in test reads: `args.profile`, `args.seed` of `args.seed is not None`."""
    if isinstance(test, cst.Comparison):
        test = test.left
    return dotted(test)


def control_of(rule: Rule) -> Control:
    """The control facts of the rule's file, made once per analysed text and kept in its SourceFacts."""
    hot = hot_map(rule)
    make: Callable[[], Control] = lambda: Control(rule, hot)  # noqa: E731
    found = rule.ctx.facts.about_node(("control",), rule.ctx.module, make)
    found.rule = rule
    return found
