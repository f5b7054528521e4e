"""The grouped (sorted, `ragged_dot`) dispatch equals the dense one, also with experts that no
token chose, and a whole tiny model run with it equals transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from models.checkpoints.hf_io import load_hf_checkpoint
from models.config import UnsupportedModelError
from models.moe import route
from models.moe_dispatch import dense_dispatch, grouped_dispatch
from models.params import flat_params, model_from_params


@pytest.mark.parametrize("experts, top_k", [(8, 2), (6, 6), (16, 1)])
def test_grouped_dispatch_equals_dense(experts, top_k):
    keys = jax.random.split(jax.random.key(0), 5)
    N, D, M = 37, 32, 24
    x = jax.random.normal(keys[0], (N, D))
    logits = jax.random.normal(keys[1], (N, experts))
    logits = logits.at[:, 0].set(-30.0)  # expert 0 is never chosen (unless top_k = E)
    weights, ids = route(logits, top_k, norm_topk_prob=False)
    gate, up = (0.2 * jax.random.normal(k, (experts, D, M)) for k in keys[2:4])
    down = 0.2 * jax.random.normal(keys[4], (experts, M, D))
    dense = dense_dispatch(x, weights, ids, gate, up, down)
    grouped = grouped_dispatch(x, weights, ids, gate, up, down)
    assert grouped.shape == (N, D)
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(dense), atol=1e-5, rtol=0)


def test_tiny_model_with_grouped_dispatch_equals_transformers(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    cfg, dense_model = load_hf_checkpoint(path)
    model = model_from_params(cfg.replace(moe_dispatch="grouped"), flat_params(dense_model))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = np.random.RandomState(4).randint(4, cfg.vocab_size, size=(1, 11)).astype(np.int32)
    logits, _ = model(jnp.asarray(tokens), jnp.arange(11, dtype=jnp.int32)[None])
    with torch.no_grad():
        ref = hf(torch.tensor(tokens).long()).logits.numpy()
    assert np.abs(np.asarray(logits) - ref).max() <= 1e-4


def test_unknown_dispatch_is_refused(tiny_checkpoint):
    cfg, _ = load_hf_checkpoint(tiny_checkpoint("olmoe"))
    with pytest.raises(UnsupportedModelError, match="moe_dispatch 'capacity' is not supported"):
        cfg.replace(moe_dispatch="capacity")
