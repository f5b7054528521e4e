"""Routing replay: a forward with given expert ids. Replaying the model's own choices gives its
logits; other ids give other logits and leave the model as it was; bad ids are refused."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.checkpoints.hf_io import load_hf_checkpoint
from models.routing import forward_with_replay, forward_with_routing


def _inputs(cfg):
    tokens = jnp.asarray(np.random.RandomState(6).randint(4, cfg.vocab_size, (2, 7)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))


@pytest.mark.parametrize("variant", ["qwen3_moe", "olmoe"])
def test_replaying_own_routing_gives_own_logits(variant, tiny_checkpoint):
    cfg, model = load_hf_checkpoint(tiny_checkpoint(variant))
    tokens, positions = _inputs(cfg)
    logits, _, record = forward_with_routing(model, tokens, positions)
    replayed, _ = forward_with_replay(model, tokens, positions, record.expert_ids)
    np.testing.assert_allclose(np.asarray(replayed), np.asarray(logits), atol=1e-6, rtol=0)
    shifted = (record.expert_ids + 1) % cfg.num_experts  # every token to other experts
    other, _ = forward_with_replay(model, tokens, positions, shifted)
    assert np.abs(np.asarray(other) - np.asarray(logits)).max() > 1e-3
    plain, _ = model(tokens, positions)  # the replay is gone after the call
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(logits))


def test_bad_replay_ids_are_refused(tiny_checkpoint):
    cfg, model = load_hf_checkpoint(tiny_checkpoint("olmoe"))
    tokens, positions = _inputs(cfg)
    L, k = cfg.num_layers, cfg.num_experts_per_tok
    with pytest.raises(
        ValueError, match=r"expert_ids must have shape \[B, T, L, k\] = \(2, 7, 2, 2\)"
    ):
        forward_with_replay(model, tokens, positions, jnp.zeros((2, 7, L, k + 1), jnp.int32))
    too_big = jnp.full((2, 7, L, k), cfg.num_experts, jnp.int32)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 4\), got \[4, 4\]"):
        forward_with_replay(model, tokens, positions, too_big)
    _, dense = load_hf_checkpoint(tiny_checkpoint("qwen3"))
    with pytest.raises(ValueError, match="qwen3 has no mixture-of-experts layer to replay"):
        forward_with_replay(dense, tokens, positions, too_big)


def test_replay_runs_under_jit(tiny_checkpoint):
    from flax import nnx

    cfg, model = load_hf_checkpoint(tiny_checkpoint("qwen3_moe"))
    tokens, positions = _inputs(cfg)
    logits, _, record = forward_with_routing(model, tokens, positions)

    @nnx.jit
    def replay(model, tokens, positions, ids):
        return forward_with_replay(model, tokens, positions, ids)[0]

    got = replay(model, tokens, positions, record.expert_ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(logits), atol=1e-5, rtol=0)
