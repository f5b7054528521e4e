"""Multi-turn prompts through the real gateway and the engine worker on the real JAX engine: a
prompt carrying an `Episode` (countdown with feedback, a real reasoning-gym entry) comes back as
G episodes, each exactly the record the episode runner makes on the same engine (the wire
changes nothing), with feedback observations between model turns; a bad episode is refused at
submission or returned aborted, never lost."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import reasoning_gym
from transformers import AutoTokenizer

from gateway import messages as m
from gateway.errors import GatewayError
from models.checkpoints.tiny import make_tiny_checkpoint
from rollout_engine.config import WorkerConfig
from rollout_engine.episode import EpisodeRunner
from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig
from rollout_engine.worker import EngineWorker

_HARNESS = Path(__file__).with_name("worker_harness.py")
_spec = importlib.util.spec_from_file_location("worker_harness_ep", _HARNESS)
assert _spec is not None and _spec.loader is not None
h = importlib.util.module_from_spec(_spec)
sys.modules["worker_harness_ep"] = h
_spec.loader.exec_module(h)


def _entry() -> dict:
    return reasoning_gym.create_dataset("countdown", size=1, seed=1, min_numbers=3, max_numbers=3)[
        0
    ]


def _config(path: Path, im_end: int) -> JaxBackendConfig:
    return JaxBackendConfig(model=str(path), num_slots=4, max_model_len=512, prefill_batch=2,
                            temperature=1.0, stop_token_ids=(im_end,))  # fmt: skip


def _episode_prompt(sid: str, tok, task: dict, env: str = "countdown", **kw) -> m.Prompt:
    text = tok.apply_chat_template(
        [{"role": "user", "content": "reach the target"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = np.asarray(tok.encode(text, add_special_tokens=False), np.int32)
    episode = m.Episode(
        env, kw.pop("task_json", json.dumps(task)), 3, kw.pop("max_tokens", 160), 200
    )
    sampling = m.SamplingParams(temperature=1.0, max_new_tokens=8, seed=kw.pop("seed", 5))
    return m.Prompt(sid, ids, 2, sampling, episode=episode)


class EngineThread:
    """The JAX backend started, the worker run and the backend shut down on one event loop
    in one thread."""

    def __init__(self, client, cfg: JaxBackendConfig) -> None:
        self.backend = JaxBackend(cfg)
        spec = m.EngineSpec(backend="jax", model_family="llama", dtype="float32",
                            transports=("gloo",))  # fmt: skip
        self.worker = EngineWorker(client, self.backend, spec, WorkerConfig())
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()

    async def _main(self) -> None:
        try:
            await self.backend.start()
            try:
                await self.worker.run()
            finally:
                await self.backend.shutdown()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e


def test_episodes_through_the_gateway_equal_the_runner_on_the_same_engine(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    tok = AutoTokenizer.from_pretrained(path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = _config(path, im_end)
    task = {"entry": _entry()}
    server, trainer, engine = h.start_gateway(max_new_tokens=512)
    try:
        run = EngineThread(engine, cfg)
        good = _episode_prompt("ep", tok, task)
        assert trainer.submit_prompts([good]) == 1
        bad = [
            _episode_prompt("unknown-env", tok, task, env="chess"),
            _episode_prompt("not-json", tok, task, task_json="{entry"),
            _episode_prompt("not-object", tok, task, task_json="[1, 2]"),
            _episode_prompt("wrong-task", tok, {"question": "2+2"}),
        ]
        assert trainer.submit_prompts(bad) == 4
        groups: dict[str, m.RolloutGroup] = {}
        deadline = time.monotonic() + 120
        while len(groups) < 5 and time.monotonic() < deadline:  # each fetch waits <= 5 s
            groups.update((g.sample_id, g) for g in trainer.fetch_rollouts(5, timeout_s=5))
        # refused at submission: over the gateway's bounds
        with pytest.raises(GatewayError, match="max_tokens 1..512"):
            trainer.submit_prompts([_episode_prompt("long", tok, task, max_tokens=513)])
        with pytest.raises(
            GatewayError, match="episode.task_json: expected at most 65536 characters"
        ):
            trainer.submit_prompts([_episode_prompt("big", tok, task, task_json="x" * 70_000)])
        trainer.shutdown("test over")
        run.thread.join(60)
        assert not run.thread.is_alive() and run.error is None, run.error
    finally:
        trainer.close()
        engine.close()
        server.stop(0)
    assert sorted(groups) == ["ep", "not-json", "not-object", "unknown-env", "wrong-task"], groups
    for sid in ("unknown-env", "not-json", "not-object", "wrong-task"):
        assert [c.finish_reason for c in groups[sid].completions] == ["abort", "abort"], sid
    assert run.worker.stats.prompts_aborted == 4

    episodes = groups["ep"].completions
    assert len(episodes) == 2
    feedback = tok.encode("No guess found. The target is 116.", add_special_tokens=False)
    for c in episodes:
        ids, forced = c.token_ids.tolist(), set(c.forced_positions)
        assert 0 < len(ids) <= 160 and forced and c.finish_reason in ("stop", "length")
        runs = _forced_runs(sorted(forced))
        assert 1 <= len(runs) <= 2  # observations between the (at most 3) model turns
        for a, b in runs:  # each observation: the template's ids around countdown's feedback
            text = tok.decode(ids[a:b])
            assert text.startswith(("<|im_end|>\n<|im_start|>user\n", "\n<|im_start|>user\n"))
            assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
            assert "target is 116" in text or _contains(ids[a:b], feedback)
        assert np.all(c.logprobs[sorted(forced)] == 0.0)
        assert (c.version_start, c.version_end) == (0, 0)
    assert episodes[0].token_ids.tolist() != episodes[1].token_ids.tolist()  # own streams

    async def direct():
        backend = JaxBackend(cfg)
        await backend.start()
        try:
            return await EpisodeRunner(str(path)).group(backend.generate, good)
        finally:
            await backend.shutdown()

    again = asyncio.run(direct())
    for got, want in zip(episodes, again, strict=True):
        assert got.token_ids.tolist() == want.token_ids.tolist()
        # a later turn is prefilled whole or continued in its slot (slot memory): 1e-5 apart
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
        assert got.forced_positions == want.forced_positions
        assert got.version_spans == want.version_spans


def _forced_runs(forced: list[int]) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for j in forced:
        if runs and j == runs[-1][1]:
            runs[-1][1] = j + 1
        else:
            runs.append([j, j + 1])
    return [(a, b) for a, b in runs]


def _contains(ids: list[int], sub: list[int]) -> bool:
    return any(ids[i : i + len(sub)] == sub for i in range(len(ids) - len(sub) + 1))


def test_gateway_settings_hold_the_episode_bounds():
    server, trainer, engine = h.start_gateway(max_turns=2)
    try:
        p = m.Prompt("t", np.asarray([1, 2], np.int32), 1, m.SamplingParams(max_new_tokens=4),
                     episode=m.Episode("calculator", "{}", 3, 10, 10))  # fmt: skip
        with pytest.raises(GatewayError, match="max_turns 1..2"):
            trainer.submit_prompts([p])
        empty = m.Prompt("e", np.asarray([1], np.int32), 1, episode=m.Episode("", "{}", 1, 4, 4))
        with pytest.raises(GatewayError, match="environment name"):
            trainer.submit_prompts([empty])
    finally:
        trainer.close()
        engine.close()
        server.stop(0)


def test_an_engine_lost_mid_episode_leaves_the_episode_to_another_engine(tmp_path):
    """Engine A leases an episode prompt and dies before returning it (silent: no heartbeat);
    the gateway drops A after heartbeat_timeout_s and queues the prompt again; engine B plays
    the G episodes and the group arrives once. A's late return is refused: nothing is lost and
    nothing is duplicated."""
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    tok = AutoTokenizer.from_pretrained(path)
    cfg = _config(path, tok.convert_tokens_to_ids("<|im_end|>"))
    server, trainer, engine = h.start_gateway(max_new_tokens=512, heartbeat_timeout_s=2.0)
    late = h.GatewayClient(server.address, h.TOKENS["engine"], margin_s=5.0)
    try:
        good = _episode_prompt("ep", tok, {"entry": _entry()})
        assert trainer.submit_prompts([good]) == 1
        spec = m.EngineSpec(backend="jax", model_family="llama", dtype="float32",
                            transports=("gloo",))  # fmt: skip
        dead = late.register_engine(spec)
        lease = late.lease_prompts(dead.engine_id, 1, 5.0)
        assert [p.sample_id for p in lease.prompts] == ["ep"]
        assert lease.prompts[0].episode == good.episode  # the episode travels whole
        run = EngineThread(engine, cfg)  # A says nothing more: dropped, its lease requeued
        groups: list[m.RolloutGroup] = []
        deadline = time.monotonic() + 120
        while not groups and time.monotonic() < deadline:
            groups += trainer.fetch_rollouts(5, timeout_s=5)
        fake = m.RolloutGroup("ep", tuple(m.Completion([1], [-0.5], "stop", 0, 0) for _ in "ab"))
        with pytest.raises(GatewayError):
            late.return_rollouts(dead.engine_id, lease.lease_id, [fake])
        more = trainer.fetch_rollouts(5, timeout_s=1.0)
        trainer.shutdown("test over")
        run.thread.join(60)
        assert not run.thread.is_alive() and run.error is None, run.error
    finally:
        trainer.close()
        engine.close()
        late.close()
        server.stop(0)
    assert [g.sample_id for g in groups] == ["ep"] and more == []
    assert groups[0].engine_id == run.worker.engine_id != dead.engine_id
    for c in groups[0].completions:
        assert c.turns >= 1 and c.token_ids.size > 0 and c.finish_reason in ("stop", "length")
