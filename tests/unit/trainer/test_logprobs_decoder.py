"""The fused log-probs of a real (tiny, random) Decoder equal its own logits' log-softmax.

This is the path the train step takes: ``model.hidden`` -> ``fused_target_logprobs`` with
``model.lm_head_weight()`` and the config's soft-cap, against ``log_softmax(model(tokens) / T)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig
from models.decoder import Decoder
from trainer.logprobs import fused_target_logprobs

V = 97


def _model(variant: str, **overrides) -> Decoder:
    cfg = ModelConfig.from_hf({**TINY_CONFIGS[variant], "vocab_size": V, **overrides})
    return Decoder(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("variant", "overrides"),
    [("llama", {}), ("gemma3", {"final_logit_softcapping": 5.0})],
    ids=["llama-untied", "gemma3-tied-softcap"],
)
def test_decoder_fused_equals_logits_path(variant, overrides):
    model = _model(variant, **overrides)
    cfg = model.cfg
    assert (cfg.final_logit_softcap is not None) == bool(overrides)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, V, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    targets = jnp.roll(tokens, -1, axis=1)
    cot = jax.random.normal(jax.random.key(2), (2, 9))
    graphdef, state = nnx.split(model)
    temperature = 0.8

    def fused(state):
        m = nnx.merge(graphdef, state)
        hidden, _ = m.hidden(tokens, positions)
        return fused_target_logprobs(
            hidden,
            m.lm_head_weight(),
            targets,
            temperature=temperature,
            softcap=m.cfg.final_logit_softcap,
            chunk_size=4,
        )

    def reference(state):
        logits, _ = nnx.merge(graphdef, state)(tokens, positions)
        logp = jax.nn.log_softmax(logits / temperature, axis=-1)
        return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

    np.testing.assert_allclose(fused(state), reference(state), rtol=1e-5, atol=1e-5)
    g_fused = jax.grad(lambda s: jnp.sum(fused(s) * cot))(state)
    g_ref = jax.grad(lambda s: jnp.sum(reference(s) * cot))(state)
    for a, b in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
