"""Golds that carry units (ASDiv's ``"9 (apples)"``): ``auto`` takes the leading number, and the
eval command warns, in one stderr line, about golds that do not parse in the chosen form."""

from __future__ import annotations

import json

import pytest

from trainer.data.answer_forms import gold_answer, is_prose, leading_number
from trainer.data.jsonl_problems import UnparsedGolds, load_jsonl_problems
from trainer.eval.problems import eval_problems
from trainer.launch.job_config import load_job_config


@pytest.mark.parametrize(
    ("value", "gold"),
    [
        ("9 (apples)", "9"),
        ("9(apples)", "9"),
        ("12.5 cm", "12.5"),
        ("1,200 (dollars)", "1200"),
        ("-3 degrees", "-3"),
        ("5 m", "5"),
        ("42", "42"),
        # not a number followed by words: read whole, as before
        ("2x + 1", "$2x + 1$"),
        ("7 x 3", "$7 x 3$"),
        ("3:4", "$3:4$"),
        ("9 (3+6)", "$9 (3+6)$"),
        ("3 hours 20 minutes", "$3 hours 20 minutes$"),
        ("3 \\sqrt{2}", "$3 \\sqrt{2}$"),
        ("three apples", "$three apples$"),
    ],
)
def test_auto_takes_the_leading_number_of_a_gold_with_a_unit(value, gold) -> None:
    assert gold_answer(value, "auto") == gold


def test_leading_number_and_prose() -> None:
    assert leading_number("0.5 (hours)") == "0.5"
    assert leading_number("0.5") is None  # a bare number is the "number" form's
    assert leading_number("(apples) 9") is None
    assert [is_prose(g) for g in ("$three apples$", "$\\frac{1}{2}$", "$x^2 + 1$", "9")] == [
        True, False, False, False,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="expected a number, got '9 \\(apples\\)'"):
        gold_answer("9 (apples)", "number")


def _write(tmp_path, answers: list[str]):
    path = tmp_path / "asdiv.jsonl"
    rows = [{"question": f"q{i}", "answer": a} for i, a in enumerate(answers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_unparsed_golds_leave_their_rows_out_under_number(tmp_path) -> None:
    path = _write(tmp_path, ["9 (apples)", "4", "three", "7"])
    unparsed = UnparsedGolds()
    problems = load_jsonl_problems(path, answer_form="number", unparsed=unparsed)
    assert [(p.problem_id, p.answer) for p in problems] == [
        ("jsonl/asdiv/1", "4"), ("jsonl/asdiv/3", "7"),
    ]  # fmt: skip
    assert unparsed.rows == 4 and unparsed.left_out
    assert unparsed.lines == [
        f"{path}:1: expected a number, got '9 (apples)'",
        f"{path}:3: expected a number, got 'three'",
    ]
    with pytest.raises(ValueError, match=f"{path}:1: field 'answer': expected a number"):
        load_jsonl_problems(path, answer_form="number")  # without `unparsed`: stops, as before


@pytest.mark.parametrize(
    ("form", "kept", "line"),
    [
        (
            "number",
            2,
            "warning: 2 of 4 golds in field 'answer' do not parse in answer form number "
            "(first: {path}:1: expected a number, got '9 (apples)'); those rows are left out",
        ),
        (
            "auto",
            4,
            "warning: 1 of 4 golds in field 'answer' do not parse in answer form auto "
            "(first: {path}:3: 'three' is read as words); they are kept, and no completion is "
            "likely to match them",
        ),
    ],
)
def test_the_eval_command_warns_once_with_a_count_and_an_example(
    tmp_path, capsys, form, kept, line
) -> None:
    path = _write(tmp_path, ["9 (apples)", "4", "three", "7"])
    job = load_job_config(None, [f"eval.data={path}", f"data.answer_form={form}"])
    problems = eval_problems(job)
    assert len(problems) == kept
    if form == "auto":
        assert [p.answer for p in problems] == ["9", "4", "$three$", "7"]
    assert capsys.readouterr().err.splitlines() == [line.format(path=path)]
