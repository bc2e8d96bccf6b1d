"""TOP610 reads a parameter's annotation to tell a tensor from a Python value: however the
annotation is spelled (spaced dots, parentheses, a string, an alias), `torchopt check` reports a
loop over a tensor's rows and stays silent for a Python-typed or literal-defaulted parameter."""

from __future__ import annotations

import hashlib
from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

from torchopt.cli import app

ROW_LOOP = "    total = 0\n    for row in a:\n        total = total + row.sum()\n    return total\n\n\n"
INDEX_LOOP = "    total = 0\n    for i in range(a.size(0)):\n        total = total + a[i]\n    return total\n\n\n"

# (signature, body, reported?)
CASES = [
    ("def plain_loss(a: torch.Tensor):", ROW_LOOP, True),
    ("def spaced_loss(a: torch . Tensor):", ROW_LOOP, True),
    ("def parenthesised_loss(a: (T.Tensor)):", ROW_LOOP, True),
    ("def string_loss(a: 'torch.Tensor'):", ROW_LOOP, True),
    ("def optional_loss(a: Optional[torch.Tensor] = None):", ROW_LOOP, True),
    ("def unannotated_loss(a):", ROW_LOOP, False),  # a bare name needs evidence that it holds a tensor
    ("def int_loss(a: builtins.int):", INDEX_LOOP, False),
    ("def list_loss(a: typing.List[torch.Tensor]):", INDEX_LOOP, False),
    ("def defaulted_loss(a: torch.Tensor = 0.0):", INDEX_LOOP, False),
    ("def untyped_index_loss(a):", INDEX_LOOP, True),
]


def _source() -> str:
    head = dedent("""\
        import builtins
        import typing
        from typing import Optional

        import torch
        import torch as T


        """)
    return head + "".join(f"{sig}\n{body}" for sig, body, _ in CASES)


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_annotation_spellings_decide_which_row_loops_are_reported(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "losses.py").write_text(_source(), encoding="utf-8")
    before = _hashes(tmp_path)
    res = CliRunner().invoke(app, ["check", str(root), "--select", "TOP610", "--no-cache"])
    assert _hashes(tmp_path) == before
    reported = {
        line.split(" in the loss function `")[1].split("`")[0] for line in res.output.splitlines() if " TOP610 " in line
    }
    expected = {sig.split("(")[0].removeprefix("def ") for sig, _, hit in CASES if hit}
    assert reported == expected, res.output
    assert res.exit_code == 1
