"""TOP303: pad sequence lengths to a multiple of 8. Advice only."""

from __future__ import annotations

import re

import libcst as cst

from torchopt.analysis.names import callee, qualified_names
from torchopt.analysis.arguments import has_star, keywords, positional
from torchopt.analysis.models import nn_module_classes
from torchopt.analysis.syntax import walk
from torchopt.codemods.pad import FAMILY
from torchopt.rewrite.rule import Invalid, Rule, Safety, Valid


def _could_match(text: str) -> bool:
    """visit_Call's necessary condition on CPython's ast: a call that may resolve to torch's
    pad_sequence, or a call (no star, no pad_to_multiple_of=, under 4 positional arguments) named
    like a Hugging Face collator in a file that imports from ``transformers`` (absolutely)."""
    import ast as _ast

    from torchopt.analysis.precheck.torch_imports import may_call_torch
    from torchopt.analysis.precheck.tree import ast_index

    index = ast_index(text)
    if index is None or may_call_torch(text, ("torch.nn.utils.rnn.pad_sequence",)):
        return True
    names = set(_HF_COLLATORS)
    hf = False
    for imp in [*index.get(_ast.Import, ()), *index.get(_ast.ImportFrom, ())]:
        if isinstance(imp, _ast.Import):
            hf = hf or any(a.name.split(".")[0] == "transformers" for a in imp.names)
        elif not imp.level and imp.module and imp.module.split(".")[0] == "transformers":
            hf = True
            if any(a.name == "*" for a in imp.names):
                return True
            names |= {a.asname for a in imp.names if a.asname}
    if not hf:
        return False
    for c in index.get(_ast.Call, ()):
        f = c.func
        last = f.attr if isinstance(f, _ast.Attribute) else f.id if isinstance(f, _ast.Name) else None
        if (
            last in names
            and not any(isinstance(a, _ast.Starred) for a in c.args)
            and all(k.arg not in (None, "pad_to_multiple_of") for k in c.keywords)
            and len(c.args) < 4
        ):
            return True
    return False


# A padding mask anywhere in the program text (`key_padding_mask=`, `attention_mask`, `masked_fill`).
_MASK = re.compile(r"mask", re.IGNORECASE)

_HF_COLLATORS = {
    "DataCollatorWithPadding",
    "DataCollatorForSeq2Seq",
    "DataCollatorForTokenClassification",
    "DataCollatorForLanguageModeling",
}


class PadSequenceLength(Rule):
    """## What it does
    Reports batches padded to their longest sequence: `torch.nn.utils.rnn.pad_sequence(...)`, and
    the Hugging Face collators (`DataCollatorWithPadding`, `DataCollatorForSeq2Seq`,
    `DataCollatorForTokenClassification`, `DataCollatorForLanguageModeling`) built without
    `pad_to_multiple_of`. Advice only: no fix is applied.

    ## Why is this slow
    The sequence length is a GEMM dimension of every projection and of the attention scores. A
    batch whose longest sequence is 37 runs all of them off the multiple-of-8 grid that fp16/bf16
    Tensor Cores use; padding to 40 costs a few extra positions and keeps the fast kernels. It also
    makes the set of shapes smaller, which helps `cudnn.benchmark` and `torch.compile`.

    ## Example
    ```python
    from torch.nn.utils.rnn import pad_sequence

    def collate(batch):
        ids = pad_sequence([b["ids"] for b in batch], batch_first=True, padding_value=PAD)
        labels = pad_sequence([b["labels"] for b in batch], batch_first=True, padding_value=-100)
        return ids, labels
    ```

    ## Use instead
    A `collate_fn` that pads to a multiple of 8 and extends the attention mask and the labels:
    ```python
    import torch
    import torch.nn.functional as F

    def collate_multiple_of_8(batch, pad_id=0, ignore_index=-100, multiple=8):
        ids = [b["ids"] for b in batch]
        labels = [b["labels"] for b in batch]
        longest = max(len(x) for x in ids)
        length = (longest + multiple - 1) // multiple * multiple
        input_ids = torch.stack([F.pad(x, (0, length - len(x)), value=pad_id) for x in ids])
        target = torch.stack([F.pad(y, (0, length - len(y)), value=ignore_index) for y in labels])
        mask = torch.stack([F.pad(torch.ones(len(x), dtype=torch.bool), (0, length - len(x))) for x in ids])
        return input_ids, mask, target
    ```
    With Hugging Face: `DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)`, or
    `tokenizer(..., padding=True, pad_to_multiple_of=8)`.

    ## Fix safety
    Display only. Padding is exact only when every added position is masked out: the attention
    mask (or `key_padding_mask`) must cover it, the loss must ignore it (`ignore_index`), and
    pooling or "last token" logic must use the real lengths. Models without a mask (a plain
    causal LM reading `ids[:, -1]`) would see the pad tokens, which is why torchopt does not
    rewrite collators.

    Not reported: `pad_sequence` in a program whose RNN packs the batches
    (`pack_padded_sequence`: it never sees the padding, so there is nothing to gain), or in a file
    that defines its models and masks nothing (no `mask` anywhere: a mean, a max over time or a
    recurrence would run over the extra pads and change the results).
    """

    code = "TOP303"
    name = "unpadded-sequence-length"
    family = FAMILY
    message = "`{what}` pads each batch to its longest sequence; pad to a multiple of 8 (with the masks extended)"
    safety = Safety.DISPLAY
    prefilter = ("pad_sequence", "DataCollator")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and _could_match(text)

    examples = (
        Invalid(
            "from torch.nn.utils.rnn import pad_sequence\n\n\ndef collate(batch):\n"
            "    return pad_sequence(batch, batch_first=True)\n",
            after=None,
        ),
        Invalid(
            "import torch\n\nx = torch.nn.utils.rnn.pad_sequence([torch.ones(3), torch.ones(5)])\n",
            after=None,
            runnable=True,
        ),
        Invalid(
            "from transformers import DataCollatorWithPadding\n\ncollator = DataCollatorWithPadding(tok)\n", after=None
        ),
        Valid(
            "from transformers import DataCollatorWithPadding\n\n"
            "collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)\n"
        ),
        Valid("def pad_sequence(xs):\n    return xs\n\nx = pad_sequence([1, 2])\n", runnable=True),
        Valid(
            "import torch\nfrom torch.nn.utils.rnn import pad_sequence\n\n\nclass Bag(torch.nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n        self.emb = torch.nn.Embedding(10, 4)\n\n"
            "    def forward(self, ids):\n        return self.emb(ids).mean(dim=1)\n\n\n"
            "def collate(batch):\n    return pad_sequence(batch, batch_first=True)\n",
            note="the model averages over the padded length with no mask: more padding changes its output",
        ),
        Valid(
            "from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence\n\n\n"
            "def encode(lstm, seqs, lengths):\n    x = pad_sequence(seqs, batch_first=True)\n"
            "    return lstm(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))\n",
            note="the LSTM reads packed batches and never sees the padding",
        ),
    )

    def _pads_not_masked(self) -> str | None:
        """Why extra padding would not pay or not be exact in this file's program: its RNN packs the
        batches (it never sees the padding), or the file defines its models and masks nothing (extra
        pads would change what they compute)."""
        module = self.ctx.module
        calls = [n for n in walk(module, cross_scopes=True) if isinstance(n, cst.Call)]
        if any(callee(self, c) == "torch.nn.utils.rnn.pack_padded_sequence" for c in calls):
            return "the batches are packed"
        if nn_module_classes(self) and not _MASK.search(self.ctx.text):
            return "the models of the file mask no padding"
        return None

    def visit_Call(self, node: cst.Call) -> None:
        name = callee(self, node)
        if name in ("torch.nn.utils.rnn.pad_sequence",):
            if self._pads_not_masked() is None:
                self.report(node, fmt={"what": "pad_sequence(...)"})
            return
        if isinstance(node.func, (cst.Name, cst.Attribute)):
            for q in qualified_names(self, node.func):
                parts = q.split(".")
                if parts[0] == "transformers" and parts[-1] in _HF_COLLATORS:
                    if has_star(node) or "pad_to_multiple_of" in keywords(node) or len(positional(node)) >= 4:
                        return
                    self.report(node, fmt={"what": f"{parts[-1]}(...)"})
                    return
