"""Display-only advice beyond the rules' examples: gradient accumulation (TOP712), activation
checkpointing for deep stacks (TOP713), a factored optimizer for billion-parameter models (TOP714)
and multi-GPU inference for a DataParallel that never trains (TOP411). `check` names each finding
and exits 1; `rewrite --unsafe-fixes` writes nothing; the thresholds are per-rule options."""

from __future__ import annotations

import hashlib
from pathlib import Path
from textwrap import dedent

import pytest
from typer.testing import CliRunner

import torchopt.cli
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source

SHRINK = dedent("""\
    import torch

    batch_size = 512
    for epoch in range(10):
        try:
            run_epoch(batch_size)
        except torch.cuda.OutOfMemoryError:
            batch_size = batch_size // 2
""")

DEEP = dedent("""\
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self, depth=10):
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)])

        def forward(self, x):
            return self.layers(x)


    Net()(torch.randn(2, 8)).sum().backward()
""")

BIG = dedent("""\
    import torch
    from model import GPT, GPTConfig

    cfg = dict(n_layer=24, n_embd=2048)
    model = GPT(GPTConfig(**cfg)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
""")

DP_EVAL = dedent("""\
    import torch
    from torch import nn

    model = nn.DataParallel(nn.Linear(16, 4)).cuda().eval()
    with torch.inference_mode():
        preds = [model(x) for x in batches]
""")


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _cli(*args: str):
    return CliRunner().invoke(torchopt.cli.app, list(args), catch_exceptions=False)


def _found(src: str, code: str, settings: Settings | None = None) -> list:
    settings = settings or Settings(select=(code,))
    return [d for d in check_source(src, settings).diagnostics if d.code == code]


@pytest.mark.parametrize(
    "code, src, line, words",
    [
        ("TOP712", SHRINK, 8, ("batch_size", "accumulate")),
        ("TOP713", DEEP, 8, ("10 identical blocks", "nn.Sequential", "checkpoint")),
        ("TOP714", BIG, 6, ("torch.optim.AdamW", "1.2B", "n_embd=2048", "n_layer=24", "Adafactor")),
        ("TOP411", DP_EVAL, 4, ("inference", "one process per GPU")),
    ],
)
def test_check_reports_and_rewrite_writes_nothing(tmp_path, code, src, line, words):
    script = tmp_path / "train.py"
    script.write_text(src, encoding="utf-8")
    before = _tree(tmp_path)
    r = _cli("check", str(script), "--select", code, "--no-cache", "-j", "1")
    assert r.exit_code == 1, r.output
    hits = [ln for ln in r.stdout.splitlines() if f" {code} " in ln]
    assert len(hits) == 1 and hits[0].startswith(f"{script}:{line}:"), r.stdout
    assert all(w in hits[0] for w in words), hits[0]
    r = _cli("rewrite", str(tmp_path), "--select", code, "--unsafe-fixes", "--no-cache", "-j", "1")
    assert r.exit_code == 0, r.output
    assert _tree(tmp_path) == before


def test_default_selection_includes_the_advice():
    for code, src in (("TOP712", SHRINK), ("TOP713", DEEP), ("TOP714", BIG), ("TOP411", DP_EVAL)):
        assert _found(src, code, Settings()), code


def test_thresholds_are_options(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        "[tool.torchopt.rules.TOP713]\nmin-blocks = 11\n[tool.torchopt.rules.TOP714]\nmin-params = 2000000000\n",
        encoding="utf-8",
    )
    for name, src in (("deep.py", DEEP), ("big.py", BIG)):
        (tmp_path / name).write_text(src, encoding="utf-8")
    r = _cli("check", str(tmp_path), "--select", "TOP713,TOP714", "--no-cache", "-j", "1")
    assert r.exit_code == 0 and "TOP71" not in r.stdout, r.output
    shallow = Settings(select=("TOP713",), rule_options={"TOP713": {"min-blocks": 10}})
    assert _found(DEEP, "TOP713", shallow)


def test_accumulation_advice_is_not_checkpointing_advice():
    """Same handler, two problems: TOP931 points at the handler, TOP712 at the assignment."""
    both = check_source(SHRINK, Settings(select=("TOP712", "TOP931"))).diagnostics
    spans = {(d.code, d.line, d.column) for d in both}
    assert {c for c, _, _ in spans} == {"TOP712", "TOP931"}
    assert len({(ln, col) for _, ln, col in spans}) == 2


def test_deep_stack_needs_a_training_file_and_a_known_depth():
    assert not _found(DEEP.replace(".sum().backward()", ""), "TOP713")
    assert not _found(DEEP.replace("range(depth)", "range(cfg.depth)"), "TOP713")
    assert not _found(
        DEEP.replace("depth=10", "depth=10, n=None").replace(
            "super().__init__()", "super().__init__()\n        depth = n"
        ),
        "TOP713",
    )


def test_memory_saving_optimizer_needs_the_config_linked_to_the_model():
    unlinked = BIG.replace("GPT(GPTConfig(**cfg))", "GPT(small)")
    assert not _found(unlinked, "TOP714")
    assert not _found(BIG.replace("n_layer=24", "n_layer=2"), "TOP714")


@pytest.mark.parametrize(
    "src",
    [
        DP_EVAL.replace("with torch.inference_mode():\n", "if True:\n")  # forward with autograd on ...
    ],
)
def test_dp_with_grad_in_a_training_file_is_not_inference(src):
    trains = "opt = torch.optim.SGD(params, lr=0.1)\nopt.step()\n"
    assert not _found(src + trains, "TOP411")
    assert _found(DP_EVAL + trains, "TOP411")


def test_the_predicate_for_the_ddp_conversion():
    """`data_parallel_for_inference` is what the DataParallel-to-DDP conversion must consult: it
    agrees with TOP411 on a program that trains the wrapped model and on one that never trains."""
    from torchopt.codemods.ddp import data_parallel_inference as mod

    seen = []

    class Probe(mod.DataParallelInference):
        def visit_Call(self, node):
            if mod.callee(self, node) in mod.DATA_PARALLEL:
                seen.append(mod.data_parallel_for_inference(self, node))

    train = DP_EVAL.replace(
        "with torch.inference_mode():\n    preds = [model(x) for x in batches]\n",
        "loss = model(x).sum()\nloss.backward()\n",
    )
    from torchopt.rewrite.config import Settings as S
    from torchopt.rewrite.engine import _run_rules, parse

    for src in (DP_EVAL, train):
        _run_rules(parse(src), [Probe], S(select=("TOP411",)), "<t>", src)
    assert seen == [True, False]
