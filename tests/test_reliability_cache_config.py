"""The result cache only creates, reads and deletes what it made, whatever folder it is pointed at; and a
malformed configuration is a one-line error naming the pyproject.toml (exit 2), never a traceback or a
silently empty rule selection. Every test hashes the whole tmp_path before and after the run."""

from __future__ import annotations

import hashlib
import os

import pytest
from typer.testing import CliRunner

import torchopt
from torchopt.cli import app
from torchopt.rewrite import cache as cache_mod
from torchopt.rewrite import runner

SAFE = "import torch\nx = torch.zeros(3).cuda()\n"
FIXED = 'import torch\nx = torch.zeros(3, device="cuda")\n'
WARNING = "running without a cache"


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def snapshot(top) -> dict[str, str]:
    """Every path under ``top``: a link by its target, a file by its bytes' hash, a folder by its mode."""
    out: dict[str, str] = {}
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, top)
            if os.path.islink(path):
                out[rel] = "link:" + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = "dir"
            else:
                with open(path, "rb") as fh:
                    out[rel] = hashlib.sha256(fh.read()).hexdigest()
    return out


def write(path, data: str | bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


@pytest.fixture
def proj(tmp_path, monkeypatch):
    """A user's project: code, data, a git folder and a .gitignore, and a sibling folder next to it."""
    monkeypatch.delenv(cache_mod.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(cache_mod, "_package_source_hash", lambda: "pinned")
    root = tmp_path / "proj"
    write(root / "src" / "a.py", SAFE)
    write(root / "data" / "train.bin", b"\x00\x01\x02")
    write(root / ".git" / "HEAD", "ref: refs/heads/main\n")
    write(root / ".git" / "objects" / "ab" / "cdef", b"blob")
    write(root / ".gitignore", "*.bin\n")
    write(tmp_path / "sibling" / "notes.txt", "mine\n")
    monkeypatch.chdir(root)
    return root


@pytest.fixture
def analyses(monkeypatch):
    """The names of the files the engine analyses (a cache hit analyses nothing)."""
    seen: list[str] = []
    real = runner.process_text

    def counting(text, path, *a, **kw):
        seen.append(os.path.basename(path))
        return real(text, path, *a, **kw)

    monkeypatch.setattr(runner, "process_text", counting)
    return seen


def assert_refused(result, folder) -> None:
    lines = [line for line in result.stderr.splitlines() if line.startswith("warning: cache:")]
    assert len(lines) == 1 and str(folder) in lines[0] and lines[0].endswith(WARNING), result.stderr


# The cache folder is a user's folder -----------------------------------------------------------------


def test_cache_dir_dot_keeps_the_project(proj, tmp_path):
    before = snapshot(tmp_path)
    checked = cli("check", "src", "-j", "1", "--cache-dir", ".")
    assert checked.exit_code == 1 and "TOP101" in checked.stdout
    assert snapshot(tmp_path) == before
    assert_refused(checked, proj)
    fixed = cli("rewrite", "src", "-j", "1", "--cache-dir", ".")
    assert fixed.exit_code == 0
    assert_refused(fixed, proj)
    assert (proj / "src" / "a.py").read_text() == FIXED
    after = snapshot(tmp_path)
    assert after.pop("proj/src/a.py") != before.pop("proj/src/a.py")
    assert after == before


def test_cache_env_var_pointing_at_a_workspace(proj, tmp_path, monkeypatch):
    monkeypatch.setenv(cache_mod.ENV_VAR, str(tmp_path))
    before = snapshot(tmp_path)
    r = cli("check", "src", "-j", "1")
    assert r.exit_code == 1 and "TOP101" in r.stdout
    assert snapshot(tmp_path) == before
    assert_refused(r, tmp_path)


def test_committed_cache_symlink_to_parent_is_not_followed(proj, tmp_path):
    write(proj / "pyproject.toml", "[tool.torchopt]\n")
    (proj / ".torchopt_cache").symlink_to("..")
    before = snapshot(tmp_path)
    r = cli("check", "src", "-j", "1")
    assert r.exit_code == 1 and "TOP101" in r.stdout
    assert snapshot(tmp_path) == before
    assert_refused(r, proj / ".torchopt_cache")
    assert "symbolic link" in r.stderr


def test_folder_with_user_files_is_refused(proj, tmp_path):
    mine = proj / "results"
    write(mine / ".gitignore", "keep me\n")
    write(mine / "0123456789abcdef0123" / "run.log", "epoch 1\n")  # a name shaped like a fingerprint
    write(mine / "plots" / "loss.png", b"\x89PNG")
    before = snapshot(tmp_path)
    r = cli("check", "src", "-j", "1", "--cache-dir", "results")
    assert r.exit_code == 1 and "TOP101" in r.stdout
    assert snapshot(tmp_path) == before
    assert_refused(r, mine)


# Links planted inside a real cache ----------------------------------------------------------------


def test_planted_symlinked_fingerprint_folder(proj, tmp_path):
    cache = tmp_path / "cache"
    assert cli("check", "src", "-j", "1", "--cache-dir", str(cache)).exit_code == 1
    (fp,) = [p.name for p in cache.iterdir() if p.is_dir()]
    victim = tmp_path / "sibling"
    for path in sorted(os.walk(cache / fp), reverse=True):  # empty the folder, then put a link there
        for name in path[2]:
            os.unlink(os.path.join(path[0], name))
        os.rmdir(path[0])
    (cache / fp).symlink_to(victim)
    (cache / ("f" * 20)).symlink_to(victim)  # a stale-looking fingerprint name too
    before = snapshot(tmp_path)
    r = cli("check", "src", "-j", "1", "--cache-dir", str(cache))
    assert r.exit_code == 1 and "TOP101" in r.stdout
    assert snapshot(tmp_path) == before
    assert_refused(r, cache / fp)


def test_planted_symlinked_shard_is_not_written_through(proj, tmp_path, analyses):
    cache = tmp_path / "cache"
    assert cli("check", "src", "-j", "1", "--cache-dir", str(cache)).exit_code == 1
    (fp,) = [p for p in cache.iterdir() if p.is_dir()]
    victim = tmp_path / "sibling"
    shards = [p for p in fp.iterdir() if p.is_dir()]
    assert shards
    for shard in shards:
        for entry in shard.iterdir():
            entry.unlink()
        shard.rmdir()
        shard.symlink_to(victim)
    before = snapshot(tmp_path)
    analyses.clear()
    first = cli("check", "src", "-j", "1", "--cache-dir", str(cache))
    second = cli("check", "src", "-j", "1", "--cache-dir", str(cache))
    assert first.exit_code == second.exit_code == 1 and first.stdout == second.stdout
    assert analyses == ["a.py", "a.py"]  # nothing cached through the link, nothing read through it
    assert snapshot(tmp_path) == before


# Pruning removes exactly the stale torchopt folders, and the cache still works ------------------


def test_old_torchopt_cache_is_pruned_and_nothing_else(proj, tmp_path, analyses, monkeypatch):
    cache = tmp_path / "cache"
    args = ("check", "src", "-j", "1", "--cache-dir", str(cache))
    cold = cli(*args)
    analyses.clear()
    warm = cli(*args)
    assert analyses == [] and (warm.exit_code, warm.stdout) == (cold.exit_code, cold.stdout)
    (old,) = [p.name for p in cache.iterdir() if p.is_dir()]
    # Things a user (or another tool) put in the cache folder: never torchopt's to delete.
    write(cache / "abcdefabcdefabcdef01" / "keep.txt", "no marker\n")
    write(cache / "notes" / "todo.txt", "mine\n")
    write(cache / "README", "mine\n")
    write(cache / old / "hand-made.txt", "mine\n")  # inside a stale folder: it and the folder stay
    (cache / "abcdefabcdefabcdef02").symlink_to(tmp_path / "sibling")
    monkeypatch.setattr(torchopt, "__version__", "99.0.0")
    folders_before = {p.name for p in cache.iterdir()}
    before = snapshot(tmp_path)
    analyses.clear()
    cli(*args)
    assert analyses == ["a.py"]
    after = snapshot(tmp_path)
    (new,) = {p.name for p in cache.iterdir()} - folders_before
    gone = set(before) - set(after)
    assert gone and all(p.startswith(f"cache/{old}/") for p in gone)
    assert after[f"cache/{old}/hand-made.txt"] == before[f"cache/{old}/hand-made.txt"]
    assert {p: h for p, h in after.items() if not p.startswith(f"cache/{new}")} == {
        p: h for p, h in before.items() if p not in gone
    }
    # A stale folder holding only what torchopt wrote is removed entirely.
    (cache / old / "hand-made.txt").unlink()
    monkeypatch.setattr(torchopt, "__version__", "99.0.1")
    cli(*args)
    assert not (cache / old).exists() and not (cache / new).exists()
    analyses.clear()
    cli(*args)
    assert analyses == []


def test_existing_empty_folder_is_adopted_and_user_gitignore_kept(proj, tmp_path, analyses):
    (tmp_path / "empty").mkdir()
    cli("check", "src", "-j", "1", "--cache-dir", str(tmp_path / "empty"))
    assert (tmp_path / "empty" / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    (tmp_path / "empty" / ".gitignore").write_text("my own rules\n")
    (tmp_path / "empty" / "CACHEDIR.TAG").unlink()  # a torchopt marker is gone: no longer ours
    before = snapshot(tmp_path)
    analyses.clear()
    r = cli("check", "src", "-j", "1", "--cache-dir", str(tmp_path / "empty"))
    assert snapshot(tmp_path) == before
    assert_refused(r, tmp_path / "empty")
    assert analyses == ["a.py"]


# Configuration errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,needle",
    [
        (b'tool = "x"\n', "[tool] must be a table"),
        (b'[tool]\ntorchopt = "x"\n', "[tool.torchopt] must be a table"),
        (b'[tool.torchopt]\n# caf\xe9\nselect = ["ALL"]\n', "not UTF-8"),
        (b'[tool.torchopt]\nselect = [""]\n', "empty rule selector"),
        (b'[tool.torchopt]\nignore = ["TOP1", " "]\n', "empty rule selector"),
        (b'[tool.torchopt]\nper-file-ignores = {"tests/*" = [""]}\n', "empty rule selector"),
        (b'[tool.torchopt]\nmax-file-size = "' + b"9" * 400 + b'MB"\n', "max-file-size"),
        # a RecursionError traceback and exit 1 before
        (b"[tool.torchopt]\nexclude = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
        (b"[tool.torchopt]\nrules = " + b"{a = " * 3000 + b"1" + b"}" * 3000 + b"\n", "nested too deeply"),
        (b"[tool.torchopt]\nx = " + b"1" * 10000 + b"\n", "invalid TOML"),
        # read as the float 2.1 before, which turned off the rules needing torch 2.10
        (b"[tool.torchopt]\ntarget-torch = 2.10\n", 'write it as a string: "2.10"'),
    ],
)
def test_bad_pyproject_is_one_line_naming_it(proj, tmp_path, body, needle):
    config = write(proj / "pyproject.toml", body)
    before = snapshot(tmp_path)
    r = cli("rewrite", "src", "-j", "1")
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {config}: ") and needle in r.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "flag,value",
    [("--select", ""), ("--select", ","), ("--select", "TOP101,"), ("--ignore", ""), ("--ignore", "TOP1,,TOP2")],
)
def test_empty_selector_on_the_command_line(proj, tmp_path, flag, value):
    before = snapshot(tmp_path)
    r = cli("rewrite", "src", "-j", "1", flag, value)
    assert r.exit_code == 2
    assert (
        r.stderr == f"error: empty rule selector in {flag} {value!r} (expected codes separated by "
        "commas, such as TOP101,TOP2)\n"
    )
    assert snapshot(tmp_path) == before
