"""`torchopt migrate` treats each repository as untrusted input and `--out` as the user's folder:
no hook, filter driver, fsmonitor, signing program or inherited git environment of a repository
runs, nothing in `--out` that torchopt did not write is replaced or removed, and a run killed with
SIGKILL is cleaned up and reported by `--resume`. Each test builds real git repositories in tmp_path
and checks, besides the marker files that a planted program would create, that every file outside
`--out` is byte-identical afterwards (only the new commit's objects and branch are added)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from torchopt.cli import app

BEFORE = 'import torch\ndevice = "cpu"\nx = torch.zeros(3).to(device)\n'
AFTER = 'import torch\ndevice = "cpu"\nx = torch.zeros(3, device=device)\n'
BRANCH = "torchopt/migrate"
IDENTITY = {
    "GIT_AUTHOR_NAME": "T",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "T",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}


@pytest.fixture(autouse=True)
def git_env(monkeypatch, tmp_path):
    """A git identity, no user or system config, and a temp folder inside tmp_path (so that what
    torchopt leaves in it is seen)."""
    for k, v in {**IDENTITY, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}.items():
        monkeypatch.setenv(k, v)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.chdir(tmp_path)


def sh(cwd, *args, check=True, env=None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    clean.update(IDENTITY, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1", **(env or {}))
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=check, env=clean)


def make_repo(root: Path, name: str, files: dict[str, str]) -> Path:
    repo = root / name
    repo.mkdir()
    sh(repo, "init", "-q", "-b", "main")
    for rel, content in files.items():
        p = repo / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
        if rel.endswith(".sh") or "hooks/" in rel:
            p.chmod(0o755)
    sh(repo, "add", "-A")
    sh(repo, "commit", "-q", "-m", "init")
    return repo


def tree_state(root: Path) -> dict[str, bytes]:
    """Every file and link under ``root`` (links by target), with its mode."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                state[rel] = b"link:" + os.readlink(p).encode()
            else:
                with open(p, "rb") as fh:
                    state[rel] = oct(os.stat(p).st_mode).encode() + b":" + fh.read()
    return state


def without_new_commit(state: dict[str, bytes], repo_rel: str) -> dict[str, bytes]:
    """``state`` less what creating the branch adds to a repository: objects, and the branch's ref and log."""
    git_dir = os.path.normpath(os.path.join(repo_rel, ".git"))
    added = [
        os.path.join(git_dir, "objects"),
        os.path.join(git_dir, "refs", "heads", "torchopt"),
        os.path.join(git_dir, "logs", "refs", "heads", "torchopt"),
    ]
    return {k: v for k, v in state.items() if not any(k == a or k.startswith(a + os.sep) for a in added)}


def cli(*args):
    return CliRunner().invoke(app, ["migrate", *map(str, args)], catch_exceptions=False)


def marker_hook(marker: Path) -> str:
    return f"#!/bin/sh\ntouch '{marker}'\ncat >/dev/null 2>&1 || true\nexit 0\n"


HOOKS = (
    "pre-commit",
    "prepare-commit-msg",
    "commit-msg",
    "post-commit",
    "post-checkout",
    "reference-transaction",
    "post-index-change",
    "pre-auto-gc",
    "post-rewrite",
)


def plant_hooks(repo: Path, marker: Path) -> None:
    for name in HOOKS:
        hook = repo / ".git" / "hooks" / name
        hook.write_text(marker_hook(marker))
        hook.chmod(0o755)


def plant_versioned_hooks(repo: Path, marker: Path) -> None:
    """Hooks committed in the repository, switched on through core.hooksPath."""
    for name in HOOKS:
        hook = repo / ".githooks" / name
        hook.parent.mkdir(exist_ok=True)
        hook.write_text(marker_hook(marker))
        hook.chmod(0o755)
    sh(repo, "add", ".githooks")
    sh(repo, "-c", "core.hooksPath=/dev/null", "commit", "-q", "-m", "hooks")
    sh(repo, "config", "core.hooksPath", ".githooks")


def plant_filters(repo: Path, marker: Path) -> None:
    """A filter driver on every .py file; the timestamps change so that `git status` would re-clean them."""
    (repo / ".gitattributes").write_text("*.py filter=evil diff=evil\n")
    sh(repo, "add", ".gitattributes")
    sh(repo, "commit", "-q", "-m", "attributes")
    sh(repo, "config", "filter.evil.clean", f"touch '{marker}'; cat")
    sh(repo, "config", "filter.evil.smudge", f"touch '{marker}'; cat")
    sh(repo, "config", "filter.evil.required", "true")
    for p in repo.glob("*.py"):
        os.utime(p, (1_000_000_000, 1_000_000_000))


def plant_process_filter(repo: Path, marker: Path) -> None:
    (repo / ".gitattributes").write_text("*.py filter=lfsish\n")
    sh(repo, "add", ".gitattributes")
    sh(repo, "commit", "-q", "-m", "attributes")
    sh(repo, "config", "filter.lfsish.process", f"sh -c \"touch '{marker}'\"")
    for p in repo.glob("*.py"):
        os.utime(p, (1_000_000_000, 1_000_000_000))


def plant_fsmonitor(repo: Path, marker: Path) -> None:
    script = repo.parent / "fsmonitor.sh"
    script.write_text(marker_hook(marker))
    script.chmod(0o755)
    sh(repo, "config", "core.fsmonitor", str(script))


def plant_included_config(repo: Path, marker: Path) -> None:
    """The repository's config includes another file that switches hooks and fsmonitor on."""
    hooks = repo.parent / "elsewhere-hooks"
    hooks.mkdir()
    for name in HOOKS:
        (hooks / name).write_text(marker_hook(marker))
        (hooks / name).chmod(0o755)
    script = repo.parent / "fsmon.sh"
    script.write_text(marker_hook(marker))
    script.chmod(0o755)
    included = repo.parent / "evil.config"
    included.write_text(f"[core]\n\thooksPath = {hooks}\n\tfsmonitor = {script}\n")
    sh(repo, "config", "include.path", str(included))


def plant_signing(repo: Path, marker: Path) -> None:
    program = repo.parent / "gpg.sh"
    program.write_text(marker_hook(marker))
    program.chmod(0o755)
    sh(repo, "config", "commit.gpgSign", "true")
    sh(repo, "config", "gpg.program", str(program))


def plant_everything_else(repo: Path, marker: Path) -> None:
    """Programs git could run for diffs, pagers and transports: none of them may run either."""
    program = repo.parent / "any.sh"
    program.write_text(marker_hook(marker))
    program.chmod(0o755)
    for key in (
        "diff.external",
        "diff.evil.textconv",
        "diff.evil.command",
        "core.pager",
        "core.sshCommand",
        "core.gitProxy",
        "core.editor",
        "sequence.editor",
        "core.askPass",
        "credential.helper",
        "core.alternateRefsCommand",
        "uploadpack.packObjectsHook",
    ):
        sh(repo, "config", key, str(program))
    (repo / ".git" / "info" / "attributes").write_text("*.py diff=evil\n")
    plant_filters(repo, marker)
    plant_hooks(repo, marker)
    plant_fsmonitor(repo, marker)
    plant_signing(repo, marker)


VECTORS = {
    "hooks": plant_hooks,
    "versioned_hooks": plant_versioned_hooks,
    "filters": plant_filters,
    "process_filter": plant_process_filter,
    "fsmonitor": plant_fsmonitor,
    "included_config": plant_included_config,
    "signing": plant_signing,
    "all": plant_everything_else,
}


def check_patch_mode(tmp_path: Path, repo: Path, marker: Path) -> None:
    before = tree_state(tmp_path)
    out = tmp_path / "out"
    res = cli(repo, "--out", out, "--select", "TOP101", "-j", "1")
    assert res.exit_code == 1, res.output
    assert not marker.exists(), "a program planted in the repository ran"
    assert tree_state(tmp_path) == {
        **before,
        **{k: v for k, v in tree_state(tmp_path).items() if k.startswith("out" + os.sep)},
    }
    patch = (out / "repo.patch").read_text()
    assert "-x = torch.zeros(3).to(device)\n+x = torch.zeros(3, device=device)\n" in patch
    assert (
        sh(
            repo,
            "-c",
            "core.hooksPath=/dev/null",
            "-c",
            "filter.evil.clean=cat",
            "-c",
            "filter.evil.smudge=cat",
            "-c",
            "filter.lfsish.process=",
            "-c",
            "core.fsmonitor=false",
            "apply",
            "--check",
            str(out / "repo.patch"),
            check=False,
        ).returncode
        == 0
    )
    assert os.listdir(tmp_path / "tmp") == []


def check_commit_mode(tmp_path: Path, repo: Path, marker: Path) -> None:
    head = sh(repo, "rev-parse", "HEAD").stdout
    refs = sh(repo, "for-each-ref").stdout
    before = tree_state(tmp_path)
    out = tmp_path / "out"
    res = cli(repo, "--out", out, "--select", "TOP101", "--commit", "-j", "1")
    assert res.exit_code == 0, res.output
    assert not marker.exists(), "a program planted in the repository ran"
    after = tree_state(tmp_path)
    rel = os.path.relpath(repo, tmp_path)
    assert without_new_commit(
        {k: v for k, v in after.items() if not k.startswith("out" + os.sep)}, rel
    ) == without_new_commit(before, rel)
    assert sh(repo, "rev-parse", "HEAD").stdout == head
    assert sh(repo, "symbolic-ref", "HEAD").stdout == b"refs/heads/main\n"
    new_refs = sh(repo, "for-each-ref").stdout.splitlines()
    assert [r for r in new_refs if not r.endswith(b"refs/heads/" + BRANCH.encode())] == refs.splitlines()
    assert sh(repo, "rev-parse", f"{BRANCH}~1").stdout == head
    assert sh(repo, "cat-file", "blob", f"{BRANCH}:train.py").stdout == AFTER.encode()
    changed = sh(repo, "diff-tree", "--no-ext-diff", "--no-textconv", "-r", "--name-only", "HEAD", BRANCH).stdout
    assert changed == b"train.py\n"
    assert sh(repo, "worktree", "list", "--porcelain").stdout.count(b"worktree ") == 1
    assert os.listdir(tmp_path / "tmp") == []


# Patch mode makes no commit: only what `git status` and `git ls-files` could run is planted for it.
CASES = [(v, "commit") for v in sorted(VECTORS)] + [
    (v, "patch") for v in ("all", "filters", "fsmonitor", "included_config", "process_filter")
]


@pytest.mark.parametrize("vector,mode", CASES)
def test_no_program_of_the_repository_runs(tmp_path, vector, mode):
    repo = make_repo(tmp_path, "repo", {"train.py": BEFORE, "lib/util.py": "X = 1\n"})
    marker = tmp_path / "MARKER"
    VECTORS[vector](repo, marker)
    assert not marker.exists()
    (check_commit_mode if mode == "commit" else check_patch_mode)(tmp_path, repo, marker)


def test_commit_keeps_modes_links_and_stored_bytes(tmp_path):
    """The commit is made from the stored blobs: an executable stays executable, a link stays a link,
    and files torchopt did not change keep their exact object."""
    repo = make_repo(
        tmp_path, "repo", {"train.py": BEFORE, "run.sh": "#!/bin/sh\n", "crlf.py": BEFORE.replace("\n", "\r\n")}
    )
    (repo / "train.py").chmod(0o755)
    os.symlink("train.py", repo / "link.py")
    sh(repo, "add", "-A")
    sh(repo, "commit", "-q", "-m", "more")
    plant_hooks(repo, tmp_path / "MARKER")
    res = cli(repo, "--out", tmp_path / "out", "--select", "TOP101", "--commit", "-j", "1")
    assert res.exit_code == 0, res.output
    listing = sh(repo, "ls-tree", "-r", BRANCH).stdout.decode()
    modes = {line.split("\t")[1]: line.split()[0] for line in listing.splitlines()}
    assert modes == {"crlf.py": "100644", "link.py": "120000", "run.sh": "100755", "train.py": "100755"}
    assert sh(repo, "cat-file", "blob", f"{BRANCH}:crlf.py").stdout == AFTER.replace("\n", "\r\n").encode()
    assert sh(repo, "rev-parse", f"{BRANCH}:run.sh").stdout == sh(repo, "rev-parse", "HEAD:run.sh").stdout
    assert not (tmp_path / "MARKER").exists()


def test_git_environment_of_the_caller_is_not_inherited(tmp_path, monkeypatch):
    """Run from inside a git hook of another repository (GIT_DIR, GIT_WORK_TREE and GIT_INDEX_FILE set),
    torchopt still migrates the repository it was given and leaves the caller's alone."""
    caller = make_repo(tmp_path, "caller", {"other.py": BEFORE})
    repo = make_repo(tmp_path, "repo", {"train.py": BEFORE})
    before = tree_state(tmp_path)
    monkeypatch.setenv("GIT_DIR", str(caller / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(caller))
    monkeypatch.setenv("GIT_INDEX_FILE", str(caller / ".git" / "index"))
    res = cli(repo, "--out", tmp_path / "out", "--select", "TOP101", "--commit", "-j", "1")
    monkeypatch.delenv("GIT_DIR")
    monkeypatch.delenv("GIT_WORK_TREE")
    monkeypatch.delenv("GIT_INDEX_FILE")
    assert res.exit_code == 0, res.output
    assert sh(repo, "cat-file", "blob", f"{BRANCH}:train.py").stdout == AFTER.encode()
    assert sh(caller, "branch", "--list", BRANCH).stdout == b""
    after = {k: v for k, v in tree_state(tmp_path).items() if not k.startswith("out" + os.sep)}
    assert without_new_commit(after, "repo") == without_new_commit(before, "repo")


# --------------------------------------------------------------------------- --out is the user's folder


def test_out_that_is_a_file_is_a_clear_error(tmp_path):
    repo = make_repo(tmp_path, "repo", {"train.py": BEFORE})
    (tmp_path / "out.txt").write_text("my notes\n")
    before = tree_state(tmp_path)
    res = cli(repo, "--out", tmp_path / "out.txt", "--select", "TOP101")
    assert res.exit_code == 2
    assert res.stderr.strip() == f"error: {tmp_path / 'out.txt'}: --out must be a folder, and this is not one"
    assert tree_state(tmp_path) == before


def test_files_in_out_that_torchopt_did_not_write_are_never_removed_or_replaced(tmp_path):
    clean = make_repo(tmp_path, "clean", {"ok.py": "import torch\nx = torch.zeros(3, device='cpu')\n"})
    busy = make_repo(tmp_path, "busy", {"train.py": BEFORE})
    other = make_repo(tmp_path, "other", {"train.py": BEFORE})
    out = tmp_path / "out"
    out.mkdir()
    (out / "clean.patch").write_text("the user's own patch\n")  # a repository with nothing to change
    (out / "busy.patch").write_text("another patch of the user's\n")  # a repository with changes
    before = tree_state(tmp_path)
    res = cli(clean, busy, other, "--out", out, "--select", "TOP101", "-j", "1")
    assert res.exit_code == 2, res.output
    after = tree_state(tmp_path)
    assert after["out/clean.patch"] == before["out/clean.patch"]
    assert after["out/busy.patch"] == before["out/busy.patch"]
    assert f"failed: {busy}: {out / 'busy.patch'}: exists and was not written by torchopt migrate" in res.stderr
    doc = {r["name"]: r for r in json.loads((out / "report.json").read_text())["repos"]}
    assert doc["busy"]["status"] == "failed" and doc["other"]["status"] == "changed"
    assert doc["clean"]["status"] == "unchanged"
    assert "+x = torch.zeros(3, device=device)" in (out / "other.patch").read_text()
    assert {k: v for k, v in after.items() if not k.startswith("out" + os.sep)} == {
        k: v for k, v in before.items() if not k.startswith("out" + os.sep)
    }

    # A patch torchopt wrote itself is replaced, and removed once its repository has nothing to change.
    (other / "train.py").write_text(AFTER)
    sh(other, "commit", "-qam", "applied")
    res = cli(other, "--out", out, "--select", "TOP101", "-j", "1")
    assert res.exit_code == 0, res.output
    assert not (out / "other.patch").exists()
    assert (out / "clean.patch").read_bytes() == before["out/clean.patch"].split(b":", 1)[1]


@pytest.mark.parametrize(
    "name,content",
    [("report.md", "# my report\n"), ("report.json", '{"mine": true}\n'), ("migrate-state.json", "not json\n")],
)
def test_a_report_file_of_the_users_is_not_overwritten(tmp_path, name, content):
    repo = make_repo(tmp_path, "repo", {"train.py": BEFORE})
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text(content)
    before = tree_state(tmp_path)
    res = cli(repo, "--out", out, "--select", "TOP101", "--resume")
    assert res.exit_code == 2
    assert res.stderr.strip() == (
        f"error: {out / name}: exists and was not written by torchopt migrate; it is "
        "left alone (move it, or choose another --out)"
    )
    assert tree_state(tmp_path) == before


# --------------------------------------------------------------------------- kill -9, then --resume

KILLED_RUN = """
import sys, time
from pathlib import Path
import torchopt.migrate.task as task

started = Path(sys.argv[1])


def stop_here(*args, **kw):  # the run is killed while it rewrites the second repository
    if "second" in str(args[0][0][0]):
        started.touch()
        time.sleep(120)
    return slow(*args, **kw)


slow = task._fix_all
task._fix_all = stop_here
from torchopt.cli import app
app(sys.argv[2:])
"""


def test_resume_after_kill_cleans_up_and_reports_unfinished_repositories(tmp_path):
    first = make_repo(tmp_path, "first", {"train.py": BEFORE})
    second = make_repo(tmp_path, "second", {"train.py": BEFORE})
    third = make_repo(tmp_path, "third", {"train.py": BEFORE})
    # A worktree an older torchopt registered before it was killed: a scratch folder of a dead run.
    legacy = tmp_path / "tmp" / "torchopt-migrate-k9old123" / "third"
    sh(third, "worktree", "add", "--quiet", "--detach", str(legacy), "HEAD")
    out = tmp_path / "out"
    started = tmp_path / "started"
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    args = [str(first), str(second), str(third), "--out", str(out), "--select", "TOP101", "--commit", "-j", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, str(started), "migrate", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for _ in range(1200):  # wait until it is inside the second repository (at most a minute)
            if started.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert started.exists(), "the run to kill did not start"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    leftovers = [n for n in os.listdir(tmp_path / "tmp") if n != "torchopt-migrate-k9old123"]
    assert leftovers and all(n.startswith(f"torchopt-migrate-{proc.pid}-") for n in leftovers)
    assert sh(first, "branch", "--list", BRANCH).stdout.strip() != b""
    repos_before = {n: tree_state(tmp_path / n) for n in ("first", "second")}

    res = cli(*args, "--resume")
    assert res.exit_code == 0, res.output
    assert f"--resume: the earlier run stopped before finishing 2 repositories: {second}, {third}" in res.stderr
    assert f"{third}: removed what an interrupted run had left: {legacy}" in res.stderr
    assert "1 done by an earlier run, skipped" in res.stderr
    assert os.listdir(tmp_path / "tmp") == []
    assert sh(third, "worktree", "list", "--porcelain").stdout.count(b"worktree ") == 1
    for repo in (first, second, third):
        assert sh(repo, "cat-file", "blob", f"{BRANCH}:train.py").stdout == AFTER.encode()
        assert sh(repo, "status", "--porcelain").stdout == b""
    assert without_new_commit(tree_state(second), ".") == without_new_commit(repos_before["second"], ".")
    doc = json.loads((out / "report.json").read_text())
    assert doc["interrupted_earlier"] == [str(second), str(third)]


def test_a_partial_clone_does_not_fetch_through_its_ssh_command(tmp_path):
    """HEAD's blobs are missing from a blobless clone: reading them must not fetch them through the
    repository's own `core.sshCommand`; the repository fails with a reason instead."""
    source = make_repo(tmp_path, "source", {"train.py": BEFORE})
    sh(source, "config", "uploadpack.allowFilter", "true")
    sh(tmp_path, "clone", "-q", "--no-checkout", "--filter=blob:none", f"file://{source}", "repo")
    repo = tmp_path / "repo"
    marker = tmp_path / "MARKER"
    program = tmp_path / "ssh.sh"
    program.write_text(f"#!/bin/sh\ntouch '{marker}'\nexit 1\n")
    program.chmod(0o755)
    sh(repo, "remote", "set-url", "origin", "ssh://example.invalid/source.git")
    sh(repo, "config", "core.sshCommand", str(program))
    before = tree_state(tmp_path)
    res = cli(repo, "--out", tmp_path / "out", "--select", "TOP101", "--commit", "--allow-dirty", "-j", "1")
    assert res.exit_code == 2, res.output
    assert not marker.exists(), "the repository's ssh command ran"
    assert f"failed: {repo}: cannot read object" in res.stderr
    assert {k: v for k, v in tree_state(tmp_path).items() if not k.startswith("out" + os.sep)} == before


# Symbolic links and aliases ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["patch", "commit"])
def test_a_tracked_link_leaves_the_link_and_migrates_its_target(tmp_path, mode):
    """`alias.py -> lib.py` is met first by the walk: before, lib.py was neither migrated nor reported."""
    repo = make_repo(tmp_path, "repo", {"lib.py": BEFORE})
    os.symlink("lib.py", repo / "alias.py")
    sh(repo, "add", "-A")
    sh(repo, "commit", "-q", "-m", "link")
    before = tree_state(repo)
    out = tmp_path / "out"
    res = cli(repo, "--out", out, "--select", "TOP101", "-j", "1", *(["--commit"] if mode == "commit" else []))
    assert res.exit_code == (0 if mode == "commit" else 1), res.output
    (got,) = json.loads((out / "report.json").read_text())["repos"]
    assert got["files_changed"] == ["lib.py"] and got["fixes"] == {"TOP101": 1}
    assert got["skipped"] == [["alias.py", "symbolic link to lib.py; migrated there, the link kept"]]
    if mode == "commit":
        listing = sh(repo, "ls-tree", "-r", BRANCH).stdout.decode()
        assert {line.split("\t")[1]: line.split()[0] for line in listing.splitlines()} == {
            "alias.py": "120000",
            "lib.py": "100644",
        }
        assert sh(repo, "cat-file", "blob", f"{BRANCH}:lib.py").stdout == AFTER.encode()
        assert sh(repo, "cat-file", "blob", f"{BRANCH}:alias.py").stdout == b"lib.py"
        assert without_new_commit(tree_state(repo), ".") == without_new_commit(before, ".")
    else:
        patch = (out / "repo.patch").read_text()
        assert "+++ b/lib.py" in patch and "alias.py" not in patch
        assert tree_state(repo) == before


def test_a_link_to_a_repository_is_the_same_repository(tmp_path):
    """Before, the alias was a second repository: two conflicting patches, or a failed second commit
    whose fixes were still counted ("fixes committed: TOP101 ×2" where 1 was)."""
    repo = make_repo(tmp_path, "repo", {"train.py": BEFORE})
    os.symlink(repo, tmp_path / "alias")
    out = tmp_path / "out"
    res = CliRunner().invoke(
        app,
        ["migrate", str(repo), str(tmp_path / "alias"), "--out", str(out), "--select", "TOP101", "-j", "1", "--commit"],
    )
    assert res.exit_code == 0, res.output
    assert [r["name"] for r in json.loads((out / "report.json").read_text())["repos"]] == ["repo"]
    assert "1 repository: 1 changed" in res.stderr
    assert "1 file changed, fixes committed: TOP101 ×1." in res.stderr


def test_fixes_of_a_repository_that_failed_are_not_counted(tmp_path):
    """A repository whose patch cannot be written (a file of the user's holds its name) applied nothing."""
    repo = make_repo(tmp_path, "repo", {"train.py": BEFORE})
    out = tmp_path / "out"
    out.mkdir()
    (out / "repo.patch").write_text("mine\n")
    res = CliRunner().invoke(app, ["migrate", str(repo), "--out", str(out), "--select", "TOP101", "-j", "1"])
    assert res.exit_code == 2, res.output
    (got,) = json.loads((out / "report.json").read_text())["repos"]
    assert got["status"] == "failed" and got["fixes"] == {} and got["files_changed"] == []
    assert "fixes in patches" not in res.stderr
    assert (out / "repo.patch").read_text() == "mine\n"
