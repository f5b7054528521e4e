"""Fixtures shared by the JAX engine's unit tests: one tiny decoder per model family."""

from collections.abc import Callable
from functools import cache

import pytest
from flax import nnx

from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig
from models.decoder import Decoder

TinySplit = tuple[ModelConfig, nnx.GraphDef, nnx.State]


def build_tiny_split(family: str) -> TinySplit:
    """A tiny random decoder of `family` ("llama", "qwen2", ... : a key of TINY_CONFIGS) with a
    64-token vocabulary and eos id 0, seeded with nnx.Rngs(0), split into (config, graphdef,
    fp32 params). Raises KeyError for an unknown family."""
    cfg = ModelConfig.from_hf(dict(TINY_CONFIGS[family], vocab_size=64, eos_token_id=0))
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    return cfg, graphdef, params


@pytest.fixture(scope="module")
def tiny_split() -> Callable[[str], TinySplit]:
    """`tiny_split(family)` -> (config, graphdef, params) of build_tiny_split, built once per
    family and test module (the params are shared by that module's tests, as before)."""
    return cache(build_tiny_split)
