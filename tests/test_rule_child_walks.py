"""Rules and the analyses they share walk subtrees with ``children_of`` (torchopt.rewrite.metadata):
LibCST's ``node.children`` property rebuilds the node through a visitor on every access, so one walk
over a file with it costs a visit per node it passes. Read from the source with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "torchopt"


def _children_reads(folder: Path) -> list[str]:
    """``path:line`` of every ``<expr>.children`` read in the modules under ``folder``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "children" and isinstance(node.ctx, ast.Load):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_rules_and_analyses_never_read_libcst_children():
    reads = _children_reads(PACKAGE / "codemods") + _children_reads(PACKAGE / "analysis")
    assert not reads, "use children_of(node) instead of node.children at: " + ", ".join(reads)
