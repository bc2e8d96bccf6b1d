"""Installing torchopt: the base package lints without PyTorch (check, rewrite, rules, rule, lsp, migrate),
`validate` without PyTorch says how to get it, and the pre-commit hooks install and run from this
repository."""

import json
import os
import shutil
import subprocess
import sys
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST = "torchopt-rewrite"
FIXABLE = "import torch\n\nx = torch.zeros(3).cuda()\n"

# Runs the CLI in a process where `import torch` fails, as in an environment without PyTorch.
WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None\n"
    "from torchopt.cli import main\n"
    "sys.argv = ['torchopt'] + sys.argv[1:]\n"
    "main()\n"
)


def _without_torch(*args, cwd):
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.mark.parametrize(
    "args",
    [
        ("validate", "train.py"),
        ("rewrite", "train.py", "--validate", "train.py"),
        ("migrate", "repo", "--validate", "train.py"),
    ],
)
def test_running_a_program_without_torch_says_how_to_install_it(tmp_path, args):
    (tmp_path / "train.py").write_text(FIXABLE)
    (tmp_path / "repo").mkdir()
    out = _without_torch(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install '{DIST}[validate]'" in lines[0], out.stderr
    assert (tmp_path / "train.py").read_text() == FIXABLE


# A fresh environment with the base install only --------------------------------------------------


def _copy_project(dest):
    """What a wheel is built from: the metadata and the package (not the .venv or build leftovers)."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), dest / name)
    shutil.copytree(os.path.join(ROOT, "torchopt"), dest / "torchopt", ignore=shutil.ignore_patterns("__pycache__"))


def _base_venv(tmp_path):
    """A new virtual environment with the package and its `lsp` extra installed by pip from the
    project's own metadata: whatever the base dependencies pull is what a user gets."""
    src, env = tmp_path / "src", tmp_path / "env"
    src.mkdir()
    _copy_project(src)
    venv.create(env, with_pip=False)
    python = str(env / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", f"{src}[lsp]"]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return env


def _frame(msg):
    body = json.dumps(msg).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def _read_message(stream):
    length = None
    while True:
        line = stream.readline()
        assert line, "the server closed its output"
        if line in (b"\r\n", b"\n"):
            break
        key, _, value = line.decode().partition(":")
        if key.lower() == "content-length":
            length = int(value)
    return json.loads(stream.read(length))


def _lsp_diagnostics(torchopt, path):
    """Initialize `torchopt lsp` over stdio, open ``path`` and return the codes it publishes for it."""
    proc = subprocess.Popen([torchopt, "lsp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    uri = "file://" + str(path)
    try:
        proc.stdin.write(
            _frame(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "initialize",
                    "params": {"processId": None, "rootUri": "file://" + str(path.parent), "capabilities": {}},
                }
            )
        )
        proc.stdin.flush()
        codes = None
        while codes is None:
            msg = _read_message(proc.stdout)
            if msg.get("id") == 1 and "result" in msg:
                assert "capabilities" in msg["result"]
                for note in (
                    {"jsonrpc": "2.0", "method": "initialized", "params": {}},
                    {
                        "jsonrpc": "2.0",
                        "method": "textDocument/didOpen",
                        "params": {
                            "textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": path.read_text()}
                        },
                    },
                ):
                    proc.stdin.write(_frame(note))
                proc.stdin.flush()
            elif "method" in msg and "id" in msg:  # a request from the server (registrations): accept it
                proc.stdin.write(_frame({"jsonrpc": "2.0", "id": msg["id"], "result": None}))
                proc.stdin.flush()
            elif msg.get("method") == "textDocument/publishDiagnostics" and msg["params"]["uri"] == uri:
                codes = [d["code"] for d in msg["params"]["diagnostics"]]
        proc.stdin.write(_frame({"jsonrpc": "2.0", "id": 2, "method": "shutdown", "params": None}))
        proc.stdin.write(_frame({"jsonrpc": "2.0", "method": "exit", "params": None}))
        proc.stdin.flush()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return codes


def _git(*args, cwd):
    env = dict(
        os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t"
    )
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, env=env)


@pytest.mark.slow
def test_base_install_lints_without_torch(tmp_path):
    env = _base_venv(tmp_path)
    bin_ = env / "bin"
    no_torch = subprocess.run([str(bin_ / "python"), "-c", "import torch"], capture_output=True, text=True)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(FIXABLE)
    torchopt = str(bin_ / "torchopt")

    def run(*args, cwd=proj):
        return subprocess.run([torchopt, *args], capture_output=True, text=True, cwd=cwd, timeout=300)

    check = run("check", "train.py")
    assert check.returncode == 1 and "train.py:3:5: TOP101" in check.stdout, check.stderr
    diff = run("rewrite", "--diff", "train.py")
    assert diff.returncode == 1 and '+x = torch.zeros(3, device="cuda")' in diff.stdout, diff.stderr
    assert run("rules").returncode == 0
    page = run("rule", "TOP101")
    assert page.returncode == 0 and "## Fix safety" in page.stdout
    assert _lsp_diagnostics(torchopt, proj / "train.py") == ["TOP101"]

    _git("init", "-q", cwd=proj)
    _git("add", "train.py", cwd=proj)
    _git("commit", "-qm", "start", cwd=proj)
    migrate = run("migrate", str(proj), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert migrate.returncode == 1, migrate.stderr
    assert 'torch.zeros(3, device="cuda")' in (tmp_path / "out" / "proj.patch").read_text()

    validate = run("validate", "train.py")
    assert validate.returncode == 2
    assert validate.stderr.strip() == (
        f"error: `torchopt validate` runs your program and needs PyTorch: pip install '{DIST}[validate]'"
    )
    assert (proj / "train.py").read_text() == FIXABLE


@pytest.mark.slow
def test_pre_commit_hooks_install_and_run_without_torch(tmp_path):
    """`pre-commit try-repo` on this repository: the hook's own environment is built from the
    package's metadata. A constraint that no PyTorch release meets makes that install fail if anything
    still required torch."""
    pre_commit = shutil.which("pre-commit") or pytest.skip("pre-commit is not installed (it is in the dev extra)")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(FIXABLE)
    cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": FIXABLE}
    notebook = json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1) + "\n"
    (proj / "nb.ipynb").write_text(notebook)
    _git("init", "-q", cwd=proj)
    _git("add", "train.py", "nb.ipynb", cwd=proj)
    (tmp_path / "no-torch.txt").write_text("torch<0\n")
    env = dict(os.environ, PRE_COMMIT_HOME=str(tmp_path / "home"), PIP_CONSTRAINT=str(tmp_path / "no-torch.txt"))

    def hook(hook_id):
        cmd = [pre_commit, "try-repo", ROOT, hook_id, "--all-files", "--color", "never"]
        return subprocess.run(cmd, cwd=proj, capture_output=True, text=True, env=env, timeout=900)

    check = hook("torchopt-check")
    assert check.returncode == 1, check.stdout + check.stderr
    assert "train.py:3:5: TOP101" in check.stdout and "nb.ipynb:cell 1:3:5: TOP101" in check.stdout
    fix = hook("torchopt-rewrite")
    assert fix.returncode == 1, fix.stdout + fix.stderr  # files were modified: the commit stops for review
    assert (proj / "train.py").read_text() == 'import torch\n\nx = torch.zeros(3, device="cuda")\n'
    assert (
        json.loads((proj / "nb.ipynb").read_text())["cells"][0]["source"]
        == 'import torch\n\nx = torch.zeros(3, device="cuda")\n'
    )
