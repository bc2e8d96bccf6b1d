"""Which of the applied fixes makes a program diverge: delta debugging over subsets of fixes.

``smallest_failing`` narrows a diverging selection to a 1-minimal one (every fix in it is needed
for the divergence: drop any one and the rest validates), trying the pieces and their complements
of each split at once, up to ``jobs`` runs in parallel. ``largest_passing`` repeats that search,
leaving one culprit out each time, until what is left validates: the selection
`rewrite --validate` writes.

Both work on any hashable units (a single fix for `validate`, a rule in one file for `rewrite
--validate`) through a ``probe(subset) -> Outcome`` callback; each subset runs once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, Sequence, TypeVar

U = TypeVar("U", bound=Hashable)


@dataclass
class Trial(Generic[U]):
    """One run of a subset of the units."""

    units: tuple[U, ...]
    diverged: bool
    outcome: object  # command.Outcome (or whatever the probe returns)


@dataclass
class Search(Generic[U]):
    """Runs subsets through ``probe`` (memoised) and says whether each diverges."""

    probe: Callable[[tuple[U, ...]], object]
    diverges: Callable[[object], bool]
    jobs: int = 1
    trials: dict[frozenset, Trial[U]] = field(default_factory=dict)

    def run(self, subsets: Sequence[tuple[U, ...]]) -> list[Trial[U]]:
        todo = list(dict.fromkeys(frozenset(s) for s in subsets if frozenset(s) not in self.trials))
        by_key = {frozenset(s): tuple(s) for s in subsets}
        if todo:
            with ThreadPoolExecutor(max_workers=max(1, min(self.jobs, len(todo)))) as pool:
                outcomes = list(pool.map(lambda k: self.probe(by_key[k]), todo))
            for key, out in zip(todo, outcomes):
                self.trials[key] = Trial(by_key[key], self.diverges(out), out)
        return [self.trials[frozenset(s)] for s in subsets]

    def known(self, units: Sequence[U], outcome: object) -> None:
        """Record a run made elsewhere (the whole selection, already run by the caller)."""
        self.trials[frozenset(units)] = Trial(tuple(units), self.diverges(outcome), outcome)


def _split(units: Sequence[U], n: int) -> list[tuple[U, ...]]:
    size, extra = divmod(len(units), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(tuple(units[start:end]))
        start = end
    return [c for c in out if c]


def smallest_failing(units: Sequence[U], search: Search[U]) -> Trial[U]:
    """A 1-minimal diverging subset of ``units`` (which must diverge as a whole), with its run."""
    current = tuple(units)
    whole = search.run([current])[0]
    if not whole.diverged:
        raise ValueError("the whole selection does not diverge")
    best = whole
    n = 2
    while len(current) >= 2:
        chunks = _split(current, n)
        complements = [tuple(u for u in current if u not in c) for c in chunks] if n > 2 else []
        trials = search.run(chunks + complements)
        failing_chunk = next((t for t in trials[: len(chunks)] if t.diverged), None)
        failing_rest = next((t for t in trials[len(chunks) :] if t.diverged), None)
        if failing_chunk is not None:
            best, current, n = failing_chunk, failing_chunk.units, 2
        elif failing_rest is not None:
            best, current, n = failing_rest, failing_rest.units, max(n - 1, 2)
        elif n < len(current):
            n = min(2 * n, len(current))
        else:
            break
    return best


@dataclass
class LeftOut(Generic[U]):
    unit: U
    trial: Trial[U]  # the smallest diverging selection it was part of
    partners: tuple[U, ...] = ()  # the other units of that selection


def largest_passing(units: Sequence[U], search: Search[U]) -> tuple[tuple[U, ...], list[LeftOut[U]], Trial[U] | None]:
    """Drop culprits until the rest validates: (kept units, left-out units with why, the run of
    the kept set, None when nothing is kept)."""
    kept = tuple(units)
    left: list[LeftOut[U]] = []
    while kept:
        trial = search.run([kept])[0]
        if not trial.diverged:
            return kept, left, trial
        culprit = smallest_failing(kept, search)
        # Every unit of a 1-minimal set is needed for the divergence; leaving the last one out
        # breaks it (the others may still be kept, each is validated with the rest).
        drop = culprit.units[-1]
        left.append(LeftOut(drop, culprit, tuple(u for u in culprit.units if u != drop)))
        kept = tuple(u for u in kept if u != drop)
    return (), left, None
