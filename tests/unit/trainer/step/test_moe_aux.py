"""The load-balancing loss in the train step (`loss.moe_aux_coef`): its metric is
`load_balancing_loss` of the batch's completion tokens, it adds coef x that to the loss, it
moves the router's update in proportion to the coef, micro-batches weigh it by their tokens,
a dense model with a coef is refused, and scanned / rematerialised layers give the same step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig
from models.decoder import Decoder
from models.routing import forward_with_routing, load_balancing_loss
from models.sharding import MeshError, make_mesh
from trainer.config import load_config
from trainer.launch.model_fit import check_model_fit
from trainer.losses import make_loss
from trainer.train_step import TrainStep

VOCAB = 64
ROUTER = "layers.0.mlp.router.kernel"


def _model(variant: str = "qwen3_moe") -> Decoder:
    hf = dict(TINY_CONFIGS[variant], vocab_size=VOCAB, max_position_embeddings=128)
    return Decoder(ModelConfig.from_hf(hf), rngs=nnx.Rngs(0))


def _step(coef: float, batch, micro_batches: int = 1, **layers):
    """One SGD(lr=1) update at `coef`: (the new params, the metrics)."""
    model = _model()
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    step = TrainStep(
        model, make_loss("grpo"), optax.sgd(1.0), mesh, moe_aux_coef=coef,
        micro_batches=micro_batches, **layers,
    )  # fmt: skip
    state, metrics = step(step.init_state(model), batch)
    return {k: np.asarray(v) for k, v in state.params.items()}, metrics


def _lb(batch, rows=slice(None)) -> float:
    """`load_balancing_loss` of the initial model over `rows` of the batch's loss-mask tokens."""
    model = _model()
    _, _, record = forward_with_routing(
        model, jnp.asarray(batch.tokens[rows]), jnp.asarray(batch.positions[rows])
    )
    k = model.cfg.num_experts_per_tok
    return float(load_balancing_loss(record.router_logits, k, jnp.asarray(batch.loss_mask[rows])))


def test_the_aux_metric_is_the_batch_load_balancing_loss_and_moves_the_router(batch_source):
    batch = batch_source(0, prompts=4)
    p0, m0 = _step(0.0, batch)
    p1, m1 = _step(0.1, batch)
    p2, m2 = _step(0.2, batch)
    assert "moe_aux_loss" not in m0  # off: not computed
    want = _lb(batch)
    assert 1.5 < want < 4.0  # k = 2 at perfect balance, E · k = 16 at its worst
    np.testing.assert_allclose(m1["moe_aux_loss"], want, rtol=1e-6)
    np.testing.assert_allclose(m2["moe_aux_loss"], want, rtol=1e-6)
    np.testing.assert_allclose(m1["pg_loss"], m0["pg_loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["loss"] - m0["loss"], 0.1 * want, rtol=1e-4, atol=1e-6)
    # SGD at lr 1: the update is minus the gradient; the aux term adds coef · its gradient
    d1, d2 = p0[ROUTER] - p1[ROUTER], p0[ROUTER] - p2[ROUTER]
    assert np.abs(d1).max() > 1e-4
    np.testing.assert_allclose(d2, 2 * d1, rtol=1e-3, atol=1e-7)
    # the LM head comes after every router: the aux term gives it no gradient
    np.testing.assert_allclose(p1["lm_head.kernel"], p0["lm_head.kernel"], rtol=0, atol=1e-7)


def test_micro_batches_weigh_the_aux_loss_by_their_tokens(batch_source):
    batch = batch_source(1, prompts=4)  # 8 rows: micro-batch j holds rows j, j + 2, ...
    _, metrics = _step(0.1, batch, micro_batches=2)
    tokens = [float(batch.loss_mask[j::2].sum()) for j in (0, 1)]
    parts = [_lb(batch, slice(j, None, 2)) for j in (0, 1)]
    want = sum(n * x for n, x in zip(tokens, parts, strict=True)) / sum(tokens)
    np.testing.assert_allclose(metrics["moe_aux_loss"], want, rtol=1e-6)


def test_scanned_and_rematerialised_layers_give_the_looped_step(batch_source):
    batch = batch_source(0, prompts=4)
    p_loop, m_loop = _step(0.1, batch)
    p_scan, m_scan = _step(0.1, batch, scan_layers=True, remat="full")
    np.testing.assert_allclose(m_scan["moe_aux_loss"], m_loop["moe_aux_loss"], rtol=1e-6)
    np.testing.assert_allclose(p_scan[ROUTER], p_loop[ROUTER], rtol=0, atol=1e-6)


def test_a_coef_on_a_dense_model_is_refused():
    dense = Decoder(
        ModelConfig.from_hf(dict(TINY_CONFIGS["llama"], vocab_size=VOCAB)), rngs=nnx.Rngs(0)
    )
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"moe_aux_coef=0.1 needs a mixture-of-experts model"):
        TrainStep(dense, make_loss("grpo"), optax.sgd(1.0), mesh, moe_aux_coef=0.1)
    # the job's preflight check: the same errors before anything starts, and ep against E
    cfg = load_config(None, ["model.path=x", "loss.moe_aux_coef=0.01"])
    with pytest.raises(ValueError, match=r"llama is dense \(num_experts=0\): set it to 0"):
        check_model_fit(dense.cfg, cfg)
    check_model_fit(_model().cfg, cfg)  # a mixture of experts takes it
    cfg = load_config(None, ["model.path=x", "trainer.ep=3"])
    with pytest.raises(MeshError, match=r"trainer.ep=3 does not divide the model's num_experts=8"):
        check_model_fit(_model().cfg, cfg)
