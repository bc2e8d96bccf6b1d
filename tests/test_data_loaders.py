"""DATA rules (TOP701-TOP703) beyond their generated example tests: how they share the DataLoader
with TOP104, what they do to the existing data_pipeline fixture, and `torchopt validate` on the
data_loader_tuning fixture (worker processes on the CPU, kept tiny)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "data_loader_tuning"


def _validate(before: Path, after: Path, steps: int = 8) -> tuple[int, dict]:
    res = CliRunner().invoke(
        app,
        ["validate", str(before), str(after), "--steps", str(steps), "--device", "cpu", "--json"],
        catch_exceptions=False,
    )
    assert res.stdout.lstrip().startswith("{"), res.output
    return res.exit_code, json.loads(res.stdout)


def test_pin_memory_is_added_once_with_top104():
    """A loop that copies the batch itself is TOP104's: the loader gets one `pin_memory`, not two."""
    src = (
        "import torch\nfrom torch.utils.data import DataLoader\n\n\ndef run(ds, device):\n"
        "    loader = DataLoader(ds)\n    for x, y in loader:\n        x = x.to(device)\n"
    )
    codes = [d.code for d in check_source(src, Settings()).diagnostics if "pin" in d.message]
    assert codes == ["TOP104"]
    out = fix_source(src, Settings(), unsafe=False).text
    assert out.count("pin_memory") == 1


def test_no_keyword_into_star_kwargs():
    src = (
        "import torch\nfrom torch.utils.data import DataLoader\n\n\ndef run(ds, device, **kw):\n"
        "    loader = DataLoader(ds, **kw)\n    for epoch in range(2):\n        for b in loader:\n"
        "            b = {k: v.to(device) for k, v in b.items()}\n"
    )
    res = fix_source(src, Settings(select=("TOP7",)), unsafe=True)
    assert res.text == src


def test_existing_data_pipeline_fixture_gets_diagnostics_only():
    """fixtures/data_pipeline builds its loaders at module level without a main guard: workers
    started by `spawn`/`forkserver` would re-run the script, so TOP701 only reports; TOP702/703 have
    nothing to do (TOP104 pins both loaders)."""
    text = (ROOT / "fixtures" / "data_pipeline" / "before.py").read_text()
    diags = check_source(text, Settings(select=("TOP7",))).diagnostics
    assert [(d.code, d.line, d.fix) for d in diags] == [("TOP701", 62, None), ("TOP701", 92, None)]
    assert all("__main__" in d.message for d in diags)
    assert fix_source(text, Settings(select=("TOP7",)), unsafe=True).text == text


def test_fixture_exercises_every_data_rule():
    text = (FIXTURE / "before.py").read_text()
    applied = fix_source(text, Settings(), unsafe=True).applied
    assert {"TOP701", "TOP702", "TOP703"} <= {d.code for d in applied}
    d701 = [d for d in check_source(text, Settings(select=("TOP701",))).diagnostics if d.fix is None]
    assert len(d701) == 1 and "IterableDataset" in d701[0].message  # LogStream does not shard


def test_workers_keep_every_value_bitwise(tmp_path):
    """TOP701 (+ TOP702) alone: worker processes load the same samples in the same order; this
    fixture's augmentation is seeded per sample, so even the R-class fix is bitwise here."""
    text = (FIXTURE / "before.py").read_text()
    after = fix_source(text, Settings(select=("TOP701", "TOP702")), unsafe=True)
    assert {d.code for d in after.applied} == {"TOP701", "TOP702"}
    assert "num_workers=" in after.text
    path = tmp_path / "after_workers.py"
    path.write_text(after.text)
    code, out = _validate(FIXTURE / "before.py", path)
    assert code == 0, out
    assert out["headline"] == "EQUIVALENT (bitwise)", out["headline"]


def test_unsafe_rewrite_validates_what_it_can_and_lists_the_rest():
    """The golden unsafe rewrite is torchopt's own, so it is validated as that rewrite: the loaders
    with workers (TOP701) and persistent workers (TOP703) are checked batch for batch against the
    original's, bit for bit through the first epoch; in the second epoch the training loader's
    persistent workers draw another shuffle, by design, so comparing stops there and its fixes are
    listed as not validated (exit 4); everything else (AMP, pinning, non-blocking copies) runs and
    its values are compared: every loss within AMP rounding of the original."""
    code, out = _validate(FIXTURE / "before.py", FIXTURE / "after_unsafe.py")
    assert code == 4, out
    assert {u["code"] for u in out["unvalidated"]} == {"TOP701", "TOP703"}, out["unvalidated"]
    assert all("second epoch" in u["why"] for u in out["unvalidated"]), out["unvalidated"]
    assert out["verdict"] == "equivalent" and out["tolerance"]["compare_values"] is True
    assert {"TOP202", "TOP104"} <= {a["code"] for a in out["applied"]}
    losses = {r["step"]: r for r in out["rows"] if r["name"].startswith("loss[")}
    assert len(losses) == 8
    assert all(losses[s]["max_rel"] < 1e-2 for s in range(8)), losses
