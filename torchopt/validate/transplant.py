"""Weight transplant: validate fixes that grow parameters (padding, TOP301/TOP302) bitwise.

A padded model cannot start from the same weights as the original by seeding alone: the padded
layers draw more random numbers, with other bounds, and every layer built afterwards draws from
a shifted stream. So the two runs are made to start from the same weights explicitly:

* the original ("record") runs first. Each time the program finishes building a ``torch.nn``
  module (the outermost one: a Linear built inside a MultiheadAttention is part of it) or returns
  from a ``torch.nn.init`` function it called itself, the module's ``state_dict`` (or the
  initialised tensor) and the RNG state are recorded, in order;
* the rewritten program ("apply") runs next. At the same events it copies the recorded tensors
  into the leading slices of its own (padded) ones, zeros the rest, and restores the recorded RNG
  state, so everything built or drawn afterwards is the same as in the original.

The comparison then reads a padded tensor's leading slice where the original has the smaller shape
(``grown``/``leading``). Events must line up: same count, same module class or init function, same
state_dict keys, and each shape equal or grown in every dimension; at the first mismatch the
transplant stops and says so in the report's notes.

Used automatically when the applied fixes include a code in ``CODES`` (``torchopt validate
--transplant`` forces it for two hand-written files).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

CODES = frozenset({"TOP301", "TOP302"})


def wanted(applied: Iterable[Any]) -> bool:
    """Whether the applied fixes (Diagnostics) grow parameters, so the runs need a transplant."""
    return any(getattr(d, "code", None) in CODES for d in applied)


def grown(before: Sequence[int], after: Sequence[int]) -> bool:
    """``after`` has the same rank as ``before`` and is at least as large in every dimension."""
    before, after = tuple(before), tuple(after)
    return len(before) == len(after) and all(a >= b for a, b in zip(after, before)) and before != after


def leading(t: Any, shape: Sequence[int]) -> Any:
    """The leading ``shape`` slice of ``t``."""
    return t[tuple(slice(0, n) for n in shape)]


class Transplant:
    """Installed in a harness process; ``mode`` is "record" (the original) or "apply" (the rewrite)."""

    def __init__(self, torch: Any, mode: str, path: str, notes: list[str]) -> None:
        self.torch = torch
        self.mode = mode
        self.path = path
        self.notes = notes
        self.depth = 0
        self.events: list[dict] = []
        self.index = 0
        self.active = True
        self.grown = 0
        self._patched: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) for uninstall
        if mode == "apply":
            try:
                self.events = torch.load(path, weights_only=False)
            except Exception as exc:  # the original crashed before saving, or wrote nothing
                self.active = False
                notes.append(f"transplant: no record of the original run ({type(exc).__name__}); weights not copied")

    # ---------------------------------------------------------------------------------- hooks

    def install(self) -> None:
        torch = self.torch
        for name in dir(torch.nn):
            cls = getattr(torch.nn, name, None)
            if (
                isinstance(cls, type)
                and issubclass(cls, torch.nn.Module)
                and cls is not torch.nn.Module
                and "__init__" in cls.__dict__
            ):
                self._patched.append((cls, "__init__", cls.__dict__["__init__"]))
                setattr(cls, "__init__", self._wrap_init(cls.__dict__["__init__"]))  # on the class, for every instance
        init = torch.nn.init
        for name in dir(init):
            fn = getattr(init, name)
            if name.endswith("_") and not name.startswith("_") and callable(fn):
                self._patched.append((init, name, fn))
                setattr(init, name, self._wrap_fn(name, fn))

    def uninstall(self) -> None:
        """Put back what :meth:`install` replaced (the harness process simply exits instead)."""
        for owner, name, orig in reversed(self._patched):
            setattr(owner, name, orig)
        self._patched.clear()

    def _wrap_init(self, orig: Any) -> Any:
        tp = self

        @functools.wraps(orig)
        def __init__(module, *args, **kwargs):
            tp.depth += 1
            try:
                orig(module, *args, **kwargs)
            finally:
                tp.depth -= 1
            if tp.depth == 0 and tp.active:
                tp._module_event(module)

        return __init__

    def _wrap_fn(self, name: str, orig: Any) -> Any:
        tp = self

        @functools.wraps(orig)
        def fn(*args, **kwargs):
            tp.depth += 1
            try:
                out = orig(*args, **kwargs)
            finally:
                tp.depth -= 1
            if tp.depth == 0 and tp.active and args and isinstance(args[0], tp.torch.Tensor):
                tp._tensor_event(name, args[0])
            return out

        return fn

    # --------------------------------------------------------------------------------- events

    def _rng(self) -> dict:
        torch = self.torch
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def _module_event(self, module: Any) -> None:
        state = module.state_dict()
        if not state:
            return  # activations, empty containers: nothing to copy
        if self.mode == "record":
            self.events.append(
                {
                    "kind": "module",
                    "name": type(module).__name__,
                    "state": {k: v.detach().cpu().clone() for k, v in state.items()},
                    "rng": self._rng(),
                }
            )
            return
        ev = self._next("module", type(module).__name__)
        if ev is None:
            return
        if set(ev["state"]) != set(state):
            return self._stop(
                f"{type(module).__name__} has state keys {sorted(state)[:4]}..., "
                f"the original {sorted(ev['state'])[:4]}..."
            )
        for key, dst in state.items():
            if not self._copy(dst, ev["state"][key], f"{type(module).__name__}.{key}"):
                return
        self._set_rng(ev["rng"])

    def _tensor_event(self, name: str, tensor: Any) -> None:
        if self.mode == "record":
            self.events.append(
                {"kind": "init", "name": name, "tensor": tensor.detach().cpu().clone(), "rng": self._rng()}
            )
            return
        ev = self._next("init", name)
        if ev is not None and self._copy(tensor, ev["tensor"], f"torch.nn.init.{name}"):
            self._set_rng(ev["rng"])

    def _next(self, kind: str, name: str) -> dict | None:
        if self.index >= len(self.events):
            self._stop(f"the rewritten program built more modules than the original ({kind} {name})")
            return None
        ev = self.events[self.index]
        self.index += 1
        if ev["kind"] != kind or ev["name"] != name:
            self._stop(f"event {self.index} is {kind} {name}, in the original {ev['kind']} {ev['name']}")
            return None
        return ev

    def _copy(self, dst: Any, src: Any, what: str) -> bool:
        torch = self.torch
        if tuple(dst.shape) == tuple(src.shape):
            with torch.no_grad():
                dst.copy_(src)
            return True
        if not grown(src.shape, dst.shape):
            self._stop(f"{what}: shape {tuple(dst.shape)} cannot hold the original {tuple(src.shape)}")
            return False
        with torch.no_grad():
            dst.zero_()
            leading(dst, src.shape).copy_(src)
        self.grown += 1
        return True

    def _set_rng(self, rng: dict) -> None:
        torch = self.torch
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def _stop(self, why: str) -> None:
        self.active = False
        self.notes.append(f"transplant stopped: {why}")

    def finish(self) -> None:
        if self.mode == "record":
            self.torch.save(self.events, self.path)
            return
        if self.active and self.index != len(self.events):
            self.notes.append(
                f"transplant: the original built {len(self.events)} modules/inits, the rewrite {self.index}"
            )
        self.notes.append(
            f"transplant: {self.index} construction/init event(s) copied from the original run, "
            f"{self.grown} tensor(s) into the leading slices of padded ones (zeros elsewhere)"
        )
