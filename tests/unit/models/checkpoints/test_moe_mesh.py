"""A mixture-of-experts checkpoint loaded straight onto an 8-device FSDP mesh (its per-expert
tensors stacked from memory-mapped views) gives the one-device logits, jitted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.checkpoints.hf_io import load_hf_checkpoint
from models.params import flat_params
from models.sharding import make_mesh


@pytest.mark.parametrize("variant", ["qwen3_moe", "olmoe"])
def test_moe_mesh_load_matches_single_device(tiny_checkpoint, variant):
    assert len(jax.devices()) == 8
    path = tiny_checkpoint(variant)
    cfg, single = load_hf_checkpoint(path)
    _, sharded = load_hf_checkpoint(path, mesh=make_mesh(dp=2, fsdp=4), min_shard_bytes=0)
    experts = flat_params(sharded)["layers.1.mlp.experts.down.kernel"]
    assert experts.shape == (cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    assert "fsdp" in tuple(experts.sharding.spec), experts.sharding.spec
    tokens = jnp.asarray(np.random.RandomState(0).randint(4, 320, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))

    @nnx.jit
    def forward(model, tokens, positions):
        return model(tokens, positions)[0]

    want = forward(single, tokens, positions)
    got = forward(sharded, tokens, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
