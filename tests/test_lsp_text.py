"""Positions, minimal edits and suppression comments of the language server (no server needed)."""

from __future__ import annotations

import random

import pytest

from torchopt.lsp.text import Edit, Lines, apply_change, apply_edits, ignore_edit, minimal_edits, units


def test_lines_split_like_lsp_not_like_splitlines():
    text = "a = 1\r\nb = '\x0c\u2028'\rc\n"
    lines = Lines(text)
    assert [lines.line(i) for i in range(len(lines))] == ["a = 1", "b = '\x0c\u2028'", "c", ""]
    assert lines.position(text.index("c")) == (2, 0)


@pytest.mark.parametrize("enc,col", [("utf-8", 12), ("utf-16", 9), ("utf-32", 8)])
def test_columns_in_each_encoding(enc, col):
    lines = Lines("import torch\nb = 'é😀x'\n")
    assert lines.to_client(1, 8, enc) == (1, col)  # the closing quote
    assert lines.from_client(1, col, enc) == lines.starts[1] + 8
    assert lines.from_client(1, col - 1, enc) == lines.starts[1] + 7  # the `x`
    if enc != "utf-32":  # a position inside the emoji counts as before it
        assert lines.from_client(1, col - 2, enc) == lines.starts[1] + 6


def test_units():
    assert units("😀é", "utf-16") == 3 and units("😀é", "utf-8") == 6 and units("😀é", "utf-32") == 2


def test_apply_change_with_emoji_before():
    text = "s = '😀'; x = 1\n"
    assert apply_change(text, (0, 14), (0, 15), "2", "utf-16") == "s = '😀'; x = 2\n"
    assert apply_change(text, None, None, "new", "utf-16") == "new"


def test_minimal_edits_are_small_and_exact():
    old = "import torch\n\nx = torch.zeros(3).cuda()\ny = 1\n"
    new = "import torch\n\nx = torch.zeros(3, device='cuda')\ny = 1\n"
    (e,) = minimal_edits(old, new)
    assert old[e.start : e.end] == ").cuda(" and e.text == ", device='cuda'"
    assert minimal_edits(old, old) == []
    rnd = random.Random(7)
    for _ in range(500):
        a = "".join(rnd.choice("ab\n\r😀") for _ in range(rnd.randint(0, 40)))
        b = "".join(rnd.choice("ab\n\r😀") for _ in range(rnd.randint(0, 40)))
        edits = minimal_edits(a, b)
        assert apply_edits(a, edits) == b
        assert all(x.end <= y.start for x, y in zip(edits, edits[1:]))  # ordered, no overlap


def test_minimal_edits_on_a_long_file_stay_local():
    old = "".join(f"line_{i} = {i}\n" for i in range(3000))
    new = old.replace("line_10 = 10\n", "line_10 = 11\nimport os\n").replace("line_2900 = 2900", "line_2900 = 0")
    edits = minimal_edits(old, new)
    assert apply_edits(old, edits) == new
    assert sum(e.end - e.start + len(e.text) for e in edits) < 30


@pytest.mark.parametrize(
    "src,want",
    [
        ("x = 1\n", "x = 1  # noqa: TOP101\n"),
        ("x = 1   \n", "x = 1  # noqa: TOP101\n"),
        ("x = 1  # noqa: TOP102\n", "x = 1  # noqa: TOP102, TOP101\n"),
        ("x = 1  # noqa:TOP102,TOP103 trailing words\n", "x = 1  # noqa:TOP102,TOP103, TOP101 trailing words\n"),
        ("x = 1  # torchopt: ignore[TOP102]\n", "x = 1  # torchopt: ignore[TOP102, TOP101]\n"),
        ("x = 1  # a note\n", "x = 1  # a note  # noqa: TOP101\n"),
        ("x = 1\r\n", "x = 1  # noqa: TOP101\r\n"),
    ],
)
def test_ignore_comment(src, want):
    edit = ignore_edit(src, "TOP101", (0,))
    assert edit is not None and apply_edits(src, [edit]) == want


def test_ignore_comment_skips_lines_it_cannot_end():
    src = 'x = f("""a\nb""")\n'  # line 0 ends inside a string: the comment goes on the end line
    assert apply_edits(src, [ignore_edit(src, "TOP101", (0, 1))]) == 'x = f("""a\nb""")  # noqa: TOP101\n'
    src = "x = 1 + \\\n    2\n"  # nothing may follow a backslash continuation
    assert apply_edits(src, [ignore_edit(src, "TOP101", (0, 1))]) == "x = 1 + \\\n    2  # noqa: TOP101\n"
    assert ignore_edit('x = """a\nb\nc"""\n', "TOP101", (1,)) is None


def test_edit_is_a_value():
    assert Edit(1, 2, "x") == Edit(1, 2, "x")


@pytest.mark.parametrize("enc", ["utf-8", "utf-16", "utf-32"])
def test_a_change_lands_where_a_whole_split_of_the_text_puts_it(enc):
    """apply_change finds the changed line without splitting every line of a text that has no
    carriage return; the offsets must be those of Lines.from_client, past the end included."""
    rng = random.Random(3)
    text = "import torch\n\nx = 'é😀'\n\n\ty = 2\nlast"
    for tail in ("", "\n"):
        t = text + tail
        lines = Lines(t)
        for _ in range(300):
            pos = [(rng.randrange(-1, 9), rng.randrange(0, 14)) for _ in range(2)]
            a, b = sorted(lines.from_client(max(0, ln), ch, enc) if ln >= 0 else 0 for ln, ch in pos)
            assert apply_change(t, pos[0], pos[1], "Z", enc) == t[:a] + "Z" + t[b:], (pos, enc)
