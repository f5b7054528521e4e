"""The same-program weight path on 8 CPU devices: trainer FSDP over devices 0-3, two engine
replicas of two devices each (the sharded mode) on devices 4-7.

A real gradient step changes the trainer's params; ``ColocatedPublisher.push`` copies them
device to device (under transfer guards: no host round trip) and the engine's greedy output
must then equal that of a fresh model built from the new params.
"""

from __future__ import annotations

import asyncio
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rollout_engine.jax.batcher import BatcherConfig
from rollout_engine.jax.colocated import ColocatedPublisher, copy_to_engine, needs_gather
from rollout_engine.jax.engine import EngineConfig, JaxEngine
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request
from trainer.checkpoints.hf_io import load_hf_checkpoint
from trainer.models.params import flat_params, model_from_params
from trainer.sharding import make_mesh

VOCAB = 320
EOS = 319  # in the vocabulary; no greedy run below meets it before the budget (checked)
PROMPTS = [(5, 17, 230, 44, 9), tuple(range(40, 51)), (7, 300, 12, 88, 91, 150, 3)]
BUDGET = 17  # tokens per sample; the first 16 are checked against the reference
WIDTH = 32  # the reference's fixed sequence width: >= longest prompt + BUDGET


@partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return nnx.merge(graphdef, params)(tokens, positions)[0]


def _greedy_reference(cfg, flat: dict[str, np.ndarray]) -> list[list[int]]:
    """BUDGET - 1 greedy tokens per prompt of a fresh Decoder built from host copies ``flat``,
    by full causal forward passes over right-padded [P, WIDTH] rows (no KV cache)."""
    graphdef, params = nnx.split(
        model_from_params(cfg, {k: jnp.asarray(v) for k, v in flat.items()})
    )
    rows = np.zeros((len(PROMPTS), WIDTH), np.int32)
    for i, p in enumerate(PROMPTS):
        rows[i, : len(p)] = p
    out: list[list[int]] = [[] for _ in PROMPTS]
    for step in range(BUDGET - 1):
        logits = np.asarray(_forward(graphdef, params, rows))  # [P, WIDTH, V]
        for i, p in enumerate(PROMPTS):
            n = len(p) + step
            rows[i, n] = int(logits[i, n - 1].argmax())
            out[i].append(int(rows[i, n]))
    return out


def _train_step(cfg, shardings: dict, lr: float = 0.5):
    """A jitted SGD step on the next-token loss of a fixed batch. Its params are donated, so
    the old buffers are deleted (as in ``trainer.train_step``); outputs take ``shardings``."""
    batch = jnp.asarray(np.random.default_rng(0).integers(10, VOCAB, (4, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), batch.shape)

    def loss(flat):
        logits = model_from_params(cfg, flat)(batch, positions)[0][:, :-1]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1).mean()

    opt = optax.sgd(lr)

    def step(flat):
        updates, _ = opt.update(jax.grad(loss)(flat), opt.init(flat), flat)
        return optax.apply_updates(flat, updates)

    return jax.jit(step, donate_argnums=(0,), out_shardings=shardings)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip(f"needs 8 devices (XLA_FLAGS host device count), got {len(devices)}")
    mesh = make_mesh(dp=1, fsdp=4, devices=devices[:4])
    path = tiny_checkpoint("llama", vocab_size=VOCAB, with_tokenizer=False)
    cfg, model = load_hf_checkpoint(path, mesh=mesh, min_shard_bytes=0)
    flat = flat_params(model)
    ecfg = EngineConfig(
        BatcherConfig(num_slots=2, max_len=WIDTH, prefill_batch=2),
        SamplingConfig(temperature=0.0),
        StopConfig(eos_ids=(EOS,), pad_id=3),
        replicas=2,
        devices_per_replica=2,
    )
    engine = JaxEngine(cfg, nnx.split(model)[1], ecfg, devices=devices[4:])
    yield cfg, model, flat, engine, devices
    engine.close()


def _generate(engine, tag: str):
    requests = [Request(f"{tag}-{i}", p, 1, BUDGET) for i, p in enumerate(PROMPTS)]
    return engine.generate(requests)


def test_push_after_a_train_step_serves_the_new_params(setup) -> None:
    cfg, model, flat, engine, devices = setup
    trainer_devs, engine_devs = set(devices[:4]), set(devices[4:])
    assert any(len(x.sharding.device_set) == 4 for x in flat.values())  # really FSDP-sharded
    before = _generate(engine, "v0")
    host0 = {k: np.asarray(v) for k, v in flat.items()}
    for r, want in zip(before, _greedy_reference(cfg, host0), strict=True):
        assert r.tokens[:-1].tolist() == want and EOS not in want
        assert r.weight_versions == [(0, 0, BUDGET)] and r.finish_reason == "length"

    step = _train_step(cfg, {k: x.sharding for k, x in flat.items()})
    new = step({k: jnp.copy(v) for k, v in flat.items()})  # the fixture's params stay
    assert all(x.sharding == flat[k].sharding for k, x in new.items())  # still on the trainer
    publisher = ColocatedPublisher(engine)
    stats = publisher.push(new, 1)
    assert stats.version == 1 and stats.num_tensors == len(new)
    assert stats.num_bytes == sum(x.nbytes for x in new.values())
    for i, replica in enumerate(engine.replicas):
        assert replica.version == 1
        own = set(devices[4 + 2 * i : 6 + 2 * i])
        for leaf in jax.tree.leaves(replica.params):
            assert leaf.sharding.device_set == own  # the replica's devices only
            assert not leaf.sharding.device_set & trainer_devs
    host1 = {k: np.asarray(v) for k, v in new.items()}
    expected = _greedy_reference(cfg, host1)
    assert expected != [r.tokens[:-1].tolist() for r in before]  # the step changed the output

    newer = step(new)  # donates `new`: the engine must hold copies, not aliases
    assert all(x.is_deleted() for x in new.values())
    after = _generate(engine, "v1")
    for r, want in zip(after, expected, strict=True):
        assert r.tokens[:-1].tolist() == want and EOS not in want
        assert r.weight_versions == [(1, 0, BUDGET)]
        assert r.replica in (0, 1)
    assert {r.replica for r in after + before} <= {0, 1}
    assert engine_devs == {d for b in engine.replicas for d in b.mesh.devices.flat}

    stats2 = publisher.push(newer, 2)
    assert stats2.version == 2 and all(b.version == 2 for b in engine.replicas)
    assert [r.weight_versions for r in _generate(engine, "v2")] == [[(2, 0, BUDGET)]] * 3
    with pytest.raises(ValueError, match="above the engine's 2"):
        publisher.push(newer, 2)


def test_copy_refuses_params_that_do_not_fit_the_engine(setup) -> None:
    _, _, flat, engine, _ = setup
    template = engine.replicas[0].params
    name = "final_norm.scale"
    with pytest.raises(KeyError, match=f"missing \\['{name}'\\]"):
        copy_to_engine({k: v for k, v in flat.items() if k != name}, template)
    bad = dict(flat)
    bad[name] = jnp.zeros(3)
    with pytest.raises(ValueError, match=f"param {name}: expected shape"):
        copy_to_engine(bad, template)
    with pytest.raises(TypeError, match=f"param {name}: expected a jax.Array, got ndarray"):
        host: dict = {**flat, name: np.ones(flat[name].shape, np.float32)}
        copy_to_engine(host, template)
    with pytest.raises(TypeError, match="expected a JaxEngine"):
        ColocatedPublisher(object())


def test_fsdp_params_are_gathered_on_the_trainer_not_on_the_host(setup) -> None:
    _, _, flat, engine, devices = setup
    x = flat["embed.embedding"]  # [V, D], FSDP over the 4 trainer devices
    assert len(x.sharding.device_set) == 4 and x.sharding.spec != ()
    dst = jax.tree.leaves(engine.replicas[1].params)[0].sharding  # replicated on devices 6, 7
    assert needs_gather(x.sharding, dst, x.shape)
    same_layout = NamedSharding(
        Mesh(np.array(devices[4:]), x.sharding.mesh.axis_names[1:]), x.sharding.spec
    )
    assert not needs_gather(x.sharding, same_layout, x.shape)
    with (
        jax.transfer_guard_device_to_host("disallow_explicit"),
        jax.transfer_guard_host_to_device("disallow_explicit"),
        pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed"),
    ):
        jax.device_put(x, dst)  # what a plain device_put does: a host round trip


def test_copy_casts_to_the_engine_dtype(setup) -> None:
    _, _, flat, engine, devices = setup
    template = jax.tree.map(
        lambda a: jax.device_put(a.astype(jnp.bfloat16), devices[7]), engine.replicas[0].params
    )
    copied = copy_to_engine(flat, template)
    for path, var in nnx.to_flat_state(copied):
        got = var.get_value()
        want = np.asarray(flat[".".join(map(str, path))]).astype(jnp.bfloat16)
        assert got.dtype == jnp.bfloat16 and got.devices() == {devices[7]}
        np.testing.assert_array_equal(np.asarray(got), want)


def test_backend_target_follows_the_version_and_never_aliases(setup, tiny_checkpoint) -> None:
    """Through ``JaxBackend.update_params`` (its ``weight_version`` follows), with the engine
    on device 0, inside the trainer's device set: the copy must still own its buffers."""
    from gateway import messages as m
    from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig

    cfg, _, flat, _, devices = setup
    path = tiny_checkpoint("llama", vocab_size=VOCAB, with_tokenizer=False)
    backend = JaxBackend(
        JaxBackendConfig(model=str(path), num_slots=2, max_model_len=WIDTH, temperature=0.0)
    )

    async def run() -> tuple[list[int], tuple]:
        await backend.start()
        try:
            params = {k: jnp.copy(v) for k, v in flat.items()}
            publisher = ColocatedPublisher(backend)
            assert publisher.push(params, 3).version == 3 and backend.weight_version == 3
            assert backend.engine is not None
            served = backend.engine.replicas[0].params
            for x in params.values():
                x.delete()  # as a donating train step would
            assert all(leaf.devices() == {devices[0]} for leaf in jax.tree.leaves(served))
            sampling = m.SamplingParams(max_new_tokens=BUDGET, temperature=0.0, top_k=0)
            prompt = m.Prompt("p", np.asarray(PROMPTS[0], np.int32), 1, sampling)
            (sample,) = await backend.generate(prompt)
            return list(sample.token_ids), sample.version_spans
        finally:
            await backend.shutdown()

    tokens, spans = asyncio.run(run())
    want = _greedy_reference(cfg, {k: np.asarray(v) for k, v in flat.items()})[0]
    assert (
        tokens[:-1] == want[: len(tokens) - 1]
    )  # the last one ends the sample (an EOS or the token at the limit)
    assert list(spans) == [(3, 0, len(tokens))]
