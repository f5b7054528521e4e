"""Rewards: verifiers (math-verify, reasoning-gym, token fraction), problem sources, scoring."""

from trainer.rewards.base import (
    Problem,
    TextVerifier,
    Verifier,
    available_verifiers,
    make_verifier,
    register_verifier,
)
from trainer.rewards.gsm8k import DEFAULT_GSM8K_DIR, load_gsm8k
from trainer.rewards.math_verifier import MathVerifier, gold_text
from trainer.rewards.problem_stream import ProblemStream
from trainer.rewards.reasoning_gym_tasks import reasoning_gym_problems
from trainer.rewards.reasoning_gym_verifier import ReasoningGymVerifier, extract_answer
from trainer.rewards.scoring import ScoringPool
from trainer.rewards.token_fraction import TokenFractionVerifier

__all__ = [
    "DEFAULT_GSM8K_DIR",
    "MathVerifier",
    "Problem",
    "ProblemStream",
    "ReasoningGymVerifier",
    "ScoringPool",
    "TextVerifier",
    "TokenFractionVerifier",
    "Verifier",
    "available_verifiers",
    "extract_answer",
    "gold_text",
    "load_gsm8k",
    "make_verifier",
    "reasoning_gym_problems",
    "register_verifier",
]
