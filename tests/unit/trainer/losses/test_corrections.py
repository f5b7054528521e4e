"""The off-policy corrections on a hand-built 2 x 5 batch: loss, gradient with respect to the
log-probs and the token counts, against formulas written out here in numpy.

Row 0 has lag 0, row 1 lag 1; row 1's last position is padding (garbage log-probs there).
Ratios r = pi_theta / pi_sampler: row 0 [1.0, 1.5, 0.4, 3.0, 1.1], row 1 [0.9, 2.5, 0.7, 1.3].
Advantages A = [1.0, -0.5]; GRPO with eps = 0.2 and token-mean aggregation (N = 9 tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.losses import make_loss
from trainer.losses.base import LossInputs
from trainer.losses.corrections import make_correction

R = np.array([[1.0, 1.5, 0.4, 3.0, 1.1], [0.9, 2.5, 0.7, 1.3, 1.0]])
P_SAMPLER = np.array([[0.5, 0.2, 0.4, 0.1, 0.3], [0.6, 0.1, 0.5, 0.2, 0.5]])
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], np.float64)
ADV = np.array([1.0, -0.5])
LAG = np.array([0, 1])
N = 9.0


def _inputs(logp):
    sampler = np.log(P_SAMPLER)
    sampler[1, 4] = -30.0  # padding garbage
    return LossInputs(
        logprobs=logp,
        sampler_logprobs=jnp.asarray(sampler, jnp.float32),
        advantages=jnp.asarray(ADV, jnp.float32),
        mask=jnp.asarray(MASK, jnp.float32),
        lag=jnp.asarray(LAG, jnp.int32),
    )


def _logp():
    logp = np.log(P_SAMPLER * R)
    logp[1, 4] = 5.0  # padding garbage
    return jnp.asarray(logp, jnp.float32)


def _run(loss):
    def f(logp):
        out = loss(_inputs(logp))
        return out.loss, out.metrics

    (value, metrics), grad = jax.value_and_grad(f, has_aux=True)(_logp())
    return float(value), np.asarray(grad, np.float64), jax.device_get(metrics)


def _grpo_plain():
    """Per-token GRPO term and its d/d log pi_theta with ratio R (clip 0.8..1.2)."""
    a = ADV[:, None]
    clipped_r = np.clip(R, 0.8, 1.2)
    term = -np.minimum(R * a, clipped_r * a)
    # the unclipped branch is the min unless the ratio left the range in A's direction
    was_clipped = ((a > 0) & (R > 1.2)) | ((a < 0) & (R < 0.8))
    grad = np.where(was_clipped, 0.0, -a * R)  # d(-r A)/d log pi = -A r
    return term, grad


def test_tis_token_by_hand():
    loss = make_loss("grpo", aggregation="token_mean").with_correction(
        make_correction("tis_token", tis_cap=2.0)
    )
    value, grad, m = _run(loss)
    w = np.minimum(R, 2.0)  # 3.0 and 2.5 capped
    # ratio to the trainer's own policy is 1: every term is -A * w, never clipped
    want = np.sum(-ADV[:, None] * w * MASK) / N
    assert value == pytest.approx(want, abs=1e-6)
    # by hand: row 0: -(1 + 1.5 + 0.4 + 2 + 1.1) = -6.0; row 1: 0.5 * (0.9 + 2 + 0.7 + 1.3) = 2.45
    assert want == pytest.approx((-6.0 + 2.45) / 9)
    np.testing.assert_allclose(grad, -ADV[:, None] * w * MASK / N, atol=1e-6)
    assert m["correction/capped_tokens"] == 2
    assert m["correction/masked_tokens"] == 0
    assert m["correction/weight_sum"] == pytest.approx(6.0 + 4.9, abs=1e-5)
    assert m["clip_fraction"] == 0


def test_tis_sequence_by_hand():
    loss = make_loss("grpo", aggregation="token_mean").with_correction(
        make_correction("tis_sequence", tis_cap=2.0)
    )
    value, grad, m = _run(loss)
    # row 0: 1 * 1.5 * 0.4 * 3 * 1.1 = 1.98 (under the cap); row 1: 0.9 * 2.5 * 0.7 * 1.3 = 2.0475
    w_row = np.array([1.98, 2.0])
    want = np.sum(-ADV[:, None] * w_row[:, None] * MASK) / N
    assert value == pytest.approx(want, abs=1e-6)
    np.testing.assert_allclose(grad, -ADV[:, None] * w_row[:, None] * MASK / N, atol=1e-6)
    assert m["correction/capped_tokens"] == 4  # the 4 tokens of row 1


def test_icepop_by_hand():
    loss = make_loss("grpo", aggregation="token_mean").with_correction(
        make_correction("icepop", icepop_beta=2.0)
    )
    value, grad, m = _run(loss)
    keep = (R >= 0.5) & (R <= 2.0) & (MASK > 0)  # drops 0.4, 3.0 (row 0) and 2.5 (row 1)
    term, g = _grpo_plain()
    assert value == pytest.approx(np.sum(term * keep) / N, abs=1e-6)
    np.testing.assert_allclose(grad, g * keep / N, atol=1e-6)
    assert m["correction/masked_tokens"] == 3
    assert m["num_tokens"] == 9  # dropped tokens still count in the normaliser


def test_decoupled_ppo_by_hand():
    loss = make_loss("grpo", aggregation="token_mean").with_correction(
        make_correction("decoupled_ppo")
    )
    value, grad, m = _run(loss)
    term, g = _grpo_plain()
    # row 0 (lag 0): the plain loss; row 1 (lag 1): clip on pi_theta / pi_prox = 1, times w
    stale_term = -ADV[1] * R[1]
    want = (np.sum(term[0]) + np.sum(stale_term[:4])) / N
    assert value == pytest.approx(want, abs=1e-6)
    want_grad = np.stack([g[0], -ADV[1] * R[1] * MASK[1]]) / N
    np.testing.assert_allclose(grad, want_grad, atol=1e-6)
    assert m["correction/weight_sum"] == pytest.approx(5 + 0.9 + 2.5 + 0.7 + 1.3, abs=1e-5)
    assert m["correction/capped_tokens"] == 0
    capped = make_loss("grpo", aggregation="token_mean").with_correction(
        make_correction("decoupled_ppo", decoupled_cap=2.0)
    )
    assert _run(capped)[2]["correction/capped_tokens"] == 1  # 2.5 in row 1; row 0 is lag 0


def test_cispo_takes_tis_too():
    loss = make_loss("cispo").with_correction(make_correction("tis_token", tis_cap=2.0))
    value, grad, _ = _run(loss)
    w = np.minimum(R, 2.0)
    logp = np.log(P_SAMPLER * R)
    assert value == pytest.approx(np.sum(-ADV[:, None] * w * logp * MASK) / N, abs=1e-6)
    np.testing.assert_allclose(grad, -ADV[:, None] * w * MASK / N, atol=1e-6)


def test_no_correction_is_the_plain_loss():
    value, grad, m = _run(make_loss("grpo", aggregation="token_mean"))
    term, g = _grpo_plain()
    assert value == pytest.approx(np.sum(term * MASK) / N, abs=1e-6)
    np.testing.assert_allclose(grad, g * MASK / N, atol=1e-6)
    assert not any(k.startswith("correction/") for k in m)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="correction must be one of"):
        make_correction("tis")
    with pytest.raises(ValueError, match="beta must be > 1"):
        make_correction("icepop", icepop_beta=1.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        make_correction("tis_token", tis_cap=0.0)


def test_config_builds_the_correction():
    from trainer.build import loss_from_config
    from trainer.config import ConfigError, load_config
    from trainer.losses.corrections import TruncatedIS

    cfg = load_config(loss={"name": "dapo", "correction": "tis_sequence", "tis_cap": 3.0})
    loss = loss_from_config(cfg)
    assert isinstance(loss.correction, TruncatedIS)
    assert (loss.correction.level, loss.correction.cap) == ("sequence", 3.0)
    assert loss_from_config(load_config()).correction is None  # off by default
    with pytest.raises(ConfigError, match="loss.correction"):
        load_config(loss={"correction": "tis"})
    with pytest.raises(ConfigError, match="loss.icepop_beta"):
        load_config(loss={"correction": "icepop", "icepop_beta": 0.5})
