"""Each loss against values worked out by hand on a 2 x 3 batch.

The batch (shared by every test): sampler log-probs -2 everywhere, current log-probs
-2 + ln(r) so the importance ratios r are exact:

    row 0: r = [1.5, 0.5, 1.0], mask [1, 1, 1], advantage +1
    row 1: r = [1.1, 0.7, 9.0], mask [1, 1, 0], advantage -2   (the 9.0 is padding)
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.losses import LossInputs, aggregate, available_losses, k3_kl, make_loss

RATIOS = np.array([[1.5, 0.5, 1.0], [1.1, 0.7, 9.0]])
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
ADV = np.array([1.0, -2.0], np.float32)
SAMPLER = np.full((2, 3), -2.0, np.float32)
LOGPROBS = (SAMPLER + np.log(RATIOS)).astype(np.float32)


def _inputs(logprobs=LOGPROBS, ratios=None, **kw) -> LossInputs:
    if ratios is not None:
        logprobs = (SAMPLER + np.log(ratios)).astype(np.float32)
    return LossInputs(
        logprobs=jnp.asarray(logprobs),
        sampler_logprobs=jnp.asarray(SAMPLER),
        advantages=jnp.asarray(ADV),
        mask=jnp.asarray(MASK),
        **kw,
    )


def _grad(loss, inputs: LossInputs) -> np.ndarray:
    def f(lp):
        return loss(
            LossInputs(
                lp,
                inputs.sampler_logprobs,
                inputs.advantages,
                inputs.mask,
                inputs.ref_logprobs,
                inputs.normalizer,
            )
        ).loss

    return np.asarray(jax.grad(f)(inputs.logprobs))


def test_registry_names_and_unknown():
    assert available_losses() == ("cispo", "dapo", "dr_grpo", "grpo")
    with pytest.raises(KeyError, match="unknown loss 'ppo'"):
        make_loss("ppo")


def test_grpo_seq_mean_token_mean_by_hand():
    # eps = 0.2, term = -min(r A, clip(r, 0.8, 1.2) A)
    # row 0 (A=+1): -min(1.5, 1.2) = -1.2 (clipped); -min(0.5, 0.8) = -0.5; -1.0 -> mean -0.9
    # row 1 (A=-2): -min(-2.2, -2.2) = 2.2; -min(-1.4, -1.6) = 1.6 (clipped) -> mean 1.9
    # loss = (-0.9 + 1.9) / 2 = 0.5; clipped 2 of 5 tokens; ratio mean 4.8 / 5 = 0.96
    out = make_loss("grpo", eps_low=0.2)(_inputs())
    np.testing.assert_allclose(out.loss, 0.5, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["clip_fraction"], 0.4, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["ratio_mean"], 0.96, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["kl"], 0.0)
    np.testing.assert_allclose(out.metrics["num_tokens"], 5.0)
    # sampler_kl = mean over masked tokens of r - 1 - ln r
    sampler_kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.0, 1.1, 0.7)) / 5
    np.testing.assert_allclose(sampler_kl, 0.06980934, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["sampler_kl"], sampler_kl, rtol=1e-5)
    # d term / d logprob = -A r where the unclipped branch is taken, 0 where clipped;
    # scaled by 1 / (tokens in row) / (rows = 2):
    # row 0: [0, -0.5 / 6, -1.0 / 6], row 1: [2.2 / 4, 0, 0 (masked)]
    expected = [[0.0, -0.5 / 6, -1.0 / 6], [0.55, 0.0, 0.0]]
    np.testing.assert_allclose(_grad(make_loss("grpo"), _inputs()), expected, atol=1e-6)


def test_grpo_token_mean_and_constant_aggregations():
    # Same per-token terms: sum = -2.7 + 3.8 = 1.1 over 5 tokens -> 0.22
    out = make_loss("grpo", aggregation="token_mean")(_inputs())
    np.testing.assert_allclose(out.loss, 0.22, rtol=1e-6)
    out = make_loss("grpo", aggregation="seq_sum_constant")(_inputs())
    np.testing.assert_allclose(out.loss, 1.1 / 6, rtol=1e-6)  # B * T = 2 * 3


def test_dr_grpo_constant_normaliser():
    # Same terms (eps 0.2), sum 1.1, divided by B * max_tokens = 2 * 4 = 8
    loss = make_loss("dr_grpo", max_tokens=4)
    assert loss.advantage_std_normalization is False
    out = loss(_inputs())
    np.testing.assert_allclose(out.loss, 1.1 / 8, rtol=1e-6)
    # gradient: -A r / 8 where unclipped: row 0 [0, -0.5/8, -1/8], row 1 [2.2/8, 0, 0]
    expected = [[0.0, -0.0625, -0.125], [0.275, 0.0, 0.0]]
    np.testing.assert_allclose(_grad(loss, _inputs()), expected, atol=1e-6)


def test_dapo_clip_higher_token_mean():
    # eps_low 0.2, eps_high 0.28: clip(r, 0.8, 1.28)
    # row 0 (A=+1): -min(1.5, 1.28) = -1.28 (clipped); -0.5; -1.0 -> sum -2.78
    # row 1 (A=-2): 2.2; -min(-1.4, -1.6) = 1.6 (clipped) -> sum 3.8
    # loss = (-2.78 + 3.8) / 5 = 0.204
    out = make_loss("dapo")(_inputs())
    np.testing.assert_allclose(out.loss, 0.204, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["clip_fraction"], 0.4, rtol=1e-6)
    # a ratio of 1.25 is clipped by GRPO's 1.2 but not by DAPO's 1.28
    ratios = np.array([[1.25, 1.0, 1.0], [1.0, 1.0, 1.0]])
    assert float(make_loss("dapo")(_inputs(ratios=ratios)).metrics["clip_fraction"]) == 0.0
    grpo = make_loss("grpo")(_inputs(ratios=ratios)).metrics["clip_fraction"]
    np.testing.assert_allclose(grpo, 0.2, rtol=1e-6)


def test_cispo_by_hand_with_gradient():
    # eps_high = 1.0 -> weight = sg(min(r, 2)); row 0 ratios [1.5, 0.5, 3.0] (3.0 is capped)
    ratios = np.array([[1.5, 0.5, 3.0], [1.1, 0.7, 9.0]])
    # lp = -2 + ln(r); term = -w A lp
    # row 0 (A=1): -[1.5, 0.5, 2.0] * lp[0]; row 1 (A=-2): 2 * [1.1, 0.7] * lp[1]
    row0 = -(1.5 * (-2 + math.log(1.5)) + 0.5 * (-2 + math.log(0.5)) + 2.0 * (-2 + math.log(3)))
    row1 = 2 * (1.1 * (-2 + math.log(1.1)) + 0.7 * (-2 + math.log(0.7)))
    # = 5.5411513 + (-7.4896626) = -1.9485112, over 5 tokens
    expected_loss = (row0 + row1) / 5
    np.testing.assert_allclose(expected_loss, -0.38970224, rtol=1e-6)
    loss = make_loss("cispo", eps_high=1.0)
    out = loss(_inputs(ratios=ratios))
    np.testing.assert_allclose(out.loss, expected_loss, rtol=1e-5)
    np.testing.assert_allclose(out.metrics["clip_fraction"], 0.2, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["ratio_mean"], 6.8 / 5, rtol=1e-6)
    # the weight is a constant: d/dlp = -w A / 5, and every token (even capped) has a gradient
    expected_grad = [[-0.3, -0.1, -0.4], [0.44, 0.28, 0.0]]
    np.testing.assert_allclose(_grad(loss, _inputs(ratios=ratios)), expected_grad, atol=1e-6)


def test_cispo_lower_bound_counts_as_clipped():
    # eps_low 0.4 -> floor 0.6: ratios 0.5 (row 0) is clipped up; 0.7 is not; 1.5, 1.0, 1.1 no
    out = make_loss("cispo", eps_high=1.0, eps_low=0.4)(_inputs())
    np.testing.assert_allclose(out.metrics["clip_fraction"], 0.2, rtol=1e-6)


def test_k3_kl_values_and_kl_term():
    # d = ref - lp: ln 2 -> 2 - ln 2 - 1 = 0.3068528; 0 -> 0; -ln 2 -> 0.5 + ln 2 - 1 = 0.1931472
    lp = jnp.zeros((1, 3))
    ref = jnp.asarray([[math.log(2), 0.0, -math.log(2)]])
    np.testing.assert_allclose(k3_kl(lp, ref), [[0.3068528, 0.0, 0.1931472]], atol=1e-6)
    # masked tokens of the shared batch get d = [ln 2, 0, -ln 2 | 0, 0]: kl sum 0.5, mean 0.1
    d = np.array([[math.log(2), 0.0, -math.log(2)], [0.0, 0.0, 5.0]], np.float32)
    inputs = _inputs(ref_logprobs=jnp.asarray(LOGPROBS + d))
    loss = make_loss("grpo", aggregation="token_mean", kl_coef=0.5)
    out = loss(inputs)
    np.testing.assert_allclose(out.metrics["kl"], 0.1, rtol=1e-5)
    np.testing.assert_allclose(out.loss, 0.22 + 0.5 * 0.1, rtol=1e-5)
    # KL gradient d/dlp (e^d - d - 1) = 1 - e^d: [-1, 0, 0.5 | 0, 0] * 0.5 / 5, plus the pg part
    pg = np.array([[0.0, -0.5, -1.0], [2.2, 0.0, 0.0]]) / 5
    kl = np.array([[-1.0, 0.0, 0.5], [0.0, 0.0, 0.0]]) * 0.5 / 5
    np.testing.assert_allclose(_grad(loss, inputs), pg + kl, atol=1e-6)
    # an infinite reference log-prob in padding leaves loss and gradient finite
    ref = np.asarray(LOGPROBS + d)
    ref[1, 2] = -np.inf
    inputs = _inputs(ref_logprobs=jnp.asarray(ref))
    np.testing.assert_allclose(loss(inputs).loss, 0.27, rtol=1e-5)
    np.testing.assert_allclose(_grad(loss, inputs), pg + kl, atol=1e-6)


def test_kl_coef_without_reference_raises():
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        make_loss("grpo", kl_coef=0.1)(_inputs())


def test_normalizer_override_for_accumulation():
    # two micro-batches (the rows) with the global token count 5 sum to the full token mean
    loss = make_loss("dapo")
    full = float(loss(_inputs()).loss)
    parts = 0.0
    for row in range(2):
        parts += float(
            loss(
                LossInputs(
                    jnp.asarray(LOGPROBS[row : row + 1]),
                    jnp.asarray(SAMPLER[row : row + 1]),
                    jnp.asarray(ADV[row : row + 1]),
                    jnp.asarray(MASK[row : row + 1]),
                    normalizer=jnp.asarray(5.0),
                )
            ).loss
        )
    np.testing.assert_allclose(parts, full, rtol=1e-6)


def test_token_level_advantages_and_padding_is_ignored():
    # [B, T] advantages equal to the broadcast [B] ones give the same loss; a huge log-prob in a
    # padded slot neither changes the loss nor makes it NaN
    adv_bt = jnp.asarray(np.repeat(ADV[:, None], 3, axis=1))
    lp = LOGPROBS.copy()
    lp[1, 2] = 1e4
    out = make_loss("grpo")(
        LossInputs(jnp.asarray(lp), jnp.asarray(SAMPLER), adv_bt, jnp.asarray(MASK))
    )
    np.testing.assert_allclose(out.loss, 0.5, rtol=1e-6)
    # CISPO multiplies by the log-prob itself: -inf in padding gives neither NaN loss nor grad
    lp[1, 2] = -np.inf
    inputs = LossInputs(jnp.asarray(lp), jnp.asarray(SAMPLER), jnp.asarray(ADV), jnp.asarray(MASK))
    loss = make_loss("cispo")
    assert np.isfinite(float(loss(inputs).loss))
    assert np.all(np.isfinite(_grad(loss, inputs)))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        make_loss("grpo")(
            LossInputs(
                jnp.asarray(LOGPROBS), jnp.asarray(SAMPLER), jnp.zeros((3,)), jnp.asarray(MASK)
            )
        )
    with pytest.raises(ValueError, match="mask must have the shape"):
        make_loss("grpo")(
            LossInputs(jnp.asarray(LOGPROBS), jnp.asarray(SAMPLER), jnp.asarray(ADV), jnp.ones(3))
        )
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregate(jnp.zeros((1, 1)), jnp.ones((1, 1)), "sum")
    with pytest.raises(ValueError, match="eps_low"):
        make_loss("grpo", eps_low=1.5)


def test_losses_jit():
    loss = make_loss("cispo")
    out = jax.jit(loss.__call__)(_inputs())
    assert set(out.metrics) == {
        "pg_loss",
        "clip_fraction",
        "ratio_mean",
        "kl",
        "sampler_kl",
        "num_tokens",
    }
