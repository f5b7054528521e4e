"""Sampling: truncation masks, greedy, log-probs under the processed distribution, per-row keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout_engine.jax.sampling import (
    CDF_BLOCK,
    SamplingConfig,
    first_argmax,
    inverse_cdf_draw,
    sample,
    truncate_logits,
)

NEG = -np.inf


def _keys(n: int, seed: int = 0) -> jax.Array:
    return jax.random.split(jax.random.key(seed), n)


def test_top_k_keeps_ties_of_the_kth_value() -> None:
    logits = jnp.array([[1.0, 3.0, 2.0, 3.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    np.testing.assert_array_equal(
        truncate_logits(logits, top_k=2),
        [[NEG, 3.0, NEG, 3.0, NEG], [5.0, 4.0, NEG, NEG, NEG]],
    )
    np.testing.assert_array_equal(
        truncate_logits(logits, top_k=3),
        [[NEG, 3.0, 2.0, 3.0, NEG], [5.0, 4.0, 3.0, NEG, NEG]],
    )


def test_off_values_leave_logits_unchanged() -> None:
    logits = jnp.array([[1.0, 3.0, 2.0]])
    for top_k, top_p in [(0, 1.0), (-1, 1.0), (3, 1.0), (7, 1.5)]:
        np.testing.assert_array_equal(truncate_logits(logits, top_k=top_k, top_p=top_p), logits)


def test_top_p_keeps_the_crossing_token_and_its_ties() -> None:
    probs = np.array([[0.5, 0.2, 0.2, 0.1], [0.1, 0.55, 0.3, 0.05]], dtype=np.float32)
    logits = jnp.log(probs)
    lg = np.log(probs)
    # top_p 0.6: row 0 mass before = 0, .5, .7 -> keep .5 and .2 and the tie .2; row 1 keeps .55 .3
    np.testing.assert_array_equal(
        truncate_logits(logits, top_p=0.6),
        [[lg[0, 0], lg[0, 1], lg[0, 2], NEG], [NEG, lg[1, 1], lg[1, 2], NEG]],
    )
    # top_p 0.45: only the most likely token of each row
    np.testing.assert_array_equal(
        truncate_logits(logits, top_p=0.45), [[lg[0, 0], NEG, NEG, NEG], [NEG, lg[1, 1], NEG, NEG]]
    )


def test_top_k_then_top_p_renormalises_over_the_kept_tokens() -> None:
    probs = np.array([[0.4, 0.3, 0.2, 0.1]], dtype=np.float32)
    lg = np.log(probs)
    # top_k 3 -> .4 .3 .2 renormalised to 4/9 3/9 2/9; top_p 0.7: mass before = 0, .444, .777
    np.testing.assert_array_equal(
        truncate_logits(jnp.asarray(lg), top_k=3, top_p=0.7), [[lg[0, 0], lg[0, 1], NEG, NEG]]
    )


def test_greedy_returns_argmax_and_its_untempered_logprob() -> None:
    logits = jnp.array([[0.0, 2.0, 1.0], [3.0, -1.0, 0.5]])
    tokens, logprobs = sample(logits, _keys(2), SamplingConfig(temperature=0.0))
    np.testing.assert_array_equal(tokens, [1, 0])
    expected = jax.nn.log_softmax(logits, axis=-1)[jnp.arange(2), jnp.array([1, 0])]
    np.testing.assert_allclose(logprobs, expected, rtol=0, atol=1e-7)
    assert tokens.dtype == jnp.int32 and logprobs.dtype == jnp.float32


def test_sampled_logprob_is_under_the_tempered_truncated_distribution() -> None:
    logits = jax.random.normal(jax.random.key(1), (6, 50)) * 3.0
    cfg = SamplingConfig(temperature=0.7, top_k=10, top_p=0.9)
    tokens, logprobs = sample(logits, _keys(6), cfg)
    ref = np.asarray(logits, dtype=np.float64) / 0.7
    for b in range(6):
        row = ref[b]
        kth = np.sort(row)[-10]
        row = np.where(row >= kth, row, -np.inf)
        p = np.exp(row - row.max())
        p /= p.sum()
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        floor = p[order][before < 0.9].min()
        row = np.where(p >= floor, row, -np.inf)
        logp = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert np.isfinite(logp[int(tokens[b])]), "sampled a truncated token"
        np.testing.assert_allclose(float(logprobs[b]), logp[int(tokens[b])], atol=1e-5)


def test_top_k_one_is_greedy_with_logprob_zero() -> None:
    logits = jax.random.normal(jax.random.key(2), (4, 30))
    tokens, logprobs = sample(logits, _keys(4), SamplingConfig(temperature=1.3, top_k=1))
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, axis=-1))
    np.testing.assert_array_equal(logprobs, np.zeros(4, np.float32))


def test_empirical_frequencies_follow_softmax_over_temperature() -> None:
    n = 20000
    logits = jnp.tile(jnp.array([[0.0, 1.0, 2.0, -1.0]]), (n, 1))
    tokens, _ = sample(logits, _keys(n, seed=3), SamplingConfig(temperature=2.0))
    freq = np.bincount(np.asarray(tokens), minlength=4) / n
    np.testing.assert_allclose(freq, jax.nn.softmax(logits[0] / 2.0), atol=0.015)


def test_a_rows_draw_depends_only_on_its_own_key() -> None:
    logits = jax.random.normal(jax.random.key(4), (5, 100))
    keys = _keys(5, seed=9)
    cfg = SamplingConfig(temperature=1.0, top_p=0.95)
    full, full_lp = sample(logits, keys, cfg)
    for b in range(5):
        one, one_lp = sample(logits[b : b + 1], keys[b : b + 1], cfg)
        assert int(one[0]) == int(full[b])
        np.testing.assert_allclose(one_lp[0], full_lp[b], atol=1e-6)


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingConfig(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p must be > 0"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match=r"logits must be \[B, V\]"):
        sample(jnp.zeros((3,)), _keys(3), SamplingConfig())
    with pytest.raises(ValueError, match=r"keys must be \[B\]"):
        sample(jnp.zeros((3, 4)), _keys(2), SamplingConfig())


def test_inverse_cdf_draw_picks_the_interval_holding_the_uniform() -> None:
    probs = np.array([[0.0, 0.25, 0.0, 0.5, 0.25]] * 6, np.float32)
    uniforms = jnp.array([0.0, 0.2499, 0.25, 0.7499, 0.75, 0.99999], jnp.float32)
    tokens = inverse_cdf_draw(jnp.asarray(probs), uniforms)
    np.testing.assert_array_equal(tokens, [1, 1, 3, 3, 4, 4])


def test_the_two_level_draw_equals_a_one_level_search_across_blocks() -> None:
    # 3 blocks and a partial fourth (V = 3 * CDF_BLOCK + 17), unnormalised weights with zero runs
    # (block 1 entirely zero, the last 17 tokens zero): the float64 one-level search is the
    # reference; uniforms on exact block boundaries and near 1 included.
    vocab = 3 * CDF_BLOCK + 17
    rng = np.random.default_rng(0)
    w = rng.random((1, vocab)).astype(np.float32) * 3.0
    w[:, CDF_BLOCK : 2 * CDF_BLOCK] = 0.0
    w[:, -17:] = 0.0
    w[:, 5] = 0.0
    cdf = np.cumsum(w[0].astype(np.float64))
    block_edge = cdf[CDF_BLOCK - 1] / cdf[-1]
    u = np.concatenate([rng.random(2000), [0.0, block_edge, 0.9999999, 1.0 - 2**-24]])
    u = u.astype(np.float32)
    tokens = np.asarray(inverse_cdf_draw(jnp.asarray(np.repeat(w, len(u), 0)), jnp.asarray(u)))
    expected = np.minimum(np.searchsorted(cdf, u.astype(np.float64) * cdf[-1], side="right"),
                          np.flatnonzero(w[0])[-1])  # fmt: skip
    # float32 sums may move a draw by one token only where u sits within rounding of an edge
    close = np.abs(cdf[np.minimum(expected, vocab - 1)] / cdf[-1] - u) < 1e-5
    assert np.all((tokens == expected) | close), np.flatnonzero(tokens != expected)
    assert np.sum(tokens != expected) <= 2
    assert np.all(w[0, tokens] > 0), "a zero-weight token was drawn"
    assert tokens[-1] == np.flatnonzero(w[0])[-1]  # u near 1 lands on the last positive token


def test_targets_near_the_rounded_end_of_a_block_never_draw_a_zero_weight_token() -> None:
    # Rows of one large weight among many weights under half its ulp, with zero-weight tokens
    # after them: the float32 running sums inside the block and the block's own sum round
    # differently, so a uniform near 1 may target past every running sum of the block; the
    # draw must then stay on the last token of nonzero weight, never a zero-weight one.
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(64):
        w = np.zeros(2 * CDF_BLOCK, np.float32)
        n = int(rng.integers(2, CDF_BLOCK))
        w[:n] = 2.0 ** -int(rng.integers(24, 27))
        w[int(rng.integers(0, n))] = 1.0
        rows.append(w)
    w = np.stack(rows)
    u = 1.0 - 2.0 ** -rng.integers(22, 25, len(rows)).astype(np.float32)
    tokens = np.asarray(inverse_cdf_draw(jnp.asarray(w), jnp.asarray(u, jnp.float32)))
    assert np.all(w[np.arange(len(rows)), tokens] > 0), tokens


def test_first_argmax_is_jnp_argmax_with_ties_nan_and_infinite_rows() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 49_152)).astype(np.float32)
    x[1, [7, 300, 40_000]] = 9.0  # a tie of the max: the first index
    x[2, [5, 60]] = np.nan  # a NaN row: its first NaN
    x[3] = -np.inf  # nothing finite: index 0
    x[4, 49_151] = 50.0  # the max at the last index
    x[5, :3] = np.inf
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32 and got[1:].tolist() == [7, 5, 0, 49_151, 0]
    xb = jnp.asarray(x).astype(jnp.bfloat16)  # bf16 logits: the same rule
    np.testing.assert_array_equal(np.asarray(first_argmax(xb)), np.asarray(jnp.argmax(xb, -1)))
