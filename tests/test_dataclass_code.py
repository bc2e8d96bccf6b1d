"""The compiled methods of dataclasses kept between processes (torchopt/rewrite/dataclass_code.py):
a class made with the table behaves as one made by ``dataclasses`` alone, a second process
compiles nothing, and the entry point's quick path writes the table and reads it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from torchopt.rewrite import dataclass_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SOURCE = """
from dataclasses import dataclass, field

@dataclass(frozen=True)
class Point:
    x: int
    y: int = 0
    tags: tuple = field(default=(), repr=False)

@dataclass(order=True)
class Box:
    name: str
    items: list = field(default_factory=list)
"""


def _classes() -> dict:
    ns: dict = {"__name__": "made_here"}
    exec(compile(SOURCE, "<made_here>", "exec", dont_inherit=True), ns)
    return ns


def _methods(cls: type) -> dict:
    return {k: v.__code__ for k, v in vars(cls).items() if hasattr(v, "__code__")}


def _behaviour(ns: dict) -> list:
    Point, Box = ns["Point"], ns["Box"]
    p = Point(1, 2, ("a",))
    out: list = [repr(p), p == Point(1, 2, ("b",)), hash(p) == hash(Point(1, 2, ("a",))), repr(Box("b"))]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.x = 3  # type: ignore[misc]  # frozen: the point of the assertion
    out.append(Box("a") < Box("b"))
    with pytest.raises(TypeError):
        Point()  # type: ignore[call-arg]  # x is required: the point of the assertion
    return out


def _installed() -> dataclass_code.CompiledMethods:
    methods = dataclass_code.installed()
    assert methods is not None
    return methods


@pytest.fixture
def fresh():
    dataclass_code.uninstall()
    yield
    dataclass_code.uninstall()


def test_same_methods_and_behaviour_first_and_second_time(tmp_path, fresh, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    plain = _classes()
    path = str(tmp_path / "table.marshal")
    assert dataclass_code.install(path)
    first = _classes()
    _installed().save()
    dataclass_code.uninstall()
    assert os.path.getsize(path) > 0

    assert dataclass_code.install(path)
    second = _classes()
    assert _installed().new == []  # every method came from the table: nothing compiled
    assert len(_installed().used) > 5
    for made in (first, second):
        for name in ("Point", "Box"):
            assert _methods(made[name]) == _methods(plain[name])
        assert _behaviour(made) == _behaviour(plain)


def test_a_damaged_table_is_compiled_again(tmp_path, fresh):
    plain = _classes()
    path = tmp_path / "table.marshal"
    path.write_bytes(b"not a table")
    assert dataclass_code.install(str(path))
    made = _classes()
    assert _installed().new  # compiled, as without a table
    assert _behaviour(made) == _behaviour(plain)


def test_nothing_written_where_bytecode_is_not(tmp_path, fresh, monkeypatch):
    path = tmp_path / "table.marshal"
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert dataclass_code.install(str(path))
    _classes()
    _installed().save()
    assert not path.exists()


def test_the_quick_path_writes_the_table_and_reads_it(tmp_path):
    """Two runs of `check -`: the first may compile and write, the second compiles nothing; both
    print the same. The table lives beside the bytecode cache, here under a prefix of the test's."""
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONPYCACHEPREFIX": str(tmp_path)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("TORCHOPT_NO_SPEEDUPS", None)
    probe = (
        "import atexit, sys\n"
        "from torchopt.__main__ import main\n"
        "from torchopt.rewrite import dataclass_code as d\n"
        "atexit.register(lambda: print('compiled', len(d.installed().new), file=sys.stderr))\n"
        "sys.argv = ['torchopt', 'check', '-', '--stdin-filename', 'train.py']\n"
        "main()\n"
    )
    text = "import torch\nx = torch.zeros(3).cuda()\n"
    runs = [
        subprocess.run([sys.executable, "-c", probe], input=text, capture_output=True, text=True, env=env, cwd=ROOT)
        for _ in range(2)
    ]
    assert runs[0].stdout == runs[1].stdout and "TOP101" in runs[0].stdout
    assert "compiled 0" not in runs[0].stderr.splitlines()[-1]
    assert runs[1].stderr.splitlines()[-1] == "compiled 0"
    assert any(p.endswith(".marshal") for _, _, files in os.walk(tmp_path) for p in files)
