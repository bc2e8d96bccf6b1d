"""What a call passes for a parameter: the one reading of a call's arguments that the value facts
(parameters take what their callers pass) and the determinism facts (a helper asked to be deterministic
by its caller) share."""

from __future__ import annotations

import libcst as cst
import pytest

from torchopt.analysis.arguments import passed


def _call(src: str) -> cst.Call:
    expr = cst.parse_expression(src)
    assert isinstance(expr, cst.Call)
    return expr


def _code(value: cst.BaseExpression | None) -> str | None:
    return None if value is None else cst.Module([]).code_for_node(value)


@pytest.mark.parametrize(
    ("src", "name", "at", "expected"),
    [
        ("train(args, 3)", "epochs", 1, (True, "3")),
        ("train(args, epochs=5)", "epochs", 1, (True, "5")),
        ("train(args)", "epochs", 1, (True, None)),  # nothing passed: the default applies
        ("train(*rest)", "epochs", 1, (False, None)),  # a star may fill it
        ("train(args, **extra)", "epochs", 1, (False, None)),
        ("train(*rest, epochs=7)", "epochs", 1, (True, "7")),  # a written keyword wins over a star
        ("train(seed=1, args=a)", "args", 0, (True, "a")),
    ],
)
def test_passed_reads_the_argument_python_binds(src: str, name: str, at: int, expected: tuple) -> None:
    known, value = passed(_call(src), name, at)
    assert (known, _code(value)) == expected
