"""The job's problems: disjoint train / held-out splits, the verifier override, chat encoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.data.problem import Problem
from trainer.launch.data import load_job_data, make_decoder, make_encoder
from trainer.launch.job_config import load_job_config

REPO = Path(__file__).resolve().parents[4]


def _gsm8k_file(path: Path, n: int) -> Path:
    rows = [{"question": f"q{i}?", "answer": f"work\n#### {i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_held_out_is_the_tail_of_the_file(tmp_path):
    path = _gsm8k_file(tmp_path / "train.jsonl", 10)
    job = load_job_config(
        REPO / "configs" / "smollm2_gsm8k.yaml",
        [f"data.path={path}", "data.eval_path=''", "data.size=100", "eval.size=3"],
    )
    data = load_job_data(job)
    suffix = job.data.suffix
    assert suffix.startswith(" Think step by step")
    assert [p.question for p in data.train] == [f"q{i}?{suffix}" for i in range(7)]
    assert [p.problem_id for p in data.held_out] == ["gsm8k/train/7", "gsm8k/train/8",
                                                     "gsm8k/train/9"]  # fmt: skip
    assert {p.verifier for p in data.train + data.held_out} == {"math"}
    with pytest.raises(ValueError, match="leaves no training problem"):
        load_job_data(load_job_config(None, [f"data.path={path}", "data.source=gsm8k",
                                             "eval.size=10"]))  # fmt: skip


def test_reasoning_gym_split_is_disjoint_and_relabelled():
    job = load_job_config(REPO / "configs" / "smollm2_arith.yaml", ["data.size=50", "eval.size=8"])
    data = load_job_data(job)
    assert (len(data.train), len(data.held_out)) == (50, 8)
    assert not {p.question for p in data.train} & {p.question for p in data.held_out}
    assert {p.verifier for p in data.train + data.held_out} == {"math"}  # data.verifier: math
    assert all(" + " in p.question for p in data.train)
    plain = load_job_data(load_job_config(REPO / "configs" / "smoke.yaml"))
    assert {p.verifier for p in plain.train} == {"reasoning_gym"}
    with pytest.raises(ValueError, match="data.verifier"):
        load_job_data(load_job_config(REPO / "configs" / "smoke.yaml", ["data.verifier=nope"]))


def test_encoder_applies_the_chat_template(tmp_path):
    from models.checkpoints.tiny import make_tokenizer

    tok = make_tokenizer(tmp_path)
    problem = Problem("p", "What is 1 + 2?", "3", "math")
    ids = make_encoder(tok, None)(problem)
    expected = "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == expected
    with_system = make_encoder(tok, "Be brief.")(problem)
    assert tok.decode(with_system) == "<|im_start|>system\nBe brief.<|im_end|>\n" + expected
    assert make_decoder(tok)(ids) == "user\nWhat is 1 + 2?\nassistant\n"
