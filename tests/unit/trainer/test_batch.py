"""RLBatch from rollout groups, checked array by array, and its sharding on 8 devices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gateway.messages import Completion
from trainer.batch import NO_VERSION, bucket_length, build_rl_batch, shard_batch, tokens_per_lag
from trainer.logprobs import fused_target_logprobs
from trainer.losses import make_loss
from trainer.rollouts import RolloutGroup


def _groups() -> list[RolloutGroup]:
    a = RolloutGroup(
        "a",
        [5, 6, 7],
        [
            Completion([8, 9], [-0.5, -1.0], "stop", 3, 4, reward=1.0),
            Completion([10], [-2.0], "length", 4, 4, reward=0.0),
        ],
    )
    b = RolloutGroup(
        "b",
        [11],
        [
            Completion([12, 13, 14, 2], [-0.1, -0.2, -0.3, -0.4], "stop", 2, 3, reward=0.5),
            Completion([15, 2], [-1.0, -1.0], "stop", 3, 3, reward=0.5),
        ],
    )
    return [a, b]


def test_build_rl_batch_exact_arrays():
    batch = build_rl_batch(_groups())
    # sequence lengths 5, 4, 5, 3 -> the default power-of-two bucket with minimum 8
    assert batch.length == 8 and batch.num_rows == 4
    np.testing.assert_array_equal(
        batch.tokens,
        [
            [5, 6, 7, 8, 9, 0, 0, 0],
            [5, 6, 7, 10, 0, 0, 0, 0],
            [11, 12, 13, 14, 2, 0, 0, 0],
            [11, 15, 2, 0, 0, 0, 0, 0],
        ],
    )
    np.testing.assert_array_equal(
        batch.targets,
        [
            [6, 7, 8, 9, 0, 0, 0, 0],
            [6, 7, 10, 0, 0, 0, 0, 0],
            [12, 13, 14, 2, 0, 0, 0, 0],
            [15, 2, 0, 0, 0, 0, 0, 0],
        ],
    )
    # position t is counted when targets[t] is a completion token: t = P-1 .. S-2
    np.testing.assert_array_equal(
        batch.loss_mask,
        [
            [0, 0, 1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
        ],
    )
    np.testing.assert_allclose(
        batch.sampler_logprobs,
        [
            [0, 0, -0.5, -1.0, 0, 0, 0, 0],
            [0, 0, -2.0, 0, 0, 0, 0, 0],
            [-0.1, -0.2, -0.3, -0.4, 0, 0, 0, 0],
            [-1.0, -1.0, 0, 0, 0, 0, 0, 0],
        ],
    )
    np.testing.assert_array_equal(batch.positions, np.tile(np.arange(8), (4, 1)))
    np.testing.assert_array_equal(batch.prompt_lens, [3, 3, 1, 1])
    np.testing.assert_array_equal(batch.seq_lens, [5, 4, 5, 3])
    np.testing.assert_array_equal(batch.rewards, [1.0, 0.0, 0.5, 0.5])
    np.testing.assert_array_equal(batch.group_mean, [0.5, 0.5, 0.5, 0.5])
    np.testing.assert_array_equal(batch.group_std, [0.5, 0.5, 0.0, 0.0])
    a = 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(batch.advantages, [a, -a, 0.0, 0.0], rtol=1e-7)
    np.testing.assert_array_equal(batch.group_index, [0, 0, 1, 1])
    np.testing.assert_array_equal(batch.version_start, [3, 4, 2, 3])
    assert batch.tokens.dtype == np.int32 and batch.sampler_logprobs.dtype == np.float32
    # rewards [1, 0, 0.5, 0.5]: mean 0.5, population std sqrt(0.125); completions 2+1+4+2 = 9
    # tokens; sequences 5+4+5+3 = 17 of 4 * 8 = 32 slots
    assert batch.metrics() == pytest.approx(
        {
            "reward_mean": 0.5,
            "reward_std": 0.125**0.5,
            "reward_min": 0.0,
            "reward_max": 1.0,
            "reward_count": 4.0,
            "completion_tokens": 9.0,
            "completion_len_mean": 2.25,
            "seq_len_max": 5.0,
            "padding_fraction": 15 / 32,
        }
    )


def test_per_token_versions_come_from_the_spans():
    """Hand-built completions with version spans (an update landed after token 2 of the first,
    two updates inside the third; the second has no spans: one version) -> the exact [B, L]
    array, aligned with the loss positions P - 1 + j, NO_VERSION (-1) elsewhere."""
    crossed = Completion(
        [8, 9, 10, 11], [-0.5] * 4, "length", 3, 4, version_spans=((3, 0, 2), (4, 2, 4)),
        reward=1.0,
    )  # fmt: skip
    whole = Completion([12, 2], [-0.25] * 2, "stop", 4, 4, reward=0.0)
    twice = Completion(
        [13, 14, 15], [-1.0] * 3, "length", 2, 4, version_spans=((2, 0, 1), (3, 1, 2), (4, 2, 3)),
        reward=0.5,
    )  # fmt: skip
    groups = [
        RolloutGroup("a", [5, 6], [crossed, whole]),
        RolloutGroup("b", [7], [twice, dataclasses.replace(whole, reward=0.5)]),
    ]
    batch = build_rl_batch(groups, version=5)
    assert batch.token_versions.dtype == np.int32 and NO_VERSION == -1
    np.testing.assert_array_equal(
        batch.token_versions,
        [
            [-1, 3, 3, 4, 4, -1, -1, -1],
            [-1, 4, 4, -1, -1, -1, -1, -1],
            [2, 3, 4, -1, -1, -1, -1, -1],
            [4, 4, -1, -1, -1, -1, -1, -1],
        ],
    )
    np.testing.assert_array_equal(batch.token_versions >= 0, batch.loss_mask > 0)
    # lag: the trainer's version minus the group's oldest token's version
    np.testing.assert_array_equal(batch.version_start, [3, 4, 2, 4])
    np.testing.assert_array_equal(batch.lag, [2, 2, 3, 3])
    # the same spans survive the wire: the gateway's proto and back
    from gateway import convert as cv

    back = cv.completion_from_pb(cv.completion_to_pb(twice))
    np.testing.assert_array_equal(back.token_versions(), [2, 3, 4])
    # tokens by their own lag (a request across an update counts in two bins)
    assert tokens_per_lag(batch, 5) == {"tokens_lag0": 0.0, "tokens_lag1": 7.0,
                                        "tokens_lag2plus": 4.0}  # fmt: skip
    at_4 = build_rl_batch(groups, version=4)
    assert tokens_per_lag(at_4, 4) == {"tokens_lag0": 7.0, "tokens_lag1": 3.0,
                                       "tokens_lag2plus": 1.0}  # fmt: skip
    with pytest.raises(ValueError, match="sampled at version 4, newer than the trainer's vers"):
        tokens_per_lag(build_rl_batch(groups, version=3), 3)


def test_forced_tokens_are_kept_out_of_the_loss_mask():
    """An engine-forced token (an end-of-think phrase) is input and target like any other, but
    the loss never counts it: the policy did not choose it."""
    group = RolloutGroup(
        "t",
        [5, 6],
        [
            Completion(
                [7, 60, 61, 9],
                [-0.3, 0.0, 0.0, -0.7],
                "length",
                0,
                0,
                reward=1.0,
                forced_positions=[1, 2],
            ),  # fmt: skip
            Completion([8, 2], [-0.2, -0.4], "stop", 0, 0, reward=0.0),
        ],
    )
    batch = build_rl_batch([group])
    np.testing.assert_array_equal(batch.tokens[0, :6], [5, 6, 7, 60, 61, 9])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 1, 0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask[1], [0, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(batch.sampler_logprobs[0, :5], [0, -0.3, 0, 0, -0.7])
    with pytest.raises(ValueError, match="forced_positions must index the 2 completion tokens"):
        RolloutGroup(
            "t", [5], [Completion([8, 2], [-0.2, -0.4], "stop", 0, 0, forced_positions=[2])]
        )


def test_dr_grpo_advantages_buckets_and_pad_id():
    batch = build_rl_batch(_groups(), normalize_std=False, buckets=(6, 16), pad_id=1)
    assert batch.length == 6
    np.testing.assert_array_equal(batch.advantages, [0.5, -0.5, 0.0, 0.0])
    np.testing.assert_array_equal(batch.tokens[3], [11, 15, 2, 1, 1, 1])
    np.testing.assert_array_equal(batch.targets[3], [15, 2, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="pad_id must be a token id >= 0; got -1"):
        build_rl_batch(_groups(), pad_id=-1)
    with pytest.raises(ValueError, match="exceeds the largest bucket 4"):
        build_rl_batch(_groups(), buckets=(4,))


def test_bucket_length():
    assert bucket_length(1) == 8 and bucket_length(9) == 16 and bucket_length(1024) == 1024
    assert bucket_length(100, (512, 128, 256)) == 128


def test_unscored_and_empty_inputs_raise():
    g = _groups()[0]
    unscored = dataclasses.replace(
        g, completions=[dataclasses.replace(g.completions[0], reward=None)]
    )
    with pytest.raises(ValueError, match=r"completions \[0\] have no reward"):
        build_rl_batch([unscored])
    with pytest.raises(ValueError, match="at least one group"):
        build_rl_batch([])


def test_rollout_checks_and_rewards():
    # the record does not check itself when built (the gateway must see and name bad input);
    # the trainer's group checks each completion
    with pytest.raises(ValueError, match="must align"):
        RolloutGroup("x", [1], [Completion([1, 2], [-0.1], "stop", 0, 0)])
    with pytest.raises(ValueError, match="version_start <= version_end"):
        RolloutGroup("x", [1], [Completion([1], [-0.1], "stop", 2, 1)])
    with pytest.raises(ValueError, match="version spans must lie within versions"):
        Completion([1], [-0.1], "stop", 0, 1, version_spans=((0, 0, 1), (2, 1, 1))).validate()
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        RolloutGroup("x", [], [Completion([1], [-0.1], "stop", 0, 0)])
    group = RolloutGroup("7", [1, 2], [Completion([3], [-0.25], "stop", 1, 2)])
    assert group.sample_id == "7" and group.version_start == 1
    assert group.completions[0].reward is None
    scored = group.with_rewards([0.75])
    assert scored.rewards == [0.75] and group.completions[0].reward is None
    with pytest.raises(ValueError, match="expected 1 rewards, got 2"):
        group.with_rewards([1.0, 0.0])


def _mesh(shape, names):
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 (host) devices")
    return jax.sharding.Mesh(devices.reshape(shape), names)


def test_shard_batch_on_dp_fsdp_mesh():
    mesh = _mesh((2, 4), ("dp", "fsdp"))
    batch = build_rl_batch(_groups() + _groups())  # 8 rows
    sharded = shard_batch(batch, mesh)
    assert sharded.tokens.sharding.spec == P(("dp", "fsdp"), None)
    assert sharded.rewards.sharding.spec == P(("dp", "fsdp"))
    # each of the 8 devices holds one row
    assert {s.data.shape for s in sharded.tokens.addressable_shards} == {(1, 8)}
    for name in ("tokens", "sampler_logprobs", "advantages", "version_start"):
        np.testing.assert_array_equal(np.asarray(getattr(sharded, name)), getattr(batch, name))


def test_shard_batch_replicates_over_other_axes_and_checks_divisibility():
    mesh = _mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    sharded = shard_batch(build_rl_batch(_groups()), mesh)  # 4 rows over dp * fsdp = 4
    assert {s.data.shape for s in sharded.loss_mask.addressable_shards} == {(1, 8)}
    with pytest.raises(ValueError, match="divisible by the 8 batch shards"):
        shard_batch(build_rl_batch(_groups()), _mesh((2, 4), ("dp", "fsdp")))


def test_alignment_with_a_bigram_engine():
    # An "engine" samples from a bigram model p(next | prev) = softmax(E[prev] @ W) and reports
    # each sampled token's log-prob; the trainer's log-probs of batch.targets from hidden states
    # E[batch.tokens] must then equal batch.sampler_logprobs on every masked position.
    v, d = 16, 4
    emb = np.asarray(jax.random.normal(jax.random.key(0), (v, d)))
    w = np.asarray(jax.random.normal(jax.random.key(1), (d, v)))
    table = np.asarray(jax.nn.log_softmax(jnp.asarray(emb @ w), axis=-1))  # [prev, next]
    rng = np.random.default_rng(0)

    def sample(prompt, n):
        ids, lps, prev = [], [], prompt[-1]
        for _ in range(n):
            tok = int(rng.integers(v))
            ids.append(tok)
            lps.append(float(table[prev, tok]))
            prev = tok
        return Completion(ids, lps, "length", 0, 0, reward=float(n))

    groups = [
        RolloutGroup("x", [3, 1], [sample([3, 1], 5), sample([3, 1], 2)]),
        RolloutGroup("y", [7], [sample([7], 6), sample([7], 1)]),
    ]
    batch = build_rl_batch(groups)
    lp = fused_target_logprobs(jnp.asarray(emb[batch.tokens]), jnp.asarray(w), batch.targets)
    mask = batch.loss_mask > 0
    np.testing.assert_allclose(np.asarray(lp)[mask], batch.sampler_logprobs[mask], atol=1e-5)
    out = make_loss("grpo")(batch.loss_inputs(lp))
    np.testing.assert_allclose(out.metrics["ratio_mean"], 1.0, atol=1e-5)
    assert float(out.metrics["clip_fraction"]) == 0.0
    assert float(out.metrics["num_tokens"]) == 5 + 2 + 6 + 1


def test_lag_per_row_is_the_groups_lag():
    # group a starts at version 3 (its oldest completion), b at 2
    batch = build_rl_batch(_groups(), version=4)
    np.testing.assert_array_equal(batch.lag, [1, 1, 2, 2])
    # without the step's version the freshest group counts as lag 0
    np.testing.assert_array_equal(build_rl_batch(_groups()).lag, [0, 0, 1, 1])
    with pytest.raises(ValueError, match="newer than the trainer's current version 2"):
        build_rl_batch(_groups(), version=2)
