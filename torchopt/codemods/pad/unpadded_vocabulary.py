"""TOP301 `unpadded-vocabulary`: pads the vocabulary of a language model's token embedding and output
projection up to a multiple of the `multiple` option, slicing the logits back to the true vocabulary."""

from __future__ import annotations

import os
import re
from textwrap import dedent

import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.names import callee
from torchopt.analysis.project import Unknown, index_of, project_files
from torchopt.analysis.statement_edits import ApplyEdits
from torchopt.analysis.syntax import walk
from torchopt.codemods.pad import FAMILY
from torchopt.codemods.pad.logit_views import outside_views, views_in
from torchopt.codemods.pad.sizes import OPTION_MULTIPLE
from torchopt.codemods.pad.sizes import arg
from torchopt.codemods.pad.sizes import code
from torchopt.codemods.pad.sizes import int_const
from torchopt.codemods.pad.sizes import is_pad_formula
from torchopt.codemods.pad.sizes import last_name
from torchopt.codemods.pad.sizes import names_in
from torchopt.codemods.pad.sizes import nn_class
from torchopt.codemods.pad.sizes import reaching_values
from torchopt.codemods.pad.sizes import self_attr
from torchopt.codemods.pad.vocab_models import PADDED, _Plan, _bound_names, _free_names, vocab_defaults, vocab_edits
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag
from torchopt.rewrite.rule import Valid


_LAYERS = frozenset({"Embedding", "Linear"})


_CHECKPOINT = ("load_state_dict", "from_pretrained", "torch.load(", "load_checkpoint")


_SIZE_ATTRS = {"num_embeddings", "out_features"}


_SIMPLE = (cst.Name, cst.Attribute, cst.Integer, cst.BinaryOperation)


class PadVocabulary(Rule):
    """## What it does
    Flags a language model whose token embedding (`nn.Embedding(V, d)`) and output projection
    (`nn.Linear(d, V)`) are built in the same class with a vocabulary size `V` that is not (or not
    known to be) a multiple of 8. The fix pads both to the next multiple, slices the logits back to
    `V` at every call of the output projection, before any softmax, argmax, sampling or loss, and
    turns `.view` on the sliced logits into `.reshape`.

    ## Why is this slow
    The output projection is often the largest GEMM of a language model (GPT-2: 768 x 50257). fp16
    and bf16 Tensor Cores work on tiles whose sides are multiples of 8; with `V = 50257`
    (`50257 % 8 == 1`) cuBLAS falls back to slower kernels or pads internally on every call. The
    PyTorch tuning guide names the vocabulary as the typical size to pad explicitly. The option
    `multiple = 64` pads further (50304), which suits GEMM tiling best.

    ## Example
    ```python
    class GPT(nn.Module):
        def __init__(self, vocab_size, d_model):
            super().__init__()
            self.embed = nn.Embedding(vocab_size, d_model)
            self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
            self.lm_head.weight = self.embed.weight

        def forward(self, idx, targets):
            logits = self.lm_head(self.embed(idx))
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            return logits, loss
    ```

    ## Use instead
    ```python
    class GPT(nn.Module):
        def __init__(self, vocab_size, d_model):
            super().__init__()
            self.vocab_size = vocab_size
            padded_vocab = ((vocab_size + 7) // 8) * 8  # a multiple of 8 for Tensor Cores
            self.embed = nn.Embedding(padded_vocab, d_model)
            self.lm_head = nn.Linear(d_model, padded_vocab, bias=False)
            self.lm_head.weight = self.embed.weight

        def forward(self, idx, targets):
            logits = self.lm_head(self.embed(idx))[..., : self.vocab_size]
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.view(-1))
            return logits, loss
    ```
    Only the two constructors see the padded size: every other use of the vocabulary size
    (`ignore_index`, `F.one_hot(..., num_classes=V)`, metrics, top-k, sampling, generation) keeps
    the unpadded value, and the logits every caller sees have exactly `V` columns. Tied weights
    stay tied (both modules are padded together).

    ## Fix safety
    Unsafe, tags semantics and rng.
    - **Outputs**: exact. With the original weights copied into the first `V` rows (pad rows zero),
      the sliced logits and the loss are bitwise equal on the CPU (`torchopt validate` does that
      copy itself, see docs/validation.md "Weight transplant"). Without the slice the
      loss would change (the pad columns enter the softmax) and argmax or sampling could return a
      pad id: the slice is why the fix is exact. Embedding lookups of valid ids are unchanged. Pad
      rows receive no gradient (with weight decay they decay from zero and stay zero).
    - **Semantics**: the parameters change shape: a checkpoint saved before the fix no longer loads
      with `load_state_dict` (copy it into the first `V` rows and zero the rest). The fix is
      therefore not offered in a file that loads checkpoints (`load_state_dict`, `torch.load`,
      `from_pretrained`): it targets training from scratch. `num_embeddings`/`out_features` and
      `weight.shape` report the padded size, so a class that reads them is not rewritten; the
      sliced logits are not contiguous, so `.view` on them must become `.reshape`: done inside the
      class and, in the same file, on what an instance of it returns (`logits, loss = model(x)`;
      separate findings of this rule); code in other files is not rewritten.
    - **rng / initialisation**: the padded layers draw more random numbers, so they and every
      module built after them are initialised differently; training from scratch starts from
      other (equally distributed) weights.
    """

    code = "TOP301"
    name = "unpadded-vocabulary"
    family = FAMILY
    message = (
        "vocabulary size `{vocab}`{value} is not a multiple of {multiple}: the embedding and the "
        "output projection `{head}` miss Tensor-Core tiles{why}"
    )
    fix_title = "Pad the vocabulary to a multiple of {multiple} and slice the logits back to `{vocab}`"
    safety = Safety.UNSAFE
    tags = (Tag.SEMANTICS, Tag.RNG)
    prefilter = ("Embedding",)

    @classmethod
    def could_match(cls, text: str) -> bool:
        from torchopt.analysis.precheck.patterns import embedding_and_head_in_init

        return super().could_match(text) and "torch" in text and embedding_and_head_in_init(text)

    options = (OPTION_MULTIPLE,)

    examples = (
        Invalid(
            dedent("""\
                import torch
                import torch.nn as nn
                import torch.nn.functional as F


                class GPT(nn.Module):
                    def __init__(self, vocab_size, d_model):
                        super().__init__()
                        self.embed = nn.Embedding(vocab_size, d_model)
                        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
                        self.lm_head.weight = self.embed.weight

                    def forward(self, idx, targets):
                        logits = self.lm_head(torch.tanh(self.embed(idx)))
                        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
                        return logits, loss


                torch.manual_seed(0)
                model = GPT(37, 8)
                idx = torch.randint(0, 37, (2, 5))
                logits, loss = model(idx, idx)
            """),
            after=dedent("""\
                import torch
                import torch.nn as nn
                import torch.nn.functional as F


                class GPT(nn.Module):
                    def __init__(self, vocab_size, d_model):
                        super().__init__()
                        self.vocab_size = vocab_size
                        padded_vocab = ((vocab_size + 7) // 8) * 8  # a multiple of 8 for Tensor Cores
                        self.embed = nn.Embedding(padded_vocab, d_model)
                        self.lm_head = nn.Linear(d_model, padded_vocab, bias=False)
                        self.lm_head.weight = self.embed.weight

                    def forward(self, idx, targets):
                        logits = self.lm_head(torch.tanh(self.embed(idx)))[..., : self.vocab_size]
                        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.view(-1))
                        return logits, loss


                torch.manual_seed(0)
                model = GPT(37, 8)
                idx = torch.randint(0, 37, (2, 5))
                logits, loss = model(idx, idx)
            """),
            unsafe=("semantics", "rng"),
            runnable=True,
        ),
        Invalid(
            dedent("""\
                import torch.nn as nn

                VOCAB = 1001


                class LM(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.n_vocab = VOCAB
                        self.tok = nn.Embedding(VOCAB, 64)
                        self.head = nn.Linear(64, VOCAB)

                    def forward(self, idx):
                        return self.head(self.tok(idx)).argmax(-1)
            """),
            after=dedent("""\
                import torch.nn as nn

                VOCAB = 1001


                class LM(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.n_vocab = VOCAB
                        padded_vocab = ((VOCAB + 7) // 8) * 8  # a multiple of 8 for Tensor Cores
                        self.tok = nn.Embedding(padded_vocab, 64)
                        self.head = nn.Linear(64, padded_vocab)

                    def forward(self, idx):
                        return self.head(self.tok(idx))[..., : self.n_vocab].argmax(-1)
            """),
            unsafe=("semantics", "rng"),
            note="an existing attribute holding the size is reused",
        ),
        Invalid(
            dedent("""\
                import torch.nn as nn

                VOCAB = 1001


                class LM(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.n_vocab = VOCAB
                        self.tok = nn.Embedding(VOCAB, 64)
                        self.head = nn.Linear(64, VOCAB)

                    def forward(self, idx):
                        return self.head(self.tok(idx)).argmax(-1)


                def load(state):
                    model = LM()
                    model.load_state_dict(state)
            """),
            note="the file loads a checkpoint, whose shapes would no longer match: reported, not fixed",
        ),
        Invalid(
            dedent("""\
                import torch.nn as nn


                class LM(nn.Module):
                    def __init__(self, cfg):
                        super().__init__()
                        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
                        self.out = nn.Linear(cfg.dim, cfg.vocab)

                    def forward(self, x):
                        return self.out(self.wte(x)), self.out.out_features
            """),
            note="the class reads `out_features`, which would report the padded size",
        ),
        Valid(
            dedent("""\
                import torch.nn as nn

                VOCAB = 40


                class LM(nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.tok = nn.Embedding(VOCAB, 64)
                        self.head = nn.Linear(64, VOCAB)

                    def forward(self, idx):
                        return self.head(self.tok(idx))
            """),
            note="the vocabulary is known to be a multiple of 8",
        ),
        Valid(
            dedent("""\
                import torch
                import torch.nn as nn
                import torch.nn.functional as F


                class GPT(nn.Module):
                    def __init__(self, vocab_size, d_model):
                        super().__init__()
                        self.vocab_size = vocab_size
                        padded_vocab = ((vocab_size + 7) // 8) * 8  # a multiple of 8 for Tensor Cores
                        self.embed = nn.Embedding(padded_vocab, d_model)
                        self.lm_head = nn.Linear(d_model, padded_vocab, bias=False)
                        self.lm_head.weight = self.embed.weight

                    def forward(self, idx, targets):
                        logits = self.lm_head(torch.tanh(self.embed(idx)))[..., : self.vocab_size]
                        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.view(-1))
                        return logits, loss


                torch.manual_seed(0)
                model = GPT(37, 8)
                idx = torch.randint(0, 37, (2, 5))
                logits, loss = model(idx, idx)
            """),
            note="already padded",
            runnable=True,
        ),
        Valid(
            dedent("""\
                import torch.nn as nn


                class Tagger(nn.Module):
                    def __init__(self, n):
                        super().__init__()
                        self.emb = nn.Embedding(n, 16)
                        self.cls = nn.Linear(16, 5)
            """),
            note="no output projection over the vocabulary",
        ),
        Valid(
            dedent("""\
                import mylib.nn as nn


                class LM(nn.Module):
                    def __init__(self, v):
                        super().__init__()
                        self.e = nn.Embedding(v, 16)
                        self.h = nn.Linear(16, v)
            """),
            note="not torch.nn",
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._multiple = int(self.option("multiple"))

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        init = (
            next((s for s in node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"), None)
            if isinstance(node.body, cst.IndentedBlock)
            else None
        )
        if init is None or not init.params.params or not isinstance(init.body, cst.IndentedBlock):
            return
        names = {last_name(n.func) for n in walk(init.body) if isinstance(n, cst.Call)}
        if not _LAYERS <= names:
            return  # no embedding and projection here: skip the name resolution
        embeds: list[cst.Call] = []
        linears: list[cst.Call] = []
        for n in walk(init.body):
            if isinstance(n, cst.Call):
                cls = nn_class(self, n, _LAYERS)
                if cls == "Embedding":
                    embeds.append(n)
                elif cls == "Linear":
                    linears.append(n)
        if not embeds or not linears:
            return
        groups: dict[str, list[cst.Call]] = {}
        vexprs: dict[str, cst.BaseExpression] = {}
        for e in embeds:
            a = arg(e, 0, "num_embeddings")
            if a is None or has_star(e):
                continue
            key = code(self, a.value)
            groups.setdefault(key, []).append(e)
            vexprs.setdefault(key, a.value)
        for key, group in groups.items():
            heads = []
            for lin in linears:
                out = arg(lin, 1, "out_features")
                if out is not None and code(self, out.value) == key:
                    heads.append(lin)
            if heads:
                self._one(node, init, vexprs[key], group, heads)

    # ------------------------------------------------------------------------------ analysis

    def _one(
        self,
        cls: cst.ClassDef,
        init: cst.FunctionDef,
        vocab: cst.BaseExpression,
        embeds: list[cst.Call],
        heads: list[cst.Call],
    ) -> None:
        m = self._multiple
        if isinstance(vocab, cst.Name):
            values = reaching_values(self, vocab) or []
            if any(is_pad_formula(v) for v in values if v is not None):
                return  # already padded
        if is_pad_formula(vocab):
            return
        value = int_const(self, vocab)
        if value is not None and value % m == 0:
            return
        defaults = vocab_defaults(self, vocab) if value is None else []
        if defaults and all(size % m == 0 for size in defaults):
            return  # every size the file falls back to is already padded (nanoGPT's 50304)
        vcode = code(self, vocab)
        parent = self.get_metadata(ParentProvider, heads[0], None)
        head = (
            code(self, parent.targets[0].target)
            if isinstance(parent, cst.Assign) and len(parent.targets) == 1
            else code(self, heads[0].func) + "(...)"
        )
        fmt = {
            "vocab": vcode,
            "value": f" ({value})" if value is not None and vcode != str(value) else "",
            "multiple": str(m),
            "head": head,
            "why": "",
        }
        plan = _Plan(vocab=vocab, embeds=embeds, heads=heads)
        why = self._plan(cls, init, plan)
        if why:
            fmt["why"] = f" (no automatic fix: {why})"
            self.report(embeds[0], fmt=fmt)
            return
        new = cls.visit(ApplyEdits(vocab_edits(self, init, plan, m)))
        self.report(
            embeds[0],
            fmt=fmt,
            replacement=new,
            target=cls,
            safety=Safety.UNSAFE,
            tags=(Tag.SEMANTICS, Tag.RNG),
            note=(
                "parameter shapes change (old checkpoints need the first V rows copied in); the "
                "padded layers draw more random numbers, so initialisation changes from there on; "
                "outputs are exact with the same weights (the logits are sliced back)"
            ),
        )
        # The model's logits are now a non-contiguous slice: `.view` on them in this file becomes
        # `.reshape` (the same result wherever `.view` worked).
        for view in outside_views(self, cls):
            reshape = view.with_changes(func=view.func.with_changes(attr=cst.Name("reshape")))
            self.report(
                view,
                message=_VIEW_MESSAGE,
                fmt={"model": cls.name.value},
                replacement=reshape,
                fix_title="Use `.reshape(...)`",
                safety=Safety.UNSAFE,
                tags=(Tag.SEMANTICS,),
                note="part of the vocabulary padding of the same class; `.reshape` equals `.view` "
                "wherever `.view` works",
            )

    def _plan(self, cls: cst.ClassDef, init: cst.FunctionDef, plan: _Plan) -> str:
        """Fill ``plan``; return why no fix can be offered ('' when one can)."""
        if any(s in self.ctx.text for s in _CHECKPOINT):
            return "the file loads checkpoints, whose shapes would no longer match"
        if any(
            isinstance(n, cst.BaseExpression) and not isinstance(n, _SIMPLE)
            for n in walk(plan.vocab, cross_scopes=True)
        ):
            return "the vocabulary size is not a plain name or constant"
        self_name = init.params.params[0].name.value
        why = (
            self._plan_head_calls(cls, self_name, plan)
            or self._plan_size_attribute(cls, init, self_name, plan)
            or self._plan_insertion_point(init, plan)
        )
        if why:
            return why
        # `.view` on the (non-contiguous) sliced logits becomes `.reshape`.
        head_calls = {id(c) for c in plan.calls}
        for fn in walk(cls, cross_scopes=True):
            if isinstance(fn, cst.FunctionDef) and fn.params.params:
                plan.views.extend(views_in(self, fn, head_calls))
        return ""

    def _plan_head_calls(self, cls: cst.ClassDef, self_name: str, plan: _Plan) -> str:
        """Record the attributes holding the output projections and every call of them in the class,
        where the logits get sliced back; any other use of a head, or of its size or weight, would
        see the padded rows, so it blocks the fix (the reason is returned, '' when none)."""
        for h in plan.heads:
            parent = self.get_metadata(ParentProvider, h, None)
            if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1):
                return "the output projection is not assigned to an attribute"
            attr = self_attr(parent.targets[0].target, self_name)
            if attr is None or has_star(h):
                return "the output projection is not assigned to an attribute"
            plan.head_attrs.add(attr)
        # Every use of the heads in the class: calls (sliced), ties and init functions.
        own = {id(self.get_metadata(ParentProvider, h)) for h in plan.heads}
        for n in walk(cls, cross_scopes=True):
            if isinstance(n, cst.Attribute) and n.attr.value in _SIZE_ATTRS:
                return f"the class reads `.{n.attr.value}`, which would report the padded size"
            if isinstance(n, cst.Attribute) and n.attr.value == "weight" and not self._weight_use_ok(n):
                return f"`{code(self, n)}` is used directly (its rows would not be sliced)"
            attr = self_attr(n, self_name) or self_attr(n, "self")
            if attr is None or attr not in plan.head_attrs:
                continue
            parent = self.get_metadata(ParentProvider, n, None)
            if isinstance(parent, cst.Call) and parent.func is n:
                plan.calls.append(parent)
            elif isinstance(parent, cst.Attribute) and parent.attr.value == "weight":
                continue  # checked above
            elif isinstance(parent, cst.AssignTarget) and id(self.get_metadata(ParentProvider, parent)) in own:
                continue
            else:
                return f"`self.{attr}` is used other than by calling it"
        if not plan.calls:
            return "the output projection is never called in the class"
        return self._used_outside(cls, plan.head_attrs)

    def _used_outside(self, cls: cst.ClassDef, attrs: set[str]) -> str:
        """A head read on an instance outside the class (`model.ff(out)` in a decoding helper, here
        or in another file of the project) would give the padded logits, unsliced: no fix then."""
        inside = {id(n) for n in walk(cls, cross_scopes=True)}
        for n in walk(self.ctx.module, cross_scopes=True):
            if isinstance(n, cst.Attribute) and n.attr.value in attrs and id(n) not in inside:
                return f"`{code(self, n)}` is used outside the class, where the logits would not be sliced"
        index = index_of(self)
        if index.path is None or index.unit is None or index.unit == index.path:
            return ""
        use = re.compile(r"\.\s*(%s)\b" % "|".join(re.escape(a) for a in sorted(attrs)))
        stem = os.path.splitext(os.path.basename(index.path))[0]
        files = project_files(index.unit)
        if isinstance(files, Unknown):
            return f"the uses of the head in other files are not known: {files.reason}"
        for path in files:
            summary = index.summary(path) if path != index.path else None
            if summary is None or not any(  # a file that imports the class, or its module
                name == cls.name.value or str(module).split(".")[-1] == stem or name == stem
                for module, name, _ in summary.imports.values()
            ):
                continue
            found = use.search(index.scope.text(path) or "")
            if found:
                return f"`.{found.group(1)}` is used in {index.shown(path)}, where the logits would not be sliced"
        return ""

    def _plan_size_attribute(self, cls: cst.ClassDef, init: cst.FunctionDef, self_name: str, plan: _Plan) -> str:
        """Choose the attribute forward() slices the logits to: one `__init__` assigns the vocabulary
        size to once, else a new `vocab_size` when the class has none (the reason is returned when
        neither exists, '' otherwise)."""
        vcode = code(self, plan.vocab)
        assigned: dict[str, int] = {}
        candidate = None
        for n in walk(cls, cross_scopes=True):
            if isinstance(n, cst.AssignTarget):
                attr = self_attr(n.target, self_name) or self_attr(n.target, "self")
                if attr:
                    assigned[attr] = assigned.get(attr, 0) + 1
        for stmt in init.body.body:
            if (
                isinstance(stmt, cst.SimpleStatementLine)
                and len(stmt.body) == 1
                and isinstance(stmt.body[0], cst.Assign)
            ):
                a = stmt.body[0]
                if len(a.targets) == 1:
                    attr = self_attr(a.targets[0].target, self_name)
                    if attr and code(self, a.value) == vcode and assigned.get(attr) == 1:
                        candidate = attr
                        break
        if candidate is not None:
            plan.vattr = candidate
        elif "vocab_size" not in assigned and not any(
            isinstance(n, cst.Attribute) and n.attr.value == "vocab_size" and self_attr(n, self_name)
            for n in walk(cls, cross_scopes=True)
        ):
            plan.vattr, plan.insert_attr = "vocab_size", True
        else:
            return "no attribute can hold the unpadded vocabulary size"
        return ""

    def _plan_insertion_point(self, init: cst.FunctionDef, plan: _Plan) -> str:
        """Where `__init__` computes the padded size: before the first statement that builds a layer,
        which must come after everything the vocabulary size reads (the reason is returned when it
        cannot, '' otherwise)."""
        if PADDED in names_in(init):
            return f"`{PADDED}` is already a name in `__init__`"
        body = list(init.body.body)
        index = len(body)
        for call in plan.embeds + plan.heads:
            cur: cst.CSTNode = call
            while True:
                parent = self.get_metadata(ParentProvider, cur, None)
                if parent is None or parent is init.body:
                    break
                cur = parent
            if cur in body:
                index = min(index, body.index(cur))
        if index == len(body):
            return "the layers are built in an unusual place"
        later: set[str] = set()
        later_attrs: set[str] = set()
        for later_stmt in body[index:]:
            later |= _bound_names(later_stmt)
            later_attrs |= {
                code(self, n.target)
                for n in walk(later_stmt)
                if isinstance(n, cst.AssignTarget) and isinstance(n.target, cst.Attribute)
            }
        used_attrs = {code(self, n) for n in walk(plan.vocab, cross_scopes=True) if isinstance(n, cst.Attribute)}
        if _free_names(plan.vocab) & later or used_attrs & later_attrs:
            return "the vocabulary size is assigned after the layers are built"
        plan.index = index
        return ""

    def _weight_use_ok(self, node: cst.Attribute) -> bool:
        parent = self.get_metadata(ParentProvider, node, None)
        if isinstance(parent, cst.AssignTarget):
            stmt = self.get_metadata(ParentProvider, parent, None)
            return (
                isinstance(stmt, cst.Assign)
                and isinstance(stmt.value, cst.Attribute)
                and stmt.value.attr.value == "weight"
            )
        if isinstance(parent, cst.Assign) and parent.value is node:
            return all(isinstance(t.target, cst.Attribute) and t.target.attr.value == "weight" for t in parent.targets)
        if isinstance(parent, cst.Arg):
            call = self.get_metadata(ParentProvider, parent, None)
            if isinstance(call, cst.Call):
                name = callee(self, call) or ""
                return name.startswith("torch.nn.init.")
        return False


_VIEW_MESSAGE = (
    "`.view` on the logits of `{model}`, whose vocabulary is padded and sliced back: the slice is "
    "not contiguous, so `.view` would raise"
)
