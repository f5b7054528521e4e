"""Problems from any JSONL file: the prompt is a template over the row's fields, the gold answer
one field read in an answer form (`trainer.data.answer_forms`), scored with math-verify.

``{"Body": "...", "Question": "...", "Answer": 72}`` with ``template="{Body} {Question}"`` and
``answer_field="Answer"`` gives the problem ``jsonl/<file stem>/<line index>``.
"""

from __future__ import annotations

import dataclasses
import json
import string
from pathlib import Path

from trainer.data.answer_forms import AnswerForm, gold_answer, is_prose
from trainer.data.problem import Problem


@dataclasses.dataclass
class UnparsedGolds:
    """The golds of the rows read that do not parse in the chosen answer form, as
    `load_jsonl_problems` fills it when given one.

    Attributes:
      rows: rows read (blank lines not counted).
      lines: ``"file:line: reason"`` of each gold that does not parse, in file order.
      left_out: the rows of `lines` were left out of the problems (a form other than "auto";
        under "auto" nothing fails, and a gold read whole as words is kept).
    """

    rows: int = 0
    lines: list[str] = dataclasses.field(default_factory=list)
    left_out: bool = False

    def warning(self, field: str, form: str) -> str | None:
        """One line for stderr with the count and the first example, or None when every gold
        parses. E.g. ``warning: 2 of 5 golds in field 'answer' do not parse in answer form
        number (first: d.jsonl:3: expected a number, got '9 (apples)'); those rows are left
        out``."""
        if not self.lines:
            return None
        fate = (
            "those rows are left out"
            if self.left_out
            else "they are kept, and no completion is likely to match them"
        )
        return (
            f"warning: {len(self.lines)} of {self.rows} golds in field {field!r} do not parse "
            f"in answer form {form} (first: {self.lines[0]}); {fate}"
        )


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
    unparsed: UnparsedGolds | None = None,
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
      unparsed: when given, a gold that does not parse in `answer_form` no longer raises: its
        row is left out and noted there; under "auto" a gold read whole that holds words
        (`answer_forms.is_prose`) is kept and noted. `unparsed.rows` counts the rows read.

    Returns:
      Problems with id ``"jsonl/<file stem>/<line index>"``; ``metadata["row"]`` is the row.

    Raises:
      FileNotFoundError: no such file. ValueError: naming ``file:line`` and the field for a line
        that is not a JSON object, a row without a field the template or the answer needs, an
        answer not in its form (unless `unparsed` is given), or a budget that is not an
        integer >= 1; a bad template.
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
            if unparsed is not None:
                unparsed.rows += 1
            try:
                gold = gold_answer(row[answer_field], answer_form, answer_regex)
            except ValueError as err:
                if unparsed is None:
                    raise ValueError(f"{where}: field {answer_field!r}: {err}") from None
                unparsed.lines.append(f"{where}: {err}")
                unparsed.left_out = True
                continue
            if unparsed is not None and answer_form == "auto" and is_prose(gold):
                unparsed.lines.append(f"{where}: {row[answer_field]!r} is read as words")
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
