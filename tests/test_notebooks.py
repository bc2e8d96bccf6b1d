"""Jupyter notebooks: found in folders, checked and fixed as one program with positions given as cell
and line, IPython syntax left alone, and every byte outside the changed cells kept."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from torchopt.cli import app

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==\n"


def cli(*args, input=None):
    return CliRunner().invoke(app, list(args), input=input)


def code(src, outputs=(), execution_count=None):
    return {
        "cell_type": "code",
        "execution_count": execution_count,
        "metadata": {},
        "outputs": list(outputs),
        "source": src.splitlines(keepends=True),
    }


def markdown(src):
    return {"cell_type": "markdown", "metadata": {}, "source": src.splitlines(keepends=True)}


MODEL = (
    "import torch\n"
    "from torch import nn\n"
    "from torch.utils.data import DataLoader, TensorDataset\n"
    "\n"
    "torch.manual_seed(0)\n"
    "device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n"
    "model = nn.Linear(4, 2).to(device)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)"
)
LOADER = "data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))\nloader = DataLoader(data, batch_size=4)"
LOOP = (
    "%%time\n"
    "for x, y in loader:\n"
    "    x = x.to(device)\n"
    "    y = y.to(device)\n"
    "    opt.zero_grad()\n"
    "    loss = nn.functional.cross_entropy(model(x), y)\n"
    "    loss.backward()\n"
    "    opt.step()\n"
    "    %time z = 1\n"
    "print(loss.item())\n"
)
IMAGE = {
    "output_type": "display_data",
    "data": {"image/png": PNG, "text/plain": ["<Figure size 640x480>"]},
    "metadata": {},
}


def training_notebook():
    """A course-style training notebook: set-up shell escapes, the model in one cell, the loader in
    another, the loop in a third, outputs with an image, a markdown cell and a bash cell."""
    return {
        "cells": [
            markdown("# Training ✓\nA small model, trained for one epoch."),
            code(
                "!pip install -q torch\n%matplotlib inline",
                outputs=[{"output_type": "stream", "name": "stdout", "text": ["ok\n"]}],
                execution_count=1,
            ),
            code(MODEL, execution_count=2),
            code(LOADER, outputs=[IMAGE], execution_count=3),
            code(LOOP, outputs=[{"output_type": "stream", "name": "stdout", "text": ["0.69\n"]}], execution_count=4),
            code("%%bash\necho x = torch.zeros(3).to(device)"),
        ],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def jupyter(nb):
    """The bytes Jupyter writes for ``nb``."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def with_sources(nb, sources):
    nb = json.loads(json.dumps(nb))
    for index, text in sources.items():
        nb["cells"][index]["source"] = text.splitlines(keepends=True)
    return nb


LOADER_FIXED = LOADER.replace("batch_size=4)", "batch_size=4, pin_memory=torch.cuda.is_available())")
LOOP_FIXED = LOOP.replace("x.to(device)", "x.to(device, non_blocking=True)").replace(
    "y.to(device)", "y.to(device, non_blocking=True)"
)


def test_check_gives_cell_and_line_and_sees_the_notebook_as_one_program(tmp_path, monkeypatch):
    """The loader is built in cell 4 and iterated in cell 5: the pinning advice needs both."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.ipynb").write_text(jupyter(training_notebook()), encoding="utf-8")
    r = cli("check", ".", "--select", "TOP104")
    assert r.exit_code == 1, r.output
    assert r.stdout.splitlines() == [
        "train.ipynb:cell 4:2:10: TOP104 [*] `DataLoader(...)` feeds host→device copies but does not pin its batches",
        "train.ipynb:cell 5:3:9: TOP104 [*] `x.to(device)` copies a DataLoader batch to the device synchronously",
        "train.ipynb:cell 5:4:9: TOP104 [*] `y.to(device)` copies a DataLoader batch to the device synchronously",
    ]
    rows = json.loads(cli("check", "train.ipynb", "--select", "TOP104", "--output-format", "json").stdout)
    assert [(row["path"], row["cell"], row["line"], row["column"]) for row in rows] == [
        ("train.ipynb", 4, 2, 10),
        ("train.ipynb", 5, 3, 9),
        ("train.ipynb", 5, 4, 9),
    ]
    # Line numbers count within the cell, so the cell is named in the messages of the other formats.
    github = cli("check", "train.ipynb", "--select", "TOP104", "--output-format", "github").stdout.splitlines()
    assert github[0].startswith("::warning title=torchopt (TOP104),file=train.ipynb,line=2,col=10,")
    assert github[0].endswith(
        "::cell 4: TOP104 `DataLoader(...)` feeds host→device copies but does not pin its batches"
    )
    sarif = json.loads(cli("check", "train.ipynb", "--select", "TOP104", "--output-format", "sarif").stdout)
    assert sarif["runs"][0]["results"][1]["message"]["text"].startswith("cell 5: `x.to(device)` copies")


def test_rewrite_changes_only_the_fixed_cells_sources(tmp_path):
    nb = training_notebook()
    path = tmp_path / "train.ipynb"
    path.write_text(jupyter(nb), encoding="utf-8")
    r = cli("rewrite", str(path), "--select", "TOP104")
    assert r.exit_code == 0, r.output
    assert path.read_bytes() == jupyter(with_sources(nb, {3: LOADER_FIXED, 4: LOOP_FIXED})).encode()
    again = cli("rewrite", str(path), "--select", "TOP104", "--diff")
    assert again.exit_code == 0 and again.stdout == ""


def test_diff_is_per_cell(tmp_path):
    path = tmp_path / "train.ipynb"
    path.write_text(jupyter(training_notebook()), encoding="utf-8")
    r = cli("rewrite", str(path), "--select", "TOP104", "--diff")
    assert r.exit_code == 1
    assert f"--- a/{path}:cell 4\n+++ b/{path}:cell 4\n" in r.stdout
    assert f"--- a/{path}:cell 5\n+++ b/{path}:cell 5\n" in r.stdout
    assert "+    x = x.to(device, non_blocking=True)\n" in r.stdout
    assert path.read_text(encoding="utf-8") == jupyter(training_notebook())


def test_other_json_layouts_are_kept(tmp_path):
    """Two-space indentation, keys in their own order, `\\u` escapes, `source` as one string, no final
    newline: the fixed cell is written in that layout and nothing else moves."""
    nb = {
        "nbformat": 4,
        "nbformat_minor": 2,
        "metadata": {"colab": {"name": "Entraînement"}},
        "cells": [
            {
                "cell_type": "code",
                "source": "import torch\nx = torch.zeros(3).cuda()  # café",
                "metadata": {},
                "outputs": [],
                "execution_count": None,
            },
            {
                "cell_type": "code",
                "source": ["y = torch.ones(2).cuda()\n"],
                "metadata": {},
                "outputs": [],
                "execution_count": None,
            },
        ],
    }

    def colab(nb):
        return json.dumps(nb, indent=2, ensure_ascii=True)

    path = tmp_path / "colab.ipynb"
    path.write_text(colab(nb), encoding="utf-8")
    r = cli("rewrite", str(path))
    assert r.exit_code == 0, r.output
    want = json.loads(json.dumps(nb))
    want["cells"][0]["source"] = 'import torch\nx = torch.zeros(3, device="cuda")  # café'
    want["cells"][1]["source"] = ['y = torch.ones(2, device="cuda")\n']
    assert path.read_text(encoding="utf-8") == colab(want)


IPYTHON = (
    "import torch\n"
    "files = !ls\n"
    "%load_ext autoreload\n"
    "torch.randn?\n"
    "label = ('%d'\n"
    "         % 3)\n"
    "doc = '''\n"
    "%not a magic inside a string\n"
    "'''\n"
    'question = """why?\n'
    '"""\n'
    "for i in range(2):\n"
    "    !echo {i}\n"
    "    t = torch.zeros(3).cuda()\n"
)


def test_ipython_syntax_is_left_alone_and_python_around_it_is_fixed(tmp_path):
    nb = {"cells": [code(IPYTHON)], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "magic.ipynb"
    path.write_text(jupyter(nb), encoding="utf-8")
    r = cli("rewrite", str(path))
    assert r.exit_code == 0, r.output
    fixed = IPYTHON.replace("torch.zeros(3).cuda()", "torch.zeros(3, device='cuda')")
    assert path.read_text(encoding="utf-8") == jupyter(with_sources(nb, {0: fixed}))


def test_cells_of_other_languages_and_non_python_notebooks_are_not_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bash = {"cells": [code("%%bash\nx = torch.zeros(3).cuda()")], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    julia = {
        "cells": [code("import torch\nx = torch.zeros(3).cuda()")],
        "metadata": {"kernelspec": {"language": "julia", "name": "julia-1.10"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (tmp_path / "bash.ipynb").write_text(jupyter(bash))
    (tmp_path / "julia.ipynb").write_text(jupyter(julia))
    r = cli("check", ".")
    assert r.exit_code == 0 and r.stdout == "", r.output


def test_notebooks_are_discovered_and_can_be_excluded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nb = {
        "cells": [code("import torch\nx = torch.zeros(3).cuda()")],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.ipynb").write_text(jupyter(nb))
    (tmp_path / "sub" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "sub" / ".ipynb_checkpoints" / "a-checkpoint.ipynb").write_text(jupyter(nb))
    r = cli("check", ".")
    assert r.exit_code == 1 and r.stdout.splitlines() == [
        "sub/a.ipynb:cell 1:2:5: TOP101 [*] `torch.zeros(...)` is created on the host, then moved to `'cuda'`"
    ]
    (tmp_path / "pyproject.toml").write_text('[tool.torchopt]\nexclude = ["*.ipynb"]\n')
    r = cli("check", ".")
    assert r.exit_code == 0 and r.stdout == "", r.output


def test_a_broken_notebook_is_reported_with_its_cell_and_left_alone(tmp_path):
    bad = tmp_path / "bad.ipynb"
    bad.write_text('{"cells": [')
    syntax = tmp_path / "syntax.ipynb"
    nb = {
        "cells": [code("import torch"), markdown("text"), code("x = (1,")],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    syntax.write_text(jupyter(nb))
    r = cli("rewrite", str(bad), str(syntax))
    assert r.exit_code == 2
    assert f"error: {bad}: not a notebook: invalid JSON" in r.stderr
    assert f"error: {syntax}: syntax error at cell 3, line 1" in r.stderr
    assert bad.read_text() == '{"cells": [' and syntax.read_text() == jupyter(nb)


def test_stdin_with_a_notebook_name(tmp_path):
    nb = {
        "cells": [code("import torch\nx = torch.zeros(3).cuda()")],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    r = cli("rewrite", "-", "--stdin-filename", "nb.ipynb", input=jupyter(nb))
    assert r.exit_code == 0
    assert r.stdout == jupyter(with_sources(nb, {0: 'import torch\nx = torch.zeros(3, device="cuda")'}))


@pytest.mark.slow
def test_validate_runs_the_code_cells_in_order(tmp_path):
    """`torchopt validate` runs the notebook's code cells as a script (IPython lines dropped) before and
    after the rewrite, on the CPU, and finds them equivalent; the notebook itself is not written."""
    path = tmp_path / "train.ipynb"
    path.write_text(jupyter(training_notebook()), encoding="utf-8")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchopt",
            "validate",
            str(path),
            "--steps",
            "3",
            "--device",
            "cpu",
            "--select",
            "TOP104",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "EQUIVALENT (bitwise)" in out.stdout and "loss[2]" in out.stdout
    assert path.read_text(encoding="utf-8") == jupyter(training_notebook())


def test_cached_results_keep_cell_positions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.ipynb").write_text(jupyter(training_notebook()), encoding="utf-8")
    cold = cli("check", "train.ipynb", "--select", "TOP104", "--cache-dir", str(tmp_path / "cache"))
    warm = cli("check", "train.ipynb", "--select", "TOP104", "--cache-dir", str(tmp_path / "cache"))
    assert cold.exit_code == warm.exit_code == 1
    assert warm.stdout == cold.stdout and "train.ipynb:cell 5:3:9: TOP104" in warm.stdout


def test_large_outputs_do_not_count_against_the_size_limit(tmp_path):
    """`max-file-size` (2 MB by default) is about code: a notebook whose images weigh more is still
    fixed, and its outputs are kept."""
    big = dict(IMAGE, data={"image/png": "A" * 3_000_000 + "\n", "text/plain": ["<Figure>"]})
    nb = {
        "cells": [code("import torch\nx = torch.zeros(3).cuda()", outputs=[big])],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = tmp_path / "big.ipynb"
    path.write_text(jupyter(nb))
    r = cli("rewrite", str(path))
    assert r.exit_code == 0, r.output
    assert path.read_text() == jupyter(with_sources(nb, {0: 'import torch\nx = torch.zeros(3, device="cuda")'}))
