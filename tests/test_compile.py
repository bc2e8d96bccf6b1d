"""TOP911 (model.compile), TOP921 (reduce-overhead), TOP922 (hand-made CUDA graphs), TOP931
(activation checkpointing): opt-in selection, target-torch, the facts the rules rely on, and
`torchopt validate` of the compile fixture.

Inductor on this CPU-only, shared machine takes over a minute to compile even a tiny model (measured:
96 s for the first call of a Conv2d+Linear model), so the validation test runs the compiled program
with `TORCH_COMPILE_OVERRIDE_BACKENDS=">=0:aot_eager"` (a torch debug switch, inherited by the
validator's subprocesses): dynamo captures the same graphs (graph breaks, guards, the compiled
`_call_impl` with its hooks) and AOTAutograd builds the same joint graph; only inductor's kernels
are replaced by eager ones. With it the rewrite is bitwise equal to the original."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import torchopt.cli
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _before(name: str) -> str:
    return (FIXTURES / name / "before.py").read_text(encoding="utf-8")


@pytest.mark.parametrize("code", ["TOP911", "TOP921"])
def test_rewrites_are_opt_in(code):
    for select in (("ALL",), ("TOP9",), ("TOP91", "TOP92"), ("compile",)):
        assert code not in Settings(select=select).enabled_codes()
    assert code in Settings(select=("ALL", code)).enabled_codes()
    assert code not in Settings(select=(code,), ignore=(code,)).enabled_codes()


def test_display_rules_are_on_by_default():
    codes = Settings().enabled_codes()
    assert {"TOP922", "TOP931", "TOP951"} <= codes


def test_target_torch_drops_module_compile():
    """`nn.Module.compile` needs 2.2; `torch.compile(mode=...)` 2.0."""
    assert "TOP911" not in Settings(select=("TOP911", "TOP921"), target_torch=(2, 1)).enabled_codes()
    assert "TOP921" in Settings(select=("TOP911", "TOP921"), target_torch=(2, 1)).enabled_codes()
    assert "TOP911" in Settings(select=("TOP911",), target_torch=(2, 2)).enabled_codes()


def test_fixture_insertion_point_and_tags():
    res = fix_source(_before("cmp_mlp_train"), Settings(select=("TOP911",)), unsafe=True)
    assert "    model = Regressor()\n    model.to(device)\n    model.compile()\n    optimizer =" in res.text
    (d,) = [d for d in res.applied if d.code == "TOP911"]
    assert set(d.fix.tags) == {"tolerance", "rng"} and "_orig_mod." in d.fix.note and "fallback_random" in d.fix.note
    both = fix_source(_before("cmp_mlp_train"), Settings(select=("TOP911", "TOP921")), unsafe=True).text
    assert 'model.compile(mode="reduce-overhead")' in both


def test_kept_outputs_block_cuda_graphs():
    src = _before("cmp_mlp_train").replace("    model.to(device)\n", "    model.to(device)\n    model.compile()\n")
    src = src.replace(
        "            total += loss.item()\n", "            total += loss.item()\n            history.append(pred)\n"
    )
    diags = [d for d in check_source(src, Settings(select=("TOP921",))).diagnostics if d.code == "TOP921"]
    assert len(diags) == 1 and diags[0].fix is None and "history.append(pred)" in diags[0].message


def _count_graphs(build) -> tuple[int, list[str]]:
    graphs = []

    def backend(gm, example_inputs):  # counts the graphs dynamo hands over; runs them eagerly
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    m = build()
    m.compile(backend=backend)
    m(torch.randn(2, 4))
    return len(graphs), list(m.state_dict())


class _User(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_module_compile_facts():
    """What the fix and its display-only branch rely on (torch 2.13): `model.compile()` keeps the
    state_dict keys of a user module and compiles it; on a container of torch.nn layers only it
    compiles nothing (dynamo skips torch.nn's own frames), so TOP911 only reports there."""
    n, keys = _count_graphs(_User)
    assert n == 1 and keys == ["fc.weight", "fc.bias"]
    n, keys = _count_graphs(lambda: torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU()))
    assert n == 0 and keys == ["0.weight", "0.bias"]
    optimized = torch.compile(torch.nn.Linear(4, 2), backend="eager")
    assert list(optimized.state_dict()) == ["_orig_mod.weight", "_orig_mod.bias"]  # the other spelling
    src = (
        "import torch\nfrom torch import nn\n\nmodel = nn.Sequential(nn.Linear(4, 2), nn.ReLU())\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nloss = model(x).sum()\n"
    )
    (d,) = check_source(src, Settings(select=("TOP911",))).diagnostics
    assert d.fix is None and "torch.compile(model)" in d.message and "_orig_mod." in d.message


def test_display_only_rules_on_fixtures():
    cl = {d.code for d in check_source(_before("cl_cnn_train"), Settings()).diagnostics}
    cmp = {d.code for d in check_source(_before("cmp_mlp_train"), Settings()).diagnostics}
    # GPU scripts with a CPU fallback: no CPU launcher advice (TOP951) for them.
    assert "TOP931" in cl and "TOP922" in cmp and "TOP951" not in cl | cmp
    assert not {"TOP901", "TOP911", "TOP921"} & (cl | cmp)


def test_fixture_validates(tmp_path, monkeypatch):
    """`torchopt validate before.py after.py` for the TOP911+TOP921 rewrite (torchopt's own, so it is
    validated as that rewrite): both fixes change the random stream only because inductor draws
    random numbers its own way, which the harness undoes (`fallback_random`), so they need no
    replay: the compiled run is compared with the eager one within the compile tolerance. (They
    used to be listed as not validated: an inserted statement cannot be replayed.)"""
    monkeypatch.setenv("TORCH_COMPILE_OVERRIDE_BACKENDS", ">=0:aot_eager")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()
    before, after = tmp_path / "b" / "train.py", tmp_path / "a" / "train.py"
    before.write_text(_before("cmp_mlp_train"), encoding="utf-8")
    after.write_text(
        fix_source(_before("cmp_mlp_train"), Settings(select=("TOP911", "TOP921")), unsafe=True).text, encoding="utf-8"
    )
    r = CliRunner().invoke(
        torchopt.cli.app,
        [
            "validate",
            str(before),
            str(after),
            "--select",
            "TOP911,TOP921",
            "--unsafe-fixes",
            "--steps",
            "8",
            "--device",
            "cpu",
            "--json",
            "--timeout",
            "120",
        ],
        catch_exceptions=False,
    )
    out = json.loads(r.stdout)
    assert r.exit_code == 0, r.stdout[-3000:]
    assert not out["unvalidated"] and {f["code"] for f in out["applied"]} == {"TOP911", "TOP921"}
    assert out["verdict"] == "equivalent" and out["tolerance"]["compare_values"] is True
