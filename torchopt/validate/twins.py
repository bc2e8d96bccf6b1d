"""Replay sites whose value is not a tensor (docs/validation.md, "Objects a random-stream fix builds").

Runs inside the harness. A random-stream fix that builds an object otherwise cannot hand the
original's object back and call the fix validated: the run would never exercise it. Two kinds of
object get a method of their own:

* **A module with fewer tensors** (a convolution built without its bias, TOP841): the rewrite's
  module runs, started from the original's values for every tensor both have. The original's
  construction ran too (it moved the generators as in the original run), so every later draw lines
  up, and the rest of the program shows whether the module without those tensors computes the same.
* **A DataLoader** (worker processes added, TOP701; persistent workers, TOP703): the original's
  loader runs, and each batch it yields is checked against the batch the rewrite's loader yields
  in the same place, drawn under the same generator states (forked, so nothing the original draws
  moves). Equal batches validate the loader bit for bit; batches whose values differ (random
  augmentation drawn in the workers) must keep structure, shapes, dtypes and moments; a different
  number of batches is a divergence. A loader with persistent workers draws another shuffle from
  its second epoch on, by design: comparing stops there and the report says so.
"""

from __future__ import annotations

import math
import random
import weakref
from typing import Any, Callable


class Sites:
    """What the object sites found, collected with the probes."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.errors: list[str] = []
        self.unchecked: dict[str, str] = {}
        self.loaders: dict[str, dict[str, int]] = {}  # site -> batches equal / checked by moments
        self.modules: list[str] = []  # sites whose module ran with the original's values
        self.loader_classes: dict[type, type] = {}  # a loader class -> its subclass that iterates a twin


def module_by_state(torch: Any, new: Any, old: Any) -> bool:
    """Give ``new`` the original's values for the tensors both modules have, when ``new``'s tensors
    are a subset of ``old``'s with the same shapes, dtypes and devices. True when done."""
    a, b = new.state_dict(), old.state_dict()
    if not a or a.keys() == b.keys() or not a.keys() <= b.keys():
        return False
    if any((a[k].shape, a[k].dtype, a[k].device) != (b[k].shape, b[k].dtype, b[k].device) for k in a):
        return False
    with torch.no_grad():
        for k, t in a.items():
            t.copy_(b[k])
    return True


def _generators(loader: Any) -> list[Any]:
    """The explicit torch generators a loader draws from (its own, its sampler's)."""
    out = []
    for owner in (
        loader,
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        g = getattr(owner, "generator", None)
        if g is not None and g not in out:
            out.append(g)
    return out


class _Forked:
    """Every random state the rewrite's loader might move, restored on exit: torch's (all devices),
    Python's and NumPy's global generators, and the loaders' own generators."""

    def __init__(self, torch: Any, generators: list[Any]) -> None:
        self.torch, self.generators = torch, generators

    def __enter__(self) -> None:
        torch = self.torch
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        self.fork = torch.random.fork_rng(devices=devices)
        self.fork.__enter__()
        self.py = random.getstate()
        try:
            import numpy

            self.np: Any = numpy.random.get_state()
        except ImportError:
            self.np = None
        self.own = [g.get_state() for g in self.generators]

    def __exit__(self, *exc: Any) -> None:
        for g, s in zip(self.generators, self.own):
            g.set_state(s)
        random.setstate(self.py)
        if self.np is not None:
            import numpy

            numpy.random.set_state(self.np)
        self.fork.__exit__(*exc)


def _leaves(torch: Any, batch: Any) -> list[Any]:
    from torch.utils._pytree import tree_flatten

    return tree_flatten(batch)[0]


def _batch_problem(torch: Any, new: Any, old: Any) -> tuple[bool, str | None]:
    """(equal bit for bit, why they cannot stand for each other or None)."""
    a, b = _leaves(torch, new), _leaves(torch, old)
    if len(a) != len(b):
        return False, f"a batch has {len(a)} parts, was {len(b)}"
    equal = True
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            for attr in ("shape", "dtype"):
                if getattr(x, attr) != getattr(y, attr):
                    return False, f"a batch tensor's {attr} is {getattr(x, attr)}, was {getattr(y, attr)}"
            if torch.equal(x.cpu(), y.cpu()):
                continue
            equal = False
            if x.is_floating_point() and x.numel() >= 30:
                p, q = x.detach().double().cpu(), y.detach().double().cpu()
                bound = 5 * float(q.std()) / math.sqrt(q.numel()) + 1e-12
                if abs(float(p.mean()) - float(q.mean())) > bound:
                    return (
                        False,
                        f"a batch tensor's mean {float(p.mean()):.4g} is more than 5 sigma/sqrt(n) from {float(q.mean()):.4g}",
                    )
            elif not x.is_floating_point():
                return False, "a batch's integer tensor (labels, indices) differs"
        elif type(x) is not type(y):
            return False, f"a batch part is {type(x).__name__}, was {type(y).__name__}"
        elif x != y:
            equal = False
    return equal, None


_END = object()


class _TwinIterator:
    def __init__(self, twin: "_Twin", old_it: Any, new_it: Any) -> None:
        self.twin, self.old_it, self.new_it = twin, old_it, new_it
        self.batch = 0

    def __iter__(self) -> "_TwinIterator":
        return self

    def __len__(self) -> int:
        return len(self.old_it)

    def __next__(self) -> Any:
        # The rewrite's loader goes first, under forked generators, then the original's from the
        # same states: a draw either makes lazily (a single-process sampler draws its shuffle at
        # the first batch) sees what the other saw.
        twin = self.twin
        new: Any = _END
        if self.new_it is not None:
            try:
                with twin.forked():
                    new = next(self.new_it)
            except StopIteration:
                pass
        try:
            old = next(self.old_it)
        except StopIteration:
            if self.new_it is not None and new is not _END:
                twin.fail(f"the rewrite's loader yields more than the original's {self.batch} batches")
            raise
        if self.new_it is not None:
            if new is _END:
                twin.fail(f"the rewrite's loader ends after {self.batch} batches; the original's yields more")
                self.new_it = None
            else:
                twin.check(new, old, self.batch)
                if twin.stopped:
                    self.new_it = None
        self.batch += 1
        return old


class _Twin:
    def __init__(self, torch: Any, sites: Sites, site_id: str, new: Any, persistent: bool) -> None:
        self.torch, self.sites, self.site_id, self.new = torch, sites, site_id, new
        self.persistent = persistent
        self.epoch = 0
        self.stopped = False
        self.counts = sites.loaders.setdefault(site_id, {"equal": 0, "moments": 0})

    def forked(self) -> _Forked:
        return _Forked(self.torch, _generators(self.new))

    def fail(self, why: str) -> None:
        if not any(e.startswith(f"{self.site_id}:") for e in self.sites.errors):
            self.sites.errors.append(f"{self.site_id}: {why}")
        self.stopped = True

    def check(self, new: Any, old: Any, batch: int) -> None:
        equal, problem = _batch_problem(self.torch, new, old)
        if equal:
            self.counts["equal"] += 1
        elif self.persistent and self.epoch > 1:
            # persistent workers keep their base seed: the shuffle drawn from epoch 2 on differs by design
            self.sites.unchecked.setdefault(
                self.site_id,
                f"its loader's persistent workers draw another shuffle from the second epoch on (by design); "
                f"batches were compared up to epoch {self.epoch}, batch {batch}, and no further",
            )
            self.stopped = True
        elif problem:
            self.fail(
                f"the rewrite's loader differs from the original's at epoch {self.epoch}, batch {batch}: {problem}"
            )
        else:
            self.counts["moments"] += 1

    def iterate(self, old_iter: Callable[[], Any]) -> _TwinIterator:
        self.epoch += 1
        new_it = None
        if not self.stopped:
            with self.forked():
                new_it = iter(self.new)
        return _TwinIterator(self, old_iter(), new_it)


_twins: "weakref.WeakKeyDictionary[Any, _Twin]" = weakref.WeakKeyDictionary()


def loader_twin(torch: Any, sites: Sites, site_id: str, new: Any, old: Any) -> bool:
    """Make ``old`` (the original's DataLoader, which the program receives) check every batch
    against ``new`` (the rewrite's). True when both are DataLoaders."""
    loader_cls = torch.utils.data.DataLoader
    if not (isinstance(new, loader_cls) and isinstance(old, loader_cls)):
        return False
    base = type(old)
    cls = sites.loader_classes.get(base)
    if cls is None:

        def __iter__(self: Any) -> Any:
            twin = _twins.get(self)
            if twin is None:
                return base.__iter__(self)
            return twin.iterate(lambda: base.__iter__(self))

        # The program sees its own class name (printing, isinstance and type checks keep working).
        cls = type(base.__name__, (base,), {"__iter__": __iter__, "__module__": base.__module__})
        cls.__qualname__ = base.__qualname__
        sites.loader_classes[base] = cls
    persistent = bool(getattr(new, "persistent_workers", False)) and not getattr(old, "persistent_workers", False)
    _twins[old] = _Twin(torch, sites, site_id, new, persistent)
    old.__class__ = cls
    return True
