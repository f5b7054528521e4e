"""The gold answer of a data row, in one of the forms benchmark files use.

- ``number``: the field is a JSON number (or a string holding one): ``27.0``, ``"025"``;
- ``hash``: the text after the last ``####`` (GSM8K's ``...\\n#### 1,234``; commas dropped);
- ``boxed``: the content of the last ``\\boxed{...}`` (MATH / Minerva solutions);
- ``regex``: the first match of a regular expression (its group 1 if it has a group);
- ``auto``: number for a JSON number, then hash, then boxed, then the leading number of a text
  that starts with one and goes on with words (ASDiv's ``"9 (apples)"`` -> ``9``), else the
  whole text.

The result is a gold text math-verify parses: a plain number, or a LaTeX expression wrapped in
``$...$`` (so ``1.5\\times10^{8}`` parses whole, not as its first number).
"""

from __future__ import annotations

import re
from typing import Any, Literal

AnswerForm = Literal["auto", "number", "hash", "boxed", "regex"]
ANSWER_FORMS: tuple[str, ...] = ("auto", "number", "hash", "boxed", "regex")
_NUMBER = re.compile(r"^[+-]?(\d[\d,]*\.?\d*|\.\d+)([eE][+-]?\d+)?$")
#: A number, then a unit or a remark: words or a parenthesis, with no digit, operator or LaTeX.
_LEADING = re.compile(
    r"^\s*([+-]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(?:\s[A-Za-z]|\()[^\d=+*/^\\$]*$"
)
#: A word of two or more letters that is not a LaTeX command (no backslash before it).
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")


def leading_number(text: str) -> str | None:
    """The number a text starts with when words or a parenthesis follow it (a unit or a remark,
    as ASDiv's ``"9 (apples)"`` or ``"12.5 cm"``), commas dropped; None otherwise (``"2x + 1"``,
    ``"3:4"``, ``"9 (3+6)"``, ``"3 hours 20 minutes"`` and a bare number are not read).
    """
    found = _LEADING.match(text)
    return found.group(1).replace(",", "") if found else None


def is_prose(gold: str) -> bool:
    """Whether a gold text (a result of `gold_answer`) holds a word outside LaTeX commands, e.g.
    ``"$three apples$"``: math-verify reads each letter as a symbol, so no completion matches it.
    """
    return _WORD.search(gold) is not None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in `text`, braces
    balanced; None when there is none or its braces do not close."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
        i += 1
    return None


def _as_gold(text: str) -> str:
    text = text.strip()
    plain = text.replace(",", "")
    if _NUMBER.match(plain):
        return plain
    return text if text.startswith("$") else f"${text}$"


def gold_answer(value: Any, form: AnswerForm = "auto", regex: str = "") -> str:
    """The gold text of the answer field's `value` read in `form` (see the module docstring).

    Args:
      value: the field's JSON value (str, int or float).
      regex: the pattern of form "regex".

    Raises:
      ValueError: the value does not have that form (the message says what it lacks).
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"expected a string or a number, got {type(value).__name__}")
    if form == "auto":
        if isinstance(value, (int, float)):
            form = "number"
        elif "####" in value:
            form = "hash"
        elif last_boxed(value) is not None:
            form = "boxed"
        else:
            return leading_number(value) or _as_gold(value)
    text = str(value)
    if form == "number":
        plain = text.strip().replace(",", "")
        if not _NUMBER.match(plain):
            raise ValueError(f"expected a number, got {text[:80]!r}")
        return plain
    if form == "hash":
        if "####" not in text:
            raise ValueError(f"expected '#### ANSWER' in {text[-80:]!r}")
        return _as_gold(text.rsplit("####", 1)[1])
    if form == "boxed":
        boxed = last_boxed(text)
        if boxed is None:
            raise ValueError(f"expected a \\boxed{{...}} answer in {text[-80:]!r}")
        return _as_gold(boxed)
    if form == "regex":
        if not regex:
            raise ValueError("answer form 'regex' needs a pattern (answer_regex)")
        found = re.search(regex, text)
        if found is None:
            raise ValueError(f"pattern {regex!r} does not match {text[-80:]!r}")
        return _as_gold(found.group(1) if found.re.groups else found.group(0))
    raise ValueError(f"unknown answer form {form!r}; expected one of {ANSWER_FORMS}")
