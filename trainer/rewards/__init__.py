"""Rewards: verifiers (math-verify, reasoning-gym, token fraction) and the scoring pool.

The problems they score and where those come from live in `trainer.data`.
"""

from trainer.rewards.base import (
    TextVerifier,
    Verifier,
    available_verifiers,
    make_verifier,
    register_verifier,
)
from trainer.rewards.math_verifier import MathVerifier, gold_text
from trainer.rewards.reasoning_gym_verifier import ReasoningGymVerifier, extract_answer
from trainer.rewards.scoring import ScoringPool
from trainer.rewards.token_fraction import TokenFractionVerifier

__all__ = [
    "MathVerifier",
    "ReasoningGymVerifier",
    "ScoringPool",
    "TextVerifier",
    "TokenFractionVerifier",
    "Verifier",
    "available_verifiers",
    "extract_answer",
    "gold_text",
    "make_verifier",
    "register_verifier",
]
