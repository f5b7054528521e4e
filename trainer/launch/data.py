"""The job's problems (a training set and a disjoint held-out split) and their prompt encoding.

reasoning-gym: training problems from seed ``trainer.seed``, held-out ones from a different
seed (``trainer.seed + 1_000_003``); questions that also occur in the training set are dropped
from the held-out split. GSM8K: the training file's first ``data.size`` lines; held-out problems
from ``data.eval_path``, or else the training file's last ``eval.size`` lines (with ``data.size``
cut so the two never overlap). jsonl: the same with any JSONL file (data.prompt_template over
its fields, data.answer_field read as data.answer_form; the first data.limit rows of each file).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainer.data import load_gsm8k, reasoning_gym_problems
from trainer.data.jsonl_problems import UnparsedGolds, load_jsonl_problems
from trainer.data.problem import Problem
from trainer.launch.job_config import JobConfig
from trainer.rewards import available_verifiers

EVAL_SEED_OFFSET = 1_000_003


@dataclasses.dataclass(frozen=True)
class JobData:
    """Training problems and the held-out split (possibly empty)."""

    train: list[Problem]
    held_out: list[Problem]


def load_file_problems(
    job: JobConfig,
    path: str | Path,
    limit: int | None = None,
    unparsed: UnparsedGolds | None = None,
) -> list[Problem]:
    """The problems of one data file of `job` (data.source gsm8k or jsonl), the first `limit`
    and at most data.limit. `unparsed` (jsonl only): see `load_jsonl_problems`; a gold not in
    its form then leaves its row out instead of raising.

    Raises:
      FileNotFoundError: no such file; ValueError: a row the source cannot read (file:line).
    """
    d = job.data
    if d.limit is not None:
        limit = d.limit if limit is None else min(limit, d.limit)
    if d.source == "gsm8k":
        return load_gsm8k(path, limit=limit, suffix=d.suffix)
    return load_jsonl_problems(
        path, template=d.prompt_template, answer_field=d.answer_field,
        answer_form=d.answer_form, answer_regex=d.answer_regex, limit=limit, suffix=d.suffix,
        max_new_tokens_field=d.max_new_tokens_field if d.source == "jsonl" else "",
        unparsed=unparsed,
    )  # fmt: skip


def _from_files(job: JobConfig) -> JobData:
    d, n_eval = job.data, job.eval.size
    path = Path(d.path)
    if d.eval_path:
        train = load_file_problems(job, path, d.size)
        held = load_file_problems(job, d.eval_path, n_eval) if n_eval else []
        return JobData(train, held)
    every = load_file_problems(job, path)
    if n_eval >= len(every):
        raise ValueError(f"eval.size={n_eval} leaves no training problem in {path}")
    cut = len(every) - n_eval
    return JobData(every[: min(d.size, cut)], every[cut:])


def _reasoning_gym(job: JobConfig) -> JobData:
    d, seed = job.data, job.run.trainer.seed
    train = reasoning_gym_problems(d.task, size=d.size, seed=seed, suffix=d.suffix, **d.task_config)
    held: list[Problem] = []
    if job.eval.size:
        seen = {p.question for p in train}
        extra = reasoning_gym_problems(
            d.task, size=4 * job.eval.size, seed=seed + EVAL_SEED_OFFSET, suffix=d.suffix,
            **d.task_config,
        )  # fmt: skip
        held = [p for p in extra if p.question not in seen][: job.eval.size]
    return JobData(train, held)


def load_job_data(job: JobConfig) -> JobData:
    """The training problems and held-out split of `job`.

    Every problem is scored by data.verifier when it is set.

    Raises:
      FileNotFoundError: a data file is missing; ValueError: eval.size takes every line of the
        file, a row lacking a field (file:line and the field), a problem's budget
        (data.max_new_tokens_field) above rollout.max_new_tokens, an unknown data.verifier;
        reasoning-gym's error for a bad task or config.
    """
    data = _reasoning_gym(job) if job.data.source == "reasoning_gym" else _from_files(job)
    cap = job.run.rollout.max_new_tokens
    for p in (*data.train, *data.held_out):
        if p.max_new_tokens is not None and p.max_new_tokens > cap:
            raise ValueError(
                f"problem {p.problem_id}: data.max_new_tokens_field asks {p.max_new_tokens} new "
                f"tokens; expected at most rollout.max_new_tokens={cap}"
            )
    name = job.data.verifier
    if name is None:
        return data
    if name not in available_verifiers():
        raise ValueError(f"data.verifier: expected one of {available_verifiers()}, got {name!r}")
    return JobData(
        [dataclasses.replace(p, verifier=name) for p in data.train],
        [dataclasses.replace(p, verifier=name) for p in data.held_out],
    )


def make_encoder(tokenizer: Any, system_prompt: str | None) -> Callable[[Problem], list[int]]:
    """problem -> prompt token ids: the question as the user turn of the tokenizer's chat
    template with the assistant's turn opened (and `system_prompt` as the system turn, if
    given).

    Raises (when called):
      ValueError: the tokenizer has no chat template.
    """

    def encode(problem: Problem) -> list[int]:
        messages = [{"role": "user", "content": problem.question}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return encode


def make_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """token ids -> text, special tokens left out (what the verifiers read)."""

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    return decode
