"""What the FLAG rules need to know about a whole file: is it an entry script, where do global
switches go, which convolutions / matmuls does it build, which switches does it already set.

**Entry script** (the only kind of file a global switch is inserted into): a file that

* has a module-level ``if __name__ == "__main__":`` block, or
* calls a module-level function ``main()`` from module level (``main()`` at the bottom of a script), or
* runs a training loop at module level: a module-level ``for``/``while`` whose body calls
  ``.backward()`` or ``.step()``.

A file that only defines models, datasets or helpers is a library module: a global switch there
would change every program that imports it, so nothing is inserted.

**Where the switch goes**: as the first statement of ``main()`` (after its docstring) when the
entry calls a module-level ``main``; else the first statement of the ``if __name__ == "__main__":``
block; else at module level right after the imports (after the last module-level import that comes
before the first ``def``/``class``/loop/``with``), and after any backend switch already placed
there, so the switches stay together in one block.
"""

from __future__ import annotations

import ast as _ast
import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.arguments import passed
from torchopt.analysis.conventions import CONVENTIONAL_MODEL_NAMES
from torchopt.analysis.lifecycle import lifecycle_of
from torchopt.analysis.project import Definition, Layers, Unknown, index_of
from torchopt.analysis.placement import Kind, placements
from torchopt.analysis.precheck.torch_imports import torch_calls_to
from torchopt.analysis.precheck.tree import ast_index, ast_tree
from torchopt.analysis.names import callee, dotted, qualified_names, torch_name
from torchopt.analysis.statement_edits import first_binding
from torchopt.analysis.values import string_value
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

# Convolution layers and functions (`nn.Conv{1,2,3}d`, `nn.ConvTranspose*`, `F.conv*`).
_CONV_CLASSES = {f"{p}{d}d" for p in ("Conv", "ConvTranspose", "LazyConv", "LazyConvTranspose") for d in (1, 2, 3)}
_CONV_FUNCS = {f"conv{d}d" for d in (1, 2, 3)} | {f"conv_transpose{d}d" for d in (1, 2, 3)}
# torchvision.models builders that do not return a model.
_TV_NOT_MODELS = {"get_model_weights", "get_weight", "list_models", "get_model_builder"}

# fp32 matrix multiplies that `set_float32_matmul_precision` affects (not convolutions).
_MATMUL_CLASSES = {
    "Linear",
    "Bilinear",
    "MultiheadAttention",
    "Transformer",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "LSTM",
    "GRU",
    "RNN",
    "LSTMCell",
    "GRUCell",
    "RNNCell",
    "LazyLinear",
}
_MATMUL_FUNCS = {
    "torch.matmul",
    "torch.mm",
    "torch.bmm",
    "torch.addmm",
    "torch.baddbmm",
    "torch.addbmm",
    "torch.einsum",
    "torch.nn.functional.linear",
    "torch.nn.functional.bilinear",
    "torch.nn.functional.scaled_dot_product_attention",
    "torch.tensordot",
    "torch.inner",
}
# Precision-sensitive fp32 linear algebra (advice instead of a fix: the switch is global).
_SENSITIVE_PREFIX = ("torch.linalg.",)
_SENSITIVE = {
    "torch.cdist",
    "torch.inverse",
    "torch.cholesky",
    "torch.cholesky_solve",
    "torch.cholesky_inverse",
    "torch.lu",
    "torch.lu_solve",
    "torch.svd",
    "torch.pinverse",
    "torch.det",
    "torch.logdet",
    "torch.slogdet",
    "torch.triangular_solve",
    "torch.qr",
    "torch.lstsq",
    "torch.matrix_exp",
}

# Backend switches whose presence means "the user already decided" (never overridden).
BENCHMARK = "torch.backends.cudnn.benchmark"
DETERMINISTIC = "torch.backends.cudnn.deterministic"
TF32_FLAGS = {
    "torch.backends.cuda.matmul.allow_tf32",
    "torch.backends.cudnn.allow_tf32",
    "torch.backends.cuda.matmul.fp32_precision",
    "torch.backends.cudnn.fp32_precision",
    "torch.backends.cudnn.conv.fp32_precision",
    "torch.backends.fp32_precision",
    "torch.backends.cudnn.rnn.fp32_precision",
    "torch.backends.mkldnn.matmul.fp32_precision",
}
SET_PRECISION = "torch.set_float32_matmul_precision"
USE_DETERMINISTIC = "torch.use_deterministic_algorithms"
CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
# Variable-length sequence handling (shapes change per batch).
_VARLEN = {
    "torch.nn.utils.rnn.pad_sequence",
    "torch.nn.utils.rnn.pack_padded_sequence",
    "torch.nn.utils.rnn.pack_sequence",
    "torch.nn.utils.rnn.pad_packed_sequence",
}
_TV_CROPS = {"CenterCrop", "RandomCrop", "RandomResizedCrop", "FiveCrop", "TenCrop"}
# torchvision transforms whose output size is drawn per sample (multi-scale augmentation).
_TV_RANDOM_SIZE = {"RandomResize", "RandomShortestSize", "ScaleJitter", "RandomZoomOut"}
# Calls whose size argument, when drawn at random, makes the next convolution see a new shape.
_RESIZERS = {
    "torch.nn.functional.interpolate",
    "torch.nn.functional.upsample",
    "torch.nn.Upsample",
    "torchvision.transforms.Resize",
    "torchvision.transforms.v2.Resize",
    "torchvision.transforms.functional.resize",
    "torchvision.transforms.v2.functional.resize",
}
# Processes started on a function: the switch must run in that function, which is all they execute
# of the entry script (a spawned child imports the file without running its `__main__` block).
_SPAWNS = {
    "torch.multiprocessing.spawn",
    "torch.multiprocessing.spawn.spawn",
    "torch.multiprocessing.start_processes",
    "torch.multiprocessing.spawn.start_processes",
    "torch.multiprocessing.Process",
    "multiprocessing.Process",
    "multiprocessing.context.Process",
}
# A device given as an index names a CUDA (or other accelerator) device: `.to(gpu_id)`, `.to(local_rank)`.
_INDEX_NAME = re.compile(r"(^|_)(gpu|gpus|gpu_id|local_rank|device_id|device_ids|rank)$", re.IGNORECASE)


@dataclass
class Switch:
    """A determinism switch the file sets."""

    node: cst.CSTNode
    what: str  # the switch, in words (for messages)


@dataclass
class Program:
    convs: list[cst.CSTNode] = field(default_factory=list)
    matmuls: list[cst.CSTNode] = field(default_factory=list)
    cuda: bool = False
    benchmark_set: list[cst.CSTNode] = field(default_factory=list)  # any assignment to cudnn.benchmark
    benchmark_on: list[cst.CSTNode] = field(default_factory=list)  # `cudnn.benchmark = True` (a literal)
    tf32_set: list[cst.CSTNode] = field(default_factory=list)  # TF32 flags / set_float32_matmul_precision
    determinism: list[Switch] = field(default_factory=list)  # switches that cost speed
    intent: bool = False  # any determinism switch, whatever its value (unless literally False)
    variable_shapes: list[tuple[cst.CSTNode, str]] = field(default_factory=list)
    sensitive: list[tuple[cst.CSTNode, str]] = field(default_factory=list)
    # Where a global switch goes: the statement it follows (after=True) or precedes, or None when
    # the file is not an entry script.
    anchor: cst.BaseStatement | None = None
    anchor_after: bool = True
    anchor_body: tuple[cst.BaseStatement, ...] = ()  # the block the anchor is a statement of
    entry: str = ""  # how the entry was recognised, in words
    # Calls of the project's own classes/functions that build the layers (id(call) -> in words), and
    # calls whose layers are unknown (the call, why): the project index's answers.
    built_elsewhere: dict[int, str] = field(default_factory=dict)
    unknown_layers: list[tuple[cst.Call, str]] = field(default_factory=list)
    # Calls of project functions that may turn a determinism switch on, decided only at run time.
    unknown_intent: list[tuple[cst.Call, str]] = field(default_factory=list)


def program(rule: Rule) -> Program:
    """The file's program facts, worked out once per parse and shared by the flag rules."""
    module = rule.ctx.module
    return rule.ctx.facts.about_node(("flags program",), module, lambda: _analyse(rule, module))


def _imported_roots(module: cst.Module) -> set[str]:
    """Top-level package names the file imports (cheap test before resolving names)."""
    roots: set[str] = set()
    for n in walk(module, cross_scopes=True):
        if isinstance(n, cst.Import):
            roots.update((cst.helpers.get_full_name_for_node(a.name) or "").split(".")[0] for a in n.names)
        elif isinstance(n, cst.ImportFrom) and n.module is not None and not n.relative:
            roots.add((cst.helpers.get_full_name_for_node(n.module) or "").split(".")[0])
    return roots


def _is_false(expr: cst.BaseExpression | None) -> bool:
    return isinstance(expr, cst.Name) and expr.value in ("False", "None")


def _is_true(expr: cst.BaseExpression | None) -> bool:
    """A literal ``True`` (a variable may hold either: not reported: only switches surely on count)."""
    return isinstance(expr, cst.Name) and expr.value == "True"


def _analyse(rule: Rule, module: cst.Module) -> Program:
    prog = Program()
    resize_int: list[cst.Call] = []
    crops = False
    has_tv = "torchvision" in _imported_roots(module)
    drawn = _drawn_names(module)
    for node in walk(module, cross_scopes=True):
        if isinstance(node, cst.Call):
            q = callee(rule, node)
            if q is None:
                if isinstance(node.func, cst.Attribute) and node.func.attr.value == "cuda":
                    prog.cuda = True
                elif _device_index_move(node):
                    prog.cuda = True
                if has_tv and not isinstance(node.func, cst.Call):
                    tv = [n for n in qualified_names(rule, node.func) if n.startswith("torchvision.")]
                    q = tv[0] if tv else None
                if q is None or not q.startswith("torchvision."):
                    continue
                last = q.rsplit(".", 1)[-1]
                if q.startswith("torchvision.models.") and last not in _TV_NOT_MODELS and not last[:1].isupper():
                    prog.convs.append(node)
                elif q.startswith("torchvision.transforms.") and last == "Resize":
                    size = node.args[0].value if node.args else None
                    for a in node.args:
                        if a.keyword is not None and a.keyword.value == "size":
                            size = a.value
                    if isinstance(size, cst.Integer):
                        resize_int.append(node)
                elif q.startswith("torchvision.transforms.") and last in _TV_CROPS:
                    crops = True
                if q.startswith("torchvision.transforms.") and last in _TV_RANDOM_SIZE:
                    prog.variable_shapes.append((node, f"`{last}` draws a new image size for every sample"))
                elif q in _RESIZERS and _drawn_at_random(node, drawn):
                    prog.variable_shapes.append((node, f"`{last}` gets a size drawn at random (multi-scale)"))
                continue
            last = q.rsplit(".", 1)[-1]
            if q.startswith("torch.nn.") and last in _CONV_CLASSES:
                prog.convs.append(node)
            elif q in {f"torch.nn.functional.{f}" for f in _CONV_FUNCS} or q in {f"torch.{f}" for f in _CONV_FUNCS}:
                prog.convs.append(node)
            if q.startswith("torch.nn.") and last in _MATMUL_CLASSES or q in _MATMUL_FUNCS:
                prog.matmuls.append(node)
            if q.startswith(("torch.cuda.", "torch.accelerator.")):
                prog.cuda = True
            if q in _RESIZERS and _drawn_at_random(node, drawn):
                prog.variable_shapes.append((node, f"`{last}` gets a size drawn at random (multi-scale)"))
            if q.startswith(_SENSITIVE_PREFIX) or q in _SENSITIVE:
                prog.sensitive.append((node, q))
            if q == SET_PRECISION:
                prog.tf32_set.append(node)
            if q == USE_DETERMINISTIC:
                first = node.args[0].value if node.args else None
                for a in node.args:
                    if a.keyword is not None and a.keyword.value == "mode":
                        first = a.value
                if not _is_false(first):
                    prog.intent = True
                if _is_true(first):
                    prog.determinism.append(Switch(node, "`torch.use_deterministic_algorithms(True)`"))
            if q in _VARLEN:
                prog.variable_shapes.append((node, f"`{q}` pads variable-length sequences"))
        elif isinstance(node, (cst.Assign, cst.AugAssign, cst.AnnAssign)):
            targets: list[cst.BaseExpression] = (
                [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            )
            value = node.value
            for t in list(targets):
                if isinstance(t, (cst.Tuple, cst.List)):
                    targets.extend(e.value for e in t.elements)
                    value = None  # an unpacked value: not a literal
            for t in targets:
                q = torch_name(rule, t) if isinstance(t, cst.Attribute) else None
                if q == BENCHMARK:
                    prog.benchmark_set.append(node)
                    if _is_true(value):
                        prog.benchmark_on.append(node)
                elif q in TF32_FLAGS:
                    prog.tf32_set.append(node)
                elif q == DETERMINISTIC and not _is_false(value):
                    prog.intent = True
                    if _is_true(value):
                        prog.determinism.append(Switch(node, "`torch.backends.cudnn.deterministic = True`"))
        elif isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
            s = string_value(node)
            if s is None:
                continue
            if s == CUBLAS_ENV:
                prog.intent = True
                prog.determinism.append(Switch(node, f"`{CUBLAS_ENV}`"))
            elif s.split(":")[0] == "cuda":
                prog.cuda = True
        elif isinstance(node, cst.Attribute) and node.attr.value == "cuda":
            prog.cuda = True
        elif isinstance(node, cst.BinaryOperation) and _torch_matmul(rule, node):
            prog.matmuls.append(node)
    if resize_int and not crops:
        prog.variable_shapes.append((resize_int[0], "`Resize(<int>)` without a crop keeps each image's aspect ratio"))
    _find_entry(rule, module, prog)
    return _project_intent(rule, module, _project_layers(rule, module, prog))


def _torch_matmul(rule: Rule, node: cst.BinaryOperation) -> bool:
    """``a @ b`` that may be a torch matmul: not one the value facts know gives no tensor (NumPy's)."""
    return isinstance(node.operator, cst.MatrixMultiply) and placements(rule).value(node).kind in (
        Kind.TENSOR,
        Kind.UNKNOWN,
    )


def _project_layers(rule: Rule, module: cst.Module, prog: Program) -> Program:
    """Calls of the project's own classes and functions (``Net()`` from ``models/net.py``) that build
    convolutions or matmul layers, asked of the project index (only for an entry that runs on CUDA
    and does not build them itself: nothing is read otherwise)."""
    if not prog.cuda or prog.anchor is None or (prog.convs and prog.matmuls):
        return prog
    index = index_of(rule)
    asked: dict[str, Layers | Unknown | None] = {}
    for node in walk(module, cross_scopes=True):
        written = dotted(node.func) if isinstance(node, cst.Call) else None
        if written is None or not isinstance(node, cst.Call):
            continue
        if written not in asked:
            found = index.resolve(written)
            asked[written] = (
                (index.layers(found) if isinstance(found, Definition) and found.kind != "module" else None)
                if not isinstance(found, Unknown)
                else found
            )
        got = asked[written]
        if isinstance(got, Unknown) and got.file and _may_be_model(rule, node):
            prog.unknown_layers.append((node, got.reason))
        if not isinstance(got, Layers):
            continue
        where = ", ".join(got.where)
        if got.has("conv") and not prog.convs:
            prog.convs.append(node)
            prog.built_elsewhere[id(node)] = f"`{written}()`, built in {where}"
        if (got.has("linear") or got.has("attention")) and not prog.matmuls:
            prog.matmuls.append(node)
            prog.built_elsewhere[id(node)] = f"`{written}()`, built in {where}"
    return prog


def _project_intent(rule: Rule, module: cst.Module, prog: Program) -> Program:
    """Reproducibility intent one call away: a project function the program calls that turns a
    determinism switch on (``init_seeds(seed, deterministic=True)`` in ``utils.py``), asked of the
    project index for an entry that runs on CUDA and shows no intent itself."""
    if not prog.cuda or prog.anchor is None or prog.intent or prog.benchmark_set:
        return prog
    index = index_of(rule)
    for node in walk(module, cross_scopes=True):
        written = dotted(node.func) if isinstance(node, cst.Call) else None
        if written is None or not isinstance(node, cst.Call):
            continue
        found = index.resolve(written)
        if not isinstance(found, Definition) or found.unit is None or not found.unit.determinism:
            continue
        got = index.asks_determinism(found, lambda name, at, call=node: _passed(module, call, name, at))  # type: ignore[misc]  # mypy infers no lambda with a default
        if got is True:
            prog.intent = True
            return prog
        if isinstance(got, Unknown):
            prog.unknown_intent.append((node, got.reason))
    return prog


def _passed(module: cst.Module, call: cst.Call, name: str, at: int) -> str | None:
    """What ``call`` passes for the parameter ``name`` (position ``at``), as written; "" for nothing,
    None when ``*args``/``**kwargs`` hide it."""
    known, value = passed(call, name, at)
    if not known:
        return None
    return "" if value is None else module.code_for_node(value)


def _may_be_model(rule: Rule, call: cst.Call) -> bool:
    """The value of ``call`` may be a model (so it may hold convolutions): it is bound to a name the
    file then uses as a module (the model lifecycle's module objects: called, moved, put in eval
    mode, its parameters optimised), or to a conventional model name. A data loader factory or a
    config reader from a module outside the run is not."""
    objects = lifecycle_of(rule).objects
    bindings = {id(o.binding) for o in objects}
    names = {o.name for o in objects}
    cur: cst.CSTNode | None = call
    while cur is not None and not isinstance(cur, (cst.FunctionDef, cst.Module)):
        if id(cur) in bindings:
            return True
        if isinstance(cur, cst.Assign):
            targets = {dotted(t.target) or "" for t in cur.targets}
            return any(t in names or t.rsplit(".", 1)[-1] in CONVENTIONAL_MODEL_NAMES for t in targets)
        cur = rule.get_metadata(ParentProvider, cur, None)
    return False


def _device_index_move(call: cst.Call) -> bool:
    """``x.to(0)``, ``x.to(gpu_id)``, ``x.to(self.local_rank)``: a device chosen by index at run time."""
    if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "to" and call.args):
        return False
    first = call.args[0]
    if first.keyword is not None or first.star:
        return False
    if isinstance(first.value, cst.Integer):
        return True
    name = cst.helpers.get_full_name_for_node(first.value)
    return name is not None and bool(_INDEX_NAME.search(name.rsplit(".", 1)[-1]))


def _random_draw(expr: cst.CSTNode, drawn: set[str]) -> bool:
    """``expr`` holds a random draw (``random.choice(sizes)``, ``np.random.randint``,
    ``torch.randint``, ``random.uniform``) or a name assigned one (``drawn``)."""
    for n in walk(expr):
        if isinstance(n, cst.Call):
            name = cst.helpers.get_full_name_for_node(n.func) or ""
            if "random" in name.split(".")[:-1] or name.rsplit(".", 1)[-1] in ("randint", "rand", "randrange"):
                return True
        elif isinstance(n, cst.Name) and n.value in drawn:
            return True
    return False


def _drawn_names(module: cst.Module) -> set[str]:
    """Names assigned a random draw anywhere in the file (``size = random.choice([...])``)."""
    out: set[str] = set()
    for n in walk(module, cross_scopes=True):
        if isinstance(n, cst.Assign) and _random_draw(n.value, set()):
            out |= {t.target.value for t in n.targets if isinstance(t.target, cst.Name)}
    return out


def _drawn_at_random(call: cst.Call, drawn: set[str]) -> bool:
    """A size or scale argument of ``call`` computed by a random draw."""
    return any(
        _random_draw(arg.value, drawn)
        for arg in call.args
        if arg.keyword is None or arg.keyword.value in ("size", "scale_factor")
    )


# --------------------------------------------------------------------------- entry and anchor


def _is_main_guard(stmt: cst.CSTNode) -> bool:
    if not isinstance(stmt, cst.If) or not isinstance(stmt.test, cst.Comparison):
        return False
    test = stmt.test
    if len(test.comparisons) != 1 or not isinstance(test.comparisons[0].operator, cst.Equal):
        return False
    left, right = test.left, test.comparisons[0].comparator
    names = {n.value for n in (left, right) if isinstance(n, cst.Name)}
    strings = {string_value(n) for n in (left, right)}
    return names == {"__name__"} and "__main__" in strings


def _calls_name(node: cst.CSTNode, name: str) -> bool:
    for n in walk(node):
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value == name:
            return True
    return False


def _is_import_line(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
    )


def _holds_import(stmt: cst.CSTNode) -> bool:
    return any(isinstance(n, (cst.Import, cst.ImportFrom)) for n in walk(stmt))


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def is_switch_line(rule: Rule, stmt: cst.CSTNode) -> bool:
    """A line that sets a backend switch: `torch.backends.... = ...` or `torch.set_float32_matmul_precision(...)`."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        q = torch_name(rule, small.targets[0].target) if isinstance(small.targets[0].target, cst.Attribute) else None
        return bool(q and q.startswith("torch.backends."))
    if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
        return callee(rule, small.value) == SET_PRECISION
    return False


def _trains(node: cst.CSTNode) -> bool:
    for n in walk(node):
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value in ("backward", "step"):
            return True
    return False


def _block_anchor(rule: Rule, body: list[cst.BaseStatement] | tuple, prog: Program) -> None:
    """First statement of a block (after a docstring and existing switch lines)."""
    i = 0
    if body and _is_docstring(body[0]):
        i = 1
    while i < len(body) and is_switch_line(rule, body[i]):
        i += 1
    prog.anchor_body = tuple(body)
    if i > 0:
        prog.anchor, prog.anchor_after = body[i - 1], True
    elif body:
        prog.anchor, prog.anchor_after = body[0], False


def _spawned_worker(rule: Rule, module: cst.Module, funcs: dict[str, cst.FunctionDef]) -> cst.FunctionDef | None:
    """The module-level function that ``mp.spawn(fn, ...)`` / ``Process(target=fn)`` starts."""
    for n in walk(module, cross_scopes=True):
        if not isinstance(n, cst.Call) or callee(rule, n) not in _SPAWNS:
            continue
        for a in n.args:
            if (a.keyword is None or a.keyword.value in ("fn", "target")) and not a.star:
                if isinstance(a.value, cst.Name) and a.value.value in funcs:
                    return funcs[a.value.value]
                if a.keyword is None:
                    break
    return None


def _find_entry(rule: Rule, module: cst.Module, prog: Program) -> None:
    body = list(module.body)
    funcs = {s.name.value: s for s in body if isinstance(s, cst.FunctionDef)}
    worker = _spawned_worker(rule, module, funcs)
    if worker is not None and isinstance(worker.body, cst.IndentedBlock):
        prog.entry = f"the spawned worker `{worker.name.value}()`"
        _block_anchor(rule, list(worker.body.body), prog)
        return
    guard = next((s for s in body if _is_main_guard(s)), None)
    top_main_call = any(isinstance(s, cst.SimpleStatementLine) and _calls_name(s, "main") for s in body)
    main = funcs.get("main")
    if main is not None and ((guard is not None and _calls_name(guard, "main")) or top_main_call):
        if isinstance(main.body, cst.IndentedBlock):
            prog.entry = "`main()` is called when the script runs"
            _block_anchor(rule, list(main.body.body), prog)
        return
    if guard is not None:
        if isinstance(guard.body, cst.IndentedBlock):
            prog.entry = 'the `if __name__ == "__main__":` block'
            _block_anchor(rule, list(guard.body.body), prog)
        return
    if not any(isinstance(s, (cst.For, cst.While)) and _trains(s) for s in body):
        return
    prog.entry = "a module-level training loop"
    last = None
    for i, stmt in enumerate(body):
        if _is_import_line(stmt) or (isinstance(stmt, (cst.Try, cst.If)) and _holds_import(stmt)):
            last = i
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef, cst.For, cst.While, cst.With)):
            break
    if last is None:
        return
    while last + 1 < len(body) and is_switch_line(rule, body[last + 1]):
        last += 1
    prog.anchor, prog.anchor_after, prog.anchor_body = body[last], True, tuple(body)


def placed_after_binding(rule: Rule, prog: Program, name: str) -> tuple[cst.BaseStatement, bool] | None:
    """Where a switch line that reads ``name`` (the file's ``torch``) goes: the program's anchor, or
    later when the block binds ``name`` only after it (``import torch`` below a ``with open(...)``
    at the top of a script): a line run before the binding raises NameError. The line then follows
    the statement that binds it (and the switch lines already after that one)."""
    if prog.anchor is None:
        return None
    body = prog.anchor_body
    at = next((i for i, s in enumerate(body) if s is prog.anchor), None)
    try:
        scope = rule.get_metadata(ScopeProvider, prog.anchor)
    except KeyError:
        return None
    bound = first_binding(scope, body, name)
    if at is None or bound is None or bound < at or (bound == at and prog.anchor_after):
        return prog.anchor, prog.anchor_after
    while bound + 1 < len(body) and is_switch_line(rule, body[bound + 1]):
        bound += 1
    return body[bound], True


def insertion(anchor: tuple[cst.BaseStatement, bool], line: cst.BaseStatement) -> cst.FlattenSentinel:
    """The anchor statement together with ``line`` in the right order (``anchor``: the statement
    and whether the line goes after it)."""
    stmt, after = anchor
    return cst.FlattenSentinel([stmt, line] if after else [line, stmt])


# --------------------------------------------------------------------------- cheap pre-checks (CPython's ast)


def _ast_main_guard(stmt: _ast.stmt) -> bool:
    """_is_main_guard, loosened: ``if <a> == <b>:`` naming ``__name__`` and ``"__main__"``."""
    if not isinstance(stmt, _ast.If) or not isinstance(stmt.test, _ast.Compare):
        return False
    t = stmt.test
    if len(t.ops) != 1 or not isinstance(t.ops[0], _ast.Eq):
        return False
    sides = (t.left, t.comparators[0])
    return any(isinstance(x, _ast.Name) and x.id == "__name__" for x in sides) and any(
        isinstance(x, _ast.Constant) and x.value == "__main__" for x in sides
    )


def entry_possible(text: str) -> bool:
    """_find_entry may find an entry (anchor) in ``text``: a spawned worker, a module-level ``__main__`` guard, a
    module-level ``main`` function called from module level, or a module-level ``for``/``while``
    that calls ``.backward``/``.step``. True when the text does not parse."""
    # _spawned_worker: a function started in new processes; every name in _SPAWNS comes from a
    # `multiprocessing` module (`Process` alone is in every `ImageProcessor` file).
    if "multiprocessing" in text and ("spawn" in text or "Process" in text):
        return True
    tree = ast_tree(text)
    if tree is None:
        return True
    body = tree.body
    if any(_ast_main_guard(s) for s in body):
        return True
    if any(isinstance(s, (_ast.FunctionDef, _ast.AsyncFunctionDef)) and s.name == "main" for s in body) and any(
        isinstance(n, _ast.Call) and isinstance(n.func, _ast.Name) and n.func.id == "main"
        for s in body
        if not isinstance(s, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.ClassDef))
        for n in _ast.walk(s)
    ):
        return True
    return any(
        isinstance(s, (_ast.For, _ast.AsyncFor, _ast.While))
        and any(
            isinstance(n, _ast.Call) and isinstance(n.func, _ast.Attribute) and n.func.attr in ("backward", "step")
            for n in _ast.walk(s)
        )
        for s in body
    )


def determinism_possible(text: str) -> bool:
    """_analyse may record a determinism switch: the CUBLAS string, an assignment of a literal
    ``True`` to a ``.deterministic`` attribute, or a call that may be
    ``torch.use_deterministic_algorithms(True)``. True when the text does not parse."""
    if CUBLAS_ENV in text:
        return True
    index = ast_index(text)
    if index is None:
        return True
    for n in [*index.get(_ast.Assign, ()), *index.get(_ast.AnnAssign, ()), *index.get(_ast.AugAssign, ())]:
        if isinstance(n.value, _ast.Constant) and n.value.value is True:
            targets = n.targets if isinstance(n, _ast.Assign) else [n.target]
            if any(isinstance(t, _ast.Attribute) and t.attr == "deterministic" for t in targets):
                return True
    calls = torch_calls_to(text, (USE_DETERMINISTIC,))
    if calls is None:
        return True
    for c in calls:
        args = [*c.args, *(k.value for k in c.keywords)]  # node.args[0] may be any keyword
        if any(isinstance(a, _ast.Constant) and a.value is True for a in args):
            return True
    return False
