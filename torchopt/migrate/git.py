"""The few git operations batch migration needs, run through the `git` command line.

Nothing here changes a repository's working tree, index or HEAD: the only writes are a temporary
worktree (in a temp folder, removed afterwards) and, with ``--commit``, one commit and one new branch.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from typing import Iterator, Sequence


class GitError(Exception):
    """A git command failed; the message is one line for the report."""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(GIT_TERMINAL_PROMPT="0", LC_ALL="C", LANG="C", GIT_OPTIONAL_LOCKS="0")
    return env


def git(repo: str, *args: str, check: bool = True, input: bytes | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(["git", "-C", repo, *args], capture_output=True, env=_env(),
                              input=input, stdin=None if input is not None else subprocess.DEVNULL)
    except FileNotFoundError:
        raise GitError("git is not installed (no `git` on PATH)") from None
    if check and proc.returncode != 0:
        msg = " ".join(proc.stderr.decode("utf-8", "replace").split()) or f"exit status {proc.returncode}"
        raise GitError(f"`git {' '.join(args[:2])}` failed: {msg}")
    return proc


def out(repo: str, *args: str) -> str:
    return git(repo, *args).stdout.decode("utf-8", "surrogateescape").strip()


def toplevel(path: str) -> str:
    """The top folder of the repository ``path`` is in; GitError when it is in none."""
    if not os.path.isdir(path):
        raise GitError("no such folder" if not os.path.exists(path) else "not a folder")
    proc = git(path, "rev-parse", "--show-toplevel", check=False)
    if proc.returncode != 0:
        msg = " ".join(proc.stderr.decode("utf-8", "replace").split())
        if "not a git repository" in msg:
            raise GitError("not a git repository")
        raise GitError(f"not usable as a git repository: {msg}")
    return proc.stdout.decode("utf-8", "surrogateescape").strip()


def head(repo: str) -> str | None:
    """HEAD's commit, or None in a repository without commits."""
    proc = git(repo, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", check=False)
    return proc.stdout.decode().strip() or None if proc.returncode == 0 else None


def head_branch(repo: str) -> str | None:
    proc = git(repo, "symbolic-ref", "--quiet", "--short", "HEAD", check=False)
    return proc.stdout.decode("utf-8", "surrogateescape").strip() or None if proc.returncode == 0 else None


def dirty_paths(repo: str) -> list[str]:
    """Paths with uncommitted changes, untracked files included (ignored files are not)."""
    raw = git(repo, "status", "--porcelain=v1", "-z", "--untracked-files=normal").stdout
    paths = []
    entries = raw.split(b"\0")
    i = 0
    while i < len(entries):
        e = entries[i]
        i += 1
        if len(e) < 4:
            continue
        if e[:1] in (b"R", b"C") or e[1:2] in (b"R", b"C"):
            i += 1  # a rename carries its old name in the next entry
        paths.append(e[3:].decode("utf-8", "surrogateescape"))
    return paths


def listed_files(tree: str) -> set[str]:
    """Files git knows in ``tree``: tracked plus untracked-but-not-ignored, relative, '/'-separated.
    Files of submodules are not listed (a submodule is its own repository)."""
    raw = git(tree, "ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout
    return {p.decode("utf-8", "surrogateescape") for p in raw.split(b"\0") if p}


def branch_exists(repo: str, name: str) -> bool:
    return git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{name}", check=False).returncode == 0


def valid_branch_name(name: str) -> bool:
    try:
        return subprocess.run(["git", "check-ref-format", "--branch", name], capture_output=True,
                              env=_env(), stdin=subprocess.DEVNULL).returncode == 0
    except FileNotFoundError:
        return False


@contextmanager
def scratch_worktree(repo: str, commit: str) -> Iterator[str]:
    """A temporary detached checkout of ``commit``, removed (with its metadata) on exit. The user's
    working tree, index and HEAD are never involved."""
    parent = tempfile.mkdtemp(prefix="torchopt-migrate-")
    path = os.path.join(parent, os.path.basename(os.path.abspath(repo)) or "repo")
    try:
        git(repo, "worktree", "add", "--quiet", "--detach", path, commit)
        yield path
    finally:
        if os.path.isdir(path):
            git(repo, "worktree", "remove", "--force", "--force", path, check=False)
        shutil.rmtree(parent, ignore_errors=True)
        git(repo, "worktree", "prune", check=False)


def commit_all(tree: str, paths: Sequence[str], message: str) -> str:
    """Commit ``paths`` (relative) in ``tree``; returns the new commit."""
    if paths:
        git(tree, "add", "--", *paths)
    git(tree, "commit", "--quiet", "--no-edit", "-F", "-", input=message.encode("utf-8"))
    return out(tree, "rev-parse", "HEAD")


def create_branch(repo: str, name: str, commit: str) -> None:
    """Create ``name`` at ``commit``; refuses (GitError) when the branch exists."""
    git(repo, "branch", "--no-track", name, commit)
