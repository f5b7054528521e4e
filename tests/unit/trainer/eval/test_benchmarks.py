"""Named benchmarks resolve to local files only; a missing one says where to put it."""

from __future__ import annotations

import pytest

from trainer.data.jsonl_problems import load_jsonl_problems
from trainer.eval.benchmarks import BENCHMARKS, benchmark_file


def test_a_missing_benchmark_file_says_where_to_put_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("JAXRL_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/math_eval/aime24.test.jsonl"):
        benchmark_file("aime24")
    with pytest.raises(KeyError, match="unknown benchmark 'math500'"):
        benchmark_file("math500")


def test_a_local_benchmark_file_reads_in_its_form(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("JAXRL_DATA_DIR", str(tmp_path))
    (tmp_path / "math_eval").mkdir()
    (tmp_path / "math_eval" / "minerva_math.test.jsonl").write_text(
        '{"problem": "Mass?", "solution": "so $m=\\\\boxed{4.5e33}$ g"}\n'
    )
    bench, path = benchmark_file("minerva")
    problems = load_jsonl_problems(
        path,
        template=bench.template,
        answer_field=bench.answer_field,
        answer_form=bench.answer_form,
    )
    assert [(p.question, p.answer) for p in problems] == [("Mass?", "4.5e33")]
    assert sorted(BENCHMARKS) == ["aime24", "amc23", "gsm8k", "minerva"]
