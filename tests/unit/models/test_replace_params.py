"""`models.params.replace_params`: a new version of some leaves, every other leaf shared (the
very array), the model's output that of a full rebuild; unknown names and wrong shapes named."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig
from models.decoder import Decoder
from models.params import flat_params, model_from_params, path_str, replace_params


def test_replaced_leaves_are_new_the_rest_shared_and_the_model_equals_a_rebuild():
    cfg = ModelConfig.from_hf(dict(TINY_CONFIGS["llama"], vocab_size=64, eos_token_id=0))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    base = flat_params(model)
    name = "layers.1.mlp.down.kernel"
    new = {name: base[name] + 0.5}
    out = replace_params(state, new)
    got = {path_str(p): v.get_value() for p, v in nnx.to_flat_state(out)}
    assert got.keys() == base.keys() and got[name] is new[name]
    assert all(got[k] is base[k] for k in base if k != name)  # shared, not copied
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)  # [B, T]
    positions = jnp.tile(jnp.arange(6, dtype=jnp.int32), (2, 1))

    def logits(m):
        return np.asarray(m(tokens, positions)[0])  # [B, T, V] float32

    rebuilt = model_from_params(cfg, {**base, **new})
    np.testing.assert_array_equal(logits(nnx.merge(graphdef, out)), logits(rebuilt))
    assert not np.array_equal(logits(nnx.merge(graphdef, out)), logits(model))


def test_unknown_names_and_wrong_shapes_are_named():
    cfg = ModelConfig.from_hf(dict(TINY_CONFIGS["llama"], vocab_size=64, eos_token_id=0))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    state = nnx.split(model)[1]
    with pytest.raises(KeyError, match="no param layers.9.attn.q.kernel"):
        replace_params(state, {"layers.9.attn.q.kernel": jnp.zeros(3)})
    kernel = flat_params(model)["layers.0.attn.o.kernel"]
    with pytest.raises(ValueError, match="layers.0.attn.o.kernel: expected shape"):
        replace_params(state, {"layers.0.attn.o.kernel": kernel.T})
