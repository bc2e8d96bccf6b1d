"""Does a global switch pay in this program: the facts TOP501 and TOP502 ask before inserting one.

Both switches trade a one-off cost or some precision for speed on *repeated* work: the cuDNN
auto-tuner benchmarks every convolution once per input shape and pays back over the later calls
with that shape; TF32 speeds up float32 matrix multiplies. Three facts of the program decide
whether that happens here:

* **Repeated forwards** (:attr:`Pays.repeats`): some loop of the file calls a model (``model(x)``,
  ``model.generate(x)``) on every iteration, directly or through functions of the file it calls.
  A forward that runs inside a FLOP counter (``with FlopCounterMode():``) or is handed to a FLOP
  analysis (``fvcore.nn.FlopCountAnalysis(model, x)``) is measured, not run for its results, and
  does not count. ``False`` is established only when no loop calls a model and the model is never
  handed to a function outside the file (``train(model, loader)`` from another module may loop:
  then the fact is unknown, ``None``, and the rules behave as before).
* **Input shapes per call** (:attr:`Pays.per_file`): the loop that calls the model iterates a file
  listing (``os.listdir``, ``glob.glob``, ``os.scandir``, ``os.walk``, ``Path(d).glob(...)``) and
  calls the model once per file on what it read: each file has its own length or size, so every
  call is a new shape unless something in between fixes the size. Established when nothing on the
  way (the loop body, the functions of the file it calls, the project functions they call, as the
  project index summarises them) resizes or crops (``interpolate``, ``resize``, a ``torchvision``
  resize, crop or ``Compose``, a slice with literal bounds); unknown when a call on the way cannot be read (a
  function of a module outside the run, a callable object whose value the file does not show).
* **Autocast** (:attr:`Pays.autocast`): every repeated forward and matmul runs inside the program's
  own ``torch.autocast`` / ``torch.cuda.amp.autocast`` block (or a function of the file or of the
  project that returns one): its matmuls run in float16/bfloat16, which TF32 does not affect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import libcst as cst
from libcst.metadata import BuiltinAssignment

from torchopt.analysis.conventions import CONVENTIONAL_MODEL_NAMES
from torchopt.analysis.lifecycle import lifecycle_of
from torchopt.analysis.names import bindings_of, callee, dotted, qualified_names
from torchopt.analysis.program import MODULE_WRAPPERS, Program, program_of
from torchopt.analysis.project import Definition, Unknown, index_of
from torchopt.analysis.project_summary import AUTOCASTS, SIZE_FIXERS
from torchopt.analysis.syntax import walk
from torchopt.analysis.values import string_value
from torchopt.codemods.flags.program_flags import Program as FlagProgram
from torchopt.rewrite.rule import Rule

# FLOP counters: a forward inside one (or a model handed to one) is measured, not run for results.
_COUNTER_CONTEXTS = {"torch.utils.flop_counter.FlopCounterMode"}
_COUNTER_CALLS = {
    "fvcore.nn.FlopCountAnalysis",
    "fvcore.nn.ActivationCountAnalysis",
    "fvcore.nn.flop_count",
    "fvcore.nn.parameter_count",
    "thop.profile",
    "ptflops.get_model_complexity_info",
}
# Calls that list the files of a folder.
_LISTINGS = {"os.listdir", "os.scandir", "os.walk", "glob.glob", "glob.iglob"}
_PATH_LISTINGS = {"glob", "rglob", "iterdir"}  # methods of a `pathlib.Path(...)`
_ITER_WRAPPERS = {"enumerate", "sorted", "list", "tqdm.tqdm", "tqdm.auto.tqdm", "reversed"}
# Methods of a module that run no forward.
_NOT_FORWARD = {
    "to",
    "cuda",
    "cpu",
    "npu",
    "xpu",
    "mps",
    "half",
    "float",
    "double",
    "bfloat16",
    "eval",
    "train",
    "parameters",
    "named_parameters",
    "buffers",
    "named_buffers",
    "modules",
    "named_modules",
    "children",
    "named_children",
    "state_dict",
    "load_state_dict",
    "zero_grad",
    "apply",
    "requires_grad_",
    "register_buffer",
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "share_memory",
}
_BUILTINS = {"isinstance", "hasattr", "getattr", "setattr", "print", "len", "id", "type", "repr", "str", "vars"}
_DEPTH = 4


@dataclass
class Pays:
    repeats: bool | None = None  # see the module docstring
    forwards: list[cst.CSTNode] = field(default_factory=list)  # forwards, convolution and matmul ops run in loops
    passed: str = ""  # the call outside the file a model is handed to (why `repeats` is unknown)
    per_file: bool | None = False  # None: a per-file loop whose shapes are unknown
    per_file_why: str = ""
    per_file_loop: cst.For | None = None
    autocast: bool | None = False  # None: a block that may be autocast could not be read
    autocast_why: str = ""


def pays(rule: Rule, prog: FlagProgram) -> Pays:
    """The facts of the rule's file, worked out once per parse and shared by the flag rules."""
    ops = [m for m in [*prog.convs, *prog.matmuls] if id(m) not in prog.built_elsewhere]  # not `Net()` elsewhere
    module = rule.ctx.module
    return rule.ctx.facts.about_node(("flags pays",), module, lambda: _Analysis(rule, ops).run())


class _Analysis:
    def __init__(self, rule: Rule, ops: list[cst.CSTNode]) -> None:
        self.rule = rule
        self.prog: Program = program_of(rule)
        self.objects = {o.name for o in lifecycle_of(rule).objects}
        self.op_ids = {id(n) for n in ops if not _builds_layer(rule, n)}
        self.out = Pays()
        self.loops_with_forwards: list[cst.CSTNode] = []
        self.autocast_why = ""
        self._assigned: dict[int, dict[str, list[cst.BaseExpression]]] = {}  # id(scope) -> name -> values

    # ------------------------------------------------------------------ what a call is
    def is_model(self, expr: cst.BaseExpression, at: cst.CSTNode) -> bool:
        d = dotted(expr)
        if d is None or self._defined(expr, at):
            return False
        if d.rsplit(".", 1)[-1] in CONVENTIONAL_MODEL_NAMES or d in self.objects:
            return True
        role = self.prog.role_of(expr, at)
        if role is not None and role.kind == "model":
            return True
        value = self._local_value(expr, at) if isinstance(expr, cst.Name) else None
        while (
            isinstance(value, cst.Call)
            and isinstance(value.func, cst.Attribute)
            and value.func.attr.value in _NOT_FORWARD
        ):
            value = value.func.value  # `Net().to(device).eval()`
        return isinstance(value, cst.Call) and self._builds_module(value)

    def _defined(self, expr: cst.BaseExpression, at: cst.CSTNode) -> bool:
        """``expr`` names a function or class (of the file, the project or a library), not a module object."""
        if isinstance(expr, cst.Name) and any(
            isinstance(getattr(b, "node", None), (cst.FunctionDef, cst.ClassDef, cst.Import, cst.ImportFrom))
            for b in bindings_of(self.rule, expr) or ()
        ):
            return True
        return bool(qualified_names(self.rule, expr)) if isinstance(expr, (cst.Name, cst.Attribute)) else False

    def _builds_module(self, call: cst.Call) -> bool:
        """``call`` builds a module: a project class that is an ``nn.Module``, or a function of the
        file that returns a model (a function that only calls a builder returns something else)."""
        fn, how = self.prog.resolve_callable(call.func, call)
        if fn is not None:
            return fn.cls in self.prog.module_classes if how == "constructor" else fn.qualname in self.prog.factories
        written = dotted(call.func)
        found = index_of(self.rule).resolve(written) if written else None
        return (
            isinstance(found, Definition)
            and found.kind == "class"
            and index_of(self.rule).is_module_class(found) is True
        )

    def is_forward(self, c: cst.Call) -> bool:
        if self.is_model(c.func, c):
            return True
        f = c.func
        return isinstance(f, cst.Attribute) and f.attr.value not in _NOT_FORWARD and self.is_model(f.value, c)

    def may_forward(self, c: cst.Call) -> bool:
        """``c`` calls a value the file holds (``g(z)``, ``self.head(x)``) that may be a module the
        analysis does not recognise: counted as a forward, so that no loop is taken for one that
        runs none."""
        f = c.func
        if isinstance(f, cst.Name):
            return not self._defined(f, c) and self._bound_here(f)
        return (
            isinstance(f, cst.Attribute)
            and isinstance(f.value, cst.Name)
            and f.value.value == "self"
            and self.prog.resolve_callable(f, c)[0] is None
        )

    def qualified(self, c: cst.Call) -> set[str]:
        if isinstance(c.func, (cst.Name, cst.Attribute)):
            return qualified_names(self.rule, c.func)
        return set()

    def counted(self, node: cst.CSTNode) -> bool:
        """``node`` runs inside a FLOP counter's ``with`` block."""
        cur = self.prog.parent(node)
        while cur is not None and not isinstance(cur, cst.Module):
            if isinstance(cur, cst.With) and any(self._counter(i.item, cur) for i in cur.items):
                return True
            cur = self.prog.parent(cur)
        return False

    def _counter(self, expr: cst.BaseExpression, at: cst.CSTNode) -> bool:
        value = self._local_value(expr, at) if isinstance(expr, cst.Name) else expr
        return isinstance(value, cst.Call) and bool(self.qualified(value) & _COUNTER_CONTEXTS)

    def _local_value(self, name: cst.Name, at: cst.CSTNode) -> cst.BaseExpression | None:
        """The value of the one plain assignment ``name = value`` in the function (or module) holding ``at``."""
        fn = self.prog.function_of(at)
        scope: cst.CSTNode = fn.node if fn is not None else self.rule.ctx.module
        assigned = self._assigned.get(id(scope))
        if assigned is None:
            assigned = self._assigned[id(scope)] = {}
            for n in walk(scope):
                if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.targets[0].target, cst.Name):
                    assigned.setdefault(n.targets[0].target.value, []).append(n.value)
        found = assigned.get(name.value, [])
        return found[0] if len(found) == 1 else None

    # ------------------------------------------------------------------ repeated forwards
    def run(self) -> Pays:
        loops = [n for n in self.prog.nodes if isinstance(n, (cst.For, cst.While))]
        for loop in loops:
            before = len(self.out.forwards)
            self._loop_forwards(loop.body, 0, set())
            if len(self.out.forwards) > before:
                self.loops_with_forwards.append(loop)
        for c in (n for n in self.prog.nodes if isinstance(n, cst.Call)):
            if not self.out.passed and self._passes_model_out(c):
                self.out.passed = cst.Module([]).code_for_node(c.func)
        if self.out.forwards:
            self.out.repeats = True
        elif self.out.passed:
            self.out.repeats = None
        else:
            self.out.repeats = False
        if self.out.forwards:
            self.out.autocast = _all([self._under_autocast(c) for c in self.out.forwards], False)
            self.out.autocast_why = self.autocast_why if self.out.autocast is None else ""
        self._per_file(loops)
        return self.out

    def _loop_forwards(self, body: cst.CSTNode, depth: int, seen: set[str]) -> None:
        for n in walk(body):
            if id(n) in self.op_ids:
                self.out.forwards.append(n)  # a convolution or matmul op: a call or an `@`
                continue
            if not isinstance(n, cst.Call):
                continue
            if (self.is_forward(n) or self.may_forward(n)) and not self.counted(n):
                self.out.forwards.append(n)
                continue
            fn, _ = self.prog.resolve_callable(n.func, n)
            if fn is not None and fn.qualname not in seen and depth < _DEPTH:
                self._loop_forwards(fn.node.body, depth + 1, seen | {fn.qualname})

    def _passes_model_out(self, c: cst.Call) -> bool:
        """``c`` hands a model to a function outside the file (which may run it in a loop)."""
        if not any(self.is_model(a.value, c) for a in c.args):
            return False
        if isinstance(c.func, cst.Name) and c.func.value in _BUILTINS:
            return False
        if self.prog.resolve_callable(c.func, c)[0] is not None:
            return False
        q = callee(self.rule, c)
        names = self.qualified(c)
        if names & (_COUNTER_CALLS | MODULE_WRAPPERS) or (q is not None and q.startswith("torch.")):
            return False
        return not (isinstance(c.func, cst.Attribute) and c.func.attr.value in _NOT_FORWARD)

    # ------------------------------------------------------------------ autocast
    def _under_autocast(self, node: cst.CSTNode, depth: int = 0) -> bool | None:
        """``node`` runs inside an autocast block: around it, or around every call of its function
        (None: a block around it may be one, see :meth:`_autocast`)."""
        cur = self.prog.parent(node)
        maybe = False
        while cur is not None and not isinstance(cur, cst.Module):
            if isinstance(cur, cst.With):
                got = [self._autocast(i.item) for i in cur.items]
                if True in got:
                    return True
                maybe = maybe or None in got
            if isinstance(cur, cst.FunctionDef):
                fn = self.prog.functions.get(self._qualname(cur))
                if fn is None or not fn.callers or depth >= _DEPTH:
                    break
                return _all([self._under_autocast(e.call, depth + 1) for e in fn.callers], maybe)
            cur = self.prog.parent(cur)
        return None if maybe else False

    def _qualname(self, fn: cst.FunctionDef) -> str:
        got = self.prog.function_of(fn.body)
        return got.qualname if got is not None else ""

    def _autocast(self, expr: cst.BaseExpression) -> bool | None:
        """``expr`` enters autocast for CUDA: ``torch.autocast(...)``, or a function of the file or
        of the project that returns one. None when it is a context manager whose name says autocast
        but whose definition cannot be read (a library's helper, a module outside the run)."""
        if not isinstance(expr, cst.Call):
            return False
        if _enabled_false(expr) or not _cuda_device(expr):
            return False
        names = self.qualified(expr)
        if names & AUTOCASTS:
            return True
        if any(q.startswith("torch.") for q in names):
            return False
        fn, _ = self.prog.resolve_callable(expr.func, expr)
        if fn is not None:
            return any(
                isinstance(r.value, cst.Call) and self._autocast(r.value)
                for r in walk(fn.node.body)
                if isinstance(r, cst.Return) and r.value is not None
            )
        written = dotted(expr.func)
        if written is None:
            return False
        found = index_of(self.rule).resolve(written)
        if isinstance(found, Definition) and found.unit is not None:
            return found.unit.autocast
        if "autocast" in written.rsplit(".", 1)[-1].lower():
            why = found.reason if isinstance(found, Unknown) else f"`{written}` is a library's helper"
            self.autocast_why = self.autocast_why or why
            return None
        return False

    # ------------------------------------------------------------------ per-file shapes
    def _per_file(self, loops: Sequence[cst.CSTNode]) -> None:
        """Set ``per_file`` when every loop that runs a forward is (or is inside) a per-file loop that
        calls the model on what it read, and no model is handed to code outside the file."""
        per_file = [n for n in loops if isinstance(n, cst.For) and self._lists_files(n.iter, n)]
        if not per_file or self.out.passed or not self.loops_with_forwards:
            return
        if not all(self._inside_any(loop, per_file) for loop in self.loops_with_forwards):
            return
        verdicts = []
        for loop in per_file:
            if isinstance(loop, cst.For) and any(loop is n for n in self.loops_with_forwards):
                verdicts.append((loop, self._size_fixer(loop.body, 0, set())))
        if not verdicts or any(v is not None and not v[0] for _, v in verdicts):
            return  # a crop or resize fixes the size: the shapes repeat
        self.out.per_file_loop = verdicts[0][0]
        unknown = next((v for _, v in verdicts if v is not None), None)
        if unknown is None:
            self.out.per_file = True
        else:
            self.out.per_file, self.out.per_file_why = None, unknown[1]

    def _inside_any(self, node: cst.CSTNode, loops: Sequence[cst.CSTNode]) -> bool:
        cur: cst.CSTNode | None = node
        while cur is not None and not isinstance(cur, cst.Module):
            if any(cur is loop for loop in loops):
                return True
            cur = self.prog.parent(cur)
        return False

    def _lists_files(self, expr: cst.BaseExpression, at: cst.CSTNode) -> bool:
        for _ in range(4):
            if isinstance(expr, cst.Name):
                value = self._local_value(expr, at)
                if value is None:
                    return False
                expr = value
                continue
            if not isinstance(expr, cst.Call):
                return False
            names = self.qualified(expr) | ({expr.func.value} if isinstance(expr.func, cst.Name) else set())
            if names & _LISTINGS:
                return True
            f = expr.func
            if isinstance(f, cst.Attribute) and f.attr.value in _PATH_LISTINGS and isinstance(f.value, cst.Call):
                return bool(self.qualified(f.value) & {"pathlib.Path", "pathlib.PosixPath"})
            if not (names & _ITER_WRAPPERS and expr.args):
                return False
            expr = expr.args[0].value
        return False

    def _size_fixer(self, body: cst.CSTNode, depth: int, seen: set[str]) -> tuple[bool, str] | None:
        """What may fix the input size on the way to the model: (False, why) for a resize or crop seen
        (the shapes repeat), (True, why) for a call that cannot be read (unknown), None for nothing."""
        unknown: tuple[bool, str] | None = None
        for n in walk(body):
            if isinstance(n, cst.Subscript) and _literal_slice(n):
                return False, "a slice with literal bounds"
            if not isinstance(n, cst.Call) or self.is_forward(n):
                continue
            names = self.qualified(n)
            last = n.func.attr.value if isinstance(n.func, cst.Attribute) else dotted(n.func) or ""
            if _fixes_size(last):
                return False, f"`{last}`"
            fn, _ = self.prog.resolve_callable(n.func, n)
            if fn is not None:
                if fn.qualname not in seen and depth < _DEPTH:
                    inner = self._size_fixer(fn.node.body, depth + 1, seen | {fn.qualname})
                    if inner is not None and not inner[0]:
                        return inner
                    unknown = unknown or inner
                continue
            written = dotted(n.func)
            if written is None or (isinstance(n.func, cst.Attribute) and not isinstance(n.func.value, cst.Name)):
                continue  # a method of a value: it does not resize by its name
            got = self._project_resizes(written)
            if got is not None and not got[0]:
                return got
            unknown = unknown or got
            if got is None and not names and isinstance(n.func, cst.Name) and self._bound_here(n.func):
                value = self._local_value(n.func, n)  # a callable object: `transform = Compose([...])`
                if isinstance(value, cst.Call) and _fixes_size((dotted(value.func) or "").rsplit(".", 1)[-1]):
                    return False, f"`{written}`"
                unknown = unknown or (True, f"what `{written}` (a callable object) does to the input size")
        return unknown

    def _bound_here(self, name: cst.Name) -> bool:
        """``name`` is bound by the file (a parameter, an assignment), not a builtin."""
        return any(not isinstance(b, BuiltinAssignment) for b in bindings_of(self.rule, name) or ())

    def _project_resizes(self, written: str) -> tuple[bool, str] | None:
        """What the project's function ``written`` (and the project functions it calls) does to a size:
        as :meth:`_size_fixer`; None for a name that is not the project's."""
        index = index_of(self.rule)
        found = index.resolve(written)
        if isinstance(found, Unknown):
            return True, f"what `{written}` does to the input: {found.reason}"
        if not isinstance(found, Definition) or found.unit is None:
            return None
        todo: list[Definition] = [found]
        seen: set[tuple[str, str]] = set()
        while todo:
            d = todo.pop()
            if (d.path, d.name) in seen or d.unit is None or len(seen) > 32:
                continue
            seen.add((d.path, d.name))
            if d.unit.resizes:
                return False, f"`{written}`"
            for inner in d.unit.calls:
                got = index.resolve(inner, d.module, d.path)
                if isinstance(got, Unknown):
                    return True, f"what `{written}` does to the input: `{inner}`: {got.reason}"
                if isinstance(got, Definition) and got.kind != "module":
                    todo.append(got)
        return None


def _all(got: list[bool | None], maybe: bool | None) -> bool | None:
    """True when every answer is True; False when one is False; else None (unknown)."""
    if got and all(g is True for g in got):
        return True
    if False in got:
        return None if maybe else False
    return None


def _fixes_size(last: str) -> bool:
    return last in SIZE_FIXERS


def _builds_layer(rule: Rule, node: cst.CSTNode) -> bool:
    """A layer construction (``nn.Linear(...)``, ``nn.Conv2d(...)``), as opposed to an op run where it
    stands (``F.conv2d``, ``torch.matmul``, ``@``)."""
    if not isinstance(node, cst.Call):
        return False
    q = callee(rule, node) or ""
    return q.startswith("torch.nn.") and not q.startswith("torch.nn.functional.")


def _enabled_false(call: cst.Call) -> bool:
    return any(
        a.keyword is not None
        and a.keyword.value == "enabled"
        and isinstance(a.value, cst.Name)
        and a.value.value == "False"
        for a in call.args
    )


def _cuda_device(call: cst.Call) -> bool:
    """An autocast call that may cover CUDA: its device type, when written as a string, is "cuda"."""
    device = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "device_type"), None)
    if device is None and call.args and call.args[0].keyword is None:
        device = call.args[0].value
    value = string_value(device) if isinstance(device, (cst.SimpleString, cst.ConcatenatedString)) else None
    return value is None or value.startswith("cuda")


def _literal_slice(node: cst.Subscript) -> bool:
    return any(
        isinstance(e.slice, cst.Slice) and any(isinstance(b, cst.Integer) for b in (e.slice.lower, e.slice.upper))
        for e in node.slice
    )
