"""The fast path for imported names (rewrite/metadata.fast_qualified_names) must answer exactly what
LibCST's scope analysis answers, node for node, wherever it answers at all."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, ScopeProvider

from torchopt.rewrite.facts import analysing
from torchopt.rewrite.metadata import fast_qualified_names
from torchopt.rewrite.registry import all_rules

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


class _Probe(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[cst.CSTNode] = []

    def visit_Name(self, node: cst.Name) -> None:
        self.nodes.append(node)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.nodes.append(node)


def compare(text: str) -> tuple[int, list[str]]:
    """(nodes the fast path answered, mismatches)."""
    module = cst.parse_module(text)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    probe = _Probe()
    module.visit(probe)
    probe._wrapper = wrapper  # what Rule.resolve sets while rules run
    probe.metadata = {}
    with analysing(text, module):  # before the full analysis: once it exists, it answers
        fast_answers = [(node, fast_qualified_names(probe, node)) for node in probe.nodes]
    scopes = wrapper.resolve(ScopeProvider)
    answered, bad = 0, []
    for node, fast in fast_answers:
        if fast is None:
            continue
        answered += 1
        scope = scopes.get(node)
        try:
            slow = frozenset(scope.get_qualified_names_for(node)) if scope is not None else frozenset()
        except Exception:
            slow = frozenset()
        if fast != slow:
            bad.append(
                f"{module.code_for_node(node)}: fast {sorted(q.name for q in fast)} "
                f"scope {sorted(q.name for q in slow)}"
            )
    return answered, bad


def _texts() -> list:
    out = [
        pytest.param(p.read_text(encoding="utf-8"), id=f"fixture-{p.parent.name}")
        for p in sorted(FIXTURES.glob("*/before.py"))
    ]
    for code, rule in sorted(all_rules().items()):
        for i, ex in enumerate(rule.examples):
            if "import" in ex.src:
                out.append(pytest.param(ex.src, id=f"{code}-{i}"))
    return out


@pytest.mark.parametrize("text", _texts())
def test_fast_names_equal_scope_analysis(text):
    _, bad = compare(text)
    assert not bad, "\n".join(bad)


TRICKY = """import torch
import torch.nn as nn
import torch.nn.functional
from torch import nn as tnn, zeros
from torch.utils import data
import numpy as np
try:
    import apex
except ImportError:
    apex = None

x = torch.zeros(3)
y = torch.nn.functional.relu(x)
z = nn.Linear(2, 2)
w = tnn.Conv2d(1, 1, 1)
v = zeros(2)
loader = data.DataLoader([])
a = np.ones(2)
b = apex
f(torch=1)

def g(torch2):
    import os
    return torch.ones(1), os.sep

class K:
    np = 3
"""


def test_tricky_module():
    answered, bad = compare(TRICKY)
    assert not bad, "\n".join(bad)
    assert answered >= 8  # torch, nn, tnn, data chains; not apex (assigned), not np (class attr)


def test_no_fast_answer_when_a_name_is_bound_otherwise_or_used_first():
    text = "print(torch)\nimport torch\nimport numpy as np\nnp = None\ntorch.zeros(1)\n"
    answered, bad = compare(text)
    assert answered == 0 and not bad
