"""Named benchmarks of `python -m trainer eval --data NAME`: where each file lies and how its rows
read (prompt template, answer field, answer form). Nothing is downloaded: a benchmark whose file
is not on disk is an error saying where to put it.

The files live under the data folder, ``$JAXRL_DATA_DIR`` or else ``data`` relative to the
working folder (the README names their sources): GSM8K's test split
(openai/grade-school-math), AIME 2024, AMC 2023 and Minerva-Math (QwenLM/Qwen2.5-Math's
evaluation data).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from trainer.data.answer_forms import AnswerForm


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One named benchmark file and how to read it (`trainer.data.jsonl_problems`)."""

    name: str
    relative_path: str
    template: str
    answer_field: str
    answer_form: AnswerForm


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("gsm8k", "gsm8k/test.jsonl", "{question}", "answer", "hash"),
        Benchmark("aime24", "math_eval/aime24.test.jsonl", "{problem}", "answer", "number"),
        Benchmark("amc23", "math_eval/amc23.test.jsonl", "{problem}", "answer", "number"),
        Benchmark("minerva", "math_eval/minerva_math.test.jsonl", "{problem}", "solution", "boxed"),
    )
}


def data_root() -> Path:
    """The data folder: ``$JAXRL_DATA_DIR``, else ``data`` relative to the working folder (as
    `trainer.data.gsm8k.DEFAULT_GSM8K_DIR`)."""
    return Path(os.environ.get("JAXRL_DATA_DIR", "data"))


def benchmark_file(name: str) -> tuple[Benchmark, Path]:
    """The benchmark `name` and its file.

    Raises:
      KeyError: an unknown name (the known ones listed). FileNotFoundError: the file is not on
        disk; the message says where to put it (or to set JAXRL_DATA_DIR).
    """
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; expected one of {sorted(BENCHMARKS)} or a "
                       "PATH.jsonl")  # fmt: skip
    bench = BENCHMARKS[name]
    path = data_root() / bench.relative_path
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark {name!r} needs the file {path} (a JSONL with fields "
            f"{bench.template!r} / {bench.answer_field!r}); nothing is downloaded: put it there, "
            "or set JAXRL_DATA_DIR to the folder holding "
            f"{bench.relative_path}, or pass --data PATH.jsonl"
        )
    return bench, path
