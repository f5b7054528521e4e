"""The optimizer against Adam worked out by hand, its schedule, and gradient accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trainer.optim import OptimizerConfig, learning_rate_schedule, make_optimizer


def test_schedule_values():
    cfg = OptimizerConfig(learning_rate=1.0, warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    lr = learning_rate_schedule(cfg)
    # warmup: 0, 0.25, 0.5, 0.75, 1.0 at steps 0..4; cosine over the 8 remaining steps:
    # step 8 is halfway: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55; step 12 and after: 0.1
    np.testing.assert_allclose(
        [lr(s) for s in (0, 1, 2, 4, 8, 12, 20)],
        [0, 0.25, 0.5, 1.0, 0.55, 0.1, 0.1],
        rtol=1e-6,
        atol=1e-7,
    )


def test_clipping_adam_and_masked_weight_decay_by_hand():
    cfg = OptimizerConfig(learning_rate=0.1, total_steps=100, weight_decay=0.5, max_grad_norm=1.0)
    tx = make_optimizer(cfg)
    params = {"w": jnp.array([[1.0, 2.0]]), "b": jnp.array([1.0])}
    state = tx.init(params)
    # global norm of (w: [3, 4], b: [0]) is 5 -> clipped to w [0.6, 0.8], b [0]
    grads = {"w": jnp.array([[3.0, 4.0]]), "b": jnp.array([0.0])}
    updates, state = tx.update(grads, state, params)
    # step 1: m = 0.1 g, v = 0.001 g^2; bias-corrected m / sqrt(v) = g / |g| = 1 for g != 0
    # update = -lr (1 + wd * p) for w (matrix): -0.1 * (1 + 0.5 * [1, 2]) = [-0.15, -0.2];
    # b is 1-D (no decay) with g = 0: 0
    np.testing.assert_allclose(updates["w"], [[-0.15, -0.2]], rtol=1e-5)
    np.testing.assert_allclose(updates["b"], [0.0], atol=1e-7)


def test_grad_accumulation_averages_micro_batches():
    base = dict(learning_rate=0.1, total_steps=10, max_grad_norm=None)
    acc = make_optimizer(OptimizerConfig(**base, grad_accum_steps=2))
    ref = make_optimizer(OptimizerConfig(**base))
    params = {"w": jnp.array([1.0, -1.0, 0.5])}
    g1, g2 = {"w": jnp.array([1.0, 2.0, -3.0])}, {"w": jnp.array([3.0, -4.0, 1.0])}
    s = acc.init(params)
    u1, s = acc.update(g1, s, params)
    np.testing.assert_array_equal(u1["w"], [0.0, 0.0, 0.0])  # no update mid-accumulation
    u2, s = acc.update(g2, s, params)
    mean = {"w": (g1["w"] + g2["w"]) / 2}
    expected, _ = ref.update(mean, ref.init(params), params)
    np.testing.assert_allclose(u2["w"], expected["w"], rtol=1e-6)
    new = optax.apply_updates(params, u2)
    assert new["w"].shape == (3,)


def test_bad_config_raises():
    with pytest.raises(ValueError, match="warmup_steps <= total_steps"):
        OptimizerConfig(warmup_steps=5, total_steps=2)
    with pytest.raises(ValueError, match="grad_accum_steps"):
        OptimizerConfig(grad_accum_steps=0)
    with pytest.raises(ValueError, match="learning_rate must be >= 0; got -1e-06"):
        OptimizerConfig(learning_rate=-1e-6)


def test_zero_learning_rate_keeps_the_weights_exactly():
    """lr = 0 is a real experiment (the engine-trainer mismatch at fixed weights): every update
    is exactly zero, weight decay included."""
    cfg = OptimizerConfig(learning_rate=0.0, total_steps=10, weight_decay=0.1, warmup_steps=2)
    tx = make_optimizer(cfg)
    params = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([0.25])}
    state = tx.init(params)
    for g in (1.0, -3.0, 7.0):
        grads = jax.tree.map(lambda p, g=g: jnp.full_like(p, g), params)
        updates, state = tx.update(grads, state, params)
        new = optax.apply_updates(params, updates)
        for key in params:
            np.testing.assert_array_equal(new[key], params[key])
