"""Programs that run no step: converters, exports, data-packing and one-off scripts.

A per-step cost (a host allocation copied to the device, ``no_grad`` instead of ``inference_mode``,
launcher settings for steady CPU work) only matters in a program that repeats work. This module says
when the program of a file does not, read from the file and, through the project index, what it
calls:

* :func:`one_off_program` -- the file is a program (it has an ``if __name__ == "__main__":`` block)
  that does no :func:`steady_work`, and no function of the project it calls runs a backward pass. A
  call the project index cannot follow leaves the fact unknown (None): the program may train
  elsewhere.
* :func:`once_per_process` -- ``node`` belongs to such a program and sits in its module-level code
  (the ``__main__`` block included), outside every loop and comprehension: it runs once per process.
* :func:`steady_work` -- the program repeats tensor work: it has a step loop, or a loop whose body
  calls a ``torch`` operation, a tensor method that computes (``add_``, ``matmul``, ``sum``, ...), a
  value (``model(x)``), code of the project, or a function of the file that does. Library calls
  that only move or store data (``image.save``, ``x.numpy()``, ``h5py``, ``tqdm``) are not work, and
  nor are the loops of an ``nn.Module`` class's methods: they run once per call of the model, which
  repeats only in a loop of the program (a value called: work).

Built on the facts of the file (``hot_map``, ``index_of``); nothing is kept between files.
"""

from __future__ import annotations

import builtins

import libcst as cst

from torchopt.analysis.models import nn_module_classes
from torchopt.analysis.names import callee, dotted
from torchopt.analysis.project import _LIBRARIES, Definition, Unknown, index_of
from torchopt.analysis.step_loops import LOOPS, hot_map
from torchopt.analysis.syntax import walk
from torchopt.rewrite.rule import Rule

_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)
_SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)
# torch calls that set things up or convert, not computations worth a thread placement.
_NOT_WORK = (
    "torch.device",
    "torch.no_grad",
    "torch.inference_mode",
    "torch.enable_grad",
    "torch.manual_seed",
    "torch.load",
    "torch.save",
    "torch.from_numpy",
    "torch.as_tensor",
    "torch.tensor",
    "torch.cuda.",
    "torch.utils.data.",
)
# Tensor methods that compute (a value's method of another name is taken for a library's: `f.resize`).
_WORK_METHODS = frozenset(
    "add add_ sub sub_ mul mul_ div div_ pow pow_ matmul mm bmm mv addmm einsum sum mean std var norm exp log "
    "sqrt abs clamp softmax log_softmax sort topk svd backward step forward copy_ addcmul_ addcdiv_ lerp_ "
    "conv2d linear".split()
)
_DEPTH = 4


def _main_guard(module: cst.Module) -> cst.If | None:
    for stmt in module.body:
        test = stmt.test if isinstance(stmt, cst.If) else None
        if (
            isinstance(test, cst.Comparison)
            and isinstance(test.left, cst.Name)
            and test.left.value == "__name__"
            and len(test.comparisons) == 1
            and isinstance(test.comparisons[0].operator, cst.Equal)
        ):
            return stmt  # type: ignore[return-value]  # an If, per the test above
    return None


def one_off_program(rule: Rule) -> str | None:
    """Why the file's program runs no training or evaluation step, or None (it may, or it is no
    program). Worked out once per text."""
    found: str = rule.ctx.facts.derived(("one-off program",), lambda: _one_off(rule) or "")
    return found or None


def _one_off(rule: Rule) -> str | None:
    module = rule.ctx.module
    if _main_guard(module) is None or steady_work(rule):
        return None
    index = index_of(rule)
    if index.path is None:
        return None  # no project to follow its imports into: what it calls is not known
    for call in walk(module, cross_scopes=True):
        if not isinstance(call, cst.Call):
            continue
        written = dotted(call.func)
        if written is None or callee(rule, call) is not None:
            continue
        got = index.resolve(written)
        if isinstance(got, Unknown):
            return None
        if isinstance(got, Definition) and got.path == index.path:
            continue  # the file's own code: its loops are read by steady_work
        if isinstance(got, Definition) and got.kind in ("function", "class") and index.runs(got, "steps") is not False:
            return None
    return "the program runs no training or evaluation step"


def once_per_process(rule: Rule, node: cst.CSTNode) -> str | None:
    """Why ``node`` runs once per process (see the module docstring), or None."""
    hot = hot_map(rule)
    cur: cst.CSTNode | None = hot.parent(node)
    while cur is not None:
        if isinstance(cur, (*_SCOPES, *LOOPS, *_COMPREHENSIONS)):
            return None
        cur = hot.parent(cur)
    why = one_off_program(rule)
    return f"it runs once per process ({why})" if why else None


def steady_work(rule: Rule) -> bool:
    """Whether the file's program repeats tensor work (see the module docstring)."""
    hot = hot_map(rule)
    models = nn_module_classes(rule)
    for loop in walk(rule.ctx.module, True):
        if not isinstance(loop, LOOPS):
            continue
        cur = hot.parent(loop)
        while cur is not None and not (isinstance(cur, cst.ClassDef) and cur.name.value in models):
            cur = hot.parent(cur)
        if cur is None and (id(loop) in hot.step_loops or _loop_works(rule, loop, set(), 0)):
            return True
    return False


def _loop_works(rule: Rule, loop: cst.CSTNode, seen: set[int], depth: int) -> bool:
    body = getattr(loop, "body", loop)
    return any(_works(rule, c, seen, depth) for c in walk(body, True) if isinstance(c, cst.Call))


def _works(rule: Rule, call: cst.Call, seen: set[int], depth: int) -> bool:
    """Whether ``call``, inside a loop, may compute on tensors."""
    q = callee(rule, call)
    if q is not None:
        return not q.startswith(_NOT_WORK)
    func = call.func
    if isinstance(func, cst.Attribute):
        if func.attr.value in _WORK_METHODS:
            return True
        written = dotted(func)
        root = written.split(".")[0] if written else None
        if root is None or root not in _imported(rule):
            return False  # a method of a value: a library's or a tensor's that does not compute
        return _project_code(rule, written or "")
    if not isinstance(func, cst.Name):
        return True  # `globals()[name]()`, `f(a)(b)`: not known
    name = func.value
    fns = [f for f, _ in hot_map(rule).resolve(call, None)]
    if fns:
        if depth >= _DEPTH:
            return True
        todo = [f for f in fns if id(f) not in seen]
        seen.update(id(f) for f in todo)
        return any(_loop_works(rule, f, seen, depth + 1) for f in todo)
    if name in _imported(rule):
        return _project_code(rule, name)
    if hasattr(builtins, name):
        return False
    return True  # a value called: a model, a function handed in


def _project_code(rule: Rule, written: str) -> bool:
    """A name from the imports that is the project's code (or may be): its work is not read here.
    Without a file to find the project from, only the standard library, torch, torchvision and numpy
    are known not to be."""
    index = index_of(rule)
    if index.path is None:
        imported = index.own.imports.get(written.split(".")[0])
        return not imported or imported[2] or str(imported[0]).split(".")[0] not in _LIBRARIES
    return isinstance(index.resolve(written), (Definition, Unknown))


def _imported(rule: Rule) -> set[str]:
    out: set[str] = set()
    for n in rule.ctx.module.body:
        for s in n.body if isinstance(n, cst.SimpleStatementLine) else ():
            if isinstance(s, cst.Import):
                out.update((a.evaluated_alias or dotted(a.name) or "").split(".")[0] for a in s.names)
            elif isinstance(s, cst.ImportFrom) and not isinstance(s.names, cst.ImportStar):
                out.update(a.evaluated_alias or (dotted(a.name) or "") for a in s.names)
    return out
