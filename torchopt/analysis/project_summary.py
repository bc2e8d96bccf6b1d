"""What one module of a project says about itself, read with CPython's ``ast``: the per-file half of
the project index (``project.py`` resolves names across files on top of it).

A :class:`ModuleSummary` is plain data (it is kept in the result cache as JSON, by the hash of the
file's bytes): the module's imports, its classes (bases, the layers their bodies build, the other
classes and functions they call), its functions (parameters, what they call, whether they run a
training step, whether they run under ``no_grad``/``inference_mode``, which determinism switches they
set and under which parameter, which parameters and module
globals their ``for`` loops iterate, the keys of a dict they return), the names assigned under
``if __name__ == "__main__":`` and the functions handed to new processes.
"""

from __future__ import annotations

import ast
import builtins
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from torchopt.rewrite.pyast import dotted_name

# torch.nn layer classes by the kind of work they do.
LAYER_KINDS: dict[str, str] = {
    **{f"{p}{d}d": "conv" for p in ("Conv", "ConvTranspose", "LazyConv", "LazyConvTranspose") for d in (1, 2, 3)},
    **{f"BatchNorm{d}d": "norm" for d in (1, 2, 3)},
    **{f"InstanceNorm{d}d": "norm" for d in (1, 2, 3)},
    "SyncBatchNorm": "norm",
    "LayerNorm": "norm",
    "GroupNorm": "norm",
    "RMSNorm": "norm",
    **{n: "dropout" for n in ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout")},
    **{n: "linear" for n in ("Linear", "LazyLinear", "Bilinear")},
    **{n: "recurrent" for n in ("RNN", "LSTM", "GRU", "RNNCell", "LSTMCell", "GRUCell")},
    **{n: "attention" for n in ("MultiheadAttention", "Transformer", "TransformerEncoderLayer")},
}
CONV_FUNCTIONS = {f"conv{d}d" for d in (1, 2, 3)} | {f"conv_transpose{d}d" for d in (1, 2, 3)}
AMP = {
    "torch.autocast",
    "torch.amp.autocast",
    "torch.cuda.amp.autocast",
    "torch.cpu.amp.autocast",
    "torch.amp.autocast_mode.autocast",
    "torch.GradScaler",
    "torch.amp.GradScaler",
    "torch.cuda.amp.GradScaler",
    "torch.amp.grad_scaler.GradScaler",
}
NO_GRAD = {"torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad", "torch.autograd.grad_mode.no_grad"}
SPAWNS = {
    "torch.multiprocessing.spawn",
    "torch.multiprocessing.start_processes",
    "multiprocessing.Process",
    "torch.multiprocessing.Process",
}
_WRAPPERS = ("enumerate", "tqdm", "iter", "track")
# Calls that give their input a size of their own (by the called name's last part, any library:
# `F.interpolate`, `cv2.resize`, a PIL image's `.resize`, `transforms.CenterCrop`); `ToTensor` or
# `Normalize` keep the size.
SIZE_FIXERS = {
    "interpolate",
    "upsample",
    "Upsample",
    "resize",
    "Resize",
    "crop",
    "center_crop",
    "resized_crop",
    "CenterCrop",
    "RandomCrop",
    "RandomResizedCrop",
    "thumbnail",
    "FiveCrop",
    "TenCrop",
    # transform containers: what they hold is not followed, so they count as giving a size
    "Compose",
    "RandomChoice",
    "RandomApply",
    "RandomOrder",
}
# Calls that create the default process group (the library calls init_process_group itself).
PG_SETUPS = frozenset(
    {
        "torch.distributed.init_process_group",
        "torch.distributed.distributed_c10d.init_process_group",
        "torch.distributed.init_device_mesh",
        "torch.distributed.device_mesh.init_device_mesh",
        "deepspeed.init_distributed",
        "deepspeed.comm.init_distributed",
        "deepspeed.comm.comm.init_distributed",
        "deepspeed.initialize",
        "accelerate.Accelerator",
        "accelerate.accelerator.Accelerator",
        "accelerate.PartialState",
        "accelerate.state.PartialState",
    }
)
# Mixed-precision contexts that cover CUDA matmuls.
AUTOCASTS = {"torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.amp.autocast_mode.autocast"}


@dataclass
class Unit:
    """A class or a function of the module."""

    line: int
    layers: dict[str, int] = field(default_factory=dict)  # kind -> how many the body builds
    widths: list[int] = field(default_factory=list)  # `nn.Linear(in, out)` literal widths
    calls: list[str] = field(default_factory=list)  # names it calls that may be the project's (as written)
    bases: list[str] = field(default_factory=list)  # a class's bases (as written)
    params: list[str] = field(default_factory=list)
    steps: bool = False  # calls `.backward()`
    amp: bool = False  # names torch's autocast or GradScaler (resolved through the module's imports)
    no_grad: bool = False  # decorated with / wholly inside `no_grad()` / `inference_mode()`
    iterates: list[str] = field(default_factory=list)  # parameters and globals its `for` loops iterate
    reads: list[str] = field(default_factory=list)  # module globals it reads
    returns_dict: dict[str, str] | None = None  # `return dict(k=v)` / `return {"k": v}`: key -> source
    passes: list[str] = field(default_factory=list)  # names it passes to calls (`ResNet(BasicBlock)`)
    # The determinism switches a function sets (`torch.use_deterministic_algorithms(True)`,
    # `cudnn.deterministic = True`, `CUBLAS_WORKSPACE_CONFIG`), each by what decides whether it runs:
    # "" always, "P:D" when the parameter P does (its default written as D, "" without a literal
    # default), "?" when a value known only at run time does.
    determinism: list[str] = field(default_factory=list)
    resizes: bool = False  # calls a SIZE_FIXERS name, or slices with literal bounds
    autocast: bool = False  # a function that returns an autocast context (`return torch.autocast("cuda")`)
    pg_setup: bool = False  # calls a setup of the default process group (process_group.SETUPS), anywhere
    # Whether train/eval mode changes what building the class (or calling the function) computes, from
    # its own body (module_modes.py follows the rest): "train" when it reads `self.training` or builds a
    # layer / calls a function whose output depends on the mode (Dropout, BatchNorm, `F.dropout`); "?"
    # when it builds something this body does not tell (a call of a parameter or of a global value, a
    # call of a call); "" when every torch layer and function it names is known to ignore the mode.
    mode: str = ""
    mode_calls: list[str] = field(default_factory=list)  # bases and calls to follow for `mode`, as written
    call_no_grad: bool = False  # a class whose `__call__` (else `forward`) runs under no_grad/inference_mode


@dataclass
class ModuleSummary:
    # local name -> [module, imported name or "", level]: `import a.b as c` -> c: [a.b, "", 0]
    imports: dict[str, list[Any]] = field(default_factory=dict)
    classes: dict[str, Unit] = field(default_factory=dict)
    functions: dict[str, Unit] = field(default_factory=dict)
    globals: list[str] = field(default_factory=list)  # names assigned at module level
    main_globals: list[str] = field(default_factory=list)  # ... of them, under the `__main__` guard
    entry: bool = False  # has an `if __name__ == "__main__":` block
    spawns: list[str] = field(default_factory=list)  # functions handed to new processes (as written)
    parsed: bool = True  # False: the file does not parse (every fact about it is unknown)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModuleSummary":
        units = {k: {n: Unit(**u) for n, u in data[k].items()} for k in ("classes", "functions")}
        return cls(**{**data, **units})

    def qualify(self, written: str) -> tuple[str, int] | None:
        """The absolute dotted name (and import level) of a name as written in this module, through its
        imports; None for a name it does not import."""
        head, _, rest = written.partition(".")
        got = self.imports.get(head)
        if got is None:
            return None
        module, name, level = got
        full = f"{module}.{name}" if name and module else (name or module)
        return (f"{full}.{rest}" if rest else full), level


def summarize(tree: ast.Module | BaseException) -> ModuleSummary:
    """The summary of a parsed module (``parsed=False`` for one that does not parse)."""
    if not isinstance(tree, ast.Module):
        return ModuleSummary(parsed=False)
    out = ModuleSummary()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                out.imports.setdefault(local, [a.name if a.asname else local, "", 0])
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name != "*":
                    out.imports.setdefault(a.asname or a.name, [node.module or "", a.name, node.level])
    for stmt in tree.body:
        _top_level(out, stmt)
    known = set(out.globals) | set(out.classes) | set(out.functions)
    for fn in out.functions.values():
        fn.reads = [n for n in fn.reads if n in known]
        fn.iterates = [n for n in fn.iterates if n in fn.params or n in known]
    for unit in [*out.functions.values(), *out.classes.values()]:
        # a project class handed to a call is built by it (`return ResNet(BasicBlock, [2, 2, 2, 2])`)
        unit.calls.extend(n for n in unit.passes if (n in out.classes or n in out.imports) and n not in unit.calls)
        unit.passes = []
    return out


def _top_level(out: ModuleSummary, stmt: ast.stmt) -> None:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        out.functions[stmt.name] = _function(out, stmt)
    elif isinstance(stmt, ast.ClassDef):
        out.classes[stmt.name] = _class(out, stmt)
    elif isinstance(stmt, ast.If) and _main_guard(stmt):
        out.entry = True
        names = _assigned(stmt.body)
        out.main_globals.extend(n for n in names if n not in out.main_globals)
        out.globals.extend(n for n in names if n not in out.globals)
        _spawned(out, stmt.body)
    else:
        out.globals.extend(n for n in _assigned([stmt]) if n not in out.globals)
        _spawned(out, [stmt])


def _main_guard(stmt: ast.If) -> bool:
    t = stmt.test
    if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)):
        return False
    sides = (t.left, t.comparators[0])
    return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
        isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
    )


def _assigned(stmts: list[ast.stmt]) -> list[str]:
    """Names bound by assignments, loops and withs in ``stmts`` (not inside functions or classes)."""
    out: list[str] = []
    stack: list[ast.AST] = list(stmts)
    while stack:
        cur = stack.pop(0)
        if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(cur, ast.Name) and isinstance(cur.ctx, ast.Store) and cur.id not in out:
            out.append(cur.id)
        stack.extend(ast.iter_child_nodes(cur))
    return out


def _spawned(out: ModuleSummary, stmts: list[ast.stmt]) -> None:
    for stmt in stmts:
        for n in ast.walk(stmt):
            if not isinstance(n, ast.Call):
                continue
            written = dotted_name(n.func)
            q = out.qualify(written) if written else None
            if q is None or q[0] not in SPAWNS:
                continue
            for v in [*n.args[:1], *(k.value for k in n.keywords if k.arg in ("fn", "target"))]:
                name = dotted_name(v)
                if name and name not in out.spawns:
                    out.spawns.append(name)


def _classify(out: ModuleSummary, call: ast.Call, unit: Unit) -> None:
    written = dotted_name(call.func)
    if not written:
        return
    q = out.qualify(written)
    full = q[0] if q is not None and q[1] == 0 else ""
    last = written.rsplit(".", 1)[-1]
    if last in SIZE_FIXERS:
        unit.resizes = True
    if full in PG_SETUPS:
        unit.pg_setup = True
    kind = None
    if full.startswith("torch.nn.") and last in LAYER_KINDS:
        kind = LAYER_KINDS[last]
    elif full.startswith(("torch.nn.functional.", "torch.")) and last in CONV_FUNCTIONS:
        kind = "conv"
    elif full.startswith("torchvision.models.") and last[:1].islower() and "weight" not in last:
        kind = "conv"  # a torchvision model builder: every one builds convolutions
    unit.passes.extend(a.id for a in call.args if isinstance(a, ast.Name) and a.id[:1].isupper())
    if kind is not None:
        unit.layers[kind] = unit.layers.get(kind, 0) + 1
        if kind == "linear" and len(call.args) >= 2:
            unit.widths.extend(a.value for a in call.args[:2] if isinstance(a, ast.Constant) and type(a.value) is int)
        return
    if written in ("super", "print", "len", "range", "isinstance") or written.startswith("self."):
        return
    if written not in unit.calls and (q is None or not full.startswith(("torch.", "torchvision."))):
        unit.calls.append(written)


def _class(out: ModuleSummary, node: ast.ClassDef) -> Unit:
    unit = Unit(line=node.lineno, bases=[b for b in (dotted_name(x) for x in node.bases) if b])
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            _classify(out, n, unit)
        elif isinstance(n, ast.Attribute) and n.attr == "backward":
            unit.steps = True
        elif isinstance(n, ast.Subscript) and _literal_slice(n):
            unit.resizes = True
    methods = {s.name: s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
    local: set[str] = set()
    for m in methods.values():
        a = m.args
        local |= {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]}
        local |= set(_assigned(m.body))
    for base in node.bases:
        _mode_of_base(out, base, unit)
    _mode_facts(out, node.body, unit, local)
    if unit.mode == "" and _runs_outside_modules(out, methods):
        unit.mode = "?"
    runs = methods.get("__call__") or methods.get("forward")
    unit.call_no_grad = runs is not None and _function(out, runs).no_grad
    return unit


def _function(out: ModuleSummary, node: ast.FunctionDef | ast.AsyncFunctionDef) -> Unit:
    a = node.args
    params = [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
    unit = Unit(line=node.lineno, params=params)
    local = set(params) | set(_assigned(node.body))
    declared_global = {n for s in ast.walk(node) if isinstance(s, ast.Global) for n in s.names}
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            _classify(out, n, unit)
            if isinstance(n.func, ast.Attribute) and n.func.attr == "backward":
                unit.steps = True
        elif isinstance(n, (ast.For, ast.AsyncFor)):
            it = _iterated(n.iter)
            if it is not None and it not in unit.iterates and (it in params or it not in local):
                unit.iterates.append(it)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            if (n.id not in local or n.id in declared_global) and n.id not in unit.reads:
                unit.reads.append(n.id)
        elif isinstance(n, ast.Subscript) and _literal_slice(n):
            unit.resizes = True
        elif isinstance(n, ast.Attribute) and not unit.amp:
            q = out.qualify(dotted_name(n) or "")
            unit.amp = q is not None and q[1] == 0 and q[0] in AMP
        if isinstance(n, ast.Name) and not unit.amp:
            q = out.qualify(n.id)
            unit.amp = q is not None and q[1] == 0 and q[0] in AMP
        if isinstance(n, ast.Return) and n.value is not None:
            unit.autocast = unit.autocast or _autocast(out, n.value)
            if unit.returns_dict is None:
                unit.returns_dict = _dict_literal(n.value)
    unit.determinism = _determinism(out, node.body, params, _literal_defaults(node), ())
    star = {p.arg for p in (a.vararg, a.kwarg) if p is not None}
    _mode_facts(out, node.body, unit, local | star)
    if unit.mode == "" and _runs_outside_modules(out, {node.name: node}, method=False):
        unit.mode = "?"
    unit.no_grad = any(_no_grad(out, d) for d in node.decorator_list) or (
        len(node.body) == 1
        and isinstance(node.body[0], ast.With)
        and any(_no_grad(out, i.context_expr) for i in node.body[0].items)
    )
    return unit


DETERMINISM = ("torch.use_deterministic_algorithms", "torch.backends.cudnn.deterministic")
_CUBLAS = "CUBLAS_WORKSPACE_CONFIG"


def _literal_defaults(node: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, str]:
    """Parameter -> its default when that is ``True``, ``False`` or ``None``."""
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    pairs = [*zip(positional[len(positional) - len(a.defaults) :], a.defaults), *zip(a.kwonlyargs, a.kw_defaults)]
    return {p.arg: repr(d.value) for p, d in pairs if isinstance(d, ast.Constant) and d.value in (True, False, None)}


def _determinism(
    out: ModuleSummary, body: list[ast.stmt], params: list[str], defaults: dict[str, str], deciders: tuple[str, ...]
) -> list[str]:
    """What decides whether each determinism switch in ``body`` runs (see ``Unit.determinism``);
    ``deciders``: the conditions of the enclosing ``if`` statements, in the same words."""
    found: list[str] = []
    for stmt in body:
        if isinstance(stmt, ast.If):
            found += _determinism(out, stmt.body, params, defaults, (*deciders, _decider(stmt.test, params, defaults)))
            found += _determinism(out, stmt.orelse, params, defaults, (*deciders, "?"))
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try)):
            for block in ("body", "orelse", "finalbody"):
                found += _determinism(out, getattr(stmt, block, []), params, defaults, deciders)
            continue
        value = _switch_value(out, stmt)
        if value is None:
            continue
        own = "" if isinstance(value, ast.Constant) else _decider(value, params, defaults)
        # the switch runs when every enclosing condition holds: a parameter decides if one does
        decided = [d for d in (*deciders, own) if d]
        found.append(next((d for d in decided if d != "?"), "?") if decided else "")
    return found


def _switch_value(out: ModuleSummary, stmt: ast.stmt) -> ast.expr | None:
    """The value a determinism switch is set to by ``stmt`` (None: not a switch, or set to False)."""
    value: ast.expr | None = None
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        written = dotted_name(stmt.value.func)
        q = out.qualify(written) if written else None
        if q is not None and q[0] == DETERMINISM[0]:
            call = stmt.value
            value = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "mode"), None)
    elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        t = stmt.targets[0]
        written = dotted_name(t) if isinstance(t, ast.Attribute) else None
        q = out.qualify(written) if written else None
        if q is not None and q[0] == DETERMINISM[1]:
            value = stmt.value
        elif isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and t.slice.value == _CUBLAS:
            value = ast.Constant(True)
    if value is None or (isinstance(value, ast.Constant) and value.value in (False, None)):
        return None
    return value


def _decider(test: ast.expr, params: list[str], defaults: dict[str, str]) -> str:
    """``P:D`` when the parameter ``P`` must be true for ``test`` to hold (``P``, ``P and ...``,
    ``P is True``), else ``?``."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    for part in parts:
        if isinstance(part, ast.Compare) and len(part.ops) == 1 and isinstance(part.ops[0], (ast.Is, ast.Eq)):
            if isinstance(part.comparators[0], ast.Constant) and part.comparators[0].value is True:
                part = part.left
        if isinstance(part, ast.Name) and part.id in params:
            return f"{part.id}:{defaults.get(part.id, '')}"
    return "?"


# ---------------------------------------------------------------------- train/eval mode
_NOT_LITERAL = object()
_DROPOUT_OFF = (0, 0.0)
# torch.nn layers whose output depends on train/eval mode, each with the argument that can turn that
# off: (name, position, the literal values that do, whether it is on when the argument is not given).
# `None`: nothing turns it off.
MODE_LAYERS: dict[str, tuple[str, int, tuple[Any, ...], bool] | None] = {
    **{n: ("p", 0, _DROPOUT_OFF, True) for n in ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d")},
    **{n: ("p", 0, _DROPOUT_OFF, True) for n in ("AlphaDropout", "FeatureAlphaDropout")},
    **{f"{p}BatchNorm{d}d": None for p in ("", "Lazy") for d in (1, 2, 3)},
    "SyncBatchNorm": None,
    "RReLU": None,
    **{f"{p}InstanceNorm{d}d": ("track_running_stats", 4, (False,), False) for p in ("", "Lazy") for d in (1, 2, 3)},
    "RNN": ("dropout", 6, _DROPOUT_OFF, False),
    "LSTM": ("dropout", 5, _DROPOUT_OFF, False),
    "GRU": ("dropout", 5, _DROPOUT_OFF, False),
    "MultiheadAttention": ("dropout", 2, _DROPOUT_OFF, False),
    "Transformer": ("dropout", 5, _DROPOUT_OFF, True),
    "TransformerEncoderLayer": ("dropout", 3, _DROPOUT_OFF, True),
    "TransformerDecoderLayer": ("dropout", 3, _DROPOUT_OFF, True),
}
# torch.nn classes whose output is the same in both modes (their submodules, when they hold any, are
# built by calls of their own: `nn.Sequential(nn.Linear(4, 4), nn.Dropout())`).
MODE_FREE_LAYERS = frozenset(
    {
        "Module", "Sequential", "ModuleList", "ModuleDict", "Parameter", "ParameterList", "ParameterDict",
        "Identity", "Linear", "LazyLinear", "Bilinear", "Flatten", "Unflatten", "Embedding", "EmbeddingBag",
        "LayerNorm", "GroupNorm", "RMSNorm", "LocalResponseNorm", "CrossMapLRN2d",
        "RNNCell", "LSTMCell", "GRUCell", "TransformerEncoder", "TransformerDecoder",
        *(f"{p}{d}d" for p in ("Conv", "ConvTranspose", "LazyConv", "LazyConvTranspose") for d in (1, 2, 3)),
        *(f"{p}{d}d" for p in ("MaxPool", "AvgPool", "AdaptiveMaxPool", "AdaptiveAvgPool", "LPPool", "MaxUnpool")
          for d in (1, 2, 3)),
        *(f"{p}{d}d" for p in ("ZeroPad", "ConstantPad", "ReflectionPad", "ReplicationPad", "CircularPad")
          for d in (1, 2, 3)),
        "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d", "PixelShuffle", "PixelUnshuffle",
        "ChannelShuffle", "Fold", "Unfold", "CosineSimilarity", "PairwiseDistance",
        "ReLU", "ReLU6", "LeakyReLU", "PReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish", "Sigmoid",
        "Tanh", "Softmax", "Softmax2d", "LogSoftmax", "Softmin", "Softplus", "Softsign", "Hardtanh",
        "Hardswish", "Hardsigmoid", "Hardshrink", "Softshrink", "Tanhshrink", "Threshold", "GLU", "LogSigmoid",
    }
)  # fmt: skip
# torch functions whose output depends on the mode they are told (`training=self.training`), unless a
# literal `training=False` says which.
MODE_FUNCTIONS = frozenset(
    {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"}
    | {"batch_norm", "instance_norm", "rrelu"}
)
# torch packages whose calls may return a module (`torch.hub.load`, `torch.jit.load`).
_MODULE_SOURCES = ("torch.hub.", "torch.jit.", "torch.export.", "torch.fx.", "torch.ao.", "torch.quantization.")
# Top-level modules whose calls build no torch module: the standard library and numpy.
_PLAIN = frozenset(sys.stdlib_module_names) | {"numpy"}


def layer_mode(name: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    """Whether the torch.nn layer ``name``, built with these literal arguments (``_NOT_LITERAL`` for
    a value known only at run time), computes differently in train and eval mode: "train" (it
    does), "" (it does not), "?" (a torch.nn class this table does not know)."""
    if name in MODE_FREE_LAYERS or name.endswith("Loss"):
        return ""
    if name not in MODE_LAYERS:
        return "?"
    switch = MODE_LAYERS[name]
    if switch is None:
        return "train"
    arg, position, off, default_on = switch
    value = kwargs.get(arg, args[position] if len(args) > position else None)
    if arg not in kwargs and len(args) <= position:
        return "train" if default_on else ""
    off_here = value is not _NOT_LITERAL and any(
        value == o and isinstance(value, bool) == isinstance(o, bool) for o in off
    )
    return "" if off_here else "train"


def torch_mode(full: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    """The mode verdict (see ``layer_mode``) of a call of the torch name ``full``."""
    last = full.rsplit(".", 1)[-1]
    if full.startswith("torch.nn.") and last[:1].isupper():
        return layer_mode(last, args, kwargs)
    if last in MODE_FUNCTIONS and (full.startswith("torch.nn.functional.") or full.count(".") == 1):
        return "" if kwargs.get("training", _NOT_LITERAL) is False else "train"
    if full.startswith("torch.nn.") and not full.startswith(("torch.nn.functional.", "torch.nn.init.")):
        return "?"  # torch.nn.utils.spectral_norm and the like: not in this table
    if full in ("torch.load", "torch.compile") or full.startswith(_MODULE_SOURCES):
        return "?"  # a module read back or made from another: what it holds is not written here
    return ""


# Calls that take numbers and names, not modules, and run nothing they are given.
_DATA_CALLS = frozenset({"range", "len", "int", "float", "bool", "str", "min", "max", "abs", "round", "print"})
_CONTAINER_CALLS = frozenset({"Sequential", "ModuleList", "ModuleDict", "append", "extend", "insert", "add_module"})


def _runs_outside_modules(
    out: ModuleSummary, methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef], method: bool = True
) -> bool:
    """Whether a value that comes from outside the class (a parameter of a method, a module-level
    value) may become a submodule that runs: stored as ``self.X = value`` and then called, iterated
    or handed on (``self.backbone = backbone`` ... ``self.backbone(x)``), or put in a container
    (``nn.Sequential(*layers)``, ``self.add_module(name, layer)``). What it is is not known here."""
    stored: set[str] = set()
    for m in methods.values():
        a = m.args
        params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]}
        params -= {a.args[0].arg} if a.args and method else set()
        own = set(_assigned(m.body)) - params

        def outside(expr: ast.expr) -> bool:
            if isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
                return any(outside(e) for e in expr.elts)
            while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Starred)):
                expr = expr.value
            return isinstance(expr, ast.Name) and expr.id != "self" and (expr.id in params or expr.id not in own)

        for n in ast.walk(m):
            if isinstance(n, ast.Assign) and outside(n.value):
                stored |= {t.attr for t in n.targets if isinstance(t, ast.Attribute) and dotted_name(t.value) == "self"}
            elif (
                isinstance(n, ast.Call) and (last := (dotted_name(n.func) or "").rsplit(".", 1)[-1]) in _CONTAINER_CALLS
            ):
                if any(outside(x) for x in (n.args if last[:1].isupper() else n.args[-1:])):
                    return True
    if not stored:
        return False
    for m in methods.values():
        for n in ast.walk(m):
            if isinstance(n, ast.Call):
                uses = [n.func, *n.args, *(k.value for k in n.keywords)]
                written = dotted_name(n.func) or ""
                q = out.qualify(written)
                data = written in _DATA_CALLS or (q is not None and q[0].startswith("torch.nn.") and q[1] == 0)
                if any(_self_attr(x) in stored for x in (uses if not data else uses[:1])):
                    return True
            elif isinstance(n, (ast.For, ast.comprehension)) and _self_attr(n.iter) in stored:
                return True
            elif isinstance(n, (ast.List, ast.Tuple, ast.Dict)):
                if any(_self_attr(x) in stored for x in ast.iter_child_nodes(n) if isinstance(x, ast.expr)):
                    return True
    return False


def _self_attr(expr: ast.expr) -> str | None:
    """``X`` for ``self.X``, ``self.X.forward``, ``self.X.encoder``, ``self.X[0]``."""
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
            return expr.attr
        expr = expr.value
    return None


def _literal(expr: ast.expr) -> Any:
    return expr.value if isinstance(expr, ast.Constant) else _NOT_LITERAL


def _mode_of_base(out: ModuleSummary, base: ast.expr, unit: Unit) -> None:
    written = dotted_name(base)
    q = out.qualify(written) if written else None
    if written is None:
        _set_mode(unit, "?")
    elif q is not None and q[1] == 0 and q[0].startswith("torch."):
        _set_mode(unit, torch_mode(q[0], [], {}))
    elif written != "object" and written not in unit.mode_calls:
        unit.mode_calls.append(written)


def _set_mode(unit: Unit, verdict: str) -> None:
    if verdict == "train" or (verdict == "?" and unit.mode == ""):
        unit.mode = verdict


def _mode_facts(out: ModuleSummary, body: list[ast.stmt], unit: Unit, local: set[str]) -> None:
    """Fill ``unit.mode`` and ``unit.mode_calls`` from the calls in ``body`` (see ``Unit.mode``)."""
    loops = {
        x.id
        for stmt in body
        for n in ast.walk(stmt)
        if isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension))
        for x in ast.walk(n.target)
        if isinstance(x, ast.Name)
    }
    for stmt in body:
        for n in ast.walk(stmt):
            if unit.mode == "train":
                return
            if isinstance(n, ast.Attribute) and n.attr == "training" and isinstance(n.value, ast.Name):
                if n.value.id == "self":
                    unit.mode = "train"
            elif isinstance(n, ast.Call):
                verdict, follow = _call_mode(out, n, local, loops)
                _set_mode(unit, verdict)
                if follow is not None and follow not in unit.mode_calls:
                    unit.mode_calls.append(follow)


def _call_mode(out: ModuleSummary, call: ast.Call, local: set[str], loops: set[str]) -> tuple[str, str | None]:
    """The mode verdict of one call, and the name to follow through the project when it has one."""
    func = call.func
    if isinstance(func, (ast.Call, ast.Lambda)):
        return "?", None  # `getattr(nn, name)()`: what it builds is known only at run time
    written = dotted_name(func)
    if written is None:
        return "", None  # `self.blocks[i](x)`, `x.view(n, -1).mean()`: runs what is already built
    head = written.partition(".")[0]
    if head == "self" or head in local:
        # a method or a submodule of its own, a method of a local value, a layer a loop takes from a
        # container (`for conv in self.convs: x = conv(x)`); a call of another local name (`block(...)`
        # with a class handed in) builds what the caller chose
        return ("?" if isinstance(func, ast.Name) and head != "self" and head not in loops else ""), None
    q = out.qualify(written)
    if q is not None and q[1] == 0 and (q[0] == "torch" or q[0].startswith("torch.")):
        args = [_literal(a) for a in call.args]
        kwargs = {k.arg: _literal(k.value) for k in call.keywords if k.arg is not None}
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            args, kwargs = [_NOT_LITERAL] * 8, {"training": _NOT_LITERAL}  # `*args`: any switch may be on
        return torch_mode(q[0], args, kwargs), None
    if q is not None and q[1] == 0 and q[0].partition(".")[0] in _PLAIN:
        return "", None
    if q is not None or head in out.classes or head in out.functions:
        return "", written
    if hasattr(builtins, head):
        return "", None
    return "?", None  # a module-level value (`ACT()`, `registry.build(cfg)`)


def _no_grad(out: ModuleSummary, expr: ast.expr) -> bool:
    written = dotted_name(expr.func if isinstance(expr, ast.Call) else expr)
    q = out.qualify(written) if written else None
    return q is not None and q[0] in NO_GRAD


def _literal_slice(node: ast.Subscript) -> bool:
    """``x[:16000]``, ``x[..., 0:224]``: a slice with a literal bound gives the result a size of its own."""
    parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    return any(
        isinstance(p, ast.Slice)
        and any(isinstance(b, ast.Constant) and type(b.value) is int for b in (p.lower, p.upper))
        for p in parts
    )


def _autocast(out: ModuleSummary, expr: ast.expr) -> bool:
    """``torch.autocast("cuda", ...)`` and the like, not turned off by a literal ``enabled=False``,
    nor written for another device (``torch.autocast("cpu")``)."""
    written = dotted_name(expr.func) if isinstance(expr, ast.Call) else None
    q = out.qualify(written) if written else None
    if not isinstance(expr, ast.Call) or q is None or q[0] not in AUTOCASTS:
        return False
    if any(k.arg == "enabled" and isinstance(k.value, ast.Constant) and k.value.value is False for k in expr.keywords):
        return False
    device = next((k.value for k in expr.keywords if k.arg == "device_type"), expr.args[0] if expr.args else None)
    return not (isinstance(device, ast.Constant) and isinstance(device.value, str) and device.value != "cuda")


def _iterated(expr: ast.expr) -> str | None:
    """The name a ``for`` iterates: ``loader``, ``enumerate(loader)``, ``tqdm(loader, ...)``."""
    for _ in range(3):
        if isinstance(expr, ast.Name):
            return expr.id
        if isinstance(expr, ast.Call) and expr.args and (dotted_name(expr.func) or "").rsplit(".")[-1] in _WRAPPERS:
            expr = expr.args[0]
            continue
        return None
    return None


def _dict_literal(expr: ast.expr) -> dict[str, str] | None:
    """``dict(k=v, ...)`` or ``{"k": v, ...}`` with plain keys: key -> source of the value."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict" and not expr.args:
        if all(k.arg is not None for k in expr.keywords):
            return {str(k.arg): ast.unparse(k.value) for k in expr.keywords}
    if isinstance(expr, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in expr.keys):
        return {str(k.value): ast.unparse(v) for k, v in zip(expr.keys, expr.values) if isinstance(k, ast.Constant)}
    return None
