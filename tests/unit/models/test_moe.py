"""The MoE layer against transformers' own router and loss: top-k routing of the Qwen3-MoE and
OLMoE routers (both normalisations), the chosen experts of a whole tiny model, and the
load-balancing loss (with and without a padding mask)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)

from models.checkpoints.hf_io import load_hf_checkpoint
from models.moe import route
from models.routing import forward_with_routing, load_balancing_loss


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_route_equals_hf_router(norm_topk_prob):
    cfg = type("C", (), dict(num_experts_per_tok=3, num_experts=8, norm_topk_prob=norm_topk_prob,
                             hidden_size=16))()  # fmt: skip
    router = Qwen3MoeTopKRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        x = torch.randn(40, 16)
        logits, ref_w, ref_ids = router(x)
    weights, ids = route(jnp.asarray(logits.numpy()), 3, norm_topk_prob)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids.numpy())
    np.testing.assert_allclose(np.asarray(weights), ref_w.numpy(), atol=1e-6, rtol=0)
    assert ids.dtype == jnp.int32
    sums = np.asarray(weights).sum(-1)
    assert np.allclose(sums, 1.0, atol=1e-6) == norm_topk_prob


@pytest.mark.parametrize("variant", ["qwen3_moe", "olmoe"])
def test_recorded_experts_and_aux_loss_equal_transformers(variant, tiny_checkpoint):
    path = tiny_checkpoint(variant)
    cfg, model = load_hf_checkpoint(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = np.random.RandomState(3).randint(4, cfg.vocab_size, size=(2, 9)).astype(np.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), tokens.shape)
    logits, _, record = forward_with_routing(model, jnp.asarray(tokens), positions)
    L, E, k = cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok
    assert record.expert_ids.shape == (2, 9, L, k) and record.expert_ids.dtype == jnp.int32
    assert record.router_logits.shape == (2, 9, L, E)
    with torch.no_grad():
        out = hf(torch.tensor(tokens).long(), output_router_logits=True)
    ref_logits = torch.stack(out.router_logits, 1).reshape(2, 9, L, E)  # HF: [B·T, E] per layer
    np.testing.assert_allclose(
        np.asarray(record.router_logits), ref_logits.numpy(), atol=1e-5, rtol=0
    )
    ref_ids = torch.topk(torch.softmax(ref_logits, -1), k, dim=-1).indices.numpy()
    np.testing.assert_array_equal(np.asarray(record.expert_ids), ref_ids)
    np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), atol=1e-4, rtol=0)
    aux = load_balancing_loss(record.router_logits, k)
    ref_aux = load_balancing_loss_func(out.router_logits, E, k)
    assert abs(float(aux) - float(ref_aux)) <= 1e-5
    assert float(out.aux_loss) == pytest.approx(float(ref_aux), abs=1e-6)
    # recording leaves the model as it was: a plain call after it gives the same logits
    again, _ = model(jnp.asarray(tokens), positions)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(logits))


def test_aux_loss_with_padding_mask_equals_transformers():
    rng = np.random.RandomState(0)
    logits = rng.randn(2, 5, 3, 6).astype(np.float32)  # [B, T, L, E]
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    per_layer = tuple(torch.tensor(logits[:, :, i].reshape(10, 6)) for i in range(3))
    ref = load_balancing_loss_func(per_layer, 6, 2, torch.tensor(mask))
    got = load_balancing_loss(jnp.asarray(logits), 2, jnp.asarray(mask))
    assert abs(float(got) - float(ref)) <= 1e-6
    # uniform router probabilities (all logits equal) score k, whichever experts are chosen
    flat = load_balancing_loss(jnp.zeros((1, 6, 1, 6)), 2)
    assert float(flat) == pytest.approx(2.0, abs=1e-6)


def test_forward_with_routing_refuses_a_dense_model(tiny_checkpoint):
    _, model = load_hf_checkpoint(tiny_checkpoint("qwen3"))
    tokens = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="qwen3 has no mixture-of-experts layer"):
        forward_with_routing(model, tokens, jnp.arange(3, dtype=jnp.int32)[None])


def test_router_and_experts_get_gradients_through_the_aux_loss_and_logits(tiny_checkpoint):
    from flax import nnx

    cfg, model = load_hf_checkpoint(tiny_checkpoint("qwen3_moe"))
    tokens = jnp.asarray(np.random.RandomState(5).randint(4, cfg.vocab_size, (2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))

    def loss(model):
        logits, _, record = forward_with_routing(model, tokens, positions)
        nll = -jnp.mean(jax.nn.log_softmax(logits)[..., 7])
        aux = load_balancing_loss(record.router_logits, cfg.num_experts_per_tok)
        return nll + cfg.router_aux_loss_coef * aux

    grads = nnx.grad(loss)(model)
    flat = {k: np.asarray(v) for k, v in nnx.to_flat_state(grads)}
    router = flat[("layers", 0, "mlp", "router", "kernel")]
    experts = flat[("layers", 1, "mlp", "experts", "down", "kernel")]
    assert router.shape == (cfg.hidden_size, cfg.num_experts)
    assert np.isfinite(router).all() and np.abs(router).max() > 0
    # only the experts some token chose get a gradient
    _, _, record = forward_with_routing(model, tokens, positions)
    chosen = set(np.asarray(record.expert_ids)[:, :, 1].ravel().tolist())
    touched = {e for e in range(cfg.num_experts) if np.abs(experts[e]).max() > 0}
    assert touched == chosen
