"""`envs.arith`: exact values of model-written arithmetic, and every hostile input refused with
a reason, fast and small."""

from __future__ import annotations

from fractions import Fraction

import pytest

from envs.arith import ArithRefused, evaluate, format_value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2*(3+4.5)", Fraction(15)),
        ("1/3*3", Fraction(1)),
        ("0.1+0.2", Fraction(3, 10)),
        ("7 // 2", Fraction(3)),
        ("-7 % 3", Fraction(2)),
        ("2**10", Fraction(1024)),
        ("2**-2", Fraction(1, 4)),
        ("-(5-8)", Fraction(3)),
        (" 48 / 2 + 48 ", Fraction(72)),
    ],
)
def test_exact_values(text, value):
    assert evaluate(text) == value


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (Fraction(42), "42"),
        (Fraction(-7), "-7"),
        (Fraction(5, 2), "2.5"),
        (Fraction(1, 3), "0.333333333333"),
        (Fraction(10) ** 40, "1e+40"),
        (Fraction(123456789012345, 10**50), "1.23456789012e-36"),
    ],
)
def test_format(value, text):
    assert format_value(value) == text


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("open('/etc/passwd')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j * 2", "only numbers"),
        ("1 < 2", "Compare is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 << 5", "LShift is not allowed"),
        ("1 / 0", "division by zero"),
        ("5 % (2 - 2)", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ** 0.5", "integer exponents"),
        ("2 ** 65", "exponent larger than 64"),
        ("99 ** 64", "too large"),
        ("9" * 100, "too large"),
        ("1 +", "not an arithmetic expression"),
        ("1; import os", "not an arithmetic expression"),
        ("(" * 300 + "1" + ")" * 300, "longer than 256"),
        ("+".join(["1"] * 60), "more than 64 parts"),
    ],
)
def test_refused_with_a_reason(text, why):
    with pytest.raises(ArithRefused, match=why):
        evaluate(text)


def test_worst_cases_stay_within_the_bit_bound():
    """The biggest value the bounds allow and nested powers: computed exactly or refused, and
    never a value over 256 bits."""
    assert evaluate("2**64*2**64*2**64*2**63") == Fraction(2) ** 255
    with pytest.raises(ArithRefused, match="too large"):
        evaluate("2**64*2**64*2**64*2**64")
    with pytest.raises(ArithRefused, match="too large"):
        evaluate("((((2**8)**8)**2)**2)")
    assert evaluate("(" * 99 + "1" + ")" * 99) == 1
