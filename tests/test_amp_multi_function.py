"""TOP202 analyses each training function on its own: a module with several independent training
functions, each with its own local `model`/`opt` (same names in every function), gets for each the
finding that function gets alone, and its unsafe fix compiles, is a fix point, runs on the CPU, and
with autocast and the scaler disabled computes bitwise what the float32 program computes."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source
from torchopt.rewrite.incremental import IncrementalChecker

from test_incremental import BLOCK, HEAD

TOP202 = Settings(select=("TOP202",))
FINDING = (
    "training step runs in float32: wrap forward and loss in `torch.autocast` and scale the loss "
    "with `torch.amp.GradScaler`"
)
N = 4
MODULE = HEAD + "".join(BLOCK.format(i=i) for i in range(N))


def _top202(text: str) -> list:
    return [d for d in check_source(text, TOP202, "m.py").diagnostics if d.code == "TOP202"]


def _function(text: str, name: str) -> str:
    tree = ast.parse(text)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(text, fn)


def test_each_function_gets_the_finding_it_gets_alone():
    diags = _top202(MODULE)
    assert [d.message for d in diags] == [FINDING] * N
    block_lines = BLOCK.format(i=0).count("\n")
    for i, d in enumerate(diags):
        alone = _top202(HEAD + BLOCK.format(i=i))
        assert [(x.message, x.column, x.fix) for x in alone] == [(d.message, d.column, d.fix)]
        assert d.line == alone[0].line + i * block_lines


def test_incremental_check_equals_check():
    assert (
        IncrementalChecker().check(MODULE, Settings(), "m.py") == check_source(MODULE, Settings(), "m.py").diagnostics
    )


def test_fix_rewrites_every_function_like_the_function_alone():
    got = fix_source(MODULE, TOP202, "m.py", unsafe=True)
    compile(got.text, "m.py", "exec", dont_inherit=True)
    assert len(got.applied) == N and got.passes == 1  # each fix replaces only its function
    again = fix_source(got.text, TOP202, "m.py", unsafe=True)
    assert again.text == got.text and not again.applied and not again.remaining
    for i in range(N):
        alone = fix_source(HEAD + BLOCK.format(i=i), TOP202, "m.py", unsafe=True).text
        assert _function(got.text, f"train_{i}") == _function(alone, f"train_{i}")
    assert got.text.count("torch.amp.GradScaler(") == N and got.text.count("with torch.autocast(") == N


_RUNNER = textwrap.dedent(r"""
    import json, re, sys
    import torch
    torch.set_num_threads(1)
    src = open(sys.argv[1]).read()
    out = {}
    after = open(sys.argv[2]).read()
    fp16 = re.sub(r'(amp_dtype\w*) = torch.float16 if .*', r"\1 = torch.float16", after)
    off = re.sub(r"dtype=(amp_dtype\w*)\)", r"dtype=\1, enabled=False)", after)
    off = re.sub(r"enabled=(amp_dtype\w*) == torch.float16\)", "enabled=False)", off)
    assert fp16 != after and off != after
    for label, text in (("before", src), ("off", off), ("bf16", after), ("fp16", fp16)):
        ns = {"__name__": "m"}
        exec(compile(text, label, "exec"), ns)
        weights = []
        for i in range(int(sys.argv[3])):
            torch.manual_seed(i)
            weights.append(ns["train_%d" % i]()[1].tolist())
        out[label] = weights
    print(json.dumps(out))
""")


@pytest.mark.slow  # runs the rewritten program in float16 on the CPU, seconds each: with the end-to-end runs
def test_fixed_module_runs_on_the_cpu(tmp_path):
    # The same module made runnable on a CPU-only machine (`.cuda()` is what TOP101 fixes) and
    # returning each function's trained weights.
    src = MODULE.replace(".cuda()", ".to(device)").replace(
        "return scratch", "return scratch, model.fc.weight.detach().clone()"
    )
    after = fix_source(src, TOP202, "m.py", unsafe=True)
    assert len(after.applied) == N
    before_py, after_py, runner = tmp_path / "before.py", tmp_path / "after.py", tmp_path / "run.py"
    before_py.write_text(src)
    after_py.write_text(after.text)
    runner.write_text(_RUNNER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHOPT_")}
    proc = subprocess.run(
        [sys.executable, str(runner), str(before_py), str(after_py), str(N)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["off"] == res["before"]  # autocast and scaler disabled: bitwise the float32 program
    for w32, w in zip(res["before"], res["bf16"]):  # bfloat16 autocast on the CPU, no scaler
        flat32 = [x for row in w32 for x in row]
        flat = [x for row in w for x in row]
        assert all(abs(a - b) <= 5e-2 * max(1.0, abs(a)) for a, b in zip(flat32, flat))
    # float16 autocast + GradScaler: the scaler may skip the first steps while it calibrates,
    # so only finite weights are required.
    assert all(math.isfinite(x) for w in res["fp16"] for row in w for x in row)


SHADOW = """import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Linear(4, 2).half().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model = nn.DataParallel(model)


def finetune(loader):
    model = nn.Linear(4, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()


for x, y in [(torch.randn(8, 4), torch.randn(8, 2))]:
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
"""


def test_a_local_shadows_the_module_level_name():
    """The module-level `model` is half precision and DataParallel (refused); the function's own
    `model` is neither, so the function's step is rewritten."""
    diags = _top202(SHADOW)
    assert [(d.line, d.message == FINDING) for d in diags] == [(15, True), (23, False)]
    assert "`.half()`" in diags[1].message
    out = fix_source(SHADOW, TOP202, "m.py", unsafe=True).text
    assert _function(out, "finetune").count("with torch.autocast(") == 1
    assert out.split("def finetune")[0].count("autocast") == 0


CKPT = """import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
optimizer = None


def train_a(loader):
    model = nn.Linear(4, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "a.pt")


def train_b(loader):
    model = nn.Linear(4, 2).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt = torch.load("a.pt")
    opt.load_state_dict(ckpt["optimizer"])
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    torch.save({"optimizer": optimizer.state_dict()}, "b.pt")
"""


def test_checkpoints_follow_the_functions_optimizer():
    out = fix_source(CKPT, TOP202, "m.py", unsafe=True).text
    compile(out, "m.py", "exec", dont_inherit=True)
    a, b = _function(out, "train_a"), _function(out, "train_b")
    assert '"scaler": scaler.state_dict()' in a  # train_a saves its own optimizer
    assert 'scaler.load_state_dict(ckpt["scaler"])' in b
    # `optimizer` in train_b is the module-level name, not train_b's `opt`: its dict is left alone.
    assert 'torch.save({"optimizer": optimizer.state_dict()}, "b.pt")' in b


SAVE_HELPER = """import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Linear(4, 2).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def save(model, optimizer, path):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


for x, y in [(torch.randn(8, 4), torch.randn(8, 2))]:
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
save(model, optimizer, "c.pt")
"""


def test_a_helper_parameter_passed_the_same_name_is_that_object():
    """`save(model, optimizer)` passes the module's optimizer to the same-named parameter: its
    checkpoint gains the scaler state, as when names were matched file-wide."""
    out = fix_source(SAVE_HELPER, TOP202, "m.py", unsafe=True).text
    assert '"scaler": scaler.state_dict()' in _function(out, "save")
