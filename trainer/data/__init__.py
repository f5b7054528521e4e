"""Training data: problems and where they come from (GSM8K, JSONL files, reasoning-gym tasks),
the answer forms of their gold answers, and the stream that deals them to the loop."""

from trainer.data.gsm8k import DEFAULT_GSM8K_DIR, load_gsm8k
from trainer.data.problem import Problem
from trainer.data.problem_stream import ProblemStream
from trainer.data.reasoning_gym_tasks import reasoning_gym_problems

__all__ = [
    "DEFAULT_GSM8K_DIR",
    "Problem",
    "ProblemStream",
    "load_gsm8k",
    "reasoning_gym_problems",
]
