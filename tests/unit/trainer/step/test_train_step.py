"""The train step: sharded (8 CPU devices, FSDP + DP, micro-batches) equals one device; the loss
it reports equals the naive full-logits path at the sampling temperature; an update raises the
surrogate objective."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.sharding import make_mesh
from trainer.logprobs import naive_target_logprobs
from trainer.losses import make_loss
from trainer.optim import OptimizerConfig, make_optimizer
from trainer.train_step import TrainStep

TEMPERATURE = 0.7


def _step(model, mesh, micro_batches, lr=1e-3, min_shard_bytes=0, loss="grpo", block=0):
    tx = make_optimizer(OptimizerConfig(learning_rate=lr, total_steps=10, max_grad_norm=1.0))
    return TrainStep(
        model,
        make_loss(loss),
        tx,
        mesh,
        temperature=TEMPERATURE,
        micro_batches=micro_batches,
        chunk_size=16,
        min_shard_bytes=min_shard_bytes,
        attention_block=block,
    )


def _run(model_factory, batch_source, mesh, micro_batches, steps=2):
    model = model_factory(0)
    step = _step(model, mesh, micro_batches)
    state = step.init_state(model)
    history = []
    for position in range(steps):
        state, metrics = step(state, batch_source(position, prompts=8))
        history.append(metrics)
    return step, state, history


def test_sharded_step_equals_single_device(model_factory, batch_source):
    assert jax.device_count() == 8
    one = make_mesh(1, 1, devices=jax.devices()[:1])
    _, ref_state, ref_hist = _run(model_factory, batch_source, one, micro_batches=1)
    step, state, hist = _run(model_factory, batch_source, make_mesh(2, 4), micro_batches=2)

    sharded = [k for k, v in state.params.items() if "fsdp" in str(v.sharding.spec)]
    assert "layers.0.mlp.up.kernel" in sharded and len(sharded) >= 10
    assert int(state.step) == 2
    # Adam scales every update to about lr = 1e-3 whatever the gradient's size, so the
    # reduction-order rounding of a near-zero gradient entry can move a param by a small fraction
    # of lr: atol = lr / 100.
    for name, ref in ref_state.params.items():
        np.testing.assert_allclose(
            np.asarray(state.params[name]), np.asarray(ref), rtol=1e-5, atol=1e-5, err_msg=name
        )
    for ours, theirs in zip(hist, ref_hist, strict=True):
        assert ours["num_tokens"] == theirs["num_tokens"]
        for key in ("loss", "grad_norm", "clip_fraction", "ratio_mean", "sampler_kl"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    # Optimizer moments follow the params' placement.
    mu = state.opt_state[1][0].mu["layers.0.mlp.up.kernel"]
    assert mu.sharding == state.params["layers.0.mlp.up.kernel"].sharding


def test_loss_equals_naive_path_and_update_raises_objective(model_factory, batch_source):
    model = model_factory(0)
    batch = batch_source(0)
    one = make_mesh(1, 1, devices=jax.devices()[:1])
    step = _step(model, one, micro_batches=2, lr=1e-2)
    loss_fn = make_loss("grpo")

    def naive(m):
        hidden, _ = m.hidden(jnp.asarray(batch.tokens), jnp.asarray(batch.positions))
        w = m.lm_head_weight()
        return naive_target_logprobs(hidden, w, jnp.asarray(batch.targets), temperature=0.7)

    before = naive(model)
    expected = loss_fn(batch.loss_inputs(before))
    state = step.init_state(model)
    state, metrics = step(state, batch)
    assert metrics["num_tokens"] == float(batch.loss_mask.sum())
    assert metrics["loss"] == pytest.approx(float(expected.loss), rel=1e-5)
    assert metrics["ratio_mean"] == pytest.approx(float(expected.metrics["ratio_mean"]), rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(float(expected.metrics["clip_fraction"]))
    # the engine-trainer gap reaches the step's metrics (token-weighted over micro-batches)
    assert metrics["sampler_kl"] == pytest.approx(float(expected.metrics["sampler_kl"]), rel=1e-4)
    assert metrics["sampler_kl"] > 0
    assert metrics["grad_norm"] > 0
    # the gap statistics of the whole batch, from the same log-probs
    on = np.asarray(batch.loss_mask) > 0
    ratios = np.exp(np.asarray(before) - np.asarray(batch.sampler_logprobs))[on]
    assert metrics["gap/all/tokens"] == on.sum()
    assert metrics["gap/all/sampler_kl"] == pytest.approx(metrics["sampler_kl"], rel=1e-4)
    assert metrics["gap/all/ratio_min"] == pytest.approx(ratios.min(), rel=1e-5)
    assert metrics["gap/all/ratio_max"] == pytest.approx(ratios.max(), rel=1e-5)
    assert metrics["gap/all/ratio_p99"] == pytest.approx(np.percentile(ratios, 99), rel=1e-5)

    after = naive(step.model(state))
    mask = batch.loss_mask
    row_change = np.asarray(((after - before) * mask).sum(1) / mask.sum(1))
    # Positive-advantage completions became likelier, negative ones less likely.
    assert float(np.sum(batch.advantages * row_change)) > 0
    assert row_change[batch.advantages > 0].mean() > 0 > row_change[batch.advantages < 0].mean()


def test_blockwise_attention_takes_the_dense_step(model_factory, batch_source):
    """With attention_block 4 (batches padded to L = 8 or 16: two to four blocks, padding
    queries and keys in the last) two updates on the (dp 2, fsdp 4) mesh with 2 micro-batches
    equal the dense path's on one device: params within 1e-5, loss and grad norm within 1e-5
    relative (the sums' order differs); a negative block is refused."""
    one = make_mesh(1, 1, devices=jax.devices()[:1])
    results = []
    for mesh, k, block in ((one, 1, 0), (make_mesh(2, 4), 2, 4)):
        model = model_factory(0)
        step = _step(model, mesh, micro_batches=k, block=block)
        state = step.init_state(model)
        history = []
        for position in range(2):
            batch = batch_source(position, prompts=8)
            assert batch.tokens.shape[1] > 4
            state, metrics = step(state, batch)
            history.append(metrics)
        results.append((state, history))
    (ref, ref_hist), (blk, blk_hist) = results
    for name, value in ref.params.items():
        np.testing.assert_allclose(
            np.asarray(blk.params[name]), np.asarray(value), rtol=1e-5, atol=1e-5, err_msg=name
        )
    for ours, theirs in zip(blk_hist, ref_hist, strict=True):
        assert ours["num_tokens"] == theirs["num_tokens"]
        for key in ("loss", "grad_norm", "ratio_mean", "sampler_kl"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    with pytest.raises(ValueError, match="attention_block must be >= 0 tokens; got -1"):
        _step(model_factory(0), one, micro_batches=1, block=-1)


def test_batch_not_divisible_is_refused(model_factory, batch_source):
    model = model_factory(0)
    step = _step(model, make_mesh(2, 4), micro_batches=2)
    state = step.init_state(model)
    with pytest.raises(ValueError, match="divisible by micro_batches 2 x batch shards 8"):
        step(state, batch_source(0, prompts=3, group=2))


@pytest.mark.parametrize("loss", ["dr_grpo"])
def test_micro_batches_do_not_change_the_update(model_factory, batch_source, loss):
    """Dr. GRPO's seq_sum_constant normalises by the whole batch's B * L, so one update on 4
    micro-batches equals one on the full batch (seq_mean_token_mean: the sharded test above)."""
    one = make_mesh(1, 1, devices=jax.devices()[:1])
    batch = batch_source(3, prompts=4, group=2)
    results = []
    for k in (1, 4):
        model = model_factory(0)
        step = _step(model, one, micro_batches=k, loss=loss)
        state, metrics = step(step.init_state(model), batch)
        results.append((state, metrics))
    (ref, ref_m), (acc, acc_m) = results
    assert acc_m["loss"] == pytest.approx(ref_m["loss"], rel=1e-5)
    assert acc_m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-5)
    for name, value in ref.params.items():
        np.testing.assert_allclose(
            np.asarray(acc.params[name]), np.asarray(value), rtol=1e-5, atol=1e-5, err_msg=name
        )


def test_kl_term_to_a_reference(model_factory, batch_source):
    model = model_factory(0)
    one = make_mesh(1, 1, devices=jax.devices()[:1])
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2, total_steps=10))
    step = TrainStep(model, make_loss("grpo", kl_coef=0.5), tx, one, chunk_size=16)
    state = step.init_state(model)
    with pytest.raises(ValueError, match="kl_coef=0.5: call set_reference first"):
        step(state, batch_source(0))
    step.set_reference(model)
    state, first = step(state, batch_source(0))
    assert first["kl"] == 0.0 and first["loss"] == pytest.approx(first["pg_loss"], abs=1e-7)
    state, second = step(state, batch_source(1))
    assert second["kl"] > 0  # the policy moved away from the reference
    assert second["loss"] > second["pg_loss"]


def test_truncation_and_correction_reach_the_step(model_factory, batch_source):
    # the step's loss under top-k / top-p and IcePop equals the naive path with the same
    # truncation and correction, and the correction's counts add up over micro-batches
    from trainer.losses.corrections import make_correction

    model = model_factory(0)
    batch = batch_source(0)
    one = make_mesh(1, 1, devices=jax.devices()[:1])
    tx = make_optimizer(OptimizerConfig(learning_rate=0.0, total_steps=10))

    def loss():
        return make_loss("grpo").with_correction(make_correction("icepop", icepop_beta=1.05))

    step = TrainStep(
        model, loss(), tx, one, temperature=TEMPERATURE, micro_batches=2, chunk_size=16,
        top_k=7, top_p=0.8,
    )  # fmt: skip
    hidden, _ = model.hidden(jnp.asarray(batch.tokens), jnp.asarray(batch.positions))
    kw = dict(temperature=TEMPERATURE, top_k=7, top_p=0.8)
    logp = naive_target_logprobs(hidden, model.lm_head_weight(), jnp.asarray(batch.targets), **kw)
    # even rows: the engine's log-probs are the trainer's (ratio 1, kept); odd rows: the fake's
    mask = np.asarray(batch.loss_mask)
    even = (np.arange(batch.num_rows) % 2 == 0)[:, None]
    sampler = np.where(even, np.asarray(logp) * mask, np.asarray(batch.sampler_logprobs))
    batch = dataclasses.replace(batch, sampler_logprobs=sampler.astype(np.float32))
    expected = loss()(batch.loss_inputs(logp))
    _, metrics = step(step.init_state(model), batch)
    assert metrics["loss"] == pytest.approx(float(expected.loss), rel=1e-5, abs=1e-7)
    masked = float(expected.metrics["correction/masked_tokens"])
    assert metrics["correction/masked_tokens"] == masked
    assert 0 < masked <= float(mask[1::2].sum())  # only odd rows' tokens can drop out
    assert metrics["gap/all/ratio_mean"] == pytest.approx(metrics["ratio_mean"], rel=1e-5)
