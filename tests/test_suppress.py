from torchopt.rewrite import suppress


def test_forms():
    text = (
        "a = 1  # noqa\n"
        "b = 2  # noqa: TOP101, TOP102\n"
        "c = 3  # torchopt: ignore[TOP103]\n"
        "d = '# noqa'\n"
        "e = 5  # noqa: E501\n"
    )
    t = suppress.parse(text)
    assert suppress.is_suppressed(t, "TOP999", (1,))
    assert suppress.is_suppressed(t, "TOP102", (2,))
    assert not suppress.is_suppressed(t, "TOP103", (2,))
    assert suppress.is_suppressed(t, "TOP103", (3,))
    assert not suppress.is_suppressed(t, "TOP101", (4,)), "a string is not a comment"
    assert not suppress.is_suppressed(t, "TOP101", (5,)), "another tool's code does not silence ours"


def test_end_line_counts():
    t = suppress.parse("x = f(\n  1,\n)  # noqa: TOP101\n")
    assert suppress.is_suppressed(t, "TOP101", (1, 3))
