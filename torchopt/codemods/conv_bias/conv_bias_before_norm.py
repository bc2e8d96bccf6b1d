"""TOP841 `conv-bias-before-norm`: Flags a convolution (`nn.Conv{1,2,3}d`, `nn.ConvTranspose{1,2,3}d`) with a bias whose output."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.arguments import set_kwarg
from torchopt.analysis.names import callee
from torchopt.analysis.syntax import has_comments
from torchopt.analysis.syntax import source
from torchopt.analysis.syntax import walk
from torchopt.codemods.conv_bias import FAMILY
from torchopt.codemods.conv_bias.conv_norm_pairs import (
    _BIAS_POS,
    _CONVS,
    _NORMS,
    _arg,
    _bias_reads,
    _could_match,
    _pairs,
    _self_attr,
    _text,
    _torch_nn_class,
)
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


class ConvBiasBeforeNorm(Rule):
    """## What it does
    Flags a convolution (`nn.Conv{1,2,3}d`, `nn.ConvTranspose{1,2,3}d`) with a bias whose output
    goes straight into a normalisation that subtracts a per-channel mean over the same channels
    (`BatchNorm{1,2,3}d`, `SyncBatchNorm`, `InstanceNorm{1,2,3}d`, `GroupNorm` with one group per
    channel), and adds `bias=False` to the convolution. It recognises

    * consecutive layers of an `nn.Sequential(...)` literal, and
    * a module that builds `self.conv = nn.Conv2d(...)` and `self.bn = nn.BatchNorm2d(...)` and
      whose `forward` computes `self.bn(self.conv(x))` (or `y = self.conv(x)` immediately followed
      by `y = self.bn(y)`), when `self.conv` is used nowhere else.

    The channel counts must match (`out_channels` and `num_features` written the same way).
    `GroupNorm` with fewer groups, `LayerNorm`, `FrozenBatchNorm2d` and other layers do not cancel
    the bias and are never flagged. No fix is offered when the file reads a `.bias` that may be the
    convolution's (`nn.init.zeros_(m.bias)` would fail on None) outside an
    `if m.bias is not None:` guard.

    ## Why is this slow
    The normalisation subtracts the per-channel mean, which removes any per-channel constant the
    convolution added: the bias is computed, stored, read, and differentiated for nothing (PyTorch
    tuning guide, "Disable bias for convolutions directly followed by a batch norm").

    ## Example
    ```python
    block = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
    ```

    ## Use instead
    ```python
    block = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
    ```

    ## Fix safety
    Unsafe (tags semantics, tolerance and rng).

    * **Train-mode outputs** are the same up to rounding (at most 4.8e-7 in fp32 in our measurements), not bitwise.
      The validator compares losses and parameters with rtol/atol 1e-5.
    * **Eval mode differs**: BatchNorm's `running_mean` includes the bias (momentum-weighted), so
      without it the running statistics shift and eval-mode outputs differ substantially (by 0.90
      after one step in our measurements) until training has updated them. When a model is trained from
      scratch and only evaluated after training this does not matter; the validator reports
      running means and eval-mode outputs without failing on them. With
      `track_running_stats=False` eval outputs stay equal up to rounding.
    * **Random stream** (tag rng): a convolution without a bias draws fewer random numbers when it
      is built, so the initial weights of every later layer, and every later initialisation,
      dropout mask and data-loader shuffle drawn from the same generator, shift
      (unless the weights are initialised afterwards from their own generator, or loaded). The
      validator reports the final RNG state without failing on it; values the shifted draws feed
      still have to agree.
    * **Checkpoints**: the state_dict loses `<conv>.bias` (one parameter tensor per layer), so
      loading an *old* checkpoint strictly fails with `Unexpected key(s) in state_dict:
      "0.bias"`. Loading can be kept working exactly by folding the old bias into the running
      mean (eval output `(z + b - μ)/σ` equals `(z - (μ - b))/σ`), either once:

      ```python
      def fold_conv_bias(state_dict, conv, norm):
          # conv / norm: state_dict prefixes, e.g. "features.0" and "features.1"
          bias = state_dict.pop(f"{conv}.bias", None)
          if bias is not None and f"{norm}.running_mean" in state_dict:
              state_dict[f"{norm}.running_mean"] = state_dict[f"{norm}.running_mean"] - bias
          return state_dict
      ```

      or automatically with a load hook on the module that owns both layers:

      ```python
      class Block(nn.Module):
          def __init__(self):
              ...
              self.register_load_state_dict_pre_hook(fold_old_bias)

      def fold_old_bias(module, state_dict, prefix, *args):
          fold_conv_bias(state_dict, prefix + "conv", prefix + "bn")
      ```

      (`model.load_state_dict(old, strict=False)` also loads, but it *drops* the bias instead of
      folding it, so eval-mode outputs of a pretrained model change.)
    """

    code = "TOP841"
    name = "conv-bias-before-norm"
    family = FAMILY
    message = "`{conv}` computes a bias that the following `{norm}` cancels"
    blocked_message = "`{conv}` computes a bias that the following `{norm}` cancels; not fixed: {why}"
    fix_title = "Drop the bias: `bias=False`"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS, Tag.TOLERANCE, Tag.RNG)
    prefilter = ("Conv",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        # Both layers must resolve to torch.nn, and every name in _NORMS spells one of these.
        return (
            super().could_match(text)
            and "torch" in text
            and ("BatchNorm" in text or "InstanceNorm" in text or "GroupNorm" in text)
            and _could_match(text)
        )

    note = (
        "train-mode outputs equal up to rounding; BatchNorm running means no longer include the bias, so "
        "eval-mode outputs differ until they converge; construction draws fewer random numbers, so "
        "default-initialised weights and later draws shift; the state_dict loses `{key}.bias`: fold it "
        "into `running_mean` to load old checkpoints (see `torchopt rule TOP841`)"
    )

    examples = (
        Invalid(
            "import torch.nn as nn\n\nblock = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())\n",
            after="import torch.nn as nn\n\nblock = nn.Sequential(\n    nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU()\n)\n",
            unsafe=("semantics", "tolerance", "rng"),
        ),
        Invalid(
            "import torch\nfrom torch import nn\n\n\nclass Block(nn.Module):\n    def __init__(self, c):\n"
            "        super().__init__()\n        self.conv = nn.Conv1d(c, 2 * c, 5, bias=True)\n"
            "        self.norm = nn.GroupNorm(2 * c, 2 * c)\n\n    def forward(self, x):\n"
            "        y = self.conv(x)\n        y = self.norm(y)\n        return torch.relu(y)\n",
            after="import torch\nfrom torch import nn\n\n\nclass Block(nn.Module):\n    def __init__(self, c):\n"
            "        super().__init__()\n        self.conv = nn.Conv1d(c, 2 * c, 5, bias=False)\n"
            "        self.norm = nn.GroupNorm(2 * c, 2 * c)\n\n    def forward(self, x):\n"
            "        y = self.conv(x)\n        y = self.norm(y)\n        return torch.relu(y)\n",
            unsafe=("semantics", "tolerance", "rng"),
        ),
        Invalid(
            "import torch.nn as nn\n\n\nclass Stem(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.conv = nn.ConvTranspose3d(4, 8, 3)\n        self.bn = nn.BatchNorm3d(8)\n\n"
            "    def forward(self, x):\n        return self.bn(self.conv(x)).relu()\n",
            after="import torch.nn as nn\n\n\nclass Stem(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.conv = nn.ConvTranspose3d(4, 8, 3, bias=False)\n        self.bn = nn.BatchNorm3d(8)\n\n"
            "    def forward(self, x):\n        return self.bn(self.conv(x)).relu()\n",
            unsafe=("semantics", "tolerance", "rng"),
        ),
        Invalid(
            "import torch.nn as nn\n\nnet = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))\n"
            "for m in net.modules():\n    if isinstance(m, nn.Conv2d):\n        nn.init.zeros_(m.bias)\n",
            after=None,
            note="the bias is initialised explicitly: with bias=False that line would fail",
        ),
        Valid(
            "import torch.nn as nn\n\nblock = nn.Sequential(nn.Conv2d(3, 64, 3, bias=False), nn.BatchNorm2d(64))\n",
            runnable=True,
            note="already done: a second run changes nothing",
        ),
        Valid(
            "import torch.nn as nn\n\nblock = nn.Sequential(nn.Conv2d(3, 64, 3), nn.GroupNorm(8, 64))\n",
            runnable=True,
            note="fewer groups than channels: the bias is not cancelled",
        ),
        Valid(
            "import torch.nn as nn\n\nblock = nn.Sequential(nn.Conv2d(3, 64, 3), nn.LayerNorm([64, 30, 30]))\n",
            runnable=True,
        ),
        Valid(
            "import torch.nn as nn\n\nblock = nn.Sequential(nn.Conv2d(3, 64, 3), nn.ReLU(), nn.BatchNorm2d(64))\n",
            runnable=True,
            note="an op in between",
        ),
        Valid(
            "import torch.nn as nn\n\nblock = nn.Sequential(nn.Conv2d(3, 32, 3), nn.BatchNorm2d(64))\n",
            note="channel counts differ",
        ),
        Valid(
            "import torch.nn as nn\n\n\nclass Res(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.conv = nn.Conv2d(8, 8, 3, padding=1)\n        self.bn = nn.BatchNorm2d(8)\n\n"
            "    def forward(self, x):\n        y = self.conv(x)\n        return self.bn(y) + y\n",
            note="the conv output is also tapped (residual)",
        ),
        Valid(
            "import torchvision\nimport torch.nn as nn\n\n"
            "block = nn.Sequential(nn.Conv2d(3, 8, 3), torchvision.ops.FrozenBatchNorm2d(8))\n",
            note="frozen statistics do not cancel the bias",
        ),
    )

    # ------------------------------------------------------------------ detection

    def _conv(self, expr: cst.BaseExpression) -> cst.Call | None:
        if isinstance(expr, cst.Call) and _torch_nn_class(callee(self, expr), _CONVS):
            return expr
        return None

    def _cancels(self, conv: cst.Call, norm: cst.BaseExpression) -> bool:
        if not isinstance(norm, cst.Call) or has_star(norm) or has_star(conv):
            return False
        cname = _torch_nn_class(callee(self, conv), _CONVS)
        nname = _torch_nn_class(callee(self, norm), _NORMS)
        if cname is None or nname is None:
            return False
        if _NORMS[nname] and _NORMS[nname] != _CONVS[cname]:
            return False
        out = _text(self, _arg(conv, 1, "out_channels"))
        if out is None:
            return False
        if nname == "GroupNorm":
            groups, chans = _text(self, _arg(norm, 0, "num_groups")), _text(self, _arg(norm, 1, "num_channels"))
            return groups == chans == out
        return _text(self, _arg(norm, 0, "num_features")) == out

    def visit_Call(self, node: cst.Call) -> None:
        q = callee(self, node)
        if q not in ("torch.nn.Sequential", "torch.nn.modules.container.Sequential") or has_star(node):
            return
        args = [a.value for a in node.args]
        if any(a.keyword is not None for a in node.args):
            return
        for first, second in zip(args, args[1:]):
            conv = self._conv(first)
            if conv is not None and isinstance(second, cst.Call) and self._cancels(conv, second):
                self._flag(conv, second, key="<index>", attr=None)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        methods = {
            s.name.value: s
            for s in (node.body.body if isinstance(node.body, cst.IndentedBlock) else ())
            if isinstance(s, cst.FunctionDef)
        }
        init, forward = methods.get("__init__"), methods.get("forward")
        if init is None or forward is None:
            return
        built: dict[str, cst.Call] = {}
        counts: dict[str, int] = {}
        for n in walk(init):
            if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.value, cst.Call):
                attr = _self_attr(n.targets[0].target)
                if attr is not None:
                    counts[attr] = counts.get(attr, 0) + 1
                    built[attr] = n.value
        built = {k: v for k, v in built.items() if counts[k] == 1}
        convs = {k: v for k, v in built.items() if self._conv(v) is not None}
        if not convs:
            return
        uses: dict[str, int] = {}
        for n in walk(node, cross_scopes=True):
            attr = _self_attr(n)
            if attr is not None:
                uses[attr] = uses.get(attr, 0) + 1
        for c_attr, n_attr in _pairs(forward, convs, built):
            if uses.get(c_attr) != 2:  # its assignment and the one call
                continue
            if self._cancels(convs[c_attr], built[n_attr]):
                self._flag(convs[c_attr], built[n_attr], key=c_attr, attr=c_attr)

    def _flag(self, conv: cst.Call, norm: cst.Call, key: str, attr: str | None) -> None:
        fmt = {"conv": source(self, conv), "norm": source(self, norm)}
        bias_kw = keyword(conv, "bias")
        if bias_kw is not None and not (isinstance(bias_kw.value, cst.Name) and bias_kw.value.value == "True"):
            return  # bias=False already, or a value we cannot see
        if len(positional(conv)) > _BIAS_POS:
            return
        why = None
        read = _bias_reads(self, attr)
        if read is not None:
            why = f"`{source(self, read)}` may read the convolution's bias, which would be None"
        elif has_comments(conv):
            why = "a comment would be lost"
        if why:
            self.report(conv, message=self.blocked_message, fmt={**fmt, "why": why})
            return
        new = set_kwarg(conv, "bias", cst.Name("False"))
        self.report(
            conv, fmt=fmt, replacement=new, tags=[Tag.SEMANTICS, Tag.TOLERANCE, Tag.RNG], note=self.note.format(key=key)
        )
