"""Routing replay in the train step (issue 29): a router logit tie that the "engine" breaks
one way and the trainer the other sends a token to different experts, so at unchanged weights
its importance ratio is off 1; with the engine's routes replayed every ratio is 1 within 1e-6.
The routing agreement metric counts the pairs whose expert sets differ, replay or not.

The "engine" here is the same tiny Qwen3-MoE run through `models.routing.hidden_with_routing`
with layer 0's tie broken towards the higher expert ids (the trainer's `jax.lax.top_k` takes
the lower ids first); the real engines are tested by the fixed-weights main-job run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gateway.messages import Completion
from models.checkpoints.hf_io import load_hf_checkpoint
from models.routing import forward_with_routing, hidden_with_routing
from models.sharding import make_mesh
from trainer.batch import build_rl_batch
from trainer.losses import make_loss
from trainer.optim import OptimizerConfig, make_optimizer
from trainer.rollouts import RolloutGroup
from trainer.train_step import TrainStep

PROMPT = [5, 9, 23, 7]
COMPLETIONS = [[40, 41, 12, 99, 3], [17, 3, 100]]


def _tied_model(tiny_checkpoint):
    """Tiny Qwen3-MoE (8 experts, top-2) whose layer-0 router ties experts 0, 1, 2 (equal
    columns) and 3..7 (zero columns): every token's top-2 is a tie."""
    cfg, model = load_hf_checkpoint(tiny_checkpoint("qwen3_moe"))
    router = model.layers[0].mlp.router.kernel
    w = np.asarray(router[...]).copy()  # [D, E]
    w[:, 1] = w[:, 2] = w[:, 0]
    w[:, 3:] = 0.0
    router[...] = jnp.asarray(w)
    return cfg, model


def _engine_rollouts(cfg, model):
    """The groups as an engine that breaks layer 0's ties the other way would return them:
    its log-probs and the routes of its passes over every token but the last."""
    completions = []
    for reward, tokens in enumerate(COMPLETIONS):
        seq = jnp.asarray([PROMPT + tokens], jnp.int32)
        pos = jnp.arange(seq.shape[1], dtype=jnp.int32)[None]
        _, _, own = forward_with_routing(model, seq, pos)
        logits0 = np.asarray(own.router_logits[0, :, 0])  # [S, E] layer 0
        top = np.sort(logits0, axis=-1)[:, -3:]
        assert np.all(top[:, 1] == top[:, 2])  # the top-2 is a tie at every token
        ids = np.full(own.expert_ids.shape, -1, np.int32)  # [1, S, L, k]
        high = logits0[:, 0] > 0  # experts 0, 1, 2 lead; else 3..7
        ids[0, :, 0] = np.where(
            high[:, None], [[2, 1]], [[7, 6]]
        )  # not the trainer's (0, 1) / (3, 4)
        hidden, _, used = hidden_with_routing(model, seq, pos, jnp.asarray(ids))
        logp = jax.nn.log_softmax(model.logits(hidden)[0], axis=-1)  # [S, V]
        p, s = len(PROMPT), seq.shape[1]
        targets = np.asarray(seq[0, p:s])
        sampled = np.asarray(logp[p - 1 : s - 1])[np.arange(s - p), targets]
        routes = np.asarray(used.expert_ids[0, : s - 1])  # [P + C - 1, L, k]
        completions.append(
            Completion(tokens, sampled, "stop", 0, 0, routed_experts=routes, reward=float(reward))
        )
    return build_rl_batch([RolloutGroup("g", PROMPT, completions)], pad_id=0)


def _step(model, replay: bool, micro_batches: int = 1, lr: float = 0.0, **layers) -> TrainStep:
    # eps = 1: Adam's first step is lr * g / (|g| + 1), about lr * g for the small gradients
    # here, so parameters compare as gradients do (at eps 1e-8 it is lr * sign(g), which
    # turns rounding noise in a near-zero gradient into a full step)
    tx = make_optimizer(OptimizerConfig(learning_rate=lr, eps=1.0 if lr else 1e-8))
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    return TrainStep(
        model, make_loss("grpo"), tx, mesh, routing_replay=replay, micro_batches=micro_batches,
        **layers,
    )  # fmt: skip


def test_replay_removes_the_ratio_error_of_a_router_tie(tiny_checkpoint):
    cfg, model = _tied_model(tiny_checkpoint)
    batch = _engine_rollouts(cfg, model)
    assert batch.routes is not None and batch.routes.shape == (2, 16, cfg.num_layers, 2)
    tokens = sum(len(c) for c in COMPLETIONS)  # 8 loss tokens, 2 layers each
    results = {}
    for replay in (False, True):
        step = _step(model, replay, micro_batches=2 if replay else 1)  # routes split too
        _, metrics = step(step.init_state(model), batch)
        results[replay] = metrics
        assert metrics["routing/pairs"] == 2 * tokens
    off, on = results[False], results[True]
    error_off = max(abs(off["gap/all/ratio_min"] - 1), abs(off["gap/all/ratio_max"] - 1))
    error_on = max(abs(on["gap/all/ratio_min"] - 1), abs(on["gap/all/ratio_max"] - 1))
    assert error_off > 1e-3, off  # the tie broken the other way: other experts, other log-probs
    assert error_on < 1e-6, on
    # layer 0 never agrees (the trainer's own choice is the lower pair); with replay layer 1
    # sees the engine's layer-0 output, so its own choice is the engine's at every token
    assert off["routing_agreement"] <= 0.5
    assert on["routing_agreement"] == 0.5 and on["routing/agree"] == tokens
    print(f"tie: |ratio - 1| max {error_off:.3e} without replay, {error_on:.3e} with; "
          f"agreement {off['routing_agreement']:.3f} / {on['routing_agreement']:.3f}")  # fmt: skip


def test_a_batch_without_routes_reports_no_agreement(tiny_checkpoint):
    cfg, model = _tied_model(tiny_checkpoint)
    batch = _engine_rollouts(cfg, model)
    plain = build_rl_batch(
        [RolloutGroup("g", PROMPT, [Completion(c, np.full(len(c), -1.0), "stop", 0, 0, reward=r)
                                    for r, c in enumerate(COMPLETIONS)])], pad_id=0,
    )  # fmt: skip
    assert plain.routes is None
    step = _step(model, True)
    _, metrics = step(step.init_state(model), plain)
    assert "routing_agreement" not in metrics and metrics["num_tokens"] == 8
    assert batch.routes is not None


def test_replay_is_refused_on_a_dense_model(tiny_checkpoint):
    _, dense = load_hf_checkpoint(tiny_checkpoint("qwen3"))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; qwen3 is dense"):
        _step(dense, True)


@pytest.mark.parametrize("layers", [{"remat": "full"}, {"scan_layers": True, "remat": "full"}])
def test_replay_under_scanned_and_rematerialised_layers_equals_the_loop(tiny_checkpoint, layers):
    """The routes go into each scanned / rematerialised layer as its input [L, B, T, k] and
    the routers' record comes out as its output: the step (replayed routes, the agreement,
    the update, about the gradient at lr 1) equals the looped one within 1e-6 in fp32."""
    cfg, model = _tied_model(tiny_checkpoint)
    batch = _engine_rollouts(cfg, model)
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    runs = {}
    for name, kw in (("loop", {}), ("other", layers)):
        step = _step(model, True, micro_batches=2, lr=1.0, **kw)
        state, metrics = step(step.init_state(model), batch)
        runs[name] = (jax.tree.leaves(state.params), metrics)
    (p_loop, m_loop), (p_other, m_other) = runs["loop"], runs["other"]
    assert m_other["routing/pairs"] == m_loop["routing/pairs"] == 16
    assert m_other["routing/agree"] == m_loop["routing/agree"] == 8  # layer 1 agrees, as above
    for key in ("loss", "gap/all/ratio_min", "gap/all/ratio_max"):
        assert abs(m_other[key] - m_loop[key]) < 1e-6, (key, m_other[key], m_loop[key])
    assert abs(m_other["gap/all/ratio_max"] - 1) < 1e-6  # replayed: the engine's own network
    worst = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(p_loop, p_other, strict=True))
    assert worst < 1e-6, worst
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(before, p_loop, strict=True))
    assert moved > 1e-3, moved  # the step did move the weights
    print(f"{layers}: params after one step within {worst:.1e} of the loop's")
