"""Problems from any JSONL file: the prompt is a template over the row's fields, the gold answer
one field read in an answer form (`trainer.rewards.answer_forms`), scored with math-verify.

``{"Body": "...", "Question": "...", "Answer": 72}`` with ``template="{Body} {Question}"`` and
``answer_field="Answer"`` gives the problem ``jsonl/<file stem>/<line index>``.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from trainer.rewards.answer_forms import AnswerForm, gold_answer
from trainer.rewards.base import Problem


def template_fields(template: str) -> list[str]:
    """The field names `template` reads (``"{Body} {Question}"`` -> ``["Body", "Question"]``).

    Raises:
      ValueError: the template is not a valid ``str.format`` template or reads a positional
        field (``{}`` / ``{0}``).
    """
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as err:
        raise ValueError(f"prompt template {template!r}: {err}") from None
    if any(not n or n.isdigit() for n in names):
        raise ValueError(f"prompt template {template!r}: name every field, e.g. {{question}}")
    return names


def load_jsonl_problems(
    path: str | Path,
    *,
    template: str = "{question}",
    answer_field: str = "answer",
    answer_form: AnswerForm = "auto",
    answer_regex: str = "",
    limit: int | None = None,
    suffix: str = "",
    verifier: str = "math",
    max_new_tokens_field: str = "",
) -> list[Problem]:
    """Read the first `limit` rows of a JSONL file as problems.

    Args:
      path: a file of one JSON object per line (blank lines skipped).
      template: ``str.format`` template over the row's fields giving the question.
      answer_field: the row's field holding the gold answer, read in `answer_form`
        (`answer_regex` for the "regex" form).
      limit: rows read from the top; None: all.
      suffix: text appended to each question. verifier: registry name stored in each problem.
      max_new_tokens_field: the row's field holding the problem's completion budget
        (`Problem.max_new_tokens`: an integer >= 1; a null: none); empty: no budgets (every
        problem gets the run's rollout.max_new_tokens).

    Returns:
      Problems with id ``"jsonl/<file stem>/<line index>"``; ``metadata["row"]`` is the row.

    Raises:
      FileNotFoundError: no such file. ValueError: naming ``file:line`` and the field for a line
        that is not a JSON object, a row without a field the template or the answer needs, an
        answer not in its form, or a budget that is not an integer >= 1; a bad template.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSONL data file not found: {path}")
    fields = template_fields(template)
    needed = [(f, "the prompt template") for f in fields] + [(answer_field, "the answer field")]
    if max_new_tokens_field:
        needed.append((max_new_tokens_field, "the budget field"))
    problems: list[Problem] = []
    with path.open(encoding="utf-8") as f:
        for index, line in enumerate(f):
            if limit is not None and len(problems) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{index + 1}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for name, use in needed:
                if name.split(".")[0].split("[")[0] not in row:
                    raise ValueError(
                        f"{where}: the row has no field {name!r} ({use}); it has {sorted(row)}"
                    )
            try:
                gold = gold_answer(row[answer_field], answer_form, answer_regex)
            except ValueError as err:
                raise ValueError(f"{where}: field {answer_field!r}: {err}") from None
            budget = row[max_new_tokens_field] if max_new_tokens_field else None
            if budget is not None and (type(budget) is not int or budget < 1):
                raise ValueError(
                    f"{where}: field {max_new_tokens_field!r}: expected an integer >= 1 (new "
                    f"tokens), got {budget!r}"
                )
            question = template.format_map(row) + suffix
            problems.append(
                Problem(
                    f"jsonl/{path.stem}/{index}",
                    question,
                    gold,
                    verifier,
                    {"row": row},
                    max_new_tokens=budget,
                )  # fmt: skip
            )
    return problems
