"""The GitHub Action (action.yml): its steps run in bash the way the runner runs a composite action's
steps, on a project with one finding."""

import os
import re
import shutil
import subprocess

import pytest
import yaml  # PyYAML comes with LibCST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXABLE = "import torch\n\nx = torch.zeros(3).cuda()\n"
ANNOTATION = (
    "::warning title=torchopt (TOP101),file=train.py,line=3,col=5,endLine=3,endColumn=26::"
    "TOP101 `torch.zeros(...)` is created on the host, then moved to `'cuda'`"
)

ANNOTATION_TOP811 = (
    "::warning title=torchopt (TOP811),file=debug.py,line=3,col=1,endLine=3,endColumn=40::TOP811 "
    "`torch.autograd.set_detect_anomaly(True)` leaves anomaly detection on: every op records a traceback, "
    "every backward checks for NaN"
)


def load_action(folder=ROOT):
    with open(os.path.join(folder, "action.yml"), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def run_steps(action, action_path, workspace, runner_temp, given=None, steps=None):
    """Run the composite steps like the runner: `${{ ... }}` expressions filled in, each `run:` in
    `bash --noprofile --norc -eo pipefail`, in the workspace; stop at the first that fails.
    Returns the completed processes."""
    assert action["runs"]["using"] == "composite"
    inputs = {name: str(spec.get("default", "")) for name, spec in action["inputs"].items()}
    inputs.update(given or {})
    context = {f"inputs.{k}": v for k, v in inputs.items()}
    context.update({"github.action_path": str(action_path), "github.workspace": str(workspace)})

    def fill(text):
        def value(m):
            assert m.group(1) in context, f"unknown expression {m.group(0)}"
            return context[m.group(1)]

        return re.sub(r"\$\{\{\s*([\w.]+)\s*\}\}", value, str(text))

    done = []
    for step in action["runs"]["steps"][slice(*steps) if steps else slice(None)]:
        assert step["shell"] == "bash"
        env = dict(os.environ, RUNNER_TEMP=str(runner_temp), GITHUB_ACTION_PATH=str(action_path))
        env.update({k: fill(v) for k, v in step.get("env", {}).items()})
        script = runner_temp / "step.sh"
        script.write_text(fill(step["run"]))
        cmd = ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)]
        done.append(subprocess.run(cmd, cwd=workspace, env=env, capture_output=True, text=True, timeout=900))
        if done[-1].returncode != 0:
            break
    return done


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(FIXABLE)
    (ws / "debug.py").write_text("import torch\n\ntorch.autograd.set_detect_anomaly(True)\n")  # TOP811
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    return ws, temp


def test_check_step_annotates_and_fails(workspace):
    """The check step alone, with the install step's venv standing in for this environment's."""
    ws, temp = workspace
    (temp / "torchopt-venv" / "bin").mkdir(parents=True)
    os.symlink(shutil.which("torchopt") or pytest.fail("torchopt is not on PATH"), temp / "torchopt-venv/bin/torchopt")
    action = load_action()
    check = len(action["runs"]["steps"]) - 1
    given = {"paths": "train.py debug.py", "args": "--select TOP1"}  # TOP811 in debug.py is not selected
    (done,) = run_steps(action, ROOT, ws, temp, given, steps=(check, None))
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == [ANNOTATION]


@pytest.mark.slow
def test_action_installs_without_torch_and_annotates(workspace, tmp_path):
    """Every step, from the action's own copy (no `version`): a fresh venv without PyTorch, then the
    annotations and the failing exit code."""
    ws, temp = workspace
    action_path = tmp_path / "action"
    action_path.mkdir()
    for name in ("action.yml", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), action_path / name)
    shutil.copytree(
        os.path.join(ROOT, "torchopt"), action_path / "torchopt", ignore=shutil.ignore_patterns("__pycache__")
    )
    install, check = run_steps(load_action(action_path), action_path, ws, temp)
    assert install.returncode == 0, install.stderr
    assert install.stdout.startswith("torchopt ")
    venv_python = temp / "torchopt-venv" / "bin" / "python"
    assert subprocess.run([str(venv_python), "-c", "import torch"], capture_output=True).returncode != 0
    assert check.returncode == 1, check.stderr
    assert sorted(check.stdout.splitlines()) == [ANNOTATION, ANNOTATION_TOP811]
