"""Fixtures of the train-step and checkpoint tests: a tiny Decoder and a deterministic batch
source (the batch at data position p depends on p only)."""

from __future__ import annotations

import numpy as np
import pytest

VOCAB = 64


def tiny_model(seed: int = 0):
    """A random 2-layer Llama-shaped Decoder (D=64, V=64) built without transformers."""
    from flax import nnx

    from models.checkpoints.tiny import TINY_CONFIGS
    from models.config import ModelConfig
    from models.decoder import Decoder

    hf = dict(TINY_CONFIGS["llama"], vocab_size=VOCAB, max_position_embeddings=128)
    return Decoder(ModelConfig.from_hf(hf), rngs=nnx.Rngs(seed))


def fake_batch(position: int, prompts: int = 4, group: int = 2):
    """The RLBatch of data position `position`: P=`prompts` groups of G=`group` completions with
    random prompt/completion tokens (lengths 2..5 and 1..6), sampler log-probs near the uniform
    -log(64) = -4.16, and 0/1 rewards (each group has both, so advantages are nonzero)."""
    from gateway.messages import Completion
    from trainer.batch import build_rl_batch
    from trainer.rollouts import RolloutGroup

    rng = np.random.default_rng(1000 + position)
    groups = []
    for p in range(prompts):
        comps = []
        for g in range(group):
            n = int(rng.integers(1, 7))
            comps.append(
                Completion(
                    token_ids=rng.integers(1, VOCAB, n).tolist(),
                    logprobs=(-4.16 + 0.3 * rng.standard_normal(n)).tolist(),
                    finish_reason="stop",
                    version_start=0,
                    version_end=0,
                    reward=float(g % 2),
                )
            )
        prompt = rng.integers(1, VOCAB, int(rng.integers(2, 6))).tolist()
        groups.append(RolloutGroup(f"{position}:{p}", prompt, comps))
    return build_rl_batch(groups, pad_id=0)


@pytest.fixture
def model_factory():
    """tiny_model(seed=0) -> a fresh Decoder."""
    return tiny_model


@pytest.fixture
def batch_source():
    """fake_batch(position, prompts=4, group=2) -> RLBatch."""
    return fake_batch
