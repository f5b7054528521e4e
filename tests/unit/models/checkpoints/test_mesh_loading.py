"""Loading straight onto an 8-device FSDP mesh gives the same logits as one device (for the
mixtures of experts too: their per-expert tensors stacked from memory-mapped views)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.checkpoints.hf_io import load_hf_checkpoint
from models.params import flat_params
from models.sharding import make_mesh


@pytest.mark.parametrize(
    "variant, name",
    [
        ("qwen3", "layers.0.mlp.gate.kernel"),
        ("qwen3_moe", "layers.1.mlp.experts.down.kernel"),
        ("olmoe", "layers.1.mlp.experts.gate.kernel"),
    ],
)
def test_fsdp_mesh_load_matches_single_device(tiny_checkpoint, variant, name):
    assert len(jax.devices()) == 8
    path = tiny_checkpoint(variant)
    _, single = load_hf_checkpoint(path)
    mesh = make_mesh(dp=2, fsdp=4)
    _, sharded = load_hf_checkpoint(path, mesh=mesh, min_shard_bytes=0)
    params = flat_params(sharded)
    spec = params[name].sharding.spec
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


def test_views_of_the_mapped_file_equal_the_read_tensors(tiny_checkpoint, tmp_path):
    """`CheckpointReader.view` (the file's bytes, memory-mapped, read-only) equals `read` for
    fp32 and bf16 tensors, and a mesh load from the views equals a one-device load bit for bit
    (bf16 checkpoint into fp32 params: each slice is cast on its own)."""
    from models.checkpoints.hf_io import CheckpointReader
    from models.checkpoints.tiny import make_tiny_checkpoint

    for path in (tiny_checkpoint("llama"), make_tiny_checkpoint(tmp_path / "bf16", "llama",
                                                                 dtype="bfloat16")):  # fmt: skip
        reader = CheckpointReader(path)
        for name in sorted(reader.names()):
            view = reader.view(name)
            assert isinstance(view.base, np.memmap) or isinstance(view, np.memmap), name
            assert not view.flags.writeable
            np.testing.assert_array_equal(view, reader.read(name), err_msg=name)
            assert view.dtype == reader.read(name).dtype
        _, single = load_hf_checkpoint(path, dtype="float32")
        _, sharded = load_hf_checkpoint(
            path, dtype="float32", mesh=make_mesh(fsdp=4, devices=jax.devices()[:4]),
            min_shard_bytes=0,
        )  # fmt: skip
        want, got = flat_params(single), flat_params(sharded)
        for name in want:
            assert got[name].dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), name)
