"""GSM8K problems from the JSONL files of openai/grade-school-math (never copied into the repo).

Each line is ``{"question": ..., "answer": "...reasoning...\\n#### 72"}``; the gold number is the
text after ``####``. The default folder is ``$JAXRL_DATA_DIR/gsm8k`` (default ``data/gsm8k``
under the working folder): put ``train.jsonl`` and ``test.jsonl`` there, or pass any other path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.data.problem import Problem

#: ``$JAXRL_DATA_DIR/gsm8k``, or ``data/gsm8k`` relative to the working folder.
DEFAULT_GSM8K_DIR = Path(os.environ.get("JAXRL_DATA_DIR", "data")) / "gsm8k"


def load_gsm8k(
    path: str | Path, *, limit: int | None = None, suffix: str = "", verifier: str = "math"
) -> list[Problem]:
    """Read GSM8K problems from a JSONL file.

    Args:
      path: a ``.jsonl`` file (e.g. ``DEFAULT_GSM8K_DIR / "test.jsonl"``).
      limit: read at most this many problems (from the top), all if None.
      suffix: text appended to each question (e.g. an instruction on the answer format).
      verifier: registry name stored in each problem.

    Returns:
      Problems with id ``"gsm8k/<file stem>/<line index>"``, the question (plus suffix), and the
      full GSM8K answer text (its ``####`` number is the gold; see `math_verifier.gold_text`).

    Raises:
      FileNotFoundError: if `path` does not exist; ValueError: for a line that is not a JSON
        object with string "question" and "answer" holding a "####".
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path}")
    problems: list[Problem] = []
    with path.open(encoding="utf-8") as f:
        for index, line in enumerate(f):
            if limit is not None and len(problems) >= limit:
                break
            row = json.loads(line)
            question, answer = row.get("question"), row.get("answer")
            if not isinstance(question, str) or not isinstance(answer, str) or "####" not in answer:
                raise ValueError(
                    f"{path}:{index + 1}: expected string 'question' and 'answer' with '####'; "
                    f"got keys {sorted(row)}"
                )
            problems.append(
                Problem(f"gsm8k/{path.stem}/{index}", question + suffix, answer, verifier)
            )
    return problems
