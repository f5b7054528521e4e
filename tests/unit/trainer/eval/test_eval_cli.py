"""The eval command's flags set the config keys they name; rows give back the summary's metrics."""

from __future__ import annotations

import pytest

from trainer.__main__ import EVAL_FLAGS, main
from trainer.eval.rows import canonical_answer, summary_from_rows
from trainer.eval.run import format_summary
from trainer.launch.job_config import load_job_config


def test_every_flag_names_a_config_key() -> None:
    from trainer.config import Config
    from trainer.launch.job_config import JOB_SECTIONS, JobConfig

    for key in EVAL_FLAGS.values():
        section, name = key.split(".")
        owner = JobConfig if section in JOB_SECTIONS else Config
        assert name in owner.model_fields[section].annotation.model_fields, key


def test_missing_benchmark_or_field_fails_before_any_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JAXRL_DATA_DIR", str(tmp_path))
    out = tmp_path / "out"
    assert main(["eval", "--model", "tiny:smollm2", "--data", "aime24", "--out", str(out)]) == 2
    assert f"needs the file {tmp_path}/math_eval/aime24.test.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"Question": "1+1?", "Answer": 2}\n{"Question": "2+2?"}\n')
    args = ["--data", str(bad), "--prompt-template", "{Question}", "--answer-field", "Answer"]
    assert main(["eval", "--model", "tiny:smollm2", *args, "--out", str(out)]) == 2
    assert f"{bad}:2: the row has no field 'Answer'" in capsys.readouterr().err
    assert not (out / "logs").exists()  # no process was started


def test_a_bad_flag_value_is_a_config_error(capsys) -> None:
    assert main(["eval", "--model", "tiny:smollm2", "--engine", "tpu"]) == 2
    assert "rollout.backend" in capsys.readouterr().err
    assert main(["eval", "--model", "tiny:smollm2", "--answer-form", "regex"]) == 2
    assert "answer_regex" in capsys.readouterr().err


def test_greedy_eval_beside_hot_jax_training_is_a_valid_config() -> None:
    job = load_job_config(None, ["rollout.backend=jax", "eval.temperature=0"])
    assert (job.eval_temperature, job.run.rollout.temperature) == (0.0, 1.0)


def test_rows_recompute_the_summary() -> None:
    rows = [
        {"scores": [1.0, 0.0], "answers": ["4", "5"], "lengths": [3, 16],
         "finish_reasons": ["stop", "length"]},
        {"scores": [0.0, 0.0], "answers": [None, "1"], "lengths": [16, 16],
         "finish_reasons": ["length", "length"]},
    ]  # fmt: skip
    got = summary_from_rows(rows)
    assert got["pass@1"] == 0.25 and got["pass@2"] == 0.5 and got["maj@2"] == 0.5
    assert got["mean_length"] == pytest.approx(51 / 4) and got["length_cut_fraction"] == 0.75
    text = format_summary({**got, "backend": "jax", "temperature": 1.0, "max_new_tokens": 16,
                           "completions": "x.jsonl"})  # fmt: skip
    assert "2 problems x 2 samples (jax" in text and "pass@2 0.5000" in text


def test_canonical_answers_vote_together() -> None:
    import math_verify as mv

    cfg = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
    keys = [canonical_answer(mv.parse(t, extraction_config=cfg, parsing_timeout=None))
            for t in ("27", "27.0", "so \\boxed{27}", "\\frac{1}{2}", "nothing")]  # fmt: skip
    assert keys == ["27", "27", "27", "0.5", None]


def test_a_question_answer_jsonl_evaluates_through_config_alone(tmp_path) -> None:
    from trainer.eval.problems import eval_problems

    path = tmp_path / "qa.jsonl"
    path.write_text("".join(f'{{"Question": "{i} + {i}?", "Answer": {2 * i}}}\n' for i in range(4)))
    config = tmp_path / "eval.yaml"
    config.write_text(
        "model: {path: 'tiny:smollm2'}\nrollout: {backend: jax}\n"
        f"data: {{source: jsonl, path: {path}, prompt_template: '{{Question}}', "
        "answer_field: Answer, limit: 3}\n"
        "eval: {samples: 4, temperature: 0, max_new_tokens: 8, out_dir: out}\n"
    )
    job = load_job_config(config)
    problems = eval_problems(job)
    assert [(p.question, p.answer) for p in problems] == [("0 + 0?", "0"), ("1 + 1?", "2"),
                                                         ("2 + 2?", "4")]  # fmt: skip
    assert (job.eval.samples, job.eval_temperature, job.eval.max_new_tokens) == (4, 0.0, 8)
    with pytest.raises(KeyError, match="eval.data: expected one of"):
        eval_problems(load_job_config(config, ["eval.data=nope"]))
