"""bf16 mixed precision (``model.dtype=bfloat16`` with ``model.param_dtype=float32``) in the train
step: the forward in bf16 against fp32 on the same weights and batch, fp32 master weights and
Adam moments after a step, and an orbax checkpoint that gives the fp32 master back bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.params import flat_params, model_from_params
from models.sharding import make_mesh
from trainer.checkpointing import Checkpointer, Progress
from trainer.losses import make_loss
from trainer.optim import OptimizerConfig, make_optimizer
from trainer.train_step import TrainStep

#: bf16 keeps 8 mantissa bits (relative rounding 2^-9 = 0.002 per op); through two layers and
#: the fp32 LM head the tiny model's token log-probs moved by 0.0023 nats at most and the loss
#: (0.0107) by 9e-5 when written; the bounds leave about 4x and 10x of room.
LOGPROB_TOL = 0.01
LOSS_TOL = 1e-3


def _steps(model_factory):
    """(fp32 step, fp32 model, mixed step, mixed model) with the same weights."""
    fp32 = model_factory(0)
    mixed = model_from_params(fp32.cfg.replace(dtype="bfloat16"), flat_params(fp32))
    one = make_mesh(1, 1, devices=jax.devices()[:1])

    def make(model):
        tx = make_optimizer(OptimizerConfig(learning_rate=1e-3, total_steps=10))
        return TrainStep(model, make_loss("grpo"), tx, one, chunk_size=16, scan_layers=True)

    return make(fp32), fp32, make(mixed), mixed


def test_mixed_step_matches_fp32_and_keeps_fp32_master(model_factory, batch_source):
    """Same weights and batch: token log-probs (float32) within 0.01 nats of fp32's, the loss
    within 1e-3; after the step every param and every Adam moment is float32 and the params
    moved by about the learning rate as in the fp32 run."""
    step32, m32, step16, m16 = _steps(model_factory)
    assert m16.cfg.dtype == "bfloat16" and m16.cfg.param_dtype == "float32"
    batch = batch_source(0, prompts=4, group=2)
    s32, s16 = step32.init_state(m32), step16.init_state(m16)
    lp32 = step32._logprobs(s32.params, batch)
    lp16 = step16._logprobs(s16.params, batch)
    assert lp16.dtype == jnp.float32
    mask = np.asarray(batch.loss_mask) > 0
    gap = np.abs(np.asarray(lp16) - np.asarray(lp32))[mask]
    assert 0 < gap.max() <= LOGPROB_TOL  # bf16 did run (not bit-equal) and stayed close
    before = {k: np.asarray(v) for k, v in s16.params.items()}
    s32, met32 = step32(s32, batch)
    s16, met16 = step16(s16, batch)
    assert abs(met16["loss"] - met32["loss"]) <= LOSS_TOL
    assert met16["num_tokens"] == met32["num_tokens"]
    for name, value in s16.params.items():
        assert value.dtype == jnp.float32, name
        moved = np.abs(np.asarray(value) - before[name]).max()
        assert 0 < moved <= 1.1e-3, name  # Adam's first step is about lr = 1e-3 per entry
    moments = [x for x in jax.tree.leaves(s16.opt_state) if x.ndim > 0]
    assert moments and all(x.dtype == jnp.float32 for x in moments)
    assert len(moments) == 2 * len(s16.params)  # mu and nu of every param


def test_checkpoint_resumes_the_fp32_master_exactly(tmp_path, model_factory, batch_source):
    """Save after a mixed-precision step, restore into a fresh process's abstract state: every
    param and moment is float32 and equal bit for bit, and the next step from the restored state
    equals the next step from the live one bit for bit."""
    _, _, step, model = _steps(model_factory)
    state, _ = step(step.init_state(model), batch_source(0))
    saved = jax.tree.map(np.asarray, (state.params, state.opt_state))
    with Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(state, Progress(1, 1, 1, jax.random.key(0)))
    with Checkpointer(tmp_path / "c") as ckpt:
        restored, _ = ckpt.restore(step.abstract_state())
    for want, got in zip(
        jax.tree.leaves(saved), jax.tree.leaves((restored.params, restored.opt_state)), strict=True
    ):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), want)
    assert all(v.dtype == jnp.float32 for v in restored.params.values())
    live, _ = step(state, batch_source(1))
    again, _ = step(restored, batch_source(1))
    for name in live.params:
        np.testing.assert_array_equal(np.asarray(again.params[name]), np.asarray(live.params[name]))
