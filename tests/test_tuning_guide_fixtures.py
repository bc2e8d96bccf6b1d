"""The tuning-guide rules that rewrite, end to end on their golden fixture: TOP106 drops
`non_blocking=True` from device-to-host copies read at once (fixtures/device_readback_eval), the
command line writes exactly the golden text and nothing else, and `torchopt validate` finds the
rewrite bitwise-equal on the CPU without touching the tree."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

import torchopt.cli

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "device_readback_eval"


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _project(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the fixture in `proj/`, beside a file outside it that no run may touch."""
    work = tmp_path / "proj"
    shutil.copytree(FIXTURE, work)
    (tmp_path / "outside.py").write_text('x.to("cpu", non_blocking=True).sum()\n', encoding="utf-8")
    return work, tmp_path


def test_rewrite_writes_the_golden_readback_fix_and_nothing_else(tmp_path):
    work, root = _project(tmp_path)
    before = _tree(root)
    r = CliRunner().invoke(
        torchopt.cli.app, ["rewrite", str(work / "before.py"), "--no-cache", "-j", "1"], catch_exceptions=False
    )
    assert r.exit_code == 0, r.output
    assert "TOP106 ×2" in r.stderr, r.stderr
    assert (work / "before.py").read_bytes() == (FIXTURE / "after_safe.py").read_bytes()
    after = _tree(root)
    changed = {name for name in before if before[name] != after.get(name)}
    assert changed == {"proj/before.py"} and set(after) == set(before), (changed, set(after) ^ set(before))


def test_readback_fixture_validates_bitwise_on_cpu_and_writes_nothing(tmp_path):
    work, root = _project(tmp_path)
    before = _tree(root)
    r = CliRunner().invoke(
        torchopt.cli.app,
        ["validate", str(work / "before.py"), "--unsafe-fixes", "--device", "cpu", "--json", "--timeout", "120"],
        catch_exceptions=False,
    )
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and out["verdict"] == "equivalent", json.dumps(out, indent=1)[:3000]
    assert [a["code"] for a in out["applied"]] == ["TOP106", "TOP106"]
    assert out["tolerance"]["bitwise"] is True
    compared = [row for row in out["rows"] if row["max_abs"] is not None]
    assert {"param", "output"} <= {row["kind"] for row in compared}
    assert all(row["max_abs"] == 0 for row in compared), compared
    assert _tree(root) == before
