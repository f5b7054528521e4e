"""Stop rules, run step by step over hand-made sampled tokens, against exact expected arrays."""

import jax.numpy as jnp
import numpy as np
import pytest

from rollout_engine.jax.stops import (
    RUNNING,
    STOP_EOS,
    STOP_LENGTH,
    StopConfig,
    decide,
    eos_mask,
)

R, E, L = RUNNING, STOP_EOS, STOP_LENGTH


def _run(sampled, start_len, max_new, finished, cfg, steps):
    """Feed `sampled [B, steps]` through `decide`; lp of step t is -(t+1)/10; returns emitted
    tokens, log-probs, reasons, forced flags ``[B, steps]`` and the final think_done ``[B]``."""
    b = len(sampled)
    gen_len = jnp.asarray(start_len, jnp.int32)
    done = jnp.asarray(finished)
    think = jnp.zeros(b, bool)
    hist = jnp.full((b, cfg.marker_len), -1, jnp.int32)
    out_t, out_lp, out_r, out_f = [], [], [], []
    for t in range(steps):
        lp = jnp.full(b, -(t + 1) / 10, jnp.float32)
        d = decide(
            jnp.asarray([row[t] for row in sampled], jnp.int32),
            lp,
            gen_len=gen_len,
            max_new=jnp.asarray(max_new, jnp.int32),
            finished=done,
            think_done=think,
            history=hist,
            cfg=cfg,
        )
        out_t.append(d.tokens)
        out_lp.append(d.logprobs)
        out_r.append(d.reason)
        out_f.append(d.forced)
        done = done | (d.reason != RUNNING)
        gen_len = gen_len + 1
        think, hist = d.think_done, d.history
    return (
        np.stack(out_t, 1),
        np.stack(out_lp, 1),
        np.stack(out_r, 1),
        np.stack(out_f, 1),
        np.asarray(think),
    )


def test_eos_mask_matches_any_of_several_ids() -> None:
    np.testing.assert_array_equal(
        eos_mask(jnp.array([2, 5, 7, 0]), (2, 7)), [True, False, True, False]
    )


def test_end_of_think_phrase_eos_and_length_masks_exactly() -> None:
    cfg = StopConfig(eos_ids=(2, 7), pad_id=0, think_phrase=(11, 12, 13), think_budget=6)
    sampled = [
        [20, 21, 22, 23, 24, 25, 26, 27],  # 0: phrase at gen_len 3..5, sampled 27 at the limit
        [30, 31, 32, 33, 34, 35, 36, 37],  # 1: joined at gen_len 2: phrase at steps 1..3
        [40, 13, 42, 43, 44, 45, 46, 47],  # 2: ends thinking by itself: no phrase
        [50, 51, 52, 53, 54, 55, 56, 57],  # 3: already finished: pads
        [60, 61, 7, 63, 64, 65, 66, 67],  # 4: samples EOS 7 (the second id)
        [70, 71, 72, 73, 74, 75, 76, 77],  # 5: max_new 5 cuts the phrase after its 2nd token
        [80, 81, 2, 83, 84, 85, 86, 87],  # 6: samples EOS at its last allowed position
        [90, 91, 92, 93, 2, 95, 96, 97],  # 7: EOS sampled inside the phrase window is overwritten
    ]
    start = [0, 2, 0, 0, 0, 1, 0, 0]
    max_new = [8, 8, 8, 8, 8, 5, 3, 8]
    finished = [False, False, False, True, False, False, False, False]
    tokens, lps, reasons, forced, think = _run(sampled, start, max_new, finished, cfg, 8)
    # at the length limit the sampled token stays, with its log-prob (as vLLM does)
    np.testing.assert_array_equal(
        tokens,
        [
            [20, 21, 22, 11, 12, 13, 26, 27],
            [30, 11, 12, 13, 34, 35, 0, 0],
            [40, 13, 42, 43, 44, 45, 46, 47],
            [0, 0, 0, 0, 0, 0, 0, 0],
            [60, 61, 7, 0, 0, 0, 0, 0],
            [70, 71, 11, 12, 0, 0, 0, 0],
            [80, 81, 2, 0, 0, 0, 0, 0],
            [90, 91, 92, 11, 12, 13, 96, 97],
        ],
    )
    s = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7, -0.8]
    np.testing.assert_allclose(
        lps,
        [
            [s[0], s[1], s[2], 0, 0, 0, s[6], s[7]],
            [s[0], 0, 0, 0, s[4], s[5], 0, 0],
            [s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]],
            [0, 0, 0, 0, 0, 0, 0, 0],
            [s[0], s[1], s[2], 0, 0, 0, 0, 0],
            [s[0], s[1], 0, 0, 0, 0, 0, 0],
            [s[0], s[1], s[2], 0, 0, 0, 0, 0],
            [s[0], s[1], s[2], 0, 0, 0, s[6], s[7]],
        ],
        rtol=0,
        atol=1e-7,
    )
    # exactly the phrase tokens are marked forced (kept out of the loss); padding is not
    np.testing.assert_array_equal(
        forced.astype(int),
        [
            [0, 0, 0, 1, 1, 1, 0, 0],
            [0, 1, 1, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 1, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 1, 1, 1, 0, 0],
        ],
    )
    np.testing.assert_array_equal(
        reasons,
        [
            [R, R, R, R, R, R, R, L],
            [R, R, R, R, R, L, R, R],
            [R, R, R, R, R, R, R, L],
            [R, R, R, R, R, R, R, R],
            [R, R, E, R, R, R, R, R],
            [R, R, R, L, R, R, R, R],
            [R, R, E, R, R, R, R, R],
            [R, R, R, R, R, R, R, L],
        ],
    )
    np.testing.assert_array_equal(think, [True, True, True, False, False, False, False, True])


def test_multi_token_marker_is_matched_on_emitted_tokens() -> None:
    # phrase 4 tokens, marker = last two (12, 13), budget 6: phrase at gen_len 2..5
    cfg = StopConfig(
        eos_ids=(2,), think_phrase=(10, 11, 12, 13), think_budget=6, think_marker=(12, 13)
    )
    sampled = [
        [12, 13, 40, 41, 42, 43, 44],  # marker emitted by itself: left alone
        [13, 31, 32, 33, 34, 35, 36],  # 13 alone is not the marker: phrase inserted
        [50, 12, 52, 53, 54, 55, 56],  # 12 alone neither
    ]
    tokens, lps, reasons, forced, think = _run(sampled, [0, 0, 0], [7, 7, 7], [False] * 3, cfg, 7)
    np.testing.assert_array_equal(
        tokens,
        [
            [12, 13, 40, 41, 42, 43, 44],
            [13, 31, 10, 11, 12, 13, 36],
            [50, 12, 10, 11, 12, 13, 56],
        ],
    )
    np.testing.assert_array_equal(lps[1], np.float32([-0.1, -0.2, 0, 0, 0, 0, -0.7]))
    np.testing.assert_array_equal(forced.sum(axis=1), [0, 4, 4])
    np.testing.assert_array_equal(reasons[:, -1], [L, L, L])
    np.testing.assert_array_equal(think, [True, True, True])


def test_no_budget_means_no_insertion() -> None:
    cfg = StopConfig(eos_ids=(2,))
    tokens, lps, reasons, forced, think = _run([[5, 6, 7, 8]], [0], [4], [False], cfg, 4)
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 8]])
    np.testing.assert_allclose(lps, [[-0.1, -0.2, -0.3, -0.4]], rtol=0, atol=1e-7)
    assert not forced.any()
    np.testing.assert_array_equal(reasons, [[R, R, R, L]])
    np.testing.assert_array_equal(think, [False])


def test_bad_configs_raise() -> None:
    with pytest.raises(ValueError, match="at least one token id"):
        StopConfig(eos_ids=())
    with pytest.raises(ValueError, match="go together"):
        StopConfig(eos_ids=(1,), think_budget=4)
    with pytest.raises(ValueError, match="must be >= the phrase length"):
        StopConfig(eos_ids=(1,), think_phrase=(3, 4, 5), think_budget=2)
    with pytest.raises(ValueError, match="must be a suffix"):
        StopConfig(eos_ids=(1,), think_phrase=(3, 4, 5), think_budget=8, think_marker=(4,))
    with pytest.raises(ValueError, match="occurs inside"):
        StopConfig(eos_ids=(1,), think_phrase=(5, 4, 5), think_budget=8)
    with pytest.raises(ValueError, match=r"history must be \[B, M\]"):
        decide(
            jnp.zeros(2, jnp.int32),
            jnp.zeros(2),
            gen_len=jnp.zeros(2, jnp.int32),
            max_new=jnp.ones(2, jnp.int32),
            finished=jnp.zeros(2, bool),
            think_done=jnp.zeros(2, bool),
            history=jnp.zeros((3, 1), jnp.int32),
            cfg=StopConfig(eos_ids=(1,)),
        )
