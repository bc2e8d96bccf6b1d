"""Memory-saving optimizer advice where Adam's state dominates: a model built from a large config."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.analysis.arguments import has_star
from torchopt.analysis.names import callee, reaching_values
from torchopt.analysis.values import int_value, string_value
from torchopt.codemods.mem import FAMILY
from torchopt.analysis.optimizers import ADAM_OPTIMIZERS, assigned_value, parameter_owners, params_arg, seen_through
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid, Option, Rule, Safety, Valid

# The spellings of a transformer's depth and width in model configs (GPT, BERT/HF, ViT, T5 ...).
_DEPTH_KEYS = {"n_layer", "n_layers", "num_layers", "num_hidden_layers", "depth", "num_blocks"}
_WIDTH_KEYS = {"n_embd", "hidden_size", "d_model", "embed_dim", "dim", "hidden_dim", "width"}
_VOCAB_KEYS = {"vocab_size", "n_vocab", "num_tokens"}
_MAX_DEPTH = 3


def _literal_sizes(node: cst.BaseExpression) -> dict[str, int]:
    """Integer keyword arguments of a call, or integer values of a dict with string keys."""
    out: dict[str, int] = {}
    if isinstance(node, cst.Call):
        for a in node.args:
            if a.keyword is not None and (size := int_value(a.value)) is not None:
                out[a.keyword.value] = size
    elif isinstance(node, cst.Dict):
        for el in node.elements:
            if (
                isinstance(el, cst.DictElement)
                and (key := string_value(el.key))
                and (size := int_value(el.value)) is not None
            ):
                out[key] = size
    return out


class MemorySavingOptimizer(Rule):
    """## What it does
    Reports `torch.optim.Adam` / `torch.optim.AdamW` updating a model built, in the same function
    (or class, or script), from a config whose literal sizes put it at `min-params` (one billion)
    parameters or more. The size is estimated as `12 · depth · width²` (+ `vocab · width`) from
    integer keywords that name a transformer's depth (`n_layer`, `num_layers`, `num_hidden_layers`,
    `depth`, ...) and width (`n_embd`, `hidden_size`, `d_model`, `embed_dim`, `dim`, ...), given
    to the model's constructor directly or through a config object or dict assigned once
    (`config = GPTConfig(n_layer=48, n_embd=1600)`; `model = GPT(config)`). Models whose size the
    source does not spell out are not reported. Display-only.

    ## Why is this slow
    Adam keeps two float32 moments per parameter: 8 bytes per parameter, twice the float32 weights
    and four times bf16 weights. At a billion parameters that is 8 GB of optimizer state that
    crowds out activations, forcing small batches (or offloading), and every step reads and writes
    it all. Adafactor (`torch.optim.Adafactor`, PyTorch 2.5) factors the second moment of each
    matrix into a row and a column vector and keeps no first moment: its state is a small fraction
    of Adam's, so the memory goes to larger batches instead.

    ## Example
    ```python
    config = GPTConfig(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    ```

    ## Use instead
    ```python
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.1)
    ```
    Other ways to shrink optimizer state: 8-bit Adam (bitsandbytes), or sharding it across GPUs
    (`ZeroRedundancyOptimizer`, FSDP).

    ## Fix safety
    Display-only: Adafactor is another algorithm (relative step sizes, update clipping, no
    momentum), with its own learning rate and convergence; switching needs retuning and cannot be
    checked by comparing runs. The estimate counts transformer blocks only; it is a trigger, not
    a measurement.
    """

    code = "TOP714"
    name = "memory-saving-optimizer"
    family = FAMILY
    message = (
        "`{opt}` keeps two float32 moments per parameter: about {gb} GB of state for a model of ~{params} "
        "parameters ({sizes}); a factored optimizer (`torch.optim.Adafactor`) keeps a fraction of that"
    )
    safety = Safety.DISPLAY
    prefilter = ("Adam",)
    requires = ("torch", "parameters")
    options = (Option("min-params", int, 1_000_000_000, "report models estimated at this many parameters or more"),)
    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)
    examples = (
        Invalid(
            dedent("""\
            import torch
            from model import GPT, GPTConfig

            config = GPTConfig(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257)
            model = GPT(config).to("cuda")
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        """)
        ),
        Invalid(
            dedent("""\
            from torch import optim as O
            from mylib import Transformer


            def build(device):
                net = Transformer(**{"num_layers": 32, "d_model": 4096})
                net.to(device)
                return O.Adam(net.parameters(), lr=1e-4)
        """),
            note="in a function, `from torch import optim as O`, a dict config",
        ),
        Invalid(
            dedent("""\
            import torch
            from model import GPT, GPTConfig


            class Trainer:
                def __init__(self, device):
                    self.model = GPT(GPTConfig(n_layer=48, n_head=25, n_embd=1600)).to(device)
                    self.optimizer = torch.optim.Adam(self.model.parameters(), lr=3e-4)
        """),
            note="in a method: the model held in an attribute",
        ),
        Valid(
            dedent("""\
            import torch
            from model import GPT, GPTConfig

            config = GPTConfig(n_layer=12, n_head=12, n_embd=768)
            model = GPT(config)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        """),
            note="about 85M parameters: activations dominate, not optimizer state",
        ),
        Valid(
            dedent("""\
            import torch
            from model import GPT

            model = GPT.from_config(cfg)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        """),
            note="size not spelled out in the source",
        ),
        Valid(
            dedent("""\
            import torch
            from model import GPT, GPTConfig

            config = GPTConfig(n_layer=48, n_embd=1600)
            model = GPT(config)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        """),
            note="plain SGD keeps no moments",
        ),
    )

    def visit_Call(self, node: cst.Call) -> None:
        opt = ADAM_OPTIMIZERS.get(callee(self, node) or "")
        if opt is None or has_star(node):
            return
        params = params_arg(node)
        if params is None:
            return
        best: tuple[int, dict[str, int]] | None = None
        for owner in parameter_owners(seen_through(self, params)):
            for value in assigned_value(self, owner, node):
                estimate = self._estimate(self._constructor(value))
                if estimate and (best is None or estimate[0] > best[0]):
                    best = estimate
        if best is None or best[0] < self.option("min-params"):
            return
        count, sizes = best
        self.report(
            node,
            fmt={
                "opt": f"torch.optim.{opt}",
                "gb": f"{8 * count / 1e9:.0f}",
                "params": f"{count / 1e9:.1f}B",
                "sizes": ", ".join(f"{k}={v}" for k, v in sorted(sizes.items())),
            },
        )

    @staticmethod
    def _constructor(value: cst.BaseExpression) -> cst.BaseExpression:
        """``GPT(config)`` out of ``GPT(config).to(device).train()``."""
        while (
            isinstance(value, cst.Call)
            and isinstance(value.func, cst.Attribute)
            and isinstance(value.func.value, cst.Call)
        ):
            value = value.func.value
        return value

    def _sizes(self, node: cst.BaseExpression, depth: int = 0) -> dict[str, int]:
        if depth > _MAX_DEPTH:
            return {}
        if isinstance(node, cst.Name):
            values = reaching_values(self, node)
            return self._sizes(values[0], depth + 1) if values and len(values) == 1 and values[0] else {}
        sizes = _literal_sizes(node)
        if isinstance(node, cst.Call):
            for a in node.args:
                if a.keyword is None:
                    for k, v in self._sizes(a.value, depth + 1).items():
                        sizes.setdefault(k, v)
        return sizes

    def _estimate(self, ctor: cst.BaseExpression) -> tuple[int, dict[str, int]] | None:
        if not isinstance(ctor, cst.Call):
            return None
        sizes = self._sizes(ctor)
        depth = next((sizes[k] for k in sorted(_DEPTH_KEYS) if k in sizes), None)
        width = next((sizes[k] for k in sorted(_WIDTH_KEYS) if k in sizes), None)
        if depth is None or width is None:
            return None
        vocab = next((sizes[k] for k in sorted(_VOCAB_KEYS) if k in sizes), 0)
        used = {k: v for k, v in sizes.items() if k in _DEPTH_KEYS | _WIDTH_KEYS | _VOCAB_KEYS}
        return 12 * depth * width * width + vocab * width, used
