"""Every ``# type: ignore`` in torchopt names the error it silences and says why (CONTRIBUTING.md,
"Types"): an ignore without a code hides every future error on its line, and one without a reason
cannot be judged when the stubs or the code change. ``mypy torchopt`` (in .ci/run) reports the ones
that silence nothing."""

from __future__ import annotations

import re
import tokenize
from pathlib import Path

TORCHOPT = Path(__file__).resolve().parent.parent / "torchopt"

_IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<codes>\[[^\]]*\])?(?P<rest>.*)")
_REASON = re.compile(r"\s+#\s*\S")


def unexplained_ignores(root: Path) -> list[str]:
    """``path:line: comment`` for each ignore under ``root`` without ``[code]`` or a ``# reason`` after it."""
    found = []
    for path in sorted(root.rglob("*.py")):
        with path.open("rb") as fh:
            comments = [(t.start[0], t.string) for t in tokenize.tokenize(fh.readline) if t.type == tokenize.COMMENT]
        for line, text in comments:
            hit = _IGNORE.search(text)
            if hit and (not hit.group("codes") or not _REASON.match(hit.group("rest"))):
                found.append(f"{path.relative_to(root)}:{line}: {text}")
    return found


def test_every_ignore_in_torchopt_has_a_code_and_a_reason():
    assert unexplained_ignores(TORCHOPT) == []


def test_bare_and_unexplained_ignores_are_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        "x: int = 'a'  # type: ignore\n"
        "y: int = 'b'  # type: ignore[assignment]\n"
        "z: int = 'c'  # type: ignore[assignment]  # a stub gap, with its reason\n"
        "s = '# type: ignore'  # a string, not a comment\n",
        encoding="utf-8",
    )
    assert unexplained_ignores(tmp_path) == ["pkg/a.py:1: # type: ignore", "pkg/a.py:2: # type: ignore[assignment]"]
