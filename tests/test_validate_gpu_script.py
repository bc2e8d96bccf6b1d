"""benchmarks/gpu_validate.py without a GPU: the commands it runs and the table it prints.

The script's point is a GPU run; here `--dry-run` shows that every rewrite goes through
`torchopt validate --bench` on the device, and a canned `validate --json` answer shows that the
table carries the before/after step times, steps/s, peak memory and the speed-up with its interval.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_validate.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_validate_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def _dry_run(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--fixtures", "cnn_train,amp_gan", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_dry_run_prints_one_bench_command_per_rewrite_and_runs_nothing():
    before = _tree(ROOT / "fixtures")
    proc = _dry_run()
    assert proc.returncode == 0, proc.stderr
    commands = [shlex.split(line) for line in proc.stdout.splitlines()]
    # cnn_train: safe and unsafe rewrites differ; amp_gan: the safe rewrite changes nothing.
    assert [(Path(c[4]).parent.name, "--unsafe-fixes" in c) for c in commands] == [
        ("cnn_train", False),
        ("cnn_train", True),
        ("amp_gan", True),
    ]
    for c in commands:
        assert c[1:4] == ["-m", "torchopt", "validate"]
        assert c[c.index("--device") + 1] == "cuda"
        assert "--json" in c
        assert c[c.index("--bench") + 1 : c.index("--bench") + 5] == ["--bench-repeats", "3", "--bench-warmup", "2"]
    assert _tree(ROOT / "fixtures") == before

    proc = _dry_run("--no-bench", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("--device cpu") == 3 and "--bench" not in proc.stdout


def test_dry_run_names_an_unknown_fixture():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--fixtures", "no_such_fixture"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: no such fixture: no_such_fixture"
    assert proc.stdout == ""


def test_table_reports_step_times_memory_and_speedup_interval():
    mod = _load()
    answer = {
        "verdict": "equivalent",
        "headline": "EQUIVALENT (bitwise)",
        "applied": [{"code": "TOP101"}] * 3,
        "tolerance": {"reason": "safe fixes only"},
        "notes": [],
        "bench": {
            "device": "cuda",
            "repeats": 3,
            "warmup_steps": 2,
            "before": {
                "median_step_s": 0.004,
                "steps_per_s": 250.0,
                "peak_memory_bytes": 64 * 2**20,
                "memory_kind": "max_memory_allocated",
            },
            "after": {
                "median_step_s": 0.0025,
                "steps_per_s": 400.0,
                "peak_memory_bytes": 48 * 2**20,
                "memory_kind": "max_memory_allocated",
            },
            "speedup": 1.6,
            "speedup_ci95": [1.41, 1.82],
            "notes": [],
            "errors": [],
        },
    }
    row = mod.summarize(answer, 0, 12.0)
    assert row["bench"]["speedup"] == 1.6 and row["fixes"] == 3
    text = mod.table([{"fixture": "cnn_train", "rewrite": "safe", "validation": row}])
    line = text.splitlines()[2].split()
    assert line[:3] == ["cnn_train", "safe", "3"]
    assert line[-9:] == ["4", "2.5", "250", "400", "64.0", "48.0", "1.6x", "[1.41,", "1.82]"]
