"""Runs one version of a program under observation, in a process of its own, and saves its probes.

    python -m torchopt.validate.harness SPEC.json

It seeds every generator, turns on deterministic algorithms, records every loss passed to
``backward``/``GradScaler.scale``, stops the program after N optimizer steps without its
cooperation, then records parameters, optimizer state, the model's outputs on the first batch it
saw (eval mode), the script's global tensors and the RNG state. Rewritten modules are served by an
import hook, so nothing on disk changes.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import json
import math
import os
import random
import sys
import traceback
import types
from typing import Any

from torchopt.validate import twins


class StopRun(BaseException):
    """Raised after the N-th optimizer step; a BaseException so `except Exception` cannot swallow it."""


# --------------------------------------------------------------------------- import hook


class _OverrideLoader(importlib.machinery.SourceFileLoader):
    """Serves the in-memory (rewritten) source of a file instead of what is on disk."""

    def __init__(self, fullname: str, path: str, text: str) -> None:
        super().__init__(fullname, path)
        self._text = text

    def get_data(self, path: str) -> bytes:
        if os.path.realpath(path) == os.path.realpath(self.path):
            return self._text.encode("utf-8")
        return super().get_data(path)

    def source_to_code(self, data, path, *, _optimize=-1):  # type: ignore[override]  # typeshed has it static; the loader calls it on self
        # Compile the text itself: the file's coding line (latin-1, ...) names the bytes on disk,
        # not the UTF-8 bytes get_data hands back.
        if os.path.realpath(path) == os.path.realpath(self.path):
            return compile(self._text, path, "exec", dont_inherit=True, optimize=_optimize)
        return super().source_to_code(data, path, _optimize=_optimize)

    def get_source(self, fullname: str) -> str:
        return self._text

    def path_stats(self, path: str):  # never trust a .pyc of the file on disk
        raise OSError("in-memory source")

    def set_data(self, path: str, data: object, *, _mode: int = 0o666) -> None:
        pass  # write no bytecode


class _OverrideFinder(importlib.abc.MetaPathFinder):
    def __init__(self, sources: dict[str, str]) -> None:
        self.sources = {os.path.realpath(p): t for p, t in sources.items()}

    def find_spec(self, fullname, path, target=None):
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin:
            return None
        text = self.sources.get(os.path.realpath(spec.origin))
        if text is None:
            return None
        spec.loader = _OverrideLoader(fullname, spec.origin, text)
        return spec


# --------------------------------------------------------------------------- recording


class Recorder:
    def __init__(self, torch: Any, steps: int) -> None:
        self.torch = torch
        self.max_steps = steps
        self.losses: list[Any] = []
        self.loss_steps: list[int] = []
        self.loss_dtypes: list[str] = []  # what each loss was computed in (before the float copy)
        self.steps_done = 0
        self.optimizers: list[Any] = []
        self.first_inputs: dict[int, tuple[Any, tuple, dict]] = {}
        self._scaled: set[int] = set()
        self.notes: list[str] = []
        self.site_errors: list[str] = []
        self.site_calls: dict[str, int] = {}
        self.site_objects: dict[str, str] = {}  # sites whose value is not a tensor: its type
        self.objects = twins.Sites()  # modules replayed by state, loaders checked batch for batch
        self.uncomputed: list[str] = []  # globals holding clock/process/random values (provenance.py)

    def _record_loss(self, t: Any) -> None:
        try:
            self.losses.append(t.detach().float().cpu().clone())
            self.loss_steps.append(self.steps_done)
            self.loss_dtypes.append(str(t.dtype))
        except Exception:  # not a tensor we can read; keep running
            pass

    def install(self) -> None:
        torch = self.torch
        rec = self
        orig_backward = torch.Tensor.backward

        def backward(self, *args, **kwargs):
            if id(self) in rec._scaled:
                rec._scaled.discard(id(self))
            else:
                rec._record_loss(self)
            return orig_backward(self, *args, **kwargs)

        torch.Tensor.backward = backward

        scaler_cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if scaler_cls is not None:
            orig_scale = scaler_cls.scale

            def scale(self, outputs):
                if isinstance(outputs, torch.Tensor):
                    rec._record_loss(outputs)
                out = orig_scale(self, outputs)
                if isinstance(out, torch.Tensor):
                    rec._scaled.add(id(out))
                return out

            scaler_cls.scale = scale

        def after_step(opt, args, kwargs):
            if not any(o is opt for o in rec.optimizers):
                rec.optimizers.append(opt)
            if opt is rec.optimizers[0]:  # count iterations by the first optimizer that steps
                rec.steps_done += 1
                if rec.max_steps and rec.steps_done >= rec.max_steps:
                    raise StopRun()

        import torch.optim.optimizer as optim_mod

        optim_mod.register_optimizer_step_post_hook(after_step)

        def before_forward(module, args, kwargs=None):
            # The probe batch is the module's first input after the first optimizer step (else its
            # very first input): a warm-up forward a rewrite inserts before training (TOP711) must
            # not make the two versions probe different batches.
            if torch.jit.is_tracing():  # the trace must see the program's operations only
                return None
            key = id(module)
            seen = rec.first_inputs.get(key)
            if seen is not None and (seen[2]["after_step"] or rec.steps_done == 0):
                return None
            if next(module.parameters(recurse=True), None) is None:
                return None
            try:
                cloned = tuple(_detach(a, torch) for a in args)
                rec.first_inputs[key] = (
                    module,
                    cloned,
                    {"after_step": rec.steps_done > 0, "autocast": _autocast_state(cloned, torch)},
                )
            except Exception:
                pass
            return None

        # Never traced by torch.compile: dynamo would guard on this module's globals through
        # `sys.modules["__main__"]`, which is the program's namespace here (AttributeError: `_detach`).
        torch.nn.modules.module.register_module_forward_pre_hook(torch.compiler.disable(before_forward))

    # -- collection --------------------------------------------------------------------------

    def roots(self) -> list[Any]:
        seen = [m for m, _, _ in self.first_inputs.values()]
        inner: set[int] = set()
        for m in seen:
            inner.update(id(c) for c in m.modules() if c is not m)
        return [m for m in seen if id(m) not in inner]

    def collect(self, namespace: dict[str, Any] | None, returned: Any = None, has_return: bool = False) -> dict:
        torch = self.torch
        tensors: dict[str, Any] = {}
        names_by_id = {id(v): k for k, v in (namespace or {}).items() if not k.startswith("_")}
        param_names: dict[int, str] = {}
        roots = self.roots()
        for i, m in enumerate(roots):
            name = names_by_id.get(id(m), f"module{i}")
            for key, value in _strip_prefixes(m.state_dict(keep_vars=True)).items():
                tensors[f"param/{name}.{key}"] = _cpu(value, torch)
                param_names[id(value)] = f"{name}.{key}"
        for i, opt in enumerate(self.optimizers):
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    pname = param_names.get(id(p))
                    if pname is None:
                        pname = names_by_id.get(id(p), f"opt{i}.group{g}.{j}")
                        tensors[f"param/{pname}"] = _cpu(p, torch)
                    for k, v in opt.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor):
                            tensors[f"optim/opt{i}.{pname}.{k}"] = _cpu(v, torch)
        for i, m in enumerate(roots):
            name = names_by_id.get(id(m), f"module{i}")
            _, args, seen = self.first_inputs[id(m)]
            was_training = m.training
            try:
                m.eval()
                with torch.no_grad(), _replay_autocast(seen.get("autocast"), torch):
                    out = m(*args)
                for k, v in _flatten(out, f"output/{name}", torch):
                    tensors[k] = v
            except Exception as exc:
                self.notes.append(f"probe batch on {name} failed: {type(exc).__name__}: {exc}")
            finally:
                m.train(was_training)
        if namespace is not None:
            for k, v in namespace.items():
                if (
                    k.startswith("_")
                    or isinstance(v, (types.ModuleType, type))
                    or callable(v)
                    and not isinstance(v, torch.nn.Module)
                ):
                    continue
                if isinstance(v, torch.nn.Module):
                    if any(v is r for r in roots):
                        continue
                    for key, t in _strip_prefixes(v.state_dict()).items():
                        tensors[f"global/{k}.{key}"] = _cpu(t, torch)
                    continue
                for name, t in _flatten(v, f"global/{k}", torch):
                    tensors[name] = t
        if has_return:
            for name, t in _flatten(returned, "return", torch):
                tensors[name] = t
        tensors["rng/cpu"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng/cuda{i}"] = s
        return {
            "losses": self.losses,
            "loss_steps": self.loss_steps,
            "loss_dtypes": self.loss_dtypes,
            "steps_done": self.steps_done,
            "tensors": tensors,
            "notes": self.notes,
            "site_errors": self.site_errors + self.objects.errors,
            "site_unchecked": dict(self.objects.unchecked),
            "site_modules": list(self.objects.modules),
            "site_loaders": dict(self.objects.loaders),
            "site_calls": dict(self.site_calls),
            "site_objects": dict(self.site_objects),
            "uncomputed": list(self.uncomputed),
        }


def _autocast_state(args: tuple, torch: Any) -> tuple[str, Any] | None:
    """The autocast region the module's input was seen in (device type, dtype), or None. Inputs
    computed inside it (an RNN's hidden state) are in its dtype, so the probe batch must be
    replayed inside the same region or the model rejects them."""
    devices = list(dict.fromkeys([*(t.device.type for t in _tensors(args, torch)), "cpu"]))
    for device in devices:
        try:
            enabled, dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        except TypeError:  # torch < 2.4: one query per device kind
            cpu = device == "cpu"
            enabled = torch.is_autocast_cpu_enabled() if cpu else torch.is_autocast_enabled()
            dtype = torch.get_autocast_cpu_dtype() if cpu else torch.get_autocast_gpu_dtype()
        except (RuntimeError, AttributeError):  # a device type autocast does not know
            continue
        if enabled:
            return device, dtype
    return None


def _replay_autocast(state: tuple[str, Any] | None, torch: Any) -> Any:
    import contextlib

    return contextlib.nullcontext() if state is None else torch.autocast(state[0], dtype=state[1])


def _tensors(value: Any, torch: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for x in value for t in _tensors(x, torch)]
    if isinstance(value, dict):
        return [t for x in value.values() for t in _tensors(x, torch)]
    return []


def _detach(value: Any, torch: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(x, torch) for x in value)
    if isinstance(value, dict):
        return {k: _detach(v, torch) for k, v in value.items()}
    return value


def _cpu(t: Any, torch: Any) -> Any:
    return t.detach().cpu().clone()


def _strip_prefixes(sd: dict) -> dict:
    """DDP's `module.` and torch.compile's `_orig_mod.` prefixes name the same parameters."""
    out = {}
    for k, v in sd.items():
        while k.startswith(("module.", "_orig_mod.")):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


def _flatten(value: Any, prefix: str, torch: Any, depth: int = 0):
    if depth > 4:
        return
    if isinstance(value, torch.Tensor):
        yield prefix, _cpu(value, torch)
    elif isinstance(value, bool) or isinstance(value, int):
        yield prefix, torch.tensor(int(value), dtype=torch.int64)
    elif isinstance(value, float):
        yield prefix, torch.tensor(value, dtype=torch.float64)
    elif isinstance(value, (list, tuple)) and len(value) <= 10_000:
        for i, v in enumerate(value):
            yield from _flatten(v, f"{prefix}[{i}]", torch, depth + 1)
    elif isinstance(value, dict) and len(value) <= 10_000:
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}[{k!r}]", torch, depth + 1)
    elif isinstance(value, torch.nn.Module):
        for k, v in _strip_prefixes(value.state_dict()).items():
            yield f"{prefix}.{k}", _cpu(v, torch)


# --------------------------------------------------------------------------- replay sites (random-stream fixes)


def _install_sites(torch: Any, rec: Recorder) -> None:
    """`__torchopt_site__(id, new, original=None)`: see torchopt.validate.replay."""
    calls: dict[str, int] = {}

    def site(site_id: str, new_fn: Any, orig_fn: Any = None) -> Any:
        if orig_fn is None:  # the baseline: just evaluate
            return new_fn()
        calls[site_id] = calls.get(site_id, 0) + 1
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            new = new_fn()
        old = orig_fn()
        unlike = _object_unlike(torch, new, old)
        if unlike and isinstance(new, torch.nn.Module) and twins.module_by_state(torch, new, old):
            if site_id not in rec.objects.modules:
                rec.objects.modules.append(site_id)
            return new  # the rewrite's module runs, from the original's values (twins.py)
        if unlike and twins.loader_twin(torch, rec.objects, site_id, new, old):
            return old  # it checks each batch against the rewrite's loader (twins.py)
        if unlike:  # the original's object stands in for one the fix built otherwise
            rec.site_objects.setdefault(site_id, unlike)
        problem = _site_problem(torch, new, old)
        if problem and not any(e.startswith(f"{site_id}:") for e in rec.site_errors):
            rec.site_errors.append(f"{site_id}: {problem}")
        return old

    builtins.__torchopt_site__ = site  # type: ignore[attr-defined]  # our own name, which the instrumented code calls
    rec.site_calls = calls


def _object_unlike(torch: Any, new: Any, old: Any) -> str:
    """Why handing back ``old`` in place of ``new`` hides what the fix changed ("" when it does not):
    a tensor, or a module with the same parameters and buffers (names, shapes, dtypes, devices),
    stands in for the new one as its random values do; any other object does not."""
    if isinstance(old, torch.Tensor):
        return ""
    if isinstance(old, torch.nn.Module) and isinstance(new, torch.nn.Module):
        a, b = new.state_dict(), old.state_dict()
        if a.keys() == b.keys() and all(
            (a[k].shape, a[k].dtype, a[k].device) == (b[k].shape, b[k].dtype, b[k].device) for k in a
        ):
            return ""
        return f"{type(old).__name__}, whose parameters differ from the rewrite's"
    return type(old).__name__


def _site_problem(torch: Any, new: Any, old: Any) -> str | None:
    if not (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)):
        return None if type(new) is type(old) else f"returns {type(new).__name__}, was {type(old).__name__}"
    for attr in ("shape", "dtype", "device", "requires_grad"):
        a, b = getattr(new, attr), getattr(old, attr)
        if a != b:
            return f"{attr} is {a}, was {b}"
    if new.is_floating_point() and new.numel() >= 30:
        n = new.numel()
        a, b = new.detach().double().cpu(), old.detach().double().cpu()
        bound = 5 * float(b.std()) / math.sqrt(n) + 1e-12
        if abs(float(a.mean()) - float(b.mean())) > bound:
            return f"mean {float(a.mean()):.4g} is more than 5 sigma/sqrt(n) from {float(b.mean()):.4g}"
    return None


# --------------------------------------------------------------------------- timing (--bench)


class StepClock:
    """Bench mode: a clock reading after each step of the first optimizer that steps, taken after
    synchronising the device; stops the program after N steps. Records nothing else, so the
    program runs at its own speed."""

    def __init__(self, torch: Any, steps: int) -> None:
        self.torch = torch
        self.max_steps = steps
        self.marks: list[float] = []
        self.first: Any = None

    def install(self) -> None:
        import time

        import torch.optim.optimizer as optim_mod

        torch = self.torch

        def after_step(opt, args, kwargs):
            if self.first is None:
                self.first = opt
            if opt is not self.first:
                return
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())
            if self.max_steps and len(self.marks) >= self.max_steps:
                raise StopRun()

        optim_mod.register_optimizer_step_post_hook(after_step)

    def collect(self) -> dict:
        torch = self.torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
            kind = "CUDA max_memory_allocated"
        else:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
            kind = "process peak RSS"
        return {
            "marks": list(self.marks),
            "steps_done": len(self.marks),
            "peak_memory": int(peak),
            "memory_kind": kind,
            "losses": [],
            "loss_steps": [],
            "tensors": {},
            "notes": [],
        }


# --------------------------------------------------------------------------- set-up


def _seed(torch: Any, seed: int) -> None:
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)  # seeds every CUDA device too


def _determinism(torch: Any, threads: int) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:  # compiled random ops draw as eager ones do (use_deterministic_algorithms imported it)
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
    except Exception:
        pass
    if threads:
        torch.set_num_threads(threads)


def _reduced_precision(torch: Any, precision: dict | None) -> Any:
    """The reference run of a numerics-changing fix (docs/validation.md, "Tolerances"): the original
    program with the precision reduced by the harness itself, TF32 switched on and/or the whole run
    inside one ``torch.autocast``. How far it lands from the float32 run is the program's own noise
    floor."""
    import contextlib

    if not precision:
        return contextlib.nullcontext()
    if precision.get("tf32"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    dtype = precision.get("autocast")
    if not dtype:
        return contextlib.nullcontext()
    device = precision.get("device") or "cpu"
    # Autocast applies to the forward pass: the backward runs outside it, as PyTorch's AMP recipe
    # asks (on the CPU the backward runs on the calling thread and would otherwise autocast too).
    for name in ("backward", "grad"):
        plain = getattr(torch.autograd, name)

        def outside(*args: Any, _plain: Any = plain, **kwargs: Any) -> Any:
            with torch.autocast(device, enabled=False):
                return _plain(*args, **kwargs)

        setattr(torch.autograd, name, outside)
    # Autocast caches its low-precision copies of the parameters until the outermost region exits,
    # which a region around the whole run never does: the forward would keep using step 0's
    # weights. The cache is dropped after every optimizer step, as leaving a per-step region does.
    import torch.optim.optimizer as optim_mod

    optim_mod.register_optimizer_step_post_hook(lambda *_: torch.clear_autocast_cache())
    return torch.autocast(device, dtype=getattr(torch, dtype))


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# audit event -> positions of the path arguments it changes; the NOFOLLOW ones act on a link itself
_PATH_EVENTS = {
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.rename": (0, 1),
    "os.mkdir": (0,),
    "os.truncate": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.utime": (0,),
    "os.link": (1,),
    "os.symlink": (1,),
    "shutil.rmtree": (0,),
    "sqlite3.connect": (0,),  # opens (and creates, journals) the database file for writing
}
_NOFOLLOW_EVENTS = frozenset({"os.remove", "os.rmdir", "os.rename", "os.symlink", "os.link"})


class _WriteGuard:
    """Refuses writes into the user's folders: the program runs in a scratch copy, and a write
    to an absolute path (or through a link to a file too big to copy) would reach the original."""

    def __init__(self, protect: list[str], allow: list[str]) -> None:
        self.protect = [os.path.realpath(p) for p in protect]
        self.allow = [os.path.realpath(p) for p in allow]

    @staticmethod
    def _inside(path: str, roots: list[str]) -> bool:
        return any(path == r or path.startswith(r + os.sep) for r in roots)

    def check(self, path: Any, follow: bool = True) -> None:
        if isinstance(path, int) or path is None:
            return
        try:
            path = os.fsdecode(os.fspath(path))
        except TypeError:
            return
        if follow:
            real = os.path.realpath(path)
        else:  # removing or renaming a link in the copy leaves its target alone
            real = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
        if self._inside(real, self.protect) and not self._inside(real, self.allow):
            raise PermissionError(
                13,
                "torchopt validate: refusing to write into your folder (the program runs in a scratch "
                "copy of it; write relative to the working directory instead)",
                real,
            )

    def hook(self, event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if writing:
                self.check(path)
        elif event in _PATH_EVENTS:
            for i in _PATH_EVENTS[event]:
                if i < len(args):
                    self.check(args[i], follow=event not in _NOFOLLOW_EVENTS)


def install_write_guard(protect: list[str], allow: list[str]) -> _WriteGuard:
    """The audit hook that refuses writes into ``protect`` (outside ``allow``)."""
    guard = _WriteGuard(protect, allow)
    sys.addaudithook(guard.hook)
    return guard


def guard_writes(torch: Any, protect: list[str], allow: list[str]) -> None:
    """The audit hook, and the savers that write from C++ (torch.save, torch.jit.save) checked too."""
    guard = install_write_guard(protect, allow)
    # torch.save opens plain paths in C++, out of the audit hook's sight.
    save = torch.save

    def guarded_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            guard.check(f)
        return save(obj, f, *args, **kwargs)

    torch.save = guarded_save
    torch.serialization.save = guarded_save
    # torch.jit.save writes from C++ too.
    jit_save = torch.jit.save

    def guarded_jit_save(m, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            guard.check(f)
        return jit_save(m, f, *args, **kwargs)

    torch.jit.save = guarded_jit_save


def _script_module(path: str, argv: list[str]) -> types.ModuleType:
    """A fresh `__main__` whose namespace we keep even when the run is stopped midway."""
    mod = types.ModuleType("__main__")
    mod.__file__ = path
    mod.__builtins__ = builtins  # type: ignore[attr-defined]  # ModuleType's stub lacks it; exec reads it
    sys.modules["__main__"] = mod
    sys.argv = [path, *argv]
    return mod


def main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    rank = int(os.environ.get("RANK", "0"))
    out_path = spec["out"].format(rank=rank)
    import torch

    bench = bool(spec.get("bench"))
    _seed(torch, int(spec.get("seed", 0)))
    if not bench:  # timing measures the program as it runs on its own
        _determinism(torch, int(spec.get("threads", 1)))
    if spec.get("sources"):
        sys.meta_path.insert(0, _OverrideFinder(spec["sources"]))
    for p in reversed(spec.get("sys_path", [])):
        sys.path.insert(0, p)
    rec = Recorder(torch, int(spec.get("steps", 0)))
    clock = StepClock(torch, int(spec.get("steps", 0)))
    if bench:
        clock.install()
    else:
        rec.install()
    _install_sites(torch, rec)
    transplant = None
    if spec.get("transplant"):  # padded parameters start from the original's weights (transplant.py)
        from torchopt.validate.transplant import Transplant

        transplant = Transplant(
            torch, spec["transplant"]["mode"], f"{spec['transplant']['path']}.rank{rank}", rec.notes
        )
        transplant.install()
    if spec.get("protect"):
        guard_writes(torch, spec["protect"], spec.get("allow", []))
    status, tb = "ok", None
    namespace: dict[str, Any] | None = None
    returned: Any = None
    has_return = False
    reduced = _reduced_precision(torch, spec.get("precision"))
    reduced.__enter__()
    try:
        if spec["mode"] == "script":
            path = spec["path"]
            source = spec.get("source")
            if source is None:  # as the rewrite engine reads it: coding line, BOM
                from torchopt.rewrite.source import read

                source = read(path, 0).text
            mod = _script_module(path, spec.get("argv", []))
            namespace = mod.__dict__
            from torchopt.validate.provenance import uncomputed_globals

            rec.uncomputed = sorted(uncomputed_globals(source))
            exec(compile(source, path, "exec", dont_inherit=True), namespace)
        else:
            module_name, _, func_name = spec["entry"].partition(":")
            module = importlib.import_module(module_name)
            returned = getattr(module, func_name)()
            has_return = True
    except StopRun:
        pass
    except SystemExit as exc:
        if exc.code not in (None, 0):
            status, tb = "error", f"SystemExit: {exc.code}"
    except BaseException:
        status, tb = "error", traceback.format_exc()
    reduced.__exit__(None, None, None)
    if transplant is not None:
        transplant.finish()
    try:
        probes = clock.collect() if bench else rec.collect(namespace, returned, has_return=has_return)
    except Exception:
        probes = {
            "losses": rec.losses,
            "loss_steps": rec.loss_steps,
            "steps_done": rec.steps_done,
            "tensors": {},
            "notes": [f"collecting probes failed: {traceback.format_exc()}"],
        }
    probes.update(status=status, traceback=tb, device="cuda" if torch.cuda.is_available() else "cpu", rank=rank)
    torch.save(probes, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
