"""The trainer's top-k / top-p keep-mask equals both engines' truncation, and the fused kernel
takes log-probs (and gradients) under the truncated distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout_engine.jax.sampling import truncate_logits
from trainer.logprobs import fused_target_logprobs, naive_target_logprobs
from trainer.truncation import keep_mask

SETTINGS = [(20, 1.0), (0, 0.9), (20, 0.9), (5, 0.5), (1, 1.0), (0, 0.05)]


def _logits(rows=16, vocab=97, seed=0, scale=3.0):
    return jax.random.normal(jax.random.key(seed), (rows, vocab), jnp.float32) * scale


@pytest.mark.parametrize(("top_k", "top_p"), SETTINGS)
def test_keep_mask_equals_the_jax_engine(top_k, top_p):
    z = _logits() / 0.6
    # targets: the argmax of each row, always in the engine's set
    targets = jnp.argmax(z, axis=-1).astype(jnp.int32)
    ours = np.asarray(keep_mask(z, targets, top_k=top_k, top_p=top_p))
    engine = np.isfinite(np.asarray(truncate_logits(z, top_k=top_k, top_p=top_p)))
    np.testing.assert_array_equal(ours, engine)
    if top_k:
        assert (ours.sum(1) <= top_k).all()


@pytest.mark.parametrize(("top_k", "top_p"), SETTINGS)
def test_keep_mask_equals_vllm_pytorch_sampler(top_k, top_p):
    torch = pytest.importorskip("torch")
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    z = _logits(seed=1) / 0.6
    targets = jnp.argmax(z, axis=-1).astype(jnp.int32)
    ours = np.asarray(keep_mask(z, targets, top_k=top_k, top_p=top_p))
    rows = z.shape[0]
    k = torch.full((rows,), top_k, dtype=torch.long) if top_k else None
    p = torch.full((rows,), top_p, dtype=torch.float32) if top_p < 1 else None
    out = topk_topp.apply_top_k_top_p_pytorch(torch.tensor(np.asarray(z)), k, p)
    np.testing.assert_array_equal(ours, np.isfinite(out.numpy()))


def test_ties_of_the_kth_logit_are_kept():
    z = jnp.array([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    keep = keep_mask(z, jnp.array([0]), top_k=2)
    np.testing.assert_array_equal(np.asarray(keep)[0], [1, 1, 1, 1, 0, 0])


def test_target_outside_the_set_is_kept():
    z = jnp.array([[3.0, 2.0, 1.0, 0.0]])
    keep = np.asarray(keep_mask(z, jnp.array([3]), top_k=1))[0]
    np.testing.assert_array_equal(keep, [1, 0, 0, 1])


def test_truncated_logprob_by_hand():
    # top_k=2 at T=1 over logits [2, 1, 0]: p = softmax([2, 1]) -> log p(0) = 2 - log(e^2 + e)
    hidden = jnp.eye(3, dtype=jnp.float32)[:1]  # [1, 3]
    w = jnp.array([[2.0, 1.0, 0.0], [0, 0, 0], [0, 0, 0]], jnp.float32)
    out = fused_target_logprobs(hidden, w, jnp.array([0]), top_k=2)
    assert float(out[0]) == pytest.approx(2 - np.log(np.exp(2) + np.exp(1)), abs=1e-6)


@pytest.mark.parametrize(
    ("top_k", "top_p", "softcap"), [(20, 0.9, None), (5, 1.0, 2.0), (0, 0.7, None)]
)
@pytest.mark.parametrize("chunk_size", [3, 64])
def test_fused_equals_naive_values_and_grads(top_k, top_p, softcap, chunk_size):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(3), 4)
    hidden = jax.random.normal(k1, (10, 8), jnp.float32)
    w = jax.random.normal(k2, (8, 61), jnp.float32)
    targets = jax.random.randint(k3, (10,), 0, 61, jnp.int32)  # some outside the set
    cot = jax.random.normal(k4, (10,), jnp.float32)
    kw = dict(temperature=0.6, softcap=softcap, top_k=top_k, top_p=top_p)
    fused = fused_target_logprobs(hidden, w, targets, chunk_size=chunk_size, **kw)
    naive = naive_target_logprobs(hidden, w, targets, **kw)
    assert np.isfinite(np.asarray(fused)).all()
    np.testing.assert_allclose(fused, naive, rtol=1e-5, atol=1e-5)
    plain = naive_target_logprobs(hidden, w, targets, temperature=0.6, softcap=softcap)
    assert (np.asarray(fused) > np.asarray(plain) + 1e-4).all()  # renormalised: mass removed

    def grads(fn, **extra):
        return jax.grad(lambda h, w_: jnp.sum(fn(h, w_, targets, **kw, **extra) * cot), (0, 1))(
            hidden, w
        )

    for a, b in zip(
        grads(fused_target_logprobs, chunk_size=chunk_size),
        grads(naive_target_logprobs),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bad_top_p_is_refused():
    with pytest.raises(ValueError, match="top_p"):
        fused_target_logprobs(jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.array([0, 1]), top_p=0.0)
