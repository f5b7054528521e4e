"""Loading straight onto an 8-device FSDP mesh gives the same logits as one device."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trainer.checkpoints.hf_io import load_hf_checkpoint
from trainer.models.params import flat_params
from trainer.sharding import make_mesh


def test_fsdp_mesh_load_matches_single_device(tiny_checkpoint):
    assert len(jax.devices()) == 8
    path = tiny_checkpoint("qwen3")
    _, single = load_hf_checkpoint(path)
    mesh = make_mesh(dp=2, fsdp=4)
    _, sharded = load_hf_checkpoint(path, mesh=mesh, min_shard_bytes=0)
    params = flat_params(sharded)
    spec = params["layers.0.mlp.gate.kernel"].sharding.spec
    assert "fsdp" in tuple(spec), spec
    assert len(params["embed.embedding"].sharding.device_set) == 8
    tokens = jnp.asarray(np.random.RandomState(0).randint(4, 320, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))

    @nnx.jit
    def forward(model, tokens, positions):
        return model(tokens, positions)[0]

    want = forward(single, tokens, positions)
    got = forward(sharded, tokens, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_sharded_index_checkpoint_loads_like_a_single_file(tiny_checkpoint, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("gemma3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    _, single = load_hf_checkpoint(path)
    _, sharded = load_hf_checkpoint(tmp_path / "sharded")
    want, got = flat_params(single), flat_params(sharded)
    assert set(want) == set(got)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
