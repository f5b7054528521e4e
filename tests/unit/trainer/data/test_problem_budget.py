"""A problem's own completion budget (data.max_new_tokens_field): read from its JSONL row,
held under rollout.max_new_tokens, and sent as its prompt's max_new_tokens."""

from __future__ import annotations

import json
import types

import pytest

from gateway import messages as m
from trainer.data.jsonl_problems import load_jsonl_problems
from trainer.data.problem import Problem
from trainer.data.problem_stream import ProblemStream
from trainer.launch.data import load_job_data
from trainer.launch.job_config import load_job_config
from trainer.rollout_source import RolloutSource


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_budgets_come_from_the_named_field(tmp_path):
    rows = [{"question": "a", "answer": 1, "budget": 16}, {"question": "b", "answer": 2,
            "budget": 128}, {"question": "c", "answer": 3, "budget": None}]  # fmt: skip
    path = _write(tmp_path / "mix.jsonl", rows)
    assert [p.max_new_tokens for p in load_jsonl_problems(path, max_new_tokens_field="budget")] == [
        16, 128, None,
    ]  # fmt: skip
    assert {p.max_new_tokens for p in load_jsonl_problems(path)} == {None}


@pytest.mark.parametrize("bad", [0, 2.5, "16", True])
def test_a_budget_that_is_not_a_positive_integer_names_file_line_and_field(tmp_path, bad):
    path = _write(tmp_path / "mix.jsonl", [{"question": "a", "answer": 1, "budget": bad}])
    with pytest.raises(ValueError, match=r"mix\.jsonl:1: field 'budget': expected an integer"):
        load_jsonl_problems(path, max_new_tokens_field="budget")


def test_a_missing_budget_field_is_named(tmp_path):
    path = _write(tmp_path / "mix.jsonl", [{"question": "a", "answer": 1}])
    with pytest.raises(ValueError, match=r"no field 'budget' \(the budget field\)"):
        load_jsonl_problems(path, max_new_tokens_field="budget")


def test_the_job_refuses_a_budget_above_rollout_max_new_tokens(tmp_path):
    rows = [{"question": "a", "answer": 1, "budget": n} for n in (8, 64)]
    path = _write(tmp_path / "mix.jsonl", rows)
    keys = ["data.source=jsonl", f"data.path={path}", "eval.size=0",
            "data.max_new_tokens_field=budget"]  # fmt: skip
    ok = load_job_data(load_job_config(None, [*keys, "rollout.max_new_tokens=64"]))
    assert [p.max_new_tokens for p in ok.train] == [8, 64]
    with pytest.raises(ValueError, match=r"asks 64 new tokens; expected at most rollout"):
        load_job_data(load_job_config(None, [*keys, "rollout.max_new_tokens=32"]))


def test_each_prompt_carries_its_problem_budget():
    sent: list[m.Prompt] = []
    client = types.SimpleNamespace(submit_prompts=sent.extend)
    problems = [Problem("a", "q", "1", "math"), Problem("b", "q", "1", "math", max_new_tokens=8),
                Problem("c", "q", "1", "math", max_new_tokens=99)]  # fmt: skip
    source = RolloutSource(
        client, ProblemStream(problems, shuffle=False), lambda p: [1, 2], scoring=None,
        group_size=2, sampling=m.SamplingParams(temperature=0.5, max_new_tokens=32),
    )  # type: ignore[arg-type]  # fmt: skip
    assert source.top_up(3, min_version=0) == 3
    assert [p.sampling.max_new_tokens for p in sent] == [32, 8, 32]  # capped at the run's
    assert {p.sampling.temperature for p in sent} == {0.5}
