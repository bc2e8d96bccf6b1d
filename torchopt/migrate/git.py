"""The few git operations batch migration needs, run through the `git` command line.

A repository to migrate is untrusted input: its config, attributes and hooks could name programs for
git to run. So git runs here with a controlled environment (nothing inherited from a calling git, no
system config) and config overrides that switch off every hook, fsmonitor, filter driver, signing
program, pager and transport, and only commands that never check files out or diff them are used:
HEAD's files are read as stored blobs into a plain temporary folder (not a git worktree), and a
commit is made from blobs, a temporary index and `commit-tree`, then its branch created with
`update-ref`. Nothing here changes a repository's working tree, index or HEAD.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

SCRATCH_PREFIX = "torchopt-migrate-"
SYMLINK, SUBMODULE = "120000", "160000"

# Kept from the caller's environment: the identity of commits, and which global config is the user's.
_KEPT_GIT_VARS = frozenset(
    {
        "GIT_AUTHOR_NAME",
        "GIT_AUTHOR_EMAIL",
        "GIT_AUTHOR_DATE",
        "GIT_COMMITTER_NAME",
        "GIT_COMMITTER_EMAIL",
        "GIT_COMMITTER_DATE",
        "GIT_CONFIG_GLOBAL",
    }
)

# Command-line config wins over every config file, the repository's (and what it includes) too.
_SAFE_CONFIG = (
    ("core.hooksPath", os.devnull),  # no hook can exist under it
    ("core.fsmonitor", "false"),
    ("core.splitIndex", "false"),  # a temporary index must not leave shared index files in .git
    ("core.pager", "cat"),
    ("protocol.allow", "never"),  # no transport, so no lazy fetch of a partial clone through ssh or ext::
    ("commit.gpgSign", "false"),
)


class GitError(Exception):
    """A git command failed; the message is one line for the report."""


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k in _KEPT_GIT_VARS}
    env.update(
        GIT_CONFIG_NOSYSTEM="1", GIT_TERMINAL_PROMPT="0", GIT_PAGER="cat", GIT_OPTIONAL_LOCKS="0", LC_ALL="C", LANG="C"
    )
    env.pop("PAGER", None)
    if extra:
        env.update(extra)
    return env


def _command(repo: str, args: Sequence[str], config: Sequence[tuple[str, str]] = ()) -> list[str]:
    cmd = ["git", "--no-pager"]
    for key, value in (*_SAFE_CONFIG, *config):
        cmd += ["-c", f"{key}={value}"]
    return [*cmd, "-C", repo, *args]


def _one_line(proc: subprocess.CompletedProcess) -> str:
    return " ".join(proc.stderr.decode("utf-8", "replace").split()) or f"exit status {proc.returncode}"


def git(
    repo: str,
    *args: str,
    check: bool = True,
    input: bytes | None = None,
    env: dict[str, str] | None = None,
    config: Sequence[tuple[str, str]] = (),
) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            _command(repo, args, config),
            capture_output=True,
            env=_env(env),
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise GitError("git is not installed (no `git` on PATH)") from None
    if check and proc.returncode != 0:
        raise GitError(f"`git {' '.join(args[:2])}` failed: {_one_line(proc)}")
    return proc


def out(repo: str, *args: str, **kw) -> str:
    return git(repo, *args, **kw).stdout.decode("utf-8", "surrogateescape").strip()


def toplevel(path: str) -> str:
    """The top folder of the repository ``path`` is in; GitError when it is in none."""
    if not os.path.isdir(path):
        raise GitError("no such folder" if not os.path.exists(path) else "not a folder")
    proc = git(path, "rev-parse", "--show-toplevel", check=False)
    if proc.returncode != 0:
        msg = _one_line(proc)
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


def _filters_off(repo: str) -> list[tuple[str, str]]:
    """Overrides that empty every filter driver the repository's config defines or changes (its own
    config and what it includes; drivers of the user's global config, such as git-lfs, are kept):
    `git status` would otherwise run a driver's clean command on any file whose timestamps changed."""
    pattern = r"^filter\..*\.(clean|smudge|process|required)$"
    proc = git(repo, "config", "-z", "--show-scope", "--get-regexp", pattern, check=False)
    if proc.returncode not in (0, 1):  # a git without --show-scope: switch off every driver
        proc = git(repo, "config", "-z", "--get-regexp", pattern, check=False)
        records = [("", r) for r in proc.stdout.split(b"\0")]
    else:
        fields = proc.stdout.split(b"\0")
        records = list(zip((f.decode() for f in fields[0::2]), fields[1::2]))
    names = set()
    for scope, record in records:
        key = record.split(b"\n", 1)[0].decode("utf-8", "surrogateescape")
        if scope != "global" and key.startswith("filter.") and key.count(".") >= 2:
            names.add(key[len("filter.") : key.rindex(".")])
    overrides = []
    for name in sorted(names):
        if "=" in name or "\n" in name:  # `-c` cannot name it, so it could not be switched off
            raise GitError(f"its config defines a filter driver named {name!r}, which torchopt cannot switch off")
        overrides += [(f"filter.{name}.{var}", "") for var in ("clean", "smudge", "process")]
        overrides.append((f"filter.{name}.required", "false"))
    return overrides


def dirty_paths(repo: str) -> list[str]:
    """Paths with uncommitted changes, untracked files included (ignored files and submodules are not:
    a migration never touches a submodule)."""
    raw = git(
        repo,
        "status",
        "--porcelain=v1",
        "-z",
        "--untracked-files=normal",
        "--ignore-submodules=all",
        config=_filters_off(repo),
    ).stdout
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
        return (
            subprocess.run(
                ["git", "check-ref-format", "--branch", name], capture_output=True, env=_env(), stdin=subprocess.DEVNULL
            ).returncode
            == 0
        )
    except FileNotFoundError:
        return False


# --------------------------------------------------------------------------- HEAD's files, as stored


def _safe_rel(rel: str) -> bool:
    """What git itself would check out: no absolute path, no `.`/`..` step, nothing inside `.git`."""
    return all(part not in ("", ".", "..") and part.lower() != ".git" for part in rel.split("/"))


def tree_entries(repo: str, commit: str) -> list[tuple[str, str, str]]:
    """(mode, object, path) of every entry of ``commit``'s tree, recursively."""
    raw = git(repo, "ls-tree", "-r", "-z", "--full-tree", commit).stdout
    entries = []
    for record in raw.split(b"\0"):
        if not record:
            continue
        meta, path = record.split(b"\t", 1)
        mode, _kind, sha = meta.decode().split()
        rel = path.decode("utf-8", "surrogateescape")
        if not _safe_rel(rel):
            raise GitError(f"HEAD holds the unsafe path {rel!r} (git refuses to check it out)")
        entries.append((mode, sha, rel))
    return entries


def read_blobs(repo: str, shas: Sequence[str]) -> Iterator[bytes]:
    """The stored bytes of each blob, in order (no filter or end-of-line conversion: `cat-file`)."""
    if not shas:
        return
    proc = subprocess.Popen(
        _command(repo, ["cat-file", "--batch"]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_env(),
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin = proc.stdin

    def feed() -> None:
        try:
            for sha in shas:
                stdin.write(sha.encode() + b"\n")
            stdin.close()
        except OSError:
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        for sha in shas:
            header = proc.stdout.readline().split()
            if len(header) != 3 or header[1] != b"blob":
                raise GitError(f"cannot read object {sha} (`git cat-file` answered {b' '.join(header)!r})")
            size = int(header[2])
            data = proc.stdout.read(size)
            proc.stdout.read(1)
            yield data
    finally:
        proc.stdout.close()
        proc.kill()
        proc.wait()
        writer.join()


def _materialize(repo: str, commit: str, folder: str) -> dict[str, str]:
    """Write ``commit``'s files into the empty ``folder``; returns path -> mode of its files and links.
    Symbolic links are made last, so no file is ever written through one."""
    entries = tree_entries(repo, commit)
    files = [(mode, sha, rel) for mode, sha, rel in entries if mode not in (SYMLINK, SUBMODULE)]
    links = [(mode, sha, rel) for mode, sha, rel in entries if mode == SYMLINK]
    for mode, _sha, rel in entries:
        if mode == SUBMODULE:
            os.makedirs(os.path.join(folder, rel), exist_ok=True)  # as an uninitialised submodule
    for (mode, _sha, rel), data in zip(files, read_blobs(repo, [sha for _m, sha, _r in files])):
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(
            path,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
            0o755 if mode == "100755" else 0o644,
        )
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    for (_mode, _sha, rel), target in zip(links, read_blobs(repo, [sha for _m, sha, _r in links])):
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(os.fsdecode(target), path)
    return {rel: mode for mode, _sha, rel in files + links}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM  # someone else's process: alive
    return True


def _scratch_owner_alive(folder_name: str) -> bool:
    """Scratch folders are named ``torchopt-migrate-<pid>-<random>``; older ones have no pid."""
    pid = folder_name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
    return pid.isdigit() and _pid_alive(int(pid))


def _is_stale_scratch(path: str) -> bool:
    parent = os.path.dirname(os.path.realpath(path))
    name = os.path.basename(parent)
    return (
        os.path.dirname(parent) == os.path.realpath(tempfile.gettempdir())
        and name.startswith(SCRATCH_PREFIX)
        and not _scratch_owner_alive(name)
    )


def remove_stale_scratch(repo: str) -> list[str]:
    """Remove what a killed run left: its scratch folders in the temp folder (their process is gone),
    and any git worktree of ``repo`` that an earlier torchopt registered in one. Returns the
    worktrees removed. Nothing of anyone else is touched: only folders named as ours, of dead runs."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        names = []
    for name in names:
        path = os.path.join(tmp, name)
        if name.startswith(SCRATCH_PREFIX) and not _scratch_owner_alive(name) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
    removed = []
    listing = git(repo, "worktree", "list", "--porcelain", "-z", check=False).stdout
    paths = [
        r[len(b"worktree ") :].decode("utf-8", "surrogateescape")
        for r in listing.split(b"\0")
        if r.startswith(b"worktree ")
    ]
    common = None
    for path in paths[1:]:  # the first is the main working tree
        if not _is_stale_scratch(path):
            continue
        if os.path.isdir(path):
            git(repo, "worktree", "remove", "--force", "--force", path, check=False)
        if os.path.isdir(path):
            continue
        common = common or os.path.join(repo, out(repo, "rev-parse", "--git-common-dir"))
        meta_root = os.path.join(common, "worktrees")
        for meta in os.listdir(meta_root) if os.path.isdir(meta_root) else []:
            try:
                with open(os.path.join(meta_root, meta, "gitdir"), encoding="utf-8", errors="surrogateescape") as fh:
                    points_to = fh.read().strip()
            except OSError:
                continue
            if os.path.realpath(os.path.dirname(points_to)) == os.path.realpath(path):
                shutil.rmtree(os.path.join(meta_root, meta), ignore_errors=True)
        removed.append(path)
    return removed


@contextmanager
def scratch_checkout(repo: str, commit: str) -> Iterator[tuple[str, dict[str, str]]]:
    """``commit``'s files, as stored, in a plain temporary folder removed on exit; yields the folder
    and path -> mode. Not a worktree: no checkout, so no hook, filter or repository metadata."""
    parent = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    path = os.path.join(parent, os.path.basename(os.path.abspath(repo)) or "repo")
    try:
        os.mkdir(path)
        modes = _materialize(repo, commit, path)
        yield path, modes
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def commit_files(repo: str, parent: str, changes: dict[str, bytes], modes: dict[str, str], message: str) -> str:
    """A commit on top of ``parent`` with ``changes`` (path -> new bytes, each keeping its mode), made from
    objects only (hash-object --no-filters, a temporary index, commit-tree); returns it. No branch moves."""
    records = []
    for rel, data in sorted(changes.items()):
        sha = out(repo, "hash-object", "-t", "blob", "-w", "--no-filters", "--stdin", input=data)
        records.append(f"{modes.get(rel, '100644')} {sha}\t{rel}".encode("utf-8", "surrogateescape"))
    folder = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    try:
        index = {"GIT_INDEX_FILE": os.path.join(folder, "index")}
        git(repo, "read-tree", parent, env=index)
        git(repo, "update-index", "-z", "--index-info", input=b"".join(r + b"\0" for r in records), env=index)
        tree = out(repo, "write-tree", env=index)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out(repo, "commit-tree", "--no-gpg-sign", tree, "-p", parent, "-F", "-", input=message.encode("utf-8"))


def create_branch(repo: str, name: str, commit: str) -> None:
    """Create ``name`` at ``commit``; refuses (GitError) when the branch exists, atomically."""
    proc = git(repo, "update-ref", "-m", "torchopt migrate", f"refs/heads/{name}", commit, "", check=False)
    if proc.returncode != 0:
        if branch_exists(repo, name):
            raise GitError(f"branch {name!r} already exists; delete it or choose another with --branch")
        raise GitError(f"cannot create branch {name!r}: {_one_line(proc)}")
