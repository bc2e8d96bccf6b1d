"""Configuration from the nearest pyproject.toml, CLI flags on top; discovery honours .gitignore,
exclude and the default folders, and always takes files named explicitly."""

import os

import pytest

from torchopt.rewrite.config import ConfigError, Overrides, Resolver, load_file
from torchopt.rewrite.discovery import discover


def write(p, text):
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_nearest_pyproject_wins(tmp_path):
    write(tmp_path / "pyproject.toml", '[tool.torchopt]\nignore = ["TOP102"]\n')
    write(tmp_path / "sub" / "pyproject.toml", '[tool.torchopt]\nselect = ["TOP102"]\n')
    write(tmp_path / "other" / "pyproject.toml", "[project]\nname='x'\n")  # no [tool.torchopt]: keep looking up
    r = Resolver()
    assert "TOP102" not in r.for_path(str(tmp_path / "a.py")).enabled_codes()
    assert r.for_path(str(tmp_path / "sub" / "b.py")).enabled_codes() == {"TOP102"}
    assert "TOP102" not in r.for_path(str(tmp_path / "other" / "c.py")).enabled_codes()


def test_cli_flags_override_config(tmp_path):
    write(tmp_path / "pyproject.toml", '[tool.torchopt]\nselect = ["TOP102"]\nunsafe-fixes = true\n')
    r = Resolver(Overrides(select=("TOP101",), unsafe_fixes=False))
    s = r.for_path(str(tmp_path / "a.py"))
    assert s.enabled_codes() == {"TOP101"} and s.unsafe_fixes is False


def test_per_file_ignores_and_prefixes(tmp_path):
    write(tmp_path / "pyproject.toml", '[tool.torchopt]\nper-file-ignores = {"tests/*" = ["TOP1"]}\n')
    s = Resolver().for_path(str(tmp_path / "x.py"))
    assert not any(c.startswith("TOP1") for c in s.enabled_codes(str(tmp_path / "tests" / "t.py")))
    assert "TOP101" in s.enabled_codes(str(tmp_path / "src" / "m.py"))


@pytest.mark.parametrize(
    "body,needle",
    [
        ("selct = ['ALL']", "unknown key"),
        ("select = ['TOP999']", "TOP999"),
        ("select = 'ALL'", "list of strings"),
        ("unsafe-fixes = 'yes'", "true or false"),
        ("[tool.torchopt.rules.TOP999]\nx = 1", "no rule"),
        ("select = [", "invalid TOML"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, body, needle):
    p = write(tmp_path / "pyproject.toml", "[tool.torchopt]\n" + body + "\n")
    with pytest.raises(ConfigError) as info:
        load_file(str(p))
    assert needle in str(info.value) and str(p) in str(info.value)


def test_extend_safe_and_unsafe(tmp_path):
    p = write(
        tmp_path / "pyproject.toml",
        '[tool.torchopt]\nextend-safe-fixes = ["TOP101"]\nextend-unsafe-fixes = ["TOP102"]\n',
    )
    s = load_file(str(p))
    assert s.fix_is_safe("TOP101", False) is True
    assert s.fix_is_safe("TOP102", True) is False
    assert s.fix_is_safe("TOP103", True) is True


def test_discovery(tmp_path):
    write(tmp_path / ".gitignore", "ignored/\n*_skip.py\n")
    write(tmp_path / "pyproject.toml", '[tool.torchopt]\nexclude = ["third_party/"]\n')
    for rel in [
        "a.py",
        "pkg/b.py",
        "ignored/c.py",
        "d_skip.py",
        "third_party/e.py",
        ".venv/f.py",
        "build/g.py",
        "pkg/notes.txt",
        ".hidden/h.py",
        "pkg/sub/i.py",
    ]:
        write(tmp_path / rel, "x = 1\n")
    write(tmp_path / "pkg" / ".gitignore", "sub/\n")
    r = Resolver()
    found = [os.path.relpath(f, tmp_path) for f in discover([str(tmp_path)], r.for_path)]
    assert found == ["a.py", os.path.join("pkg", "b.py")]
    # A file named explicitly is taken even if excluded.
    explicit = discover([str(tmp_path / "third_party" / "e.py")], r.for_path)
    assert explicit == [str(tmp_path / "third_party" / "e.py")]


def test_discovery_survives_symlink_loops(tmp_path):
    write(tmp_path / "pkg" / "a.py", "x = 1\n")
    (tmp_path / "pkg" / "loop").symlink_to(tmp_path / "pkg")
    found = discover([str(tmp_path)], Resolver().for_path)
    assert [os.path.basename(f) for f in found] == ["a.py"]
