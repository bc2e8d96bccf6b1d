"""benchmarks/real_world_extract.py: a manifest's repositories written out of bare git directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import real_world_extract as rwe  # noqa: E402

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]


def run(*args: str, cwd: Path) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, capture_output=True, check=True, text=True).stdout.strip()


def make_mirror(tmp_path: Path) -> tuple[Path, str, str]:
    """A bare git dir under mirror/o+r/repo whose commit has kept, skipped, linked and lost files."""
    work = tmp_path / "work"
    (work / "pkg").mkdir(parents=True)
    (work / "train.py").write_text("print('first')\n")
    (work / "pkg" / "nb.ipynb").write_text('{"cells": []}\n')
    (work / "pkg" / "conf.yaml").write_text("a: 1\n")
    (work / "weights.bin").write_bytes(b"\0\1")
    (work / "gone.py").write_text("lost = True\n")
    os.symlink("train.py", work / "alias.py")
    run("init", "-q", cwd=work)
    run("add", "-A", cwd=work)
    run("commit", "-q", "-m", "one", cwd=work)
    first = run("rev-parse", "HEAD", cwd=work)
    (work / "train.py").write_text("print('second')\n")
    run("commit", "-q", "-am", "two", cwd=work)
    bare = tmp_path / "mirror" / "o+r" / "repo"
    run("clone", "-q", "--bare", "--no-local", str(work), str(bare), cwd=tmp_path)
    run("repack", "-q", "-a", "-d", cwd=bare)  # one pack; then unpack all but the lost blob as loose objects
    gone = run("rev-parse", f"{first}:gone.py", cwd=bare)
    for pack in (bare / "objects" / "pack").glob("*.pack"):
        data = pack.read_bytes()
        for f in pack.parent.glob(pack.stem + ".*"):
            f.unlink()
        subprocess.run([*GIT, "unpack-objects", "-q"], cwd=bare, input=data, check=True)
    loose = bare / "objects" / gone[:2] / gone[2:]
    loose.unlink()
    return tmp_path / "mirror", first, gone


def test_extracts_the_manifest_commit_and_only_source_files(tmp_path: Path) -> None:
    mirror, first, _ = make_mirror(tmp_path)
    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[[entry]]\nrepository = "o/r"\npath = "train.py"\ncommit = "{first}"\n', encoding="utf-8")
    root = tmp_path / "root"
    assert rwe.main([str(manifest), str(root), "--git-dirs", str(mirror)]) == 0
    out = root / "o+r"
    assert (out / "train.py").read_text() == "print('first')\n"  # the manifest's commit, not HEAD
    assert (out / "pkg" / "nb.ipynb").is_file() and (out / "pkg" / "conf.yaml").is_file()
    assert not (out / "weights.bin").exists()  # not a source file
    assert not (out / "alias.py").exists()  # a link
    assert not (out / "gone.py").exists()  # its blob is not in the git dir


def test_counts_links_and_missing_blobs(tmp_path: Path) -> None:
    mirror, first, _ = make_mirror(tmp_path)
    done = rwe.extract(rwe.git_dir(mirror, "o/r"), first, tmp_path / "out")
    assert (done.written, done.links, done.missing) == (3, 1, 1)


def test_a_missing_git_dir_or_two_commits_of_one_repository_fail(tmp_path: Path) -> None:
    manifest = tmp_path / "m.toml"
    manifest.write_text('[[entry]]\nrepository = "o/none"\npath = "a.py"\ncommit = "HEAD"\n', encoding="utf-8")
    assert rwe.main([str(manifest), str(tmp_path / "root"), "--git-dirs", str(tmp_path)]) == 2
    manifest.write_text(
        '[[entry]]\nrepository = "o/r"\npath = "a.py"\ncommit = "a"\n'
        '[[entry]]\nrepository = "o/r"\npath = "b.py"\ncommit = "b"\n',
        encoding="utf-8",
    )
    assert rwe.main([str(manifest), str(tmp_path / "root"), "--git-dirs", str(tmp_path)]) == 2
