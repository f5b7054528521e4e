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


def _temp_bytes(step: TrainStep, batch) -> int:
    """XLA's planned temporary bytes of the compiled step (activations kept for the backward
    pass, gradients, the optimizer's scratch)."""
    return int(step.lower(batch).compile().memory_analysis().temp_size_in_bytes)


def test_bf16_residual_step_stays_close_to_fp32(model_factory, batch_source):
    """``model.residual_dtype=bfloat16``: the hidden states are bf16 (the stream itself, not a
    cast at the end); token log-probs stay within the mixed step's bound of fp32's and differ
    from the float32-residual mixed step's, and the master weights stay float32."""
    step32, m32, mixed, m_mixed = _steps(model_factory)
    m_res = model_from_params(m_mixed.cfg.replace(residual_dtype="bfloat16"), flat_params(m32))
    one = make_mesh(1, 1, devices=jax.devices()[:1])
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-3, total_steps=10))
    res = TrainStep(m_res, make_loss("grpo"), tx, one, chunk_size=16, scan_layers=True)
    tokens = jnp.asarray([[1, 5, 9, 13]], jnp.int32)
    hidden, _ = m_res.hidden(tokens, jnp.arange(4)[None])
    assert hidden.dtype == jnp.bfloat16
    assert m_mixed.hidden(tokens, jnp.arange(4)[None])[0].dtype == jnp.float32

    batch = batch_source(0, prompts=4, group=2)
    s32, sres = step32.init_state(m32), res.init_state(m_res)
    mask = np.asarray(batch.loss_mask) > 0
    lp32 = np.asarray(step32._logprobs(s32.params, batch))
    lpres = np.asarray(res._logprobs(sres.params, batch))
    lpmix = np.asarray(mixed._logprobs(mixed.init_state(m_mixed).params, batch))
    assert 0 < np.abs(lpres - lp32)[mask].max() <= LOGPROB_TOL
    assert not np.array_equal(lpres, lpmix)  # the residual did round to bf16
    sres, met = res(sres, batch)
    assert np.isfinite(met["loss"]) and all(v.dtype == jnp.float32 for v in sres.params.values())


def test_bf16_residual_plans_fewer_bytes_for_the_backward_pass():
    """On a model whose MLP is wide (D 128, F 1,024, 4 layers) and a batch whose activations
    outweigh the weights (8 rows x 128 tokens), XLA plans fewer temporary bytes for the bf16
    residual step than for the float32-residual mixed step (the trainer's default loop over
    the layers; 0.72 of them when written: the residual and the MLP's hidden activation kept
    for the backward pass are half as wide)."""
    from flax import nnx

    from models.checkpoints.tiny import TINY_CONFIGS
    from models.config import ModelConfig
    from models.decoder import Decoder

    hf = dict(TINY_CONFIGS["llama"], vocab_size=64, max_position_embeddings=256,
              hidden_size=128, intermediate_size=1024, num_hidden_layers=4)  # fmt: skip
    one = make_mesh(1, 1, devices=jax.devices()[:1])
    big = _long_batch(rows=8, completion=120)
    planned = {}
    for residual in ("float32", "bfloat16"):
        cfg = ModelConfig.from_hf(hf, dtype="bfloat16", param_dtype="float32",
                                  residual_dtype=residual)  # fmt: skip
        tx = make_optimizer(OptimizerConfig(learning_rate=1e-3, total_steps=10))
        step = TrainStep(Decoder(cfg, rngs=nnx.Rngs(0)), make_loss("grpo"), tx, one,
                         chunk_size=16, scan_layers=False)  # fmt: skip
        planned[residual] = _temp_bytes(step, big)
    assert planned["bfloat16"] < 0.85 * planned["float32"], planned


def _long_batch(rows: int, completion: int):
    """`rows` rows of a 8-token prompt and `completion` tokens (groups of 2, rewards 0/1)."""
    from gateway.messages import Completion
    from trainer.batch import build_rl_batch
    from trainer.rollouts import RolloutGroup

    rng = np.random.default_rng(7)
    groups = []
    for p in range(rows // 2):
        comps = [
            Completion(token_ids=rng.integers(1, 64, completion).tolist(),
                       logprobs=[-4.16] * completion, finish_reason="length",
                       version_start=0, version_end=0, reward=float(g))
            for g in range(2)
        ]  # fmt: skip
        groups.append(RolloutGroup(f"long:{p}", rng.integers(1, 64, 8).tolist(), comps))
    return build_rl_batch(groups, pad_id=0)


def test_a_bf16_residual_in_a_float32_model_is_refused(model_factory):
    """A residual narrower than the compute dtype is refused by the model config and by the
    trainer's config, each naming both dtypes."""
    import pytest

    from models.config import UnsupportedModelError
    from trainer.config import load_config

    cfg = model_factory(0).cfg
    with pytest.raises(UnsupportedModelError, match="residual_dtype='bfloat16'"):
        cfg.replace(residual_dtype="bfloat16")
    with pytest.raises(ValueError, match="needs dtype='bfloat16'"):
        load_config(model={"residual_dtype": "bfloat16"})
    assert load_config(model={"dtype": "bfloat16", "residual_dtype": "bfloat16"})
