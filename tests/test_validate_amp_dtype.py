"""Which AMP tolerance row `torchopt validate` holds a mixed-precision rewrite to.

The rewrite autocasts to float16 on CUDA unless `[tool.torchopt.rules.TOP202] dtype = "bfloat16"`
asks for bfloat16, and to bfloat16 everywhere else; the row must follow what the program computes
in. The runs themselves are replaced by canned probes (a GPU is not needed to pick a row), so these
tests check the decision and what the user sees: the verdict, the exit code and the criterion.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from torchopt.rewrite.config import Resolver
from torchopt.validate import runner
from torchopt.validate.command import validate

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "fixtures" / "amp_plain_loop" / "before.py"


def _tree_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _probes(loss_scale: float) -> list[dict]:
    """One rank's probes: four losses (scaled by ``loss_scale``), a parameter, the RNG state."""
    return [
        {
            "status": "ok",
            "traceback": None,
            "device": "cuda",
            "steps_done": 4,
            "losses": [torch.tensor(1.0 / (i + 1)) * loss_scale for i in range(4)],
            "loss_steps": [0, 1, 2, 3],
            "tensors": {
                "param/model.fc1.weight": torch.full((2, 2), 0.5 * loss_scale),
                "rng/cpu": torch.arange(8, dtype=torch.uint8),
            },
            "notes": [],
        }
    ]


@pytest.fixture
def canned_runs(monkeypatch):
    """Runs that return the original's probes, and a rewrite whose losses are 3 % higher:
    inside the bfloat16 row (5 %), outside the float16 one (1 %). The reference run (the original
    at reduced precision, for the noise floor) fails, so the flat rows decide; the dtype it was
    asked to autocast to is recorded."""
    asked: list[str] = []

    def fake_run(version, opts, workdir=None, cancel=None):  # noqa: ARG001 - run_version's signature
        assert opts.device == "cuda"
        if version.label == "reference":
            asked.append(opts.precision["autocast"])
            return [{"status": "error", "traceback": "RuntimeError: no GPU here", "losses": [], "tensors": {}}]
        return _probes(1.0 if version.label == "before" else 1.03)

    monkeypatch.setattr(runner, "run_version", fake_run)
    return asked


def _project(proj: Path, config: str) -> Path:
    proj.mkdir()
    shutil.copy(PROGRAM, proj / "train.py")
    (proj / "pyproject.toml").write_text(config)
    return proj / "train.py"


def _validate(script: Path):
    settings = Resolver().for_path(str(script))
    return validate(
        str(script),
        None,
        settings,
        unsafe=True,
        steps=4,
        device="cuda",
        argv=(),
        entry=None,
        nproc=1,
        timeout=30,
        bisect=False,
    )


def test_amp_row_follows_the_dtype_the_rewrite_computes_in(tmp_path, canned_runs):
    """A rewrite configured for bfloat16 is held to the bfloat16 row on CUDA (its 3 % drift passes),
    the default float16 rewrite to the tighter float16 row (the same drift diverges at loss[0])."""
    bf16 = _project(tmp_path / "bf16", '[tool.torchopt]\n\n[tool.torchopt.rules.TOP202]\ndtype = "bfloat16"\n')
    fp16 = _project(tmp_path / "fp16", "[tool.torchopt]\n")
    before = _tree_hashes(tmp_path)

    out = _validate(bf16)
    assert "TOP202" in {f["code"] for f in out.json["applied"]}
    assert out.json["tolerance"]["reason"].startswith("numerics (bfloat16)")
    assert out.exit_code == 0, out.text
    assert out.text.startswith("EQUIVALENT")
    assert canned_runs == ["bfloat16"]

    out = _validate(fp16)
    assert out.json["tolerance"]["reason"].startswith("numerics (float16)")
    assert out.exit_code == 1
    assert out.json["first_divergence"]["name"] == "loss[0]"
    assert out.text.startswith("DIVERGED")
    assert canned_runs == ["bfloat16", "float16"]

    assert _tree_hashes(tmp_path) == before
