"""Writes cannot be redirected: a folder (or the file itself) swapped for a symbolic link after torchopt
found the files is refused with one line naming the file, and nothing outside the folders given is
read or written. And a rewrite keeps what is attached to the file besides its bytes: user extended
attributes and its ACL (and does not gain an ACL its folder would give a new file). Each test hashes
the project and a folder outside it before and after."""

from __future__ import annotations

import errno
import os
import stat
import struct

import pytest
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite import runner

NEEDS_FIX = b'import torch\ndevice = "cpu"\nx = torch.zeros(3).to(device)\n'
FIXED = b'import torch\ndevice = "cpu"\nx = torch.zeros(3, device=device)\n'


def cli(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def tree(root) -> dict:
    """Every entry under ``root`` without following links: a link by its target, a file by its bytes."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = ("dir",)
            else:
                with open(path, "rb") as fh:
                    out[rel] = ("file", fh.read())
    return out


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """``proj`` with files at the top and in ``sub``; ``outside`` with the same names."""
    proj, outside = tmp_path / "proj", tmp_path / "outside"
    for top in (proj, outside):
        (top / "sub").mkdir(parents=True)
        for rel in ("a.py", "b.py", "sub/c.py", "sub/d.py"):
            (top / rel).write_bytes(NEEDS_FIX)
    monkeypatch.chdir(tmp_path)
    return proj, outside


def swap_during_run(monkeypatch, when: str, swap) -> None:
    """Call ``swap`` once, while torchopt analyses the file named ``when`` (after discovery, before
    the files that follow it are read): a deterministic stand-in for another process racing it."""
    real = runner.process_text
    done = []

    def analyse(text, path, *args, **kwargs):
        if os.path.basename(path) == when and not done:
            done.append(swap())
        return real(text, path, *args, **kwargs)

    monkeypatch.setattr(runner, "process_text", analyse)


@pytest.mark.parametrize("what", ["subfolder", "named-folder", "file"])
def test_path_swapped_for_a_link_during_the_run_is_not_followed(layout, tmp_path, monkeypatch, what):
    proj, outside = layout
    if what == "subfolder":  # mv proj/sub proj/sub.real; ln -s outside/sub proj/sub

        def swap():
            os.rename(proj / "sub", proj / "sub.real")
            os.symlink(outside / "sub", proj / "sub")

        refused = ["sub/c.py", "sub/d.py"]
    elif what == "named-folder":  # the folder given on the command line itself

        def swap():
            os.rename(proj, tmp_path / "proj.real")
            os.symlink(outside, proj)

        refused = ["b.py", "sub/c.py", "sub/d.py"]
    else:  # one file replaced by a link to a file outside

        def swap():
            os.unlink(proj / "b.py")
            os.symlink(outside / "b.py", proj / "b.py")

        refused = ["b.py"]
    swap_during_run(monkeypatch, "a.py", swap)
    before = tree(outside)
    r = cli("rewrite", "proj", "-j", "1", "--no-cache")
    assert r.exit_code == 2, r.output
    assert tree(outside) == before  # nothing outside was read for a fix, nothing written there
    lines = errors(r.stderr)
    assert [line.split(": ", 2)[1] for line in lines] == [os.path.join("proj", p) for p in refused]
    if what == "file":
        assert lines == [f"error: {os.path.join('proj', 'b.py')}: not a regular file (symbolic link); not opened"]
    else:
        assert all("was replaced" in line and line.endswith("not read or written") for line in lines)
    real = tmp_path / "proj.real" if what == "named-folder" else proj
    assert (real / "a.py").read_bytes() == FIXED  # processed before the swap
    moved = real / "sub.real" if what == "subfolder" else real / "sub"
    assert {(moved / n).read_bytes() for n in ("c.py", "d.py")} == {FIXED if what == "file" else NEEDS_FIX}
    assert [p for _, _, fs in os.walk(tmp_path) for p in fs if p.endswith(".tmp")] == []


# Extended attributes and ACLs ----------------------------------------------------------------------------


def _set_or_skip(path, name: str, value: bytes) -> None:
    try:
        os.setxattr(path, name, value)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            pytest.skip(f"this file system does not take {name}: {exc.strerror}")
        raise


def _acl(*entries: tuple[int, int, int]) -> bytes:
    """A POSIX ACL as Linux stores it in system.posix_acl_*: version 2, then (tag, perm, id) entries."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, uid) for tag, perm, uid in entries)


USER_OBJ, USER, GROUP_OBJ, MASK, OTHER, ANY = 0x01, 0x02, 0x04, 0x10, 0x20, 0xFFFFFFFF
ACL_NAME = "system.posix_acl_access"


@pytest.mark.skipif(not hasattr(os, "setxattr"), reason="no extended attributes on this platform")
def test_rewrite_keeps_user_xattrs_and_the_acl(tmp_path, monkeypatch):
    path = tmp_path / "f.py"
    path.write_bytes(NEEDS_FIX)
    _set_or_skip(path, "user.origin", b"dataset-v2")
    _set_or_skip(path, "user.checksum", b"\x00\x01binary\xff")
    acl = _acl((USER_OBJ, 6, ANY), (USER, 4, 1234), (GROUP_OBJ, 4, ANY), (MASK, 4, ANY), (OTHER, 0, ANY))
    _set_or_skip(path, ACL_NAME, acl)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    monkeypatch.chdir(tmp_path)
    r = cli("rewrite", "f.py", "--no-cache")
    assert r.exit_code == 0, r.output
    assert path.read_bytes() == FIXED
    assert os.getxattr(path, "user.origin") == b"dataset-v2"
    assert os.getxattr(path, "user.checksum") == b"\x00\x01binary\xff"
    assert os.getxattr(path, ACL_NAME) == acl
    assert stat.S_IMODE(os.stat(path).st_mode) == mode


@pytest.mark.skipif(not hasattr(os, "setxattr"), reason="no extended attributes on this platform")
def test_rewrite_does_not_add_the_folders_default_acl(tmp_path, monkeypatch):
    """A file made before its folder got a default ACL has none; the new file would inherit it."""
    path = tmp_path / "f.py"
    path.write_bytes(NEEDS_FIX)
    default = _acl((USER_OBJ, 7, ANY), (USER, 7, 1234), (GROUP_OBJ, 5, ANY), (MASK, 7, ANY), (OTHER, 5, ANY))
    _set_or_skip(tmp_path, "system.posix_acl_default", default)
    assert ACL_NAME not in os.listxattr(path)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    monkeypatch.chdir(tmp_path)
    r = cli("rewrite", "f.py", "--no-cache")
    assert r.exit_code == 0, r.output
    assert path.read_bytes() == FIXED
    assert ACL_NAME not in os.listxattr(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
