"""TOP302 `unpadded-gemm-size`: Reports `nn.Linear`, `nn.MultiheadAttention`, `nn.Transformer*Layer` and recurrent layers whose."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import positional
from torchopt.analysis.syntax import walk
from torchopt.analysis.workload import workload_of
from torchopt.codemods.pad import FAMILY
from torchopt.codemods.pad.sizes import OPTION_MULTIPLE
from torchopt.codemods.pad.sizes import arg
from torchopt.codemods.pad.sizes import code
from torchopt.codemods.pad.sizes import int_const
from torchopt.codemods.pad.sizes import last_name
from torchopt.codemods.pad.sizes import maybe_int
from torchopt.codemods.pad.sizes import nn_class
from torchopt.codemods.pad.sizes import pad_formula
from torchopt.codemods.pad.sizes import padded
from torchopt.codemods.pad.gemm_layers import (
    CONVS,
    DROPOUT,
    LAYERS,
    MIN_SIZE,
    NO_ARGS_ONLY,
    ZERO_PRESERVING,
    _bad_size_possible,
)
from torchopt.codemods.pad.module_chains import ModulePairs
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


_MOVES = {"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "train", "eval", "requires_grad_"}


_LAYER_NAMES = frozenset(LAYERS)
_CONV_NAMES = frozenset(CONVS)
# Layers chained in a Sequential whose hidden width can be padded: the next one must be the same kind.
_CHAINABLE = {"Linear": ("in_features", "out_features"), **{c: ("in_channels", "out_channels") for c in CONVS}}


class PadGemmDims(Rule):
    """## What it does
    Reports `nn.Linear`, `nn.MultiheadAttention`, `nn.Transformer*Layer` and recurrent layers whose
    sizes are known constants that are not multiples of 8, with the nearest padded size. Sizes the
    rule cannot evaluate (function parameters, config fields) are not reported, nor sizes below 8
    (a score head `nn.Linear(h, 1)`, a 2-way classifier: memory-bound, nothing to gain). Convolution
    channels are reported only where they can be fixed (below): cuDNN 7.3 and later runs other
    channel counts without a large penalty, so advice alone would be noise.

    ## Why is this slow
    fp16/bf16 (and TF32) Tensor Cores multiply tiles whose sides are multiples of 8; a GEMM with
    `K`, `N` or `M` off that grid runs slower kernels or is padded inside cuBLAS on every call.

    ## Example
    ```python
    mlp = nn.Sequential(nn.Linear(16, 100), nn.ReLU(), nn.Linear(100, 24))
    ```

    ## Use instead
    ```python
    mlp = nn.Sequential(nn.Linear(16, 104), nn.ReLU(), nn.Linear(104, 24))
    ```
    Changing a size changes the architecture, so in general this is advice only. A fix is offered
    in one case where it is provably output-preserving at equal weights: a hidden dimension between
    two `nn.Linear` layers of one `nn.Sequential`, joined only by elementwise activations with
    `f(0) == 0` (ReLU, GELU, SiLU, Tanh, ...) or dropout, is padded on both sides. The Sequential's
    input and output sizes are never changed, nor a size a normalisation layer reduces over, nor a
    Sequential the file indexes or slices (its hidden features would become visible). Chains of
    plain `nn.Conv1d`/`nn.Conv2d`/`nn.Conv3d` layers in one `nn.Sequential` are padded the same way
    (hidden channels; not through a grouped convolution, a norm, pooling or sigmoid). The same holds
    for two `nn.Linear` attributes of one module whose only use is `self.fc2(act(self.fc1(x)))`
    (activations held in attributes, their functional forms such as `F.relu`, `.relu()`, or
    dropout in between), also written statement by statement in `forward`
    (`x = F.relu(self.fc1(x))`, `x = self.fc2(x)`): each intermediate value is bound to a name that
    exactly one later statement of the same straight-line body reads before binding it again, so
    the hidden features are seen nowhere else (not returned, not read on a branch or twice).

    Not reported in a file whose every training step steps a `gym`/`gymnasium` environment in the
    same iteration and whose layers are all `nn.Linear` of at most 256 features (a reinforcement
    learning policy): the environment dominates the iteration, and GEMMs that small gain nothing
    from padding.

    ## Fix safety
    Unsafe, tags semantics, rng and tolerance. With the original weights in the leading rows and
    columns and zeros in the pad (what `torchopt validate` sets up, docs/validation.md "Weight
    transplant"), each pad unit computes `f(0) = 0`, contributes exact zeros to the next layer and
    receives exactly zero gradient, so it stays zero during training.
    - **semantics**: parameter shapes change (old checkpoints no longer load as they are).
    - **rng**: the padded layers draw more random numbers at initialisation, so they and every module
      built afterwards start from other weights; dropout between the layers draws its mask over the
      padded width, so the mask of the real units changes.
    - **tolerance**: the second GEMM sums over more (zero) terms; on the CPU the kernel blocks the sum
      differently, so results differ by float rounding (measured up to 1e-4 absolute on 64 x 784 x
      300 x 10; bitwise for some shapes only). The validator holds it to the fp32 tolerance.
    """

    code = "TOP302"
    name = "unpadded-gemm-size"
    family = FAMILY
    message = "`{layer}`: {dims} not a multiple of {multiple} (nearest padded: {suggest})"
    fix_title = "Pad the hidden size {hidden} to {padded} on both sides"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS, Tag.RNG, Tag.TOLERANCE)
    prefilter = (
        "Linear",
        "MultiheadAttention",
        "TransformerEncoderLayer",
        "TransformerDecoderLayer",
        "LSTM",
        "GRU",
        "RNN",
        "Conv1d",
        "Conv2d",
        "Conv3d",
    )

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.patterns import int_sized_layer_call
        from torchopt.analysis.precheck.torch_imports import torch_callees

        # The layer must resolve to torch.nn and have a size maybe_int can evaluate (visit_Call).
        if not (super().could_match(text) and "torch" in text and int_sized_layer_call(text, {**LAYERS, **CONVS})):
            return False
        callees = torch_callees(text)
        if callees is not None and not any(
            (q.split(".")[-1] in LAYERS or q.split(".")[-1] in CONVS)
            and (q.count(".") == 2 or q.split(".")[2] == "modules")
            and q.startswith("torch.nn.")
            for q in callees
        ):
            return False
        return _bad_size_possible(text)

    options = (OPTION_MULTIPLE,)

    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn

                torch.manual_seed(0)
                mlp = nn.Sequential(
                    nn.Linear(16, 100),
                    nn.ReLU(),
                    nn.Linear(100, 24),
                )
                out = mlp(torch.randn(4, 16))
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn

                torch.manual_seed(0)
                mlp = nn.Sequential(
                    nn.Linear(16, 104),
                    nn.ReLU(),
                    nn.Linear(104, 24),
                )
                out = mlp(torch.randn(4, 16))
            """),
            unsafe=("semantics", "rng", "tolerance"),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch.nn as nn

                H = 50
                net = nn.Sequential(nn.Linear(32, H), nn.GELU(), nn.Dropout(0.1), nn.Linear(H, 8))
            """),
            after=dedent("""\
                import torch.nn as nn

                H = 50
                net = nn.Sequential(
                    nn.Linear(32, ((H + 7) // 8) * 8),
                    nn.GELU(),
                    nn.Dropout(0.1),
                    nn.Linear(((H + 7) // 8) * 8, 8),
                )
            """),
            unsafe=("semantics", "rng", "tolerance"),
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                import torch.nn.functional as F


                class FeedForward(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(32, 100)
                        self.act = nn.GELU()
                        self.fc2 = nn.Linear(100, 32)

                    def forward(self, x):
                        return self.fc2(self.act(self.fc1(x)))


                torch.manual_seed(0)
                out = FeedForward()(torch.randn(3, 32))
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn
                import torch.nn.functional as F


                class FeedForward(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(32, 104)
                        self.act = nn.GELU()
                        self.fc2 = nn.Linear(104, 32)

                    def forward(self, x):
                        return self.fc2(self.act(self.fc1(x)))


                torch.manual_seed(0)
                out = FeedForward()(torch.randn(3, 32))
            """),
            unsafe=("semantics", "rng", "tolerance"),
            runnable=True,
            note="two layers of one module, joined by an activation held in an attribute",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                import torch.nn.functional as F


                class FeedForward(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(32, 100)
                        self.act = nn.GELU()
                        self.fc2 = nn.Linear(100, 32)

                    def forward(self, x):
                        return self.fc2(self.act(self.fc1(x))) + self.fc1(x).sum()


                torch.manual_seed(0)
                out = FeedForward()(torch.randn(3, 32))
            """),
            note="the hidden features are used twice: reported, not fixed",
        ),
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                import torch.nn.functional as F


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(784, 500)
                        self.fc2 = nn.Linear(500, 10)

                    def forward(self, x):
                        x = x.view(-1, 784)
                        x = F.relu(self.fc1(x))
                        x = self.fc2(x)
                        return x


                torch.manual_seed(0)
                out = Net()(torch.randn(2, 1, 28, 28))
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn
                import torch.nn.functional as F


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(784, 504)
                        self.fc2 = nn.Linear(504, 10)

                    def forward(self, x):
                        x = x.view(-1, 784)
                        x = F.relu(self.fc1(x))
                        x = self.fc2(x)
                        return x


                torch.manual_seed(0)
                out = Net()(torch.randn(2, 1, 28, 28))
            """),
            unsafe=("semantics", "rng", "tolerance"),
            runnable=True,
            note="the layers used statement by statement in `forward`: each value goes to the next statement only",
        ),
        Invalid(
            dedent("""\
                import torch.nn as nn
                import torch.nn.functional as F


                class Net(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc1 = nn.Linear(784, 500)
                        self.fc2 = nn.Linear(500, 10)

                    def forward(self, x):
                        h = F.relu(self.fc1(x))
                        return self.fc2(h), h
            """),
            note="the hidden features are returned too: reported, not fixed",
        ),
        Invalid(
            dedent("""\
                import torch.nn as nn

                head = nn.Linear(64, 10)
            """),
            note="an output size: reported, never padded",
        ),
        Invalid(
            dedent("""\
                import torch.nn as nn

                net = nn.Sequential(nn.Linear(8, 30), nn.LayerNorm(30), nn.ReLU(), nn.Linear(30, 8))
            """),
            note="LayerNorm reduces over the hidden size",
        ),
        Invalid(
            dedent("""\
                import torch.nn as nn

                net = nn.Sequential(nn.Linear(8, 30), nn.Sigmoid(), nn.Linear(30, 8))
            """),
            note="sigmoid(0) = 0.5: the pad units would learn",
        ),
        Invalid(
            dedent("""\
                import torch.nn as nn

                net = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8))
                features = net[:2]
            """),
            note="the hidden features are used directly",
        ),
        Invalid(
            dedent("""\
                import torch.nn as nn

                attn = nn.MultiheadAttention(100, 4)
            """)
        ),
        Valid(
            dedent("""\
                import torch.nn as nn

                net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
            """),
            runnable=True,
        ),
        Valid(
            dedent("""\
                import torch.nn as nn

                def build(n):
                    return nn.Linear(n, 3 * n)
            """),
            note="sizes not known",
        ),
        Valid(
            dedent("""\
                import torch.nn as nn

                conv = nn.Conv2d(3, 17, 3)
            """),
            note="convolutions are not reported",
        ),
        Valid(
            dedent("""\
                import gymnasium as gym
                import torch
                import torch.nn as nn

                env = gym.make("CartPole-v1")
                q = nn.Sequential(nn.Linear(4, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 2))
                opt = torch.optim.Adam(q.parameters())
                obs, _ = env.reset()
                for step in range(1000):
                    action = q(torch.tensor(obs)).argmax().item()
                    obs, reward, done, trunc, _ = env.step(action)
                    loss = (q(torch.tensor(obs)).max() - reward) ** 2
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            """),
            note="a small MLP policy trained between environment steps: padding cannot pay",
        ),
        Invalid(
            dedent("""\
                import torch
                from torch import nn as tnn

                torch.manual_seed(0)
                features = tnn.Sequential(
                    tnn.Conv2d(3, 20, 3, padding=1),
                    tnn.ReLU(),
                    tnn.Conv2d(20, 30, 3),
                    tnn.Tanh(),
                    tnn.Conv2d(30, 16, 1),
                )
                out = features(torch.randn(2, 3, 8, 8))
            """),
            after=dedent("""\
                import torch
                from torch import nn as tnn

                torch.manual_seed(0)
                features = tnn.Sequential(
                    tnn.Conv2d(3, 24, 3, padding=1),
                    tnn.ReLU(),
                    tnn.Conv2d(24, 32, 3),
                    tnn.Tanh(),
                    tnn.Conv2d(32, 16, 1),
                )
                out = features(torch.randn(2, 3, 8, 8))
            """),
            unsafe=("semantics", "rng", "tolerance"),
            runnable=True,
            note="a convolution chain, aliased import: channels 20 and 30 padded, 3 and 16 kept",
        ),
        Valid(
            dedent("""\
                import torch.nn as nn

                net = nn.Sequential(nn.Conv2d(3, 20, 3), nn.BatchNorm2d(20), nn.ReLU(), nn.Conv2d(20, 16, 3))
                dw = nn.Sequential(nn.Conv2d(20, 20, 3, groups=20), nn.ReLU(), nn.Conv2d(20, 16, 1))
                gate = nn.Sequential(nn.Conv2d(3, 20, 3), nn.Sigmoid(), nn.Conv2d(20, 16, 3))
            """),
            note="a norm, a grouped convolution, sigmoid(0) = 0.5: convolution channels left alone",
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._multiple = int(self.option("multiple"))
        self._vocab_keys: set[str] | None = None
        self._subscripted: set[str] | None = None
        self._module_pairs = ModulePairs(self, self._multiple)
        self._environment_bound: bool | None = None

    def visit_Call(self, node: cst.Call) -> None:
        name = last_name(node.func)
        if name in CONVS:
            self._visit_conv(node)
            return
        if name not in LAYERS or has_star(node):
            return
        if not any(a is not None and maybe_int(self, a.value) for a in (arg(node, i, n) for n, i in LAYERS[name])):
            return  # no size can be known: skip the name resolution
        if self._environment_bound is None:
            self._environment_bound = workload_of(self).environment_bound
        if self._environment_bound:
            return  # a small MLP trained between environment steps: padding cannot pay
        cls = nn_class(self, node, _LAYER_NAMES)
        if cls not in LAYERS:
            return
        m = self._multiple
        bad = []
        for name, index in LAYERS[cls]:
            a = arg(node, index, name)
            if a is None:
                continue
            v = int_const(self, a.value)
            if v is None or v < MIN_SIZE or v % m == 0:
                continue
            if cls == "Linear" and name == "out_features" and code(self, a.value) in self._vocabulary():
                continue  # the vocabulary: TOP301
            bad.append((name, v))
        if cls == "MultiheadAttention":
            e, h = arg(node, 0, "embed_dim"), arg(node, 1, "num_heads")
            ev, hv = int_const(self, e.value if e else None), int_const(self, h.value if h else None)
            if ev and hv and ev % hv == 0 and (ev // hv) % m and not bad:
                bad.append(("head_dim", ev // hv))
        if not bad:
            return
        fmt = {
            "layer": code(self, node) if len(code(self, node)) <= 60 else code(self, node.func) + "(...)",
            "dims": ", ".join(f"{n}={v}" for n, v in bad) + (" is" if len(bad) == 1 else " are"),
            "multiple": str(m),
            "suggest": ", ".join(f"{n}={padded(v, m)}" for n, v in bad),
        }
        fix = (self._sequential_fix(node) or self._module_pairs.fix(node)) if cls == "Linear" else None
        if fix is None:
            self.report(node, fmt=fmt)
            return
        seq, replacement, hidden, pad_to, dropout = fix
        fmt.update(hidden=hidden, padded=pad_to)
        note = (
            "parameter shapes change; the padded layers draw more random numbers at initialisation; "
            "the next layer sums over extra zero terms (float rounding may differ)"
        )
        if dropout:
            note += "; dropout draws its mask over the padded width"
        self.report(
            node,
            fmt=fmt,
            replacement=replacement,
            target=seq,
            safety=Safety.UNSAFE,
            tags=(Tag.SEMANTICS, Tag.RNG, Tag.TOLERANCE),
            note=note,
        )

    def _visit_conv(self, node: cst.Call) -> None:
        """Convolution channels are reported only where they can be padded inside a Sequential chain:
        cuDNN runs other channel counts without a large penalty, so the advice alone is noise."""
        if has_star(node) or nn_class(self, node, _CONV_NAMES) not in CONVS:
            return
        fix = self._sequential_fix(node)
        if fix is None:
            return
        seq, replacement, hidden, pad_to, dropout = fix
        m = self._multiple
        bad = [
            (n, v)
            for n, v in (
                (n, int_const(self, a.value))
                for n, a in ((n, arg(node, i, n)) for n, i in CONVS[nn_class(self, node) or "Conv2d"])
                if a
            )
            if v is not None and v >= MIN_SIZE and v % m
        ]
        if not bad:
            return
        fmt = {
            "layer": code(self, node) if len(code(self, node)) <= 60 else code(self, node.func) + "(...)",
            "dims": ", ".join(f"{n}={v}" for n, v in bad) + (" is" if len(bad) == 1 else " are"),
            "multiple": str(m),
            "suggest": ", ".join(f"{n}={padded(v, m)}" for n, v in bad),
            "hidden": hidden,
            "padded": pad_to,
        }
        note = (
            "parameter shapes change; the padded layers draw more random numbers at initialisation; "
            "the next layer sums over extra zero channels (float rounding may differ)"
        )
        if dropout:
            note += "; dropout draws its mask over the padded width"
        self.report(
            node,
            fmt=fmt,
            replacement=replacement,
            target=seq,
            safety=Safety.UNSAFE,
            tags=(Tag.SEMANTICS, Tag.RNG, Tag.TOLERANCE),
            note=note,
        )

    def _chain_link(self, item: cst.BaseExpression) -> str | None:
        """The kind of a layer whose output width can be padded: a Linear, or a plain convolution
        (no ``groups``, which ties channels together, and no ``*args``)."""
        if not isinstance(item, cst.Call) or has_star(item):
            return None
        kind = nn_class(self, item)
        if kind not in _CHAINABLE:
            return None
        if kind in CONVS:
            groups = arg(item, 6, "groups")
            if groups is not None and int_const(self, groups.value) != 1:
                return None
        return kind

    def _vocabulary(self) -> set[str]:
        if self._vocab_keys is None:
            keys: set[str] = set()
            if "Embedding" in self.ctx.text:
                for n in walk(self.ctx.module, cross_scopes=True):
                    if isinstance(n, cst.Call) and nn_class(self, n, {"Embedding"}) == "Embedding":
                        a = arg(n, 0, "num_embeddings")
                        if a is not None:
                            keys.add(code(self, a.value))
            self._vocab_keys = keys
        return self._vocab_keys

    def _sequential_fix(self, linear: cst.Call):
        """(Sequential call, its padded replacement, first hidden size, its padded size, dropout?) when
        ``linear`` takes part in a paddable hidden dimension of an nn.Sequential; else None."""
        parent = self.get_metadata(ParentProvider, linear, None)
        seq = self.get_metadata(ParentProvider, parent, None) if isinstance(parent, cst.Arg) else None
        if not isinstance(seq, cst.Call) or nn_class(self, seq) != "Sequential" or has_star(seq):
            return None
        if any(a.keyword is not None for a in seq.args) or not self._private(seq):
            return None
        items = [a.value for a in positional(seq)]
        m = self._multiple
        edits: dict[int, cst.BaseExpression] = {}  # id(Arg) -> new value
        involved: set[int] = set()
        first = None
        dropout = False
        for i, item in enumerate(items):
            kind = self._chain_link(item)
            if kind is None or not isinstance(item, cst.Call):  # (a link is a call)
                continue
            in_name, out_name = _CHAINABLE[kind]
            out = arg(item, 1, out_name)
            h = int_const(self, out.value) if out else None
            if out is None or h is None or h <= 0 or h % m == 0:
                continue
            j = i + 1
            drop_here = False
            while j < len(items):
                nxt = items[j]
                if not isinstance(nxt, cst.Call):
                    break
                cls = nn_class(self, nxt)
                if cls in ZERO_PRESERVING or (cls in NO_ARGS_ONLY and not nxt.args):
                    j += 1
                    continue
                if cls in DROPOUT:
                    drop_here = True
                    j += 1
                    continue
                break
            if j >= len(items):
                continue
            nxt = items[j]
            if self._chain_link(nxt) != kind or not isinstance(nxt, cst.Call):
                continue
            inp = arg(nxt, 0, in_name)
            if inp is None or int_const(self, inp.value) != h:
                continue
            if isinstance(out.value, cst.Integer):
                new_out: cst.BaseExpression = cst.Integer(str(padded(h, m)))
            else:
                new_out = cst.parse_expression(pad_formula(code(self, out.value), m))
            if isinstance(inp.value, cst.Integer):
                new_in: cst.BaseExpression = cst.Integer(str(padded(h, m)))
            else:
                new_in = cst.parse_expression(pad_formula(code(self, inp.value), m))
            edits[id(out)] = new_out
            edits[id(inp)] = new_in
            involved |= {id(item), id(nxt)}
            dropout = dropout or drop_here
            if first is None:
                first = (h, padded(h, m))
        if id(linear) not in involved or first is None:
            return None

        class _Edit(cst.CSTTransformer):
            def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
                new = edits.get(id(original_node))
                return updated_node if new is None else updated_node.with_changes(value=new)

        return seq, seq.visit(_Edit()), str(first[0]), str(first[1]), dropout

    def _private(self, seq: cst.Call) -> bool:
        """The Sequential is bound to a name or attribute that the file never indexes or slices."""
        cur: cst.CSTNode = seq
        parent = self.get_metadata(ParentProvider, cur, None)
        while isinstance(parent, cst.Attribute) and parent.value is cur and parent.attr.value in _MOVES:
            call = self.get_metadata(ParentProvider, parent, None)  # `nn.Sequential(...).to(device)`
            if not (isinstance(call, cst.Call) and call.func is parent):
                return False
            cur, parent = call, self.get_metadata(ParentProvider, call, None)
        if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1):
            return False
        target = parent.targets[0].target
        if not isinstance(target, (cst.Name, cst.Attribute)):
            return False
        if self._subscripted is None:
            names: set[str] = set()
            for n in walk(self.ctx.module, cross_scopes=True):
                if isinstance(n, cst.Subscript):
                    v = n.value
                    if isinstance(v, cst.Attribute):
                        names.add(v.attr.value)
                    elif isinstance(v, cst.Name):
                        names.add(v.value)
            self._subscripted = names
        attr = target.attr.value if isinstance(target, cst.Attribute) else target.value
        return attr not in self._subscripted
