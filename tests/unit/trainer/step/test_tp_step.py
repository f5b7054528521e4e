"""Tensor and expert parallelism in the train step: at tp=2 and at tp=2 x fsdp=2 two updates
equal the one-device ones (fp32) on every family's tiny model; at ep=2, ep=2 x tp=2 and
ep=2 x fsdp=2 x tp=2 on both mixture-of-experts families with both dispatches; a tp or ep that
does not fit is refused."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from models.checkpoints.tiny import TINY_CONFIGS
from models.config import ModelConfig
from models.decoder import Decoder
from models.sharding import MeshError, check_ep, make_mesh
from trainer.losses import make_loss
from trainer.train_step import TrainStep

VOCAB = 64  # the batch source's vocabulary (conftest.VOCAB)


def _model(variant: str, dispatch: str = "dense") -> Decoder:
    """The variant's tiny Decoder (V=64); a single KV head becomes two, so tp=2 divides it;
    a mixture of experts computes its experts by `dispatch`."""
    hf = dict(TINY_CONFIGS[variant], vocab_size=VOCAB, max_position_embeddings=128)
    hf["num_key_value_heads"] = max(2, hf["num_key_value_heads"])
    hf["num_attention_heads"] = max(2, hf["num_attention_heads"])
    cfg = replace(ModelConfig.from_hf(hf), moe_dispatch=dispatch)
    return Decoder(cfg, rngs=nnx.Rngs(0))


def _run(variant, batch_source, mesh, dispatch="dense"):
    model = _model(variant, dispatch)
    # Plain SGD: the update is the gradient times lr, so a rounding difference in a near-zero
    # gradient entry stays that small (Adam would scale it up to about lr).
    step = TrainStep(model, make_loss("grpo"), optax.sgd(0.5), mesh, min_shard_bytes=0)
    state = step.init_state(model)
    history = []
    for position in range(2):
        state, metrics = step(state, batch_source(position, prompts=8))
        history.append(metrics)
    return state, history


def test_tp_step_equals_one_device(family_variant, batch_source):
    _, variant = family_variant
    devices = jax.devices()
    ref_state, ref_hist = _run(variant, batch_source, make_mesh(1, 1, devices=devices[:1]))
    for fsdp in (1, 2):
        mesh = make_mesh(1, fsdp, devices=devices[: 2 * fsdp], tp=2)
        state, hist = _run(variant, batch_source, mesh)
        q = state.params["layers.0.attn.q.kernel"].sharding.spec
        assert tuple(q) == ("fsdp" if fsdp > 1 else None, "tp", None)
        if "layers.0.mlp.down.kernel" in state.params:  # dense MLP: down [F, D]
            assert tuple(state.params["layers.0.mlp.down.kernel"].sharding.spec)[0] == "tp"
        else:  # mixture of experts: down [E, M, D], each expert's width M over tp
            down = state.params["layers.0.mlp.experts.down.kernel"]
            assert tuple(down.sharding.spec)[:2] == (None, "tp")
        _assert_same(state, hist, ref_state, ref_hist)
        assert ref_hist[1]["loss"] != ref_hist[0]["loss"]  # the first update moved the params


def _assert_same(state, hist, ref_state, ref_hist):
    """Each step's loss, grad norm and token count, and the final params, equal the
    reference run's within 1e-6 (fp32)."""
    for got, want in zip(hist, ref_hist, strict=True):
        for key in ("loss", "grad_norm", "num_tokens"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)
    for key, ref in ref_state.params.items():
        np.testing.assert_allclose(
            np.asarray(state.params[key]), np.asarray(ref), rtol=1e-6, atol=1e-6, err_msg=key
        )


@pytest.mark.parametrize("dispatch", ["dense", "grouped"])
@pytest.mark.parametrize("variant", ["qwen3_moe", "olmoe"])
def test_ep_step_equals_one_device(variant, dispatch, batch_source):
    devices = jax.devices()
    ref_state, ref_hist = _run(
        variant, batch_source, make_mesh(1, 1, devices=devices[:1]), dispatch
    )
    assert ref_hist[1]["loss"] != ref_hist[0]["loss"]  # the first update moved the params
    for fsdp, tp in ((1, 1), (1, 2), (2, 2)):
        mesh = make_mesh(1, fsdp, devices=devices[: 2 * fsdp * tp], tp=tp, ep=2)
        state, hist = _run(variant, batch_source, mesh, dispatch)
        # experts [E, D, M] over ep, their width D over fsdp, M over tp; the router's E over ep
        gate = state.params["layers.0.mlp.experts.gate.kernel"].sharding.spec
        want = ("ep", "fsdp" if fsdp > 1 else None, "tp" if tp > 1 else None)
        assert tuple(gate) + (None,) * (3 - len(gate)) == want
        router = state.params["layers.0.mlp.router.kernel"].sharding.spec
        assert tuple(router)[1] == "ep"
        # the batch's rows split over ep too: every ep rank sees its own rows
        assert len(state.params["layers.0.mlp.experts.gate.kernel"].addressable_shards) == len(
            mesh.devices.flat
        )
        _assert_same(state, hist, ref_state, ref_hist)


def test_ep_that_does_not_fit_is_refused():
    olmoe = ModelConfig.from_hf(dict(TINY_CONFIGS["olmoe"], vocab_size=VOCAB))  # 4 experts
    with pytest.raises(MeshError, match=r"trainer.ep=8 does not divide the model's num_experts=4"):
        check_ep(olmoe, 8)
    dense = ModelConfig.from_hf(dict(TINY_CONFIGS["llama"], vocab_size=VOCAB))
    model = Decoder(dense, rngs=nnx.Rngs(0))
    mesh = make_mesh(1, 1, devices=jax.devices()[:2], ep=2)
    with pytest.raises(MeshError, match=r"trainer.ep=2 needs a mixture-of-experts model"):
        TrainStep(model, make_loss("grpo"), optax.sgd(0.1), mesh)
    with pytest.raises(MeshError, match=r"dp·ep·tp = 1·3·2 = 6 does not divide the 8 devices"):
        make_mesh(1, -1, tp=2, ep=3)
    with pytest.raises(MeshError, match=r"dp·fsdp·ep·tp = 1·2·2·1 = 4, but there are 8 devices"):
        make_mesh(1, 2, ep=2)
    with pytest.raises(MeshError, match=r"got dp=1, ep=0, tp=1"):
        make_mesh(1, -1, ep=0)


def test_tp_that_does_not_fit_is_refused():
    hf = dict(TINY_CONFIGS["llama3"], vocab_size=VOCAB)  # 4 query heads, 1 KV head
    model = Decoder(ModelConfig.from_hf(hf), rngs=nnx.Rngs(0))
    mesh = make_mesh(1, 1, devices=jax.devices()[:2], tp=2)
    with pytest.raises(MeshError, match=r"trainer.tp=2 does not divide the model's num_kv_heads=1"):
        TrainStep(model, make_loss("grpo"), optax.sgd(0.1), mesh)
    hf = dict(TINY_CONFIGS["llama"], vocab_size=VOCAB)  # 4 query heads, 2 KV heads
    model = Decoder(ModelConfig.from_hf(hf), rngs=nnx.Rngs(0))
    mesh = make_mesh(1, 1, devices=jax.devices()[:3], tp=3)
    with pytest.raises(MeshError, match=r"trainer.tp=3 does not divide the model's num_heads=4"):
        TrainStep(model, make_loss("grpo"), optax.sgd(0.1), mesh)
    with pytest.raises(MeshError, match=r"dp·tp = 1·3 = 3 does not divide the 8 devices"):
        make_mesh(1, -1, tp=3)
    with pytest.raises(MeshError, match=r"dp·fsdp·tp = 1·2·2 = 4, but there are 8 devices"):
        make_mesh(1, 2, tp=2)
