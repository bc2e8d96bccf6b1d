"""FLAG rules (TOP501 cuDNN auto-tuner, TOP502 TF32 matmuls, TOP503 determinism switches): where a
global switch is inserted (entry scripts only), that it is inserted exactly once and a second run
changes nothing, what stops it, and the numerical check of the flags fixture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from semantic import compare_programs
from torchopt.cli import app
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"
BENCH = "torch.backends.cudnn.benchmark = True"
PREC = 'torch.set_float32_matmul_precision("high")'
FLAGS = Settings(select=("TOP5",))


@pytest.fixture(autouse=True)
def _restore_backend_flags():
    """The programs run in this process set global switches; put them back."""
    bench, prec, threads = torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision(), torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.backends.cudnn.benchmark = bench
    torch.set_float32_matmul_precision(prec)
    torch.set_num_threads(threads)


def fix(src: str, select: str = "TOP5") -> str:
    return fix_source(src, Settings(select=(select,)), unsafe=True).text


def codes(src: str, select: str = "TOP5") -> list[str]:
    return [d.code for d in check_source(src, Settings(select=(select,))).diagnostics]


CONV_LOOP = (
    "import torch\nimport torch.nn as nn\n\nnet = nn.Conv2d(3, 8, 3).cuda()\n"
    "for _ in range(3):\n    net(torch.randn(2, 3, 8, 8).cuda()).sum().backward()\n"
)


# --------------------------------------------------------------------------- where it goes


def test_module_level_loop_goes_after_the_imports():
    out = fix(CONV_LOOP, "TOP501")
    assert out.splitlines()[:4] == [
        "import torch",
        "import torch.nn as nn",
        "",
        BENCH,
    ]  # after a blank line, as isort wants


def test_imports_after_path_setup_are_waited_for():
    src = (
        "import sys\nsys.path.insert(0, 'src')\nimport torch\nfrom torch import nn\n\n"
        "net = nn.Conv2d(3, 8, 3).cuda()\nfor _ in range(3):\n    net(torch.randn(2, 3, 8, 8).cuda()).sum().backward()\n"
    )
    lines = fix(src, "TOP501").splitlines()
    assert lines.index(BENCH) == lines.index("from torch import nn") + 2
    assert lines[lines.index(BENCH) - 1] == ""


def test_main_function_gets_it_first_after_its_docstring():
    src = (
        'import torch\nimport torch.nn as nn\n\n\ndef main():\n    """Doc."""\n    net = nn.Conv2d(3, 8, 3).cuda()\n'
        "    for _ in range(3):\n        net(torch.randn(1, 3, 8, 8).cuda())\n\n\nif __name__ == '__main__':\n    main()\n"
    )
    out = fix(src, "TOP501")
    assert f'    """Doc."""\n    {BENCH}\n    net = nn.Conv2d' in out


def test_main_called_at_module_level_without_guard():
    src = (
        "import torch\nimport torch.nn as nn\n\n\ndef main():\n    net = nn.Conv2d(3, 8, 3).cuda()\n"
        "    for _ in range(3):\n        net(torch.randn(1, 3, 8, 8).cuda())\n\n\nmain()\n"
    )
    assert f"def main():\n    {BENCH}\n" in fix(src, "TOP501")


def test_guard_without_main_gets_it_first_in_the_guard():
    src = (
        "import torch\nimport torch.nn as nn\n\nif __name__ == '__main__':\n    net = nn.Conv2d(3, 8, 3).cuda()\n"
        "    for _ in range(3):\n        net(torch.randn(1, 3, 8, 8).cuda())\n"
    )
    assert f"if __name__ == '__main__':\n    {BENCH}\n" in fix(src, "TOP501")


def test_library_module_is_left_alone():
    src = (
        "import torch.nn as nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.conv = nn.Conv2d(3, 8, 3)\n\n    def forward(self, x):\n        return self.conv(x.cuda())\n"
    )
    assert codes(src) == []


def test_alias_is_reused_and_both_switches_stay_together():
    src = (
        CONV_LOOP.replace("import torch\n", "import torch as T\n")
        .replace("torch.randn", "T.randn")
        .replace("import torch.nn as nn\n", "import torch.nn as nn\nhead = nn.Linear(8, 2).cuda()\n")
    )
    lines = fix(src).splitlines()
    i = lines.index("import torch.nn as nn")
    # one block right after the imports (in the order the fixes were applied)
    assert sorted(lines[i + 1 : i + 3]) == sorted([BENCH.replace("torch.", "T.", 1), PREC.replace("torch.", "T.", 1)])


# --------------------------------------------------------------------------- exactly once, never twice


@pytest.mark.parametrize("name", ["flags_cnn_train", "cnn_train", "cbn_resnet"])
def test_inserted_exactly_once_and_second_run_changes_nothing(name):
    before = (FIX / name / "before.py").read_text(encoding="utf-8")
    first = fix_source(before, FLAGS, unsafe=True)
    assert first.text.count("torch.backends.cudnn.benchmark") == 1
    assert first.text.count("set_float32_matmul_precision") == 1
    assert sorted(d.code for d in first.applied) == ["TOP501", "TOP502"]
    again = fix_source(first.text, FLAGS, unsafe=True)
    assert again.text == first.text and not again.applied
    assert [d.code for d in check_source(first.text, FLAGS).diagnostics] == []
    # the full rule set, too (the goldens): exactly one of each
    full = (FIX / name / "after_unsafe.py").read_text(encoding="utf-8") if name != "cnn_train" else None
    if full is not None:
        assert full.count("cudnn.benchmark = True") == 1 and full.count("set_float32_matmul_precision") == 1


def test_safe_mode_inserts_nothing():
    assert fix_source(CONV_LOOP, FLAGS, unsafe=False).text == CONV_LOOP


def test_existing_cnn_train_fixture_select_top501_is_correct_and_runs():
    """TOP501 fires on fixtures/cnn_train (module-level training loop, Conv2d, `device` may be
    'cuda'): the line goes after the imports, before the seed, and the program computes bitwise
    the same thing on the CPU (the switch is a no-op without cuDNN)."""
    before = (FIX / "cnn_train" / "before.py").read_text(encoding="utf-8")
    after = fix(before, "TOP501")
    lines = after.splitlines()
    # after the imports, the blank line that followed them kept before the next statement
    assert lines.index(BENCH) == lines.index("from torch.utils.data import DataLoader, TensorDataset") + 2
    assert len(after.splitlines()) == len(before.splitlines()) + 2
    assert compare_programs(before, after) == []


# --------------------------------------------------------------------------- what stops it


@pytest.mark.parametrize(
    "line",
    [
        "torch.backends.cudnn.benchmark = False",
        "torch.backends.cudnn.deterministic = True",
        "torch.use_deterministic_algorithms(True)",
        "torch.backends.cudnn.deterministic = args_deterministic",
        "os.environ['CUBLAS_WORKSPACE_CONFIG'] = ':4096:8'",
    ],
)
def test_user_settings_and_reproducibility_intent_block_insertion(line):
    src = CONV_LOOP.replace("import torch.nn as nn\n", f"import os\nimport torch.nn as nn\n{line}\n")
    assert "TOP501" not in codes(src)


def test_variable_shapes_are_reported_without_fix():
    src = (
        "import torch\nimport torch.nn as nn\nfrom torchvision import transforms\n\n"
        "tf = transforms.Compose([transforms.Resize(256), transforms.ToTensor()])\n" + CONV_LOOP.split("\n\n", 1)[1]
    )
    found = [d for d in check_source(src, FLAGS).diagnostics if d.code == "TOP501"]
    assert len(found) == 1 and found[0].fix is None and "vary per batch" in found[0].message
    crop = src.replace("transforms.Resize(256), ", "transforms.Resize(256), transforms.CenterCrop(224), ")
    assert any(d.code == "TOP501" and d.fix for d in check_source(crop, FLAGS).diagnostics)


def test_deterministic_fixture_only_reports():
    before = (FIX / "flags_deterministic" / "before.py").read_text(encoding="utf-8")
    diags = check_source(before, FLAGS).diagnostics
    assert [(d.code, d.line) for d in diags] == [("TOP503", 21), ("TOP503", 25), ("TOP503", 27)]
    assert all(d.fix is None for d in diags)
    assert fix(before) == before


def test_sensitive_linear_algebra_blocks_tf32():
    src = (
        "import torch\n\nw = torch.nn.Linear(4, 4).cuda()\nfor _ in range(2):\n"
        "    w(torch.linalg.inv(torch.eye(4)).cuda()).sum().backward()\n"
    )
    found = [d for d in check_source(src, FLAGS).diagnostics if d.code == "TOP502"]
    assert len(found) == 1 and found[0].fix is None


# --------------------------------------------------------------------------- numerical check


@pytest.mark.parametrize("code,tags", [("TOP501", {"tolerance"}), ("TOP502", {"numerics"})])
def test_flags_fixture_validates_within_its_class_tolerance(tmp_path, code, tags):
    """`torchopt validate BEFORE AFTER` on the rewrite by one rule: TOP501 is held to the
    tolerance (T) criterion, TOP502 to the numerics (N) one. On the CPU both switches are no-ops,
    so every probe is in fact bitwise equal."""
    before = FIX / "flags_cnn_train" / "before.py"
    after = tmp_path / "after.py"
    after.write_text(fix(before.read_text(encoding="utf-8"), code), encoding="utf-8")
    res = CliRunner().invoke(
        app,
        [
            "validate",
            str(before),
            str(after),
            "--select",
            code,
            "--unsafe-fixes",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--json",
        ],
        catch_exceptions=False,
    )
    out = json.loads(res.stdout)
    assert res.exit_code == 0, out
    assert out["verdict"] == "equivalent"
    assert set(out["tolerance"]["tags"]) == tags and not out["tolerance"]["bitwise"]
    assert [f["code"] for f in out["applied"]] == [code]
    assert any(r["kind"] == "loss" for r in out["rows"])
    assert all(r["max_abs"] in (0, None) for r in out["rows"]), [r for r in out["rows"] if r["max_abs"]]


# --------------------------------------------------------------------------- the switch follows `import torch`

_LATE_TORCH = {
    "module-level loop": """\
import os
with open(os.devnull) as f:
    header = f.read()
import torch

device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.ones(2, 3, 8, 8, device=device)).sum().backward()
    opt.step()
""",
    "main guard": """\
import os

if __name__ == "__main__":
    print(os.sep)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(2, 3, 8, 8, device=device)).sum().backward()
        opt.step()
""",
    "main function": """\
def main():
    \"\"\"Train.\"\"\"
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(2, 3, 8, 8, device=device)).sum().backward()
        opt.step()


main()
""",
}


@pytest.mark.parametrize("layout", sorted(_LATE_TORCH))
def test_switches_go_after_the_import_that_binds_torch(layout):
    """Statements that run before `import torch` (a file read at the top of the script, a print in
    the `__main__` block, a function that imports torch itself): the switches are placed after the
    import, never where `torch` is not bound yet, and the program still runs."""
    before = _LATE_TORCH[layout]
    after = fix_source(before, FLAGS, unsafe=True)
    assert sorted(d.code for d in after.applied) == ["TOP501", "TOP502"]
    lines = [line.strip() for line in after.text.splitlines()]
    assert lines.index(BENCH) > lines.index("import torch") and lines.index(PREC) > lines.index("import torch")
    assert compare_programs(before, after.text) == []
