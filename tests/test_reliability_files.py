"""Which files torchopt reads and how it writes them back: it never leaves the named folders through a
link, never opens what is not a regular file, never overwrites an edit made while it ran, never changes
a file's mode, owner or links, and keeps every byte outside a fix (or refuses the file). Each fault:
the exit code, a one-line message naming the file, and the whole tree byte-identical to what is expected."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite import runner, source

NEEDS_FIX = b'import torch\ndevice = "cpu"\nx = torch.zeros(3).to(device)\n'
FIXED = b'import torch\ndevice = "cpu"\nx = torch.zeros(3, device=device)\n'


def cli(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def subprocess_cli(*args: str, cwd, env_extra=None, timeout=60):
    """A separate process: for faults that would hang torchopt, and for strict output streams."""
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "torchopt", *args], cwd=cwd, env=env, capture_output=True, timeout=timeout
    )


def tree_state(root) -> dict:
    """Every entry under ``root`` without following links: its kind, bytes or link target, and stat."""
    out = {}
    for folder, dirs, files in os.walk(os.fsencode(root)):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                what = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as fh:
                    what = ("file", fh.read())
            else:
                what = ("other", stat.S_IFMT(st.st_mode))
            out[os.path.relpath(path, os.fsencode(root))] = (
                what,
                stat.S_IMODE(st.st_mode),
                st.st_uid,
                st.st_gid,
                st.st_nlink,
            )
    return out


def with_files(state: dict, **changes: bytes) -> dict:
    """``state`` with the named regular files holding new bytes, and nothing else different."""
    out = dict(state)
    for rel, data in changes.items():
        key = os.fsencode(rel.replace("/", os.sep))
        out[key] = (("file", data),) + out[key][1:]
    return out


def same_tree(expected: dict, actual: dict) -> bool:
    return expected == actual


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("warning:")]


# Links ------------------------------------------------------------------------------------------------


def test_walk_does_not_follow_links_out_of_the_named_folder(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "shared.py").write_bytes(NEEDS_FIX)
    (tmp_path / "target.py").write_bytes(NEEDS_FIX)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "a.py").write_bytes(NEEDS_FIX)
    (proj / "lib").symlink_to("../lib")
    (proj / "t.py").symlink_to("../target.py")
    (proj / "alias.py").symlink_to("a.py")  # stays inside: followed, the real file processed once
    monkeypatch.chdir(tmp_path)
    before = tree_state(tmp_path)
    r = cli("rewrite", "proj", "--no-cache")
    assert r.exit_code == 0, r.stderr
    warned = warnings(r.stderr)
    assert len(warned) == 2
    assert any(w.startswith(f"warning: {os.path.join('proj', 'lib')}: symbolic link") for w in warned)
    assert any(w.startswith(f"warning: {os.path.join('proj', 't.py')}: symbolic link") for w in warned)
    assert "Fixed 1 issue in 1 file" in r.stderr
    assert same_tree(with_files(before, **{"proj/a.py": FIXED}), tree_state(tmp_path))
    # Named on the command line, a link is processed: its target is rewritten, the link stays a link.
    r = cli("rewrite", os.path.join("proj", "t.py"), "--no-cache")
    assert r.exit_code == 0, r.stderr
    assert same_tree(with_files(before, **{"proj/a.py": FIXED, "target.py": FIXED}), tree_state(tmp_path))


# An edit made during the run ---------------------------------------------------------------------------


@pytest.mark.parametrize("keep_stat", [False, True], ids=["plain-edit", "same-size-and-mtime"])
def test_edit_made_while_torchopt_runs_is_not_overwritten(tmp_path, monkeypatch, keep_stat):
    path = tmp_path / "f.py"
    path.write_bytes(NEEDS_FIX)
    (tmp_path / "other.py").write_bytes(NEEDS_FIX)
    user_edit = NEEDS_FIX.replace(b"cpu", b"CPU")  # same size: only the bytes tell
    analyse = runner.process_cached

    def analyse_then_user_saves(text, path_shown, *args, **kwargs):
        res = analyse(text, path_shown, *args, **kwargs)
        if path_shown.endswith("f.py"):
            st = os.stat(path)
            path.write_bytes(user_edit)
            if keep_stat:
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        return res

    monkeypatch.setattr(runner, "process_cached", analyse_then_user_saves)
    monkeypatch.chdir(tmp_path)
    before = tree_state(tmp_path)
    r = cli("rewrite", ".", "-j", "1", "--no-cache")
    assert r.exit_code == 2
    assert errors(r.stderr) == ["error: f.py: changed on disk since torchopt read it; not written (run torchopt again)"]
    assert same_tree(with_files(before, **{"f.py": user_edit, "other.py": FIXED}), tree_state(tmp_path))
    assert [p for p in os.listdir(tmp_path) if p.startswith(".torchopt-")] == []


# Mode, owner and links ---------------------------------------------------------------------------------


def test_read_only_file_is_refused(tmp_path, monkeypatch):
    (tmp_path / "ro.py").write_bytes(NEEDS_FIX)
    os.chmod(tmp_path / "ro.py", 0o444)
    (tmp_path / "ok.py").write_bytes(NEEDS_FIX)
    monkeypatch.chdir(tmp_path)
    before = tree_state(tmp_path)
    r = cli("rewrite", ".", "--no-cache")
    assert r.exit_code == 2
    assert errors(r.stderr) == ["error: ro.py: file is read-only (mode 0444); not written"]
    assert same_tree(with_files(before, **{"ok.py": FIXED}), tree_state(tmp_path))


def test_normal_rewrite_keeps_mode_owner_and_link_count(tmp_path, monkeypatch):
    path = tmp_path / "f.py"
    path.write_bytes(NEEDS_FIX)
    os.chmod(path, 0o640)
    if os.geteuid() == 0:  # root can give the file to someone else; torchopt must hand it back
        os.chown(path, 1234, 2345)
    st = os.stat(path)
    monkeypatch.chdir(tmp_path)
    r = cli("rewrite", "f.py", "--no-cache")
    assert r.exit_code == 0, r.stderr
    after = os.stat(path)
    assert path.read_bytes() == FIXED
    assert (stat.S_IMODE(after.st_mode), after.st_uid, after.st_gid, after.st_nlink) == (0o640, st.st_uid, st.st_gid, 1)


def test_hard_linked_file_is_refused(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "a.py").write_bytes(NEEDS_FIX)
    (tmp_path / "elsewhere.py").hardlink_to(proj / "a.py")
    (proj / "b.py").write_bytes(NEEDS_FIX)
    monkeypatch.chdir(tmp_path)
    before = tree_state(tmp_path)
    r = cli("rewrite", "proj", "--no-cache")
    assert r.exit_code == 2
    assert errors(r.stderr) == [
        f"error: {os.path.join('proj', 'a.py')}: file has 2 hard links and replacing it would split them; not written"
    ]
    assert same_tree(with_files(before, **{"proj/b.py": FIXED}), tree_state(tmp_path))


# Things that are not regular files (a separate process: the old behaviour was to hang) ------------------


def test_fifo_and_socket_in_a_walked_folder_are_skipped(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    os.mkfifo(proj / "pipe.py")
    os.mkfifo(proj / ".gitignore")  # read by the walk itself: skipped, never opened
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(proj / "sock.py"))
    except OSError:  # socket path too long on this machine
        sock.close()
        sock = None
    (proj / "good.py").write_bytes(NEEDS_FIX)
    before = tree_state(tmp_path)
    r = subprocess_cli("rewrite", "proj", "--no-cache", cwd=tmp_path, timeout=30)
    if sock is not None:
        sock.close()
    stderr = r.stderr.decode()
    assert r.returncode == 0, stderr
    assert f"warning: {os.path.join('proj', 'pipe.py')}: not a regular file (named pipe); not opened" in warnings(
        stderr
    )
    if sock is not None:
        assert f"warning: {os.path.join('proj', 'sock.py')}: not a regular file (socket); not opened" in warnings(
            stderr
        )
    assert same_tree(with_files(before, **{"proj/good.py": FIXED}), tree_state(tmp_path))


def test_fifo_named_on_the_command_line_is_an_error(tmp_path):
    os.mkfifo(tmp_path / "pipe.py")
    (tmp_path / "good.py").write_bytes(NEEDS_FIX)
    before = tree_state(tmp_path)
    r = subprocess_cli("rewrite", "pipe.py", "good.py", "--no-cache", cwd=tmp_path, timeout=30)
    assert r.returncode == 2
    assert errors(r.stderr.decode()) == ["error: pipe.py: not a regular file (named pipe); not opened"]
    assert same_tree(with_files(before, **{"good.py": FIXED}), tree_state(tmp_path))


# .gitignore lines git accepts but cannot use ---------------------------------------------------------------


@pytest.mark.parametrize("bad_line", ["!", "trailing\\", "[z-a]", "\\"])
def test_unusable_gitignore_lines_are_dropped_and_the_rest_kept(tmp_path, monkeypatch, bad_line):
    (tmp_path / ".gitignore").write_text(f"{bad_line}\nskip_me.py\n")
    (tmp_path / "skip_me.py").write_bytes(NEEDS_FIX)
    (tmp_path / "a.py").write_bytes(NEEDS_FIX)
    monkeypatch.chdir(tmp_path)
    before = tree_state(tmp_path)
    r = cli("rewrite", ".", "--no-cache")
    assert r.exit_code == 0, r.stderr
    assert same_tree(with_files(before, **{"a.py": FIXED}), tree_state(tmp_path))


# Codecs that do not give the same bytes back ---------------------------------------------------------------


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"# coding: unicode_escape\nimport torch\ns = '\\u00e9'\nx = torch.zeros(3).cuda()\n", "ASCII-compatible"),
        (
            b"# coding: raw_unicode_escape\nimport torch\ns = '\\u00e9'\nx = torch.zeros(3).cuda()\n",
            "does not give these bytes back",
        ),
        (b"# coding: utf-7\nimport torch\ns = 'a+b'\nx = torch.zeros(3).cuda()\n", "ASCII-compatible"),
    ],
)
def test_codec_that_does_not_round_trip_is_refused(tmp_path, monkeypatch, data, reason):
    (tmp_path / "enc.py").write_bytes(data)
    # The same codec on bytes it is proven to give back exactly: rewritten.
    proven = b"# coding: raw_unicode_escape\nimport torch\ns = 'caf\xe9'\nx = torch.zeros(3).cuda()\n"
    (tmp_path / "proven.py").write_bytes(proven)
    monkeypatch.chdir(tmp_path)
    before = tree_state(tmp_path)
    r = cli("rewrite", ".", "--no-cache")
    assert r.exit_code == 2
    assert len(errors(r.stderr)) == 1 and errors(r.stderr)[0].startswith("error: enc.py: declared encoding")
    assert reason in errors(r.stderr)[0]
    proven_fixed = proven.replace(b".cuda()", b"").replace(b"(3)", b"(3, device='cuda')")
    assert same_tree(with_files(before, **{"proven.py": proven_fixed}), tree_state(tmp_path))


def test_fixed_text_that_would_read_back_differently_is_not_encoded():
    src = source.decode(b"# coding: raw_unicode_escape\nx = 1\n")
    with pytest.raises(source.SourceError, match="would not read back"):
        src.encode("# coding: raw_unicode_escape\nx = '\\u00e9'\n")  # a backslash-u the codec would decode


# Bytes outside a fix ---------------------------------------------------------------------------------------


FORM_FEED_LINE = b'import torch\ndevice = "cpu"\n\x0c\nx = torch.zeros(3).to(device)\n'
FORM_FEED_LINE_FIXED = b'import torch\ndevice = "cpu"\n\x0c\nx = torch.zeros(3, device=device)\n'


@pytest.mark.parametrize(
    "data,what",
    [
        (b'import torch\ndevice = "cpu"\n\x0cx = torch.zeros(3).to(device)\ny = 1\n', "a form feed at line 3"),
        (b'import torch\rdevice = "cpu"\rx = torch.zeros(3).to(device)\r', "a carriage return at line 3"),
    ],
)
@pytest.mark.parametrize("flag", ["--diff", None])
def test_bytes_libcst_would_drop_make_the_file_refused(tmp_path, monkeypatch, data, what, flag):
    (tmp_path / "m.py").write_bytes(data)
    (tmp_path / "ok.py").write_bytes(FORM_FEED_LINE)  # a form feed LibCST keeps: fixed as usual
    monkeypatch.chdir(tmp_path)
    before = tree_state(tmp_path)
    r = cli("rewrite", ".", "--no-cache", *([flag] if flag else []))
    assert r.exit_code == 2
    assert errors(r.stderr) == [
        f"error: m.py: LibCST would not keep {what} byte for byte, so no fix is written (left unchanged)"
    ]
    expected = before if flag else with_files(before, **{"ok.py": FORM_FEED_LINE_FIXED})
    assert same_tree(expected, tree_state(tmp_path))


def test_stdin_filter_gives_back_bytes_libcst_would_drop(tmp_path, monkeypatch):
    data = b'import torch\ndevice = "cpu"\n\x0cx = torch.zeros(3).to(device)\n'
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["rewrite", "-", "--no-cache"], input=data, catch_exceptions=False)
    assert r.exit_code == 2
    assert r.stdout_bytes == data
    assert errors(r.stderr) == [
        "error: -: LibCST would not keep a form feed at line 3 byte for byte, so no fix is written (left unchanged)"
    ]


# File names that are not UTF-8, printed to a strict UTF-8 stream ---------------------------------------------


STRICT = {"PYTHONIOENCODING": "utf-8:strict", "LC_ALL": "C.UTF-8"}


@pytest.mark.parametrize(
    "args,code",
    [
        (["rewrite", ".", "--diff"], 2),
        (["rewrite", ".", "--check"], 2),
        (["rewrite", ".", "--check", "--output-format", "json"], 2),
        (["check", ".", "--output-format", "sarif"], 2),
        (["check", ".", "--output-format", "github"], 2),
        (["check", "."], 2),
        (["rewrite", "."], 2),
    ],
)
def test_non_utf8_file_names_are_printed_not_a_traceback(tmp_path, args, code):
    good, broken = os.fsdecode(b"caf\xe9.py"), os.fsdecode(b"bad\xff.py")
    (tmp_path / good).write_bytes(NEEDS_FIX)
    (tmp_path / broken).write_bytes(b"def f(:\n")
    before = tree_state(tmp_path)
    r = subprocess_cli(*args, "--no-cache", cwd=tmp_path, env_extra=STRICT)
    out, err = r.stdout.decode("utf-8"), r.stderr.decode("utf-8")
    assert r.returncode == code, err
    assert "Traceback" not in err
    assert errors(err) and errors(err)[0].startswith("error: bad\\xff.py: syntax error")
    if args != ["rewrite", "."]:  # a plain rewrite names only the files it could not process
        assert "xe9.py" in out + err  # the name, with its odd byte written out (escaped again in JSON)
    expected = with_files(before, **{good: FIXED}) if args == ["rewrite", "."] else before
    assert same_tree(expected, tree_state(tmp_path))
