"""Extract the repositories of a real-world manifest at their commits, from bare git directories, into ROOT.

Usage:
    python benchmarks/real_world_extract.py MANIFEST ROOT --git-dirs DIR

MANIFEST is a TOML manifest of benchmarks/real_world_sample.py (`[[entry]]` tables with `repository` and
`commit`). For each repository and commit it names, the git directory ``GIT_DIRS/owner+name/repo`` (or
``repo/.git`` where the snapshot is a clone with a work tree) is read with ``git ls-tree`` and ``git cat-file``
(nothing is fetched) and its files are written under ``ROOT/owner+name/`` at their paths, the layout
benchmarks/real_world_sample.py reads. Only source and configuration files are written (.py, .ipynb, .toml,
.cfg, .txt, .yaml, .yml); symbolic links, submodules and blobs absent from the git directory (a shallow or
partial snapshot) are skipped and counted. One repository at two commits is refused: ROOT holds one tree
per repository.

Exit status: 0 when every repository was extracted, 2 when a git directory or a commit is missing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

SUFFIXES = (".py", ".ipynb", ".toml", ".cfg", ".txt", ".yaml", ".yml")
BLOB_MODES = ("100644", "100755")  # 120000 is a link, 160000 a submodule
NO_FETCH = {**os.environ, "GIT_NO_LAZY_FETCH": "1", "GIT_TERMINAL_PROMPT": "0"}


@dataclass
class Extracted:
    written: int = 0
    links: int = 0  # links and submodules
    missing: int = 0  # blobs the git directory does not hold


def git_dir(git_dirs: Path, repository: str) -> Path:
    repo = git_dirs / repository.replace("/", "+") / "repo"
    return repo / ".git" if (repo / ".git").is_dir() else repo


def git(gdir: Path, *args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(
        ["git", "--git-dir", str(gdir), *args], input=stdin, capture_output=True, check=True, env=NO_FETCH
    ).stdout


def wanted(path: str) -> bool:
    parts = PurePosixPath(path).parts
    return path.endswith(SUFFIXES) and ".." not in parts and not PurePosixPath(path).is_absolute()


def tree(gdir: Path, commit: str) -> list[tuple[str, str, str]]:
    """(mode, object id, path) of every file at the commit."""
    out = []
    for record in git(gdir, "ls-tree", "-r", "-z", "--full-tree", commit).split(b"\0"):
        if record:
            meta, path = record.split(b"\t", 1)
            mode, _, oid = meta.decode().split(" ")
            out.append((mode, oid, path.decode("utf-8", errors="surrogateescape")))
    return out


def read_blobs(gdir: Path, oids: list[str]) -> dict[str, bytes]:
    """The contents of the blobs the git directory holds; absent ones are left out."""
    data = git(gdir, "cat-file", "--batch", stdin="".join(f"{oid}\n" for oid in oids).encode())
    blobs, at = {}, 0
    while at < len(data):
        end = data.index(b"\n", at)
        header = data[at:end].decode().split(" ")
        at = end + 1
        if len(header) == 3:  # "<oid> <type> <size>", then the content and a newline
            size = int(header[2])
            blobs[header[0]] = data[at : at + size]
            at += size + 1
        # else "<oid> missing": no content follows
    return blobs


def extract(gdir: Path, commit: str, into: Path) -> Extracted:
    done = Extracted()
    files = []
    for mode, oid, path in tree(gdir, commit):
        if not wanted(path):
            continue
        if mode not in BLOB_MODES:
            done.links += 1
        else:
            files.append((oid, path))
    blobs = read_blobs(gdir, sorted({oid for oid, _ in files}))
    for oid, path in files:
        if oid not in blobs:
            done.missing += 1
            continue
        target = into / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            target.unlink()
        target.write_bytes(blobs[oid])
        done.written += 1
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("root", type=Path, help="folder to write one owner+name folder per repository into")
    parser.add_argument("--git-dirs", type=Path, required=True, help="the folder holding owner+name/repo bare git dirs")
    args = parser.parse_args(argv)
    entries = tomllib.loads(args.manifest.read_text(encoding="utf-8"))["entry"]
    commits: dict[str, str] = {}
    for e in entries:
        if commits.setdefault(e["repository"], e["commit"]) != e["commit"]:
            print(f"error: {e['repository']} is named at two commits", file=sys.stderr)
            return 2
    failed = False
    for repository, commit in commits.items():
        gdir = git_dir(args.git_dirs, repository)
        try:
            done = extract(gdir, commit, args.root / repository.replace("/", "+"))
        except (subprocess.CalledProcessError, OSError) as err:
            detail = (
                err.stderr.decode(errors="replace").strip() if isinstance(err, subprocess.CalledProcessError) else err
            )
            print(f"error: {repository} at {commit} from {gdir}: {detail}", file=sys.stderr)
            failed = True
            continue
        print(f"{repository} @{commit[:7]}: {done.written} files, {done.links} links skipped, {done.missing} missing")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
