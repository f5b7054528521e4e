"""Any JSONL as problems: templates over fields, the four answer forms, errors naming file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.data.answer_forms import gold_answer, last_boxed
from trainer.data.jsonl_problems import load_jsonl_problems, template_fields
from trainer.eval.benchmarks import data_root
from trainer.launch.data import load_job_data
from trainer.launch.job_config import load_job_config
from trainer.rewards.math_verifier import MathVerifier

SHARED = data_root()


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("value", "form", "regex", "gold"),
    [
        (27.0, "number", "", "27.0"), ("025", "number", "", "025"), ("1,234", "number", "", "1234"),
        ("so 3 + 4\n#### 1,234", "hash", "", "1234"), ("x =\\boxed{\\frac{1}{2}} cm", "boxed", "",
         "$\\frac{1}{2}$"), ("Final: 42 apples", "regex", r"Final: (\d+)", "42"),
        (72, "auto", "", "72"), ("a\n#### 5", "auto", "", "5"), ("\\boxed{4.5e33}", "auto", "",
         "4.5e33"), ("\\sqrt{2}", "auto", "", "$\\sqrt{2}$"),
    ],
)  # fmt: skip
def test_gold_answer_forms(value, form, regex, gold) -> None:
    assert gold_answer(value, form, regex) == gold


def test_gold_answer_refuses_the_wrong_form() -> None:
    with pytest.raises(ValueError, match="expected a number"):
        gold_answer("seven", "number")
    with pytest.raises(ValueError, match="####"):
        gold_answer("42", "hash")
    with pytest.raises(ValueError, match="boxed"):
        gold_answer("42", "boxed")
    with pytest.raises(ValueError, match="does not match"):
        gold_answer("42", "regex", r"Final: (\d+)")
    assert last_boxed("\\boxed{\\frac{a}{b}} and \\boxed{{x}}") == "{x}"
    assert last_boxed("\\boxed{1") is None


def test_template_over_fields_and_scoring_with_math_verify(tmp_path) -> None:
    path = _write(tmp_path / "mine.jsonl", [
        {"Body": "Ann has 3 apples.", "Question": "How many?", "Answer": 3},
        {"Body": "Bo has half.", "Question": "What fraction?", "Answer": "\\boxed{\\frac{1}{2}}"},
    ])  # fmt: skip
    problems = load_jsonl_problems(path, template="{Body} {Question}", answer_field="Answer")
    assert [p.question for p in problems] == ["Ann has 3 apples. How many?",
                                              "Bo has half. What fraction?"]  # fmt: skip
    assert [p.answer for p in problems] == ["3", "$\\frac{1}{2}$"]
    assert [p.problem_id for p in problems] == ["jsonl/mine/0", "jsonl/mine/1"]
    v = MathVerifier()
    assert v.score("so the answer is 3.", problems[0]) == 1.0
    assert v.score("the answer is 4", problems[0]) == 0.0
    assert v.score("it is \\boxed{0.5}", problems[1]) == 1.0
    assert v.score("it is \\boxed{1/3}", problems[1]) == 0.0
    assert len(load_jsonl_problems(path, template="{Body}", answer_field="Answer", limit=1)) == 1


def test_a_row_lacking_a_field_names_the_file_line_and_field(tmp_path) -> None:
    path = _write(tmp_path / "bad.jsonl", [
        {"Question": "1+1?", "Answer": 2}, {"Question": "2+2?", "Answer": 4}, {"Question": "3+3?"},
    ])  # fmt: skip
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: the row has no field 'Answer' "
                       r"\(the answer field\); it has \['Question'\]"):  # fmt: skip
        load_jsonl_problems(path, template="{Question}", answer_field="Answer")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: the row has no field 'Body' "
                       r"\(the prompt template\)"):  # fmt: skip
        load_jsonl_problems(path, template="{Body} {Question}", answer_field="Answer")
    (tmp_path / "junk.jsonl").write_text('{"Question": "a", "Answer": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"junk\.jsonl:2: not JSON"):
        load_jsonl_problems(tmp_path / "junk.jsonl", template="{Question}", answer_field="Answer")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl_problems(tmp_path / "nope.jsonl")


def test_templates_are_checked() -> None:
    assert template_fields("{Body} {Question}") == ["Body", "Question"]
    with pytest.raises(ValueError, match="name every field"):
        template_fields("{} and {0}")
    with pytest.raises(ValueError, match="prompt template"):
        template_fields("{unclosed")


def test_question_answer_jsonl_through_config_alone(tmp_path) -> None:
    rows = [{"Question": f"What is {i} + {i}?", "Answer": 2 * i} for i in range(6)]
    path = _write(tmp_path / "qa.jsonl", rows)
    config = tmp_path / "job.yaml"
    config.write_text(
        f"data: {{source: jsonl, path: {path}, prompt_template: '{{Question}}',"
        " answer_field: Answer, answer_form: number, limit: 5}\neval: {size: 2}\n"
    )
    data = load_job_data(load_job_config(config))
    assert [p.question for p in data.train] == [f"What is {i} + {i}?" for i in range(3)]
    assert [p.answer for p in data.held_out] == ["6", "8"]
    assert {p.verifier for p in data.train + data.held_out} == {"math"}
    assert MathVerifier().score("3 + 3 = 6", data.held_out[0]) == 1.0


def test_config_errors_name_the_key(tmp_path) -> None:
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="answer_regex"):
        load_job_config(None, ["data.source=jsonl", "data.answer_form=regex"])
    with pytest.raises(ConfigError, match="prompt template"):
        load_job_config(None, ["data.prompt_template='{'"])
    path = _write(tmp_path / "qa.jsonl", [{"Question": "q", "Answer": 1}, {"Question": "r"}])
    job = load_job_config(
        None,
        [
            "data.source=jsonl",
            f"data.path={path}",
            "eval.size=1",
            "data.prompt_template='{Question}'",
            "data.answer_field=Answer",
        ],
    )
    with pytest.raises(ValueError, match=r"qa\.jsonl:2: the row has no field 'Answer'"):
        load_job_data(job)


@pytest.mark.skipif(not (SHARED / "math_eval").is_dir(), reason="no shared math_eval data")
def test_the_shared_benchmark_files_read_in_their_forms() -> None:
    amc = load_jsonl_problems(SHARED / "math_eval" / "amc23.test.jsonl", template="{problem}")
    assert len(amc) == 40 and amc[0].answer == "27.0"
    minerva = load_jsonl_problems(SHARED / "math_eval" / "minerva_math.test.jsonl",
                                  template="{problem}", answer_field="solution",
                                  answer_form="boxed")  # fmt: skip
    assert len(minerva) == 272 and minerva[0].answer == "1.6"
