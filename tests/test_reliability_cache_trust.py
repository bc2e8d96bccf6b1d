"""Nothing in a cache is written into a file unless this user's torchopt computed it for exactly the
bytes on disk: a planted entry (committed with the project, or in a shared folder another user owns or
anyone may write) is ignored with one warning and the file is analysed again; a text that does not
compile is never written, wherever it came from. Every test hashes the whole tmp_path (the project, the
user's cache folder, a folder outside) before and after."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite import cache as cache_mod

NEEDS_FIX = "import torch\nx = torch.zeros(3).cuda()\n"
FIXED = 'import torch\nx = torch.zeros(3, device="cuda")\n'
PAYLOAD = "__import__('os').system('touch /tmp/pwned')\n" + FIXED
BROKEN = "def broken(:\n \0"


def cli(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def snapshot(top) -> dict[str, str]:
    """Every path under ``top``: a link by its target, a folder by its mode, a file by its bytes' hash."""
    out: dict[str, str] = {}
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, top)
            if os.path.islink(path):
                out[rel] = "link:" + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = f"dir:{stat.S_IMODE(os.lstat(path).st_mode):o}"
            else:
                with open(path, "rb") as fh:
                    out[rel] = hashlib.sha256(fh.read()).hexdigest()
    return out


def outside_cache(snap: dict[str, str], cache_rel: str) -> dict[str, str]:
    return {p: h for p, h in snap.items() if p != cache_rel and not p.startswith(cache_rel + os.sep)}


def entries(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".json"))


def plant(root, new_text: str, secret: bytes | None) -> int:
    """Put ``new_text`` into every fix entry under the cache ``root``, as an attacker would: signed
    with ``secret`` (the attacker's own key, or the user's to stand for a bug of ours), or unsigned."""
    count = 0
    for path in entries(root):
        with open(path, "rb") as fh:
            data = fh.read()
        head, _, rest = data.partition(b"\n")
        body = rest if rest and len(head) == 64 else data
        entry = json.loads(body)
        if entry.get("new_text") is None:
            continue
        entry["new_text"] = new_text
        body = json.dumps(entry, separators=(",", ":")).encode()
        if secret is not None and hasattr(cache_mod.Cache, "seal"):
            fp = os.path.basename(os.path.dirname(os.path.dirname(path)))
            body = cache_mod.Cache(root=str(root), fp=fp, secret=secret).seal(path, body)
        with open(path, "wb") as fh:
            fh.write(body)
        count += 1
    return count


@pytest.fixture
def proj(tmp_path, monkeypatch):
    """A project that configures torchopt (so its cache is ``.torchopt_cache`` inside it), a folder
    outside it, and the user's own cache home."""
    monkeypatch.delenv(cache_mod.ENV_VAR, raising=False)
    monkeypatch.setattr(cache_mod, "_package_source_hash", lambda: "pinned")
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[tool.torchopt]\n")
    (root / "src" / "train.py").write_text(NEEDS_FIX)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "notes.txt").write_text("mine\n")
    monkeypatch.chdir(root)
    return root


def as_user(monkeypatch, tmp_path, who: str) -> str:
    home = tmp_path / f"home-{who}"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return str(home / "torchopt")


def attacker_fills(monkeypatch, tmp_path, *args: str) -> bytes:
    """The attacker runs torchopt on the same path with their own key, then plants the payload."""
    as_user(monkeypatch, tmp_path, "attacker")
    assert cli("rewrite", "src", "-j", "1", "--diff", *args).exit_code == 1
    return cache_mod.load_key() if hasattr(cache_mod, "load_key") else b""


def warned_about_entries(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: cache:")]


@pytest.mark.parametrize("signed", [True, False], ids=["signed-by-attacker", "unsigned"])
def test_committed_cache_with_a_payload_is_not_written(proj, tmp_path, monkeypatch, signed):
    attacker_key = attacker_fills(monkeypatch, tmp_path)
    cache = proj / ".torchopt_cache"
    assert plant(cache, PAYLOAD, attacker_key if signed else None) == 1
    as_user(monkeypatch, tmp_path, "victim")  # the same path, cloned by someone else
    before = snapshot(tmp_path)
    r = cli("rewrite", "src", "-j", "1")
    assert r.exit_code == 0, r.output
    assert (proj / "src" / "train.py").read_text() == FIXED
    (warning,) = warned_about_entries(r.stderr)
    assert str(cache) in warning and "ignored 1 entry" in warning
    after = snapshot(tmp_path)
    assert after.pop("proj/src/train.py") != before.pop("proj/src/train.py")
    rel = "proj/.torchopt_cache"
    victim_home = "home-victim"
    assert outside_cache(outside_cache(after, rel), victim_home) == outside_cache(
        outside_cache(before, rel), victim_home
    )
    assert all("__import__" not in open(p).read() for p in entries(cache))  # replaced by the real result
    again = cli("rewrite", "src", "-j", "1", "--diff")
    assert again.exit_code == 0 and again.stdout == "" and warned_about_entries(again.stderr) == []


@pytest.mark.parametrize("owner", ["another-user", "me"])
def test_shared_cache_folder_others_may_write_is_refused(proj, tmp_path, monkeypatch, owner):
    shared = tmp_path / "shared-cache"
    monkeypatch.setenv(cache_mod.ENV_VAR, str(shared))
    attacker_key = attacker_fills(monkeypatch, tmp_path)
    assert plant(shared, PAYLOAD, attacker_key) == 1
    if owner == "another-user":
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        for folder, dirs, files in os.walk(shared):
            for name in [folder] + [os.path.join(folder, n) for n in dirs + files]:
                os.chown(name, 1234, 1234)
    os.chmod(shared, 0o777)
    as_user(monkeypatch, tmp_path, "victim")
    before = snapshot(tmp_path)
    r = cli("rewrite", "src", "-j", "1")
    assert r.exit_code == 0, r.output
    assert (proj / "src" / "train.py").read_text() == FIXED
    (warning,) = warned_about_entries(r.stderr)
    why = "owned by another user (uid 1234)" if owner == "another-user" else "writable by others (mode 0777"
    assert warning.startswith(f"warning: cache: {shared} is {why}") and warning.endswith("running without a cache")
    after = snapshot(tmp_path)
    assert after.pop("proj/src/train.py") != before.pop("proj/src/train.py")
    assert after == before  # nothing read from, or written to, the shared folder; no key made


@pytest.mark.parametrize("via", ["cache", "fix"])
def test_a_fix_that_does_not_compile_is_never_written(proj, tmp_path, monkeypatch, via):
    """A cache entry the user's own torchopt signed (as a bug of ours would) or a fix computed now:
    either way the text is compiled just before writing, and a failure names the file."""
    as_user(monkeypatch, tmp_path, "me")
    extra: tuple[str, ...] = ()
    if via == "cache":
        assert cli("rewrite", "src", "-j", "1", "--diff").exit_code == 1
        own_key = cache_mod.load_key() if hasattr(cache_mod, "load_key") else None
        assert plant(proj / ".torchopt_cache", BROKEN, own_key) == 1
    else:
        from torchopt.rewrite import runner

        real = runner.process_text

        def broken_fix(text, path, *args, **kwargs):
            res = real(text, path, *args, **kwargs)
            res.new_text = BROKEN
            return res

        monkeypatch.setattr(runner, "process_text", broken_fix)
        extra = ("--no-cache",)
    before = snapshot(tmp_path)
    r = cli("rewrite", "src", "-j", "1", *extra)
    assert r.exit_code == 2, r.output
    (error,) = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: src/train.py: the fixed text does not compile (") and error.endswith("not written")
    assert warned_about_entries(r.stderr) == []
    assert "Fixed" not in r.stderr
    assert snapshot(tmp_path) == before


def test_key_is_private_to_the_user_and_never_in_the_project(proj, tmp_path, monkeypatch):
    home = as_user(monkeypatch, tmp_path, "me")
    assert cli("check", "src", "-j", "1").exit_code == 1
    key = os.path.join(home, "key")
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700 and stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert not any(name == "key" for _, _, files in os.walk(proj) for name in files)
    os.chmod(key, 0o644)  # readable by others: anyone could sign entries with it
    before = snapshot(tmp_path)
    r = cli("check", "src", "-j", "1")
    assert r.exit_code == 1 and "TOP101" in r.stdout
    (warning,) = warned_about_entries(r.stderr)
    assert warning == (
        f"warning: cache: the cache key {key} is readable by others (mode 0644; chmod 600 it to use it); "
        "running without a cache"
    )
    assert snapshot(tmp_path) == before
