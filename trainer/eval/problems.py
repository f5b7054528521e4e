"""The problems of `python -m trainer eval`: ``eval.data`` names a benchmark (a local file read in
its own form) or a PATH.jsonl (read with the data.* keys); empty, data.path as data.source."""

from __future__ import annotations

import sys
from pathlib import Path

from trainer.data.jsonl_problems import UnparsedGolds, load_jsonl_problems
from trainer.data.problem import Problem
from trainer.eval.benchmarks import BENCHMARKS, benchmark_file
from trainer.launch.data import load_file_problems
from trainer.launch.job_config import JobConfig


def eval_problems(job: JobConfig) -> list[Problem]:
    """The problems to evaluate, the first data.limit of them (all when unset).

    A PATH.jsonl whose golds do not all parse in data.answer_form gets one warning line on
    stderr (`UnparsedGolds.warning`: the count and the first example); under a form other than
    "auto" those rows are left out, under "auto" a gold read as words is kept.

    Raises:
      KeyError: eval.data is neither a benchmark nor a .jsonl path. FileNotFoundError: the file
        is not on disk (for a benchmark: where to put it). ValueError: a row the reader cannot
        read (file:line and the field), or data.source=reasoning_gym without eval.data.
    """
    spec, d = job.eval.data, job.data
    if spec in BENCHMARKS:
        bench, path = benchmark_file(spec)
        return load_jsonl_problems(
            path, template=bench.template, answer_field=bench.answer_field,
            answer_form=bench.answer_form, limit=d.limit, suffix=d.suffix,
        )  # fmt: skip
    if spec:
        if not spec.endswith(".jsonl"):
            raise KeyError(f"eval.data: expected one of {sorted(BENCHMARKS)} or a PATH.jsonl, "
                           f"got {spec!r}")  # fmt: skip
        job = job.model_copy(update={"data": d.model_copy(update={"source": "jsonl"})})
        unparsed = UnparsedGolds()
        problems = load_file_problems(job, Path(spec), unparsed=unparsed)
        warning = unparsed.warning(d.answer_field, d.answer_form)
        if warning:
            print(warning, file=sys.stderr)
        return problems
    if d.source == "reasoning_gym":
        raise ValueError("eval needs a data file: --data NAME|PATH.jsonl (eval.data), or "
                         "data.source gsm8k/jsonl with data.path")  # fmt: skip
    return load_file_problems(job, Path(d.path))
