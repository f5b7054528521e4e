"""math-verify rewards on real GSM8K lines and hand-written completions."""

import pytest

from trainer.data import DEFAULT_GSM8K_DIR, Problem, load_gsm8k
from trainer.rewards import gold_text, make_verifier

GSM8K_TEST = DEFAULT_GSM8K_DIR / "test.jsonl"


@pytest.fixture(scope="module")
def verifier():
    return make_verifier("math")


def _problem(answer: str) -> Problem:
    return Problem("p", "q", answer, "math")


def test_gold_text():
    assert gold_text("so 200,000-130,000=$70,000\n#### 70,000") == "70000"
    assert gold_text("\\boxed{\\frac{1}{2}}") == "\\boxed{\\frac{1}{2}}"
    assert gold_text(" 42 ") == "42"


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("Janet has 16 - 3 - 4 = 9 eggs, 9 * 2 = 18. The answer is 18.", 1.0),
        ("She makes \\boxed{18} dollars.", 1.0),
        ("\\boxed{18.0}", 1.0),
        ("#### 18", 1.0),
        ("I first thought 18 but it is 17", 0.0),
        ("The answer is \\boxed{16}.", 0.0),
        ("eighteen", 0.0),
        ("", 0.0),
    ],
)
def test_math_rewards(verifier, completion, reward):
    assert verifier.score(completion, _problem("9 * 2 = <<9*2=18>>18\n#### 18")) == reward


def test_fractions_commas_and_boxed_gold(verifier):
    assert verifier.score("it is 1/2", _problem("\\boxed{0.5}")) == 1.0
    assert verifier.score("It costs $70,000 in total.", _problem("#### 70000")) == 1.0
    assert verifier.score("It costs $7,000 in total.", _problem("#### 70000")) == 0.0


def test_unparseable_gold_raises(verifier):
    with pytest.raises(ValueError, match="cannot parse gold"):
        verifier.score("1", _problem("#### no number"))
    with pytest.raises(ValueError, match="max_chars"):
        make_verifier("math", max_chars=0)


@pytest.mark.skipif(not GSM8K_TEST.is_file(), reason=f"{GSM8K_TEST} is not present")
def test_real_gsm8k_lines(verifier):
    problems = load_gsm8k(GSM8K_TEST, limit=3, suffix="\nAnswer after ####.")
    assert [p.problem_id for p in problems] == ["gsm8k/test/0", "gsm8k/test/1", "gsm8k/test/2"]
    assert [gold_text(p.answer) for p in problems] == ["18", "3", "70000"]
    assert problems[0].question.startswith("Janet’s ducks lay 16 eggs per day.")
    assert problems[0].question.endswith("\nAnswer after ####.")
    # the reference solution itself scores 1, another problem's solution scores 0
    assert [verifier.score(p.answer, p) for p in problems] == [1.0, 1.0, 1.0]
    assert verifier.score(problems[1].answer, problems[0]) == 0.0
    assert verifier.score("The house profit is \\boxed{70000}", problems[2]) == 1.0


def test_load_gsm8k_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="GSM8K file not found"):
        load_gsm8k(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: expected"):
        load_gsm8k(bad)
