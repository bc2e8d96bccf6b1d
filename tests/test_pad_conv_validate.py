"""`torchopt validate` on the padded convolution chain (a subprocess run; ~40 s): the rewrite starts
from the original's weights with zero-padded channels, and every probe matches."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

import torchopt.cli

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "pad_cnn_hidden"


def test_padded_conv_chain_passes_validate_on_cpu_and_writes_nothing(tmp_path):
    work = tmp_path / "proj"
    shutil.copytree(FIXTURE, work)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in work.iterdir()}
    r = CliRunner().invoke(
        torchopt.cli.app,
        [
            "validate",
            str(work / "before.py"),
            "--select",
            "TOP302",
            "--unsafe-fixes",
            "--device",
            "cpu",
            "--steps",
            "4",
            "--json",
            "--timeout",
            "300",
        ],
        catch_exceptions=False,
    )
    out = json.loads(r.output)
    assert r.exit_code == 0 and out["verdict"] == "equivalent", json.dumps(out, indent=1)[:3000]
    rows = {row["name"]: row for row in out["rows"]}
    losses = [row for name, row in rows.items() if name.startswith("loss[")]
    assert len(losses) == 4 and all(row["max_abs"] == 0 for row in losses), losses
    assert "padded (20, 3, 3, 3) -> (24, 3, 3, 3)" in rows["param/model.features.0.weight"]["detail"]
    assert "padded (16, 30, 1, 1) -> (16, 32, 1, 1)" in rows["param/model.features.4.weight"]["detail"]
    assert rows["param/model.stem.0.weight"]["max_abs"] == 0
    assert not any("transplant stopped" in n for n in out["notes"]), out["notes"]
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in work.iterdir()} == before
