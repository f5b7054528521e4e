"""Math answers checked with math-verify (HuggingFace's parser and sympy-based comparer).

Gold answers: GSM8K's ``... #### 1,234`` (the text after the last ``####``), a ``\\boxed{}``
expression or a plain number. Completions: the last ``\\boxed{}`` answer if any, else the last
expression math-verify extracts (a final plain number such as "so the answer is 42."), and text
after a ``####`` marker when the model writes GSM8K's format.

math-verify's own timeouts use ``signal.alarm``, which fails outside the main thread; scoring here
runs in a thread pool, so they are off and the completion is cut to its last `max_chars`
characters instead (the answer is at the end) to bound the parsing time.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from trainer.data.problem import Problem
from trainer.rewards.base import TextVerifier, register_verifier

_log = logging.getLogger(__name__)


def gold_text(answer: str) -> str:
    """The gold answer to parse: the text after the last ``####`` (GSM8K), else `answer`.

    Thousands separators are removed from a GSM8K answer ("1,234" -> "1234").
    """
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip().replace(",", "")
    return answer.strip()


@register_verifier
class MathVerifier(TextVerifier):
    """1.0 if the completion's final answer equals the gold answer under math-verify, else 0.0.

    Args:
      max_chars: only the last `max_chars` characters of a completion are parsed (> 0).

    Raises:
      ValueError: for max_chars <= 0.
    """

    name: ClassVar[str] = "math"

    def __init__(self, *, max_chars: int = 2000):
        if max_chars <= 0:
            raise ValueError(f"max_chars must be > 0; got {max_chars}")
        import math_verify  # heavy (sympy): imported when a verifier is made

        self._mv = math_verify
        self._config = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
        self.max_chars = max_chars

    def _parse(self, text: str) -> list:
        return self._mv.parse(text, extraction_config=self._config, parsing_timeout=None)

    def extract(self, completion: str) -> list:
        """math-verify's parse of the completion's final answer: ``[sympy value, its text]``,
        or ``[]`` when there is none (read from the last `max_chars` characters, after a
        ``####`` marker when there is one)."""
        text = completion[-self.max_chars :]
        if "####" in text:
            text = text.rsplit("####", 1)[1]
        return self._parse(text)

    def score(self, completion: str, problem: Problem) -> float:
        """1.0 or 0.0 (see the class docstring).

        Raises:
          ValueError: if the gold answer of `problem` cannot be parsed.
        """
        gold = self._parse(gold_text(problem.answer))
        if not gold:
            raise ValueError(f"problem {problem.problem_id}: cannot parse gold {problem.answer!r}")
        pred = self.extract(completion)
        if not pred:
            return 0.0
        try:
            return 1.0 if self._mv.verify(gold, pred, timeout_seconds=None) else 0.0
        except Exception:  # sympy can raise on odd expressions: an unverifiable answer scores 0
            _log.debug("math-verify failed on %r", pred, exc_info=True)
            return 0.0
