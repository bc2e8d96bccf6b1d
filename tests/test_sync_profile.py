"""`torchopt check --profile trace.json`: synchronisations recorded by torch.profiler are attached to
the SYNC diagnostics of the functions that ran them (a real CPU trace, and a hand-made one)."""

from __future__ import annotations

import json
import os
import runpy

import torch
from typer.testing import CliRunner

from torchopt.cli import app

PROG = """\
import torch


def clipped(pred, y):
    err = (pred - y).abs()
    if err.max() > 10.0:
        err = err.clamp(max=10.0)
    return err.mean()


def train(model, opt, data):
    total = 0.0
    for x, y in data:
        loss = clipped(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
        idx = torch.nonzero(y > 0)
    return total


def run(data):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return train(model, opt, data)
"""

# The batches come from outside the file, as a loader's would: their device is not known statically.
BATCHES = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(5)]


def check(*args):
    res = CliRunner().invoke(
        app, ["check", *map(str, args), "--select", "TOP6", "--output-format", "json"], catch_exceptions=False
    )
    text = res.stdout.strip()
    return [json.loads(line) for line in text.splitlines()] if not text.startswith("[") else json.loads(text)


def test_real_cpu_trace_is_attached_to_the_static_findings(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    ns = runpy.run_path(str(prog))
    torch.set_num_threads(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        ns["run"](BATCHES)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    plain = {(d["line"], d["code"]): d["message"] for d in check(prog)}
    prof_diags = {(d["line"], d["code"]): d["message"] for d in check(prog, "--profile", trace)}
    assert set(plain) == set(prof_diags)  # every sync the profile saw has a static finding here
    assert "[profile: `aten::is_nonzero` ran 5× in `clipped`" in prof_diags[(6, "TOP605")]
    assert "[profile: `aten::_local_scalar_dense` ran 5× in `train`" in prof_diags[(18, "TOP601")]
    assert "[profile: `aten::nonzero` ran 5× in `train`" in prof_diags[(19, "TOP604")]
    assert "profile" not in plain[(6, "TOP605")]


def test_unexplained_sync_is_reported_at_its_function(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    path = os.path.abspath(prog)
    ev = [
        {"ph": "X", "cat": "python_function", "name": f"{path}(11): train", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "pid": 1, "tid": 1, "ts": 10, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::_local_scalar_dense", "pid": 1, "tid": 2, "ts": 10, "dur": 5},
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": ev}))
    diags = check(prog, "--profile", trace)
    new = [d for d in diags if d["name"] == "profiled-sync"]
    assert len(new) == 1 and new[0]["line"] == 11 and new[0]["code"] == "TOP606"
    assert "`cudaDeviceSynchronize` ran 1× in `train`" in new[0]["message"]
    # the op on another thread has no Python frame of this file: not attributed
    assert not any("_local_scalar_dense" in d["message"] for d in diags)


def test_bad_trace_is_a_usage_error(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    res = CliRunner().invoke(app, ["check", str(prog), "--profile", str(bad)], catch_exceptions=False)
    assert res.exit_code == 2
    assert "cannot read the profile" in res.stderr
