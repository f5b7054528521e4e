"""Arithmetic on model text without `eval`: a bounded, exact evaluator of + - * / // % ** and
parentheses over integer and decimal literals.

The expression is parsed with Python's own parser (`ast.parse(..., mode="eval")`) and walked
node by node; only numbers, the unary signs and the seven binary operators are accepted, so a
name, a call, an attribute, a string, a comparison or anything else is refused before any value
is computed. Values are exact rationals (`fractions.Fraction`; "0.1" is 1/10), so `1/3*3` is 1.

Every dimension of the work is bounded, so hostile text costs microseconds and a few kilobytes:
- the text: at most `max_chars` characters (default 256) and `max_nodes` syntax nodes (64);
- the values: every intermediate numerator and denominator at most `max_bits` bits (256, about
  77 decimal digits); a power's exponent an integer of magnitude at most `max_exponent` (64),
  and checked against `max_bits` before it is computed;
- the answer: at most `max_result_chars` characters (32); an exact integer or a decimal with up
  to 12 significant digits, in scientific notation when longer.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
from fractions import Fraction


class ArithRefused(ValueError):
    """The text is not an expression this evaluator computes, or its value is out of bounds;
    the message says why in words a model can read back."""


@dataclasses.dataclass(frozen=True)
class ArithLimits:
    """Bounds of one evaluation (see the module docstring)."""

    max_chars: int = 256
    max_nodes: int = 64
    max_bits: int = 256
    max_exponent: int = 64
    max_result_chars: int = 32


DEFAULT_LIMITS = ArithLimits()

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def evaluate(text: str, limits: ArithLimits = DEFAULT_LIMITS) -> Fraction:
    """The exact value of the arithmetic expression `text` ("2*(3+4.5)", "7 // 2", "2**10").

    Raises:
        ArithRefused: too long, not an expression, a refused construct (names, calls,
            strings, booleans, comparisons, ...), division by zero, a non-integer or too large
            exponent, or an intermediate value over `limits.max_bits` bits.
    """
    if len(text) > limits.max_chars:
        raise ArithRefused(f"expression longer than {limits.max_chars} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ArithRefused("not an arithmetic expression") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > limits.max_nodes:
        raise ArithRefused(f"expression has more than {limits.max_nodes} parts")
    return _value(tree.body, limits)


def _checked(x: Fraction, limits: ArithLimits) -> Fraction:
    if max(abs(x.numerator).bit_length(), x.denominator.bit_length()) > limits.max_bits:
        raise ArithRefused("number too large")
    return x


def _value(node: ast.AST, limits: ArithLimits) -> Fraction:
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ArithRefused(f"only numbers are allowed, got {type(v).__name__}")
        return _checked(Fraction(repr(v)) if isinstance(v, float) else Fraction(v), limits)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        x = _value(node.operand, limits)
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp):
        a, b = _value(node.left, limits), _value(node.right, limits)
        if isinstance(node.op, ast.Pow):
            return _power(a, b, limits)
        fn = _BINARY.get(type(node.op))
        if fn is None:
            raise ArithRefused(f"operator {type(node.op).__name__} is not allowed")
        if b == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
            raise ArithRefused("division by zero")
        return _checked(Fraction(fn(a, b)), limits)
    raise ArithRefused(f"{type(node).__name__} is not allowed in arithmetic")


def _power(base: Fraction, exp: Fraction, limits: ArithLimits) -> Fraction:
    if exp.denominator != 1:
        raise ArithRefused("only integer exponents are allowed")
    e = exp.numerator
    if abs(e) > limits.max_exponent:
        raise ArithRefused(f"exponent larger than {limits.max_exponent}")
    if base == 0 and e < 0:
        raise ArithRefused("division by zero")
    bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if bits * abs(e) > limits.max_bits + abs(e):  # |base|**e has about bits*e bits
        raise ArithRefused("number too large")
    return _checked(base**e, limits)


def format_value(x: Fraction, limits: ArithLimits = DEFAULT_LIMITS) -> str:
    """`x` as a model reads it: an integer exactly ("42", "-7"), else a decimal with up to 12
    significant digits ("0.333333333333", "2.5"); scientific notation when either would be
    longer than `limits.max_result_chars` ("1.23456789012e+40")."""
    if x.denominator == 1:
        text = str(x.numerator)
        if len(text) <= limits.max_result_chars:
            return text
    text = f"{float(x):.12g}"  # |x| < 2**max_bits: a finite float
    return text if len(text) <= limits.max_result_chars else f"{float(x):.6e}"
