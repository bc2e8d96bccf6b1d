"""Rules answer from the syntax when it settles the question, and pay for the scope analysis of the
whole file only when it does not; the answers stay those of the scope analysis."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, ScopeProvider

from torchopt.analysis.names import plainly_assigned, reaching_values
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source
from torchopt.rewrite.facts import analysing
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.registry import all_rules

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _providers_resolved_on(text: str, select: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list, set[str]]:
    """(findings as (code, line, message), providers computed on the file's own tree) of one check."""
    resolved: set[str] = set()
    original = MetadataWrapper.resolve

    def resolve(wrapper, key):
        if wrapper.module.code == text:  # not the small modules the imported-name fast path builds
            resolved.add(key.__name__)
        return original(wrapper, key)

    monkeypatch.setattr(MetadataWrapper, "resolve", resolve)
    result = check_source(text, Settings(select=(select,)), "train.py")
    return [(d.code, d.line, d.message) for d in result.diagnostics], resolved


def test_device_parameter_needs_no_scope_analysis(monkeypatch):
    # `device` is only a parameter: no assignment can make it a dtype or a known device, so the
    # device-name convention decides without analysing the file's scopes.
    text = "import torch\n\n\ndef make(device):\n    return torch.zeros(3).to(device)\n"
    findings, resolved = _providers_resolved_on(text, "TOP101", monkeypatch)
    assert findings == [
        (
            "TOP101",
            5,
            "`torch.zeros(...)` is created on the host, then moved to `device` (assuming `device` is a torch.device)",
        )
    ]
    assert "ScopeProvider" not in resolved


def test_assigned_device_is_still_followed(monkeypatch):
    text = "import torch\n\n\ndef make():\n    device = 'cuda:1'\n    return torch.zeros(3).to(device)\n"
    findings, resolved = _providers_resolved_on(text, "TOP101", monkeypatch)
    assert [(code, line) for code, line, _ in findings] == [("TOP101", 6)]
    assert "assuming" not in findings[0][2]  # proven from its assignment, not from its name
    assert "ScopeProvider" in resolved


def test_torch_imported_inside_a_match_case_is_torch():
    # An import under `match` binds the name like one under `if`: the factory is recognised.
    text = (
        "import sys\n\nmatch sys.platform:\n    case 'linux':\n        import torch as T\n"
        "    case _:\n        T = None\n\n\ndef make():\n    return T.zeros(3).cuda()\n"
    )
    result = check_source(text, Settings(select=("TOP101",)), "train.py")
    assert [(d.code, d.line) for d in result.diagnostics] == [("TOP101", 11)]
    assert "`T.zeros(...)` is created on the host" in result.diagnostics[0].message


class _Names(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[cst.Name] = []

    def visit_Name(self, node: cst.Name) -> None:
        self.names.append(node)


class _Probe(cst.MetadataDependent):
    """Just enough of a rule for reaching_values: a context with the module, and metadata."""

    METADATA_DEPENDENCIES = (ScopeProvider, ParentProvider)

    def __init__(self, module: cst.Module, wrapper: MetadataWrapper) -> None:
        super().__init__()
        self.ctx = type("Ctx", (), {"module": module})()
        self.metadata = {key: wrapper.resolve(key) for key in self.METADATA_DEPENDENCIES}


def _texts() -> list:
    out = [
        pytest.param(p.read_text(encoding="utf-8"), id=f"fixture-{p.parent.name}")
        for p in sorted(FIXTURES.glob("*/before.py"))
    ]
    for code, rule in sorted(all_rules().items()):
        for i, ex in enumerate(rule.examples):
            out.append(pytest.param(ex.src, id=f"{code}-{i}"))
    return out


@pytest.mark.parametrize("text", _texts())
def test_unassigned_names_reach_no_value(text):
    """Where no plain assignment binds a spelling, the scope analysis finds no value for it either."""
    module = cst.parse_module(text)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    probe = _Probe(module, wrapper)
    visitor = _Names()
    module.visit(visitor)
    with analysing(text, module):
        wrong = [
            n.value
            for n in visitor.names
            if not plainly_assigned(probe, n) and any(v is not None for v in (reaching_values(probe, n) or []))
        ]
    assert not wrong
