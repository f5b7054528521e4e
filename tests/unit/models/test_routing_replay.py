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
    with pytest.raises(
        ValueError, match=r"must lie in \[0, 4\) or be -1 \(no route\), got \[4, 4\]"
    ):
        forward_with_replay(model, tokens, positions, too_big)
    with pytest.raises(ValueError, match=r"got \[-2, 0\]"):
        forward_with_replay(model, tokens, positions, jnp.zeros_like(too_big).at[0, 0].set(-2))
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


def test_tokens_without_a_route_keep_their_own_router(tiny_checkpoint):
    from models.routing import hidden_with_routing

    cfg, model = load_hf_checkpoint(tiny_checkpoint("qwen3_moe"))
    tokens, positions = _inputs(cfg)
    logits, _, record = forward_with_routing(model, tokens, positions)
    ids = np.full(record.expert_ids.shape, -1, np.int32)  # [2, 7, L, k]: no route anywhere
    ids[1, 3] = (np.asarray(record.expert_ids[1, 3]) + 1) % cfg.num_experts  # one other route
    hidden, _, got = hidden_with_routing(model, tokens, positions, jnp.asarray(ids))
    replayed = np.asarray(model.logits(hidden))
    np.testing.assert_allclose(replayed[0], np.asarray(logits[0]), atol=1e-6, rtol=0)
    np.testing.assert_allclose(replayed[1, :3], np.asarray(logits[1, :3]), atol=1e-6, rtol=0)
    assert np.abs(replayed[1, 3:] - np.asarray(logits[1, 3:])).max() > 1e-4
    used = np.asarray(got.expert_ids)
    np.testing.assert_array_equal(used[1, 3], ids[1, 3])
    np.testing.assert_array_equal(used[0], np.asarray(record.expert_ids[0]))
    np.testing.assert_allclose(  # the router's own logits are recorded, replay or not
        np.asarray(got.router_logits[:, :3]), np.asarray(record.router_logits[:, :3]), atol=1e-6
    )
