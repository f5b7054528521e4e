"""Background pushes (``sync.background``, issue 26 item 4) on the real loop: a gateway on
loopback, `python -m rollout_engine` processes of the JAX backend (fp32) whose load is slowed
through the test-only `rollout_engine.worker.LOAD_DELAY_ENV`, the gloo `WeightPublisher` driven
by the `BackgroundPusher`, and the train step.

- 20 background pushes to a slow engine: every trained token's recorded version is the version
  that sampled it (its log-prob under that version's weights equals the engine's; under the
  version before it does not), every lag stays within max_lag, versions are skipped and none
  of them (nor a half-loaded one) ever served a token;
- an engine killed while it loads a background push: the push commits on the other engine, the
  run completes, every submitted group is accounted for;
- a stop while a push is in flight (the engine acked "ready" and is still loading): the send
  under way runs to its end, the wait for "loaded" is cancelled, no push thread is left, the
  engine committed nothing half-loaded and stops cleanly at the gateway's shutdown.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gateway import messages as m
from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.server import GatewayServer
from models.checkpoints.hf_io import load_hf_checkpoint
from models.sharding import make_mesh
from protos import gateway_pb2 as gpb
from rollout_engine.worker import LOAD_DELAY_ENV
from tests.integration.loop_harness import TOKENS, waits
from tests.integration.smoke_job import child_env
from trainer.build import train_step_from_config
from trainer.config import load_config
from trainer.data import ProblemStream
from trainer.data.problem import Problem
from trainer.loop import AsyncTrainer
from trainer.publish import WeightPublisher
from trainer.rewards import ScoringPool, TokenFractionVerifier
from trainer.rollout_source import RolloutSource
from transport.config import GlooTransportConfig

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--jax-num-slots", "64", "--jax-max-model-len", "32", "--jax-prefill-batch", "8",
               "--jax-steps-per-call", "8"]  # fmt: skip
READY = gpb.SYNC_PHASE_READY
TOLERANCE = 1e-3  # fp32 engine and trainer at equal weights differ by about 1e-6


@contextlib.contextmanager
def slow_engines(
    tmp_path: Path, ckpt: Path, model_cfg, delays: Sequence[float]
) -> Iterator[tuple[GatewayClient, WeightPublisher, list[subprocess.Popen]]]:
    """A gateway, one JAX engine per entry of `delays` (named e0, e1, ...; each waits that many
    seconds before loading a version) and a gloo publisher; all registered before this yields
    (client, publisher, engine processes); all stopped after."""
    token_file = tmp_path / "tokens.txt"
    token_file.write_text("".join(f"{k}={v}\n" for k, v in TOKENS.items()))
    settings = RunSettings(model_family="llama", dtype="float32")
    server = GatewayServer(GatewayConfig(settings=settings, max_wait_s=5.0), TOKENS).start()
    client = GatewayClient(server.address, TOKENS["trainer"], margin_s=5.0)
    client.configure(m.RunSettings(model_family="llama", dtype="float32", transport="gloo"))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollout_engine",
                "--backend",
                "jax",
                "--name",
                f"e{i}",
                "--gateway",
                server.address,
                "--token-file",
                str(token_file),
                "--model",
                str(ckpt),
                "--dtype",
                "float32",
                "--transports",
                "gloo",
                "--log-level",
                "WARNING",
                *ENGINE_ARGS,
            ],
            env=child_env(**({LOAD_DELAY_ENV: str(d)} if d else {})),
        )  # fmt: skip
        for i, d in enumerate(delays)
    ]
    publisher = WeightPublisher(client, GlooTransportConfig(), "llama", model_cfg, "float32")
    try:
        waits.wait_for(
            lambda: len(client.status().engines) == len(delays), procs, "the engines' registration"
        )
        yield client, publisher, procs
    finally:
        publisher.close()
        client.shutdown("test over")
        try:
            for p in procs:
                if p.poll() is None:
                    waits.exit_status(p, "an engine's exit after the gateway's shutdown")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            client.close()
            server.stop(0)


def _trainer(tmp_path, client, publisher, model, max_lag: int, steps: int, **loop):
    """(AsyncTrainer with background pushes, P=4 x G=4, its ScoringPool): groups scored by
    the fraction of token 5."""
    cfg = load_config(
        trainer={"steps": steps, "prompts_per_step": 4, "logprob_chunk_size": 64},
        rollout={"backend": "jax", "group_size": 4, "max_new_tokens": 8, "max_lag": max_lag,
                 "fetch_timeout_s": 0.2, "rollout_timeout_s": 300.0},
        optim={"learning_rate": 2e-2, "max_grad_norm": 1.0},
        sync={"background": True},
    )  # fmt: skip
    problems = [Problem(str(i), "", "", "token_fraction", {"token_id": 5}) for i in range(64)]
    scoring = ScoringPool(verifiers={"token_fraction": TokenFractionVerifier(ignore_ids=[0])})
    source = RolloutSource(
        client,
        ProblemStream(problems, seed=0),
        lambda p: [1, 2, 10 + int(p.problem_id)],
        scoring,
        group_size=4,
        sampling=m.SamplingParams(temperature=1.0, max_new_tokens=8),
        fetch_timeout_s=0.2,
    )
    step = train_step_from_config(cfg, model, make_mesh(1, 1, devices=jax.devices()[:1]))
    trainer = AsyncTrainer(
        cfg, step, step.init_state(model), source, publisher, tmp_path / "run", client=client,
        **loop,
    )  # fmt: skip
    return trainer, scoring


def _logprobs(model, prompt: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """float32 [len(tokens)]: log p(tokens[j] | prompt, tokens[:j]) under `model`, temperature 1."""
    seq = np.concatenate([prompt, tokens])[None, :-1]
    logits, _ = model(jnp.asarray(seq), jnp.arange(seq.shape[1])[None])
    lp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
    rows = np.arange(len(prompt) - 1, seq.shape[1])
    return lp[rows, tokens]


def _copy(model):
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(jnp.array, state))


def test_twenty_background_pushes_to_a_slow_engine(tmp_path, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama", seed=0)
    model_cfg, model = load_hf_checkpoint(ckpt, dtype="float32")
    kept = {0: _copy(model)}  # version -> the trainer's weights of it
    trained: list = []
    with slow_engines(tmp_path, ckpt, model_cfg, [2.0]) as (client, publisher, _):
        trainer, scoring = _trainer(
            tmp_path, client, publisher, model, max_lag=2, steps=20,
            on_groups=lambda step, groups: trained.extend(groups),
            after_update=lambda step, version: kept.update(
                {version: _copy(trainer.step.model(trainer.state))}
            ),
        )  # fmt: skip
        with scoring:
            summary = trainer.run()
        engine = client.status().engines[0]
    pusher = trainer.pusher
    assert pusher is not None
    assert (summary.steps, summary.version, summary.stop_reason) == (20, 20, "completed")
    assert sorted(pusher.pushed + pusher.skipped) == list(range(1, 21))
    assert pusher.skipped and pusher.pushed[-1] == 20 == pusher.committed
    assert engine.weight_version == 20  # the final version committed before run() returned
    assert len(trained) == 80 == summary.trained_groups
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    assert all(r["lag_max"] <= 2 for r in rows)
    checked = discriminated = 0
    for g in trained:
        for c in g.completions:
            spans = c.version_spans or ((c.version_start, 0, len(c.token_ids)),)
            for v, a, b in spans:
                # never a skipped version, never one the engine did not load whole
                assert v == 0 or v in pusher.pushed, (v, pusher.pushed)
                got = _logprobs(kept[v], g.prompt_ids, c.token_ids)[a:b]
                assert np.abs(got - c.logprobs[a:b]).max() < TOLERANCE, (g.sample_id, v)
                checked += b - a
                if v > 0:  # the version before it would not have sampled these log-probs
                    before = _logprobs(kept[v - 1], g.prompt_ids, c.token_ids)[a:b]
                    discriminated += np.abs(before - c.logprobs[a:b]).max() > 10 * TOLERANCE
    assert checked >= 80 * 4  # every trained completion has at least one token
    assert discriminated > 0


def _mid_load(client: GatewayClient, name: str) -> bool:
    """Whether engine `name` acknowledged "ready" for a version it has not loaded yet."""
    return any(
        e.name == name and e.sync_version > e.weight_version and e.sync_phase == READY
        for e in client.status().engines
    )


def test_an_engine_killed_mid_load_of_a_background_push(tmp_path, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama", seed=0)
    model_cfg, model = load_hf_checkpoint(ckpt, dtype="float32")
    with slow_engines(tmp_path, ckpt, model_cfg, [0.0, 3.0]) as (client, publisher, procs):
        killed = threading.Event()

        def kill_mid_load() -> None:
            waits.wait_for(lambda: _mid_load(client, "e1"), procs, "e1 loading", 600.0, 0.05)
            procs[1].send_signal(signal.SIGKILL)
            killed.set()

        killer = threading.Thread(target=kill_mid_load, daemon=True)
        killer.start()
        ids: list[str] = []
        trainer, scoring = _trainer(
            tmp_path, client, publisher, model, max_lag=1, steps=8,
            on_groups=lambda step, groups: ids.extend(g.sample_id for g in groups),
        )  # fmt: skip
        with scoring:
            summary = trainer.run()
        killer.join(10)
        engines = client.status().engines
    assert killed.is_set() and procs[1].returncode == -signal.SIGKILL
    assert (summary.steps, summary.version, summary.stop_reason) == (8, 8, "completed")
    assert trainer.pusher is not None and trainer.pusher.committed == 8
    assert [(e.name, e.weight_version) for e in engines] == [("e0", 8)]
    lost = summary.submitted - (
        summary.trained_groups + summary.filtered_lag + summary.filtered_zero_variance
        + summary.filtered_aborted + summary.in_flight
    )  # fmt: skip
    assert lost == 0 and summary.trained_groups == 32
    assert len(set(ids)) == len(ids) == 32  # no group trained twice


def test_a_stop_while_a_background_push_is_in_flight(tmp_path, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama", seed=0)
    model_cfg, model = load_hf_checkpoint(ckpt, dtype="float32")
    with slow_engines(tmp_path, ckpt, model_cfg, [4.0]) as (client, publisher, procs):
        mid = threading.Event()

        def stop() -> str | None:
            if trainer.version >= 2 and _mid_load(client, "e0"):
                mid.set()
            return "interrupted (test)" if mid.is_set() else None

        trainer, scoring = _trainer(
            tmp_path, client, publisher, model, max_lag=1, steps=20, stop_requested=stop
        )
        with scoring:
            summary = trainer.run()
        assert procs[0].poll() is None  # the engine lives on; the gateway's shutdown ends it
    assert mid.is_set() and summary.stop_reason == "interrupted (test)"
    assert trainer.pusher is not None and not trainer.pusher.alive
    assert [t for t in threading.enumerate() if t.name == "background-push"] == []
    assert procs[0].returncode == 0
