"""The result cache: a warm run answers from it with identical output and without analysing any file
again (counted, not timed); an edit, a settings change, a torchopt version or source change invalidate
it; a corrupt entry is a miss; --no-cache neither reads nor writes it."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from typer.testing import CliRunner

import torchopt
from torchopt.cli import app
from torchopt.rewrite import cache as cache_mod
from torchopt.rewrite import runner
from torchopt.rewrite.config import Settings

SAFE = "import torch\nx = torch.zeros(3).cuda()\n"
UNSAFE = "import torch\ny = torch.rand(3).cuda()\n"
CLEAN = "import torch\nz = torch.zeros(3, device='cuda')\n"
NO_TORCH = "def f(a):\n    return a + 1\n"
BROKEN = "def f(:\n"


def cli(*args):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


@pytest.fixture
def proj(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(cache_mod.ENV_VAR, raising=False)
    # The real hash covers torchopt's own source; pin it so an edit elsewhere mid-test is not a miss.
    monkeypatch.setattr(cache_mod, "_package_source_hash", lambda: "pinned")
    src = tmp_path / "src"
    src.mkdir()
    for name, text in (("safe.py", SAFE), ("unsafe.py", UNSAFE), ("clean.py", CLEAN), ("plain.py", NO_TORCH)):
        (src / name).write_text(text)
    return tmp_path


@pytest.fixture
def analyses(monkeypatch):
    """Counts the files the engine analyses (runs in-process with -j 1)."""
    seen: list[str] = []
    real = runner.process_text

    def counting(text, path, *a, **kw):
        seen.append(os.path.basename(path))
        return real(text, path, *a, **kw)

    monkeypatch.setattr(runner, "process_text", counting)
    return seen


def run_check(proj, *extra):
    return cli("check", "src", "-j", "1", "--cache-dir", str(proj / "cache"), *extra)


def test_warm_check_is_identical_and_analyses_nothing(proj, analyses):
    cold = run_check(proj)
    assert sorted(analyses) == ["clean.py", "plain.py", "safe.py", "unsafe.py"]
    analyses.clear()
    warm = run_check(proj)
    assert analyses == []
    assert (warm.exit_code, warm.stdout, warm.stderr) == (cold.exit_code, cold.stdout, cold.stderr)
    assert "TOP101" in cold.stdout
    # Machine-readable output too: every field of every diagnostic survives the round trip.
    cold_json = cli("check", "src", "-j", "1", "--no-cache", "--output-format", "json").stdout
    analyses.clear()
    warm_json = run_check(proj, "--output-format", "json").stdout
    assert analyses == [] and json.loads(warm_json) == json.loads(cold_json)


def test_cache_folder_is_tagged_and_ignored_by_git(proj):
    run_check(proj)
    tag = (proj / "cache" / "CACHEDIR.TAG").read_text()
    assert tag.startswith("Signature: 8a477f597d28d172789f06886806bc55")
    assert (proj / "cache" / ".gitignore").read_text().splitlines()[-1] == "*"


def test_edit_invalidates_only_that_file(proj, analyses):
    run_check(proj)
    analyses.clear()
    (proj / "src" / "clean.py").write_text(SAFE)
    r = run_check(proj)
    assert analyses == ["clean.py"]
    assert r.stdout.count("TOP101") == 3  # safe.py, unsafe.py, and the edited clean.py


def test_settings_change_invalidates(proj, analyses):
    run_check(proj)
    analyses.clear()
    run_check(proj, "--select", "TOP101")
    assert len(analyses) == 4
    analyses.clear()
    run_check(proj, "--select", "TOP101")
    assert analyses == []
    # A configuration file changes the settings of every file below it.
    (proj / "pyproject.toml").write_text('[tool.torchopt]\ndevice-names = ["dev"]\n')
    run_check(proj, "--select", "TOP101")
    assert len(analyses) == 4


def test_settings_hash_covers_every_field_even_new_ones():
    base = Settings()
    for f in dataclasses.fields(Settings):
        value = getattr(base, f.name)
        changed = {
            bool: lambda v: not v,
            int: lambda v: v + 1,
            str: lambda v: v + "x",
            tuple: lambda v: v + ("TOP101",),
            type(None): lambda v: "x",
        }.get(type(value))
        if changed is None:
            changed = lambda v: {"TOP101": {"x": 1}}  # noqa: E731 - a mapping field
        other = dataclasses.replace(base, **{f.name: changed(value)})
        assert cache_mod.settings_hash(other) != cache_mod.settings_hash(base), f.name

    @dataclasses.dataclass(frozen=True)
    class Later(Settings):  # a field another change adds later is part of the key by itself
        target_something: tuple[int, int] | None = None

    assert cache_mod.settings_hash(Later(target_something=(2, 1))) != cache_mod.settings_hash(Later())
    assert cache_mod.settings_hash(Settings(rule_options={"a": {"x": 1, "y": 2}})) == cache_mod.settings_hash(
        Settings(rule_options={"a": {"y": 2, "x": 1}})
    )


def test_version_change_invalidates_and_prunes(proj, analyses, monkeypatch):
    run_check(proj)
    old = {p.name for p in (proj / "cache").iterdir() if p.is_dir()}
    analyses.clear()
    monkeypatch.setattr(torchopt, "__version__", "99.0.0")
    run_check(proj)
    assert len(analyses) == 4
    new = {p.name for p in (proj / "cache").iterdir() if p.is_dir()}
    assert len(new) == 1 and new != old  # the old version's entries are gone


def test_fingerprint_covers_package_source_and_rule_set(monkeypatch):
    from torchopt.rewrite.registry import all_rules

    rules = all_rules()
    fp = cache_mod.fingerprint(rules)
    fewer = dict(list(rules.items())[:-1])
    assert cache_mod.fingerprint(fewer) != fp
    monkeypatch.setattr(cache_mod, "_package_source_hash", lambda: "edited")
    assert cache_mod.fingerprint(rules) != fp


def test_corrupt_entries_are_misses(proj, analyses):
    cold = run_check(proj)
    entries = [os.path.join(d, f) for d, _, fs in os.walk(proj / "cache") for f in fs if f.endswith(".json")]
    assert len(entries) == 4
    garbage = [b"", b"{not json", b'{"key": 1}', b"\x00\xff" * 10]
    for path, junk in zip(entries, garbage):
        with open(path, "wb") as fh:
            fh.write(junk)
    analyses.clear()
    again = run_check(proj)
    assert len(analyses) == 4
    assert again.stdout == cold.stdout and again.exit_code == cold.exit_code
    analyses.clear()
    run_check(proj)
    assert analyses == []  # rewritten correctly


def test_no_cache_reads_and_writes_nothing(proj, analyses):
    cli("check", "src", "-j", "1", "--no-cache", "--cache-dir", str(proj / "cache"))
    cli("check", "src", "-j", "1", "--no-cache", "--cache-dir", str(proj / "cache"))
    assert len(analyses) == 8
    assert not (proj / "cache").exists()


def test_rewrite_diff_warm_and_fix_after_cached_check(proj, analyses):
    args = ("rewrite", "src", "-j", "1", "--cache-dir", str(proj / "cache"))
    cold = cli(*args, "--diff", "--unsafe-fixes")
    analyses.clear()
    warm = cli(*args, "--diff", "--unsafe-fixes")
    assert analyses == [] and warm.stdout == cold.stdout and warm.exit_code == cold.exit_code == 1
    assert 'device="cuda"' in warm.stdout
    # Safe fixes only: another kind of result, analysed once, then cached.
    cli(*args, "--check")
    assert len(analyses) == 4
    analyses.clear()
    listed = cli(*args, "--check")
    assert analyses == [] and listed.stdout == "Would rewrite: src/safe.py\n"
    # Writing from a cached result writes exactly what the analysis produced.
    fixed = cli(*args)
    assert analyses == [] and fixed.exit_code == 0
    assert (proj / "src" / "safe.py").read_text() == 'import torch\nx = torch.zeros(3, device="cuda")\n'
    assert (proj / "src" / "unsafe.py").read_text() == UNSAFE
    again = cli(*args, "--diff")
    assert analyses == ["safe.py"] and again.exit_code == 0 and again.stdout == ""


def test_failures_are_cached_and_reported_the_same(proj, analyses):
    (proj / "src" / "broken.py").write_text(BROKEN)
    cold = run_check(proj)
    analyses.clear()
    warm = run_check(proj)
    assert analyses == []
    assert cold.exit_code == warm.exit_code == 2
    assert "error: src/broken.py: syntax error" in warm.stderr and warm.stderr == cold.stderr


def test_path_is_part_of_the_key(proj, analyses):
    run_check(proj)
    analyses.clear()
    r = cli("check", str(proj / "src"), "-j", "1", "--cache-dir", str(proj / "cache"))
    # Another spelling of the same files: diagnostics must name the path as given this time.
    assert len(analyses) == 4 and f"{proj}/src/safe.py:2" in r.stdout


def test_parallel_workers_fill_the_cache(proj, analyses):
    for i in range(12):
        (proj / "src" / f"m{i:02d}.py").write_text(SAFE if i % 2 else UNSAFE)
    par = cli("check", "src", "-j", "2", "--cache-dir", str(proj / "cache"))
    analyses.clear()
    serial = run_check(proj)
    assert analyses == [] and serial.stdout == par.stdout


def test_default_locations(proj, analyses, monkeypatch):
    monkeypatch.setenv(cache_mod.ENV_VAR, str(proj / "envcache"))
    cli("check", "src", "-j", "1")
    assert (proj / "envcache" / "CACHEDIR.TAG").exists()
    monkeypatch.delenv(cache_mod.ENV_VAR)
    (proj / "pyproject.toml").write_text("[tool.torchopt]\n")
    cli("check", "src", "-j", "1")
    assert (proj / ".torchopt_cache" / "CACHEDIR.TAG").exists()
    # No configuration: the user's cache folder, never the folder torchopt was pointed at.
    (proj / "pyproject.toml").unlink()
    monkeypatch.setenv("XDG_CACHE_HOME", str(proj / "xdg"))
    cli("check", "src", "-j", "1")
    assert (proj / "xdg" / "torchopt" / "CACHEDIR.TAG").exists()
    assert cache_mod.default_dir(None, "/x/y") == "/x/y"


def test_unwritable_cache_folder_turns_caching_off(proj, analyses):
    (proj / "afile").write_text("")
    r = cli("check", "src", "-j", "1", "--cache-dir", str(proj / "afile" / "sub"))
    assert r.exit_code == 1 and "TOP101" in r.stdout and len(analyses) == 4
