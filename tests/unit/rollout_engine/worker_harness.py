"""Shared by the worker and publisher tests (loaded by path): a real in-process gateway, a
small backend beside the worker whose outputs are known exactly (its data plane is the real
one: it receives through `transport` receivers), and a worker run in its own thread.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import torch
from pydantic import TypeAdapter

from gateway import messages as m
from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.server import GatewayServer
from rollout_engine.backend import RolloutBackend, UpdateStats, completion
from rollout_engine.config import WorkerConfig
from rollout_engine.worker import EngineWorker
from transport.base import TransferError
from transport.config import TransportConfig
from transport.factory import make_receiver
from transport.manifest import Manifest, check_manifest

TOKENS = {"trainer": "trainer-token-0123456789", "engine": "engine-token-0123456789"}


def start_gateway(**overrides) -> tuple[GatewayServer, GatewayClient, GatewayClient]:
    """A gateway on a free loopback port (family llama) with trainer and engine clients."""
    run = {k: overrides.pop(k) for k in list(overrides) if k in RunSettings.__dataclass_fields__}
    cfg = {"heartbeat_timeout_s": 6.0, "max_wait_s": 5.0, **overrides}
    settings = RunSettings(**{"model_family": "llama", **run})
    server = GatewayServer(GatewayConfig(settings=settings, **cfg), TOKENS).start()
    trainer = GatewayClient(server.address, TOKENS["trainer"], margin_s=5.0)
    engine = GatewayClient(server.address, TOKENS["engine"], margin_s=5.0)
    return server, trainer, engine


def expected_tokens(prompt: list[int], index: int, n: int) -> list[int]:
    """The fake's completion `index` of a prompt: `[last + 10 (index + 1) + j for j < n]`."""
    return [prompt[-1] + 10 * (index + 1) + j for j in range(n)]


def expected_logprobs(n: int) -> list[float]:
    """The fake's log-probs: `-(j + 1) / 8` (exact in float32)."""
    return [-(j + 1) / 8 for j in range(n)]


class FakeBackend(RolloutBackend):
    """Generates `expected_tokens`, one token per `step_s`, stamping each token with the
    version held when it is made. A prompt id in `holds` stops after half its tokens until
    the test sets that threading.Event; ids starting with "bad" are refused (ValueError).
    Weights come through a real transport receiver into `received` (name -> tensor copy);
    `fail_at[version] = k` fails that version at bucket k (after loading buckets < k);
    `gate` (set by default) holds an update before it receives."""

    def __init__(self, step_s: float = 0.005, expected: dict | None = None) -> None:
        self.step_s = step_s
        self.expected = expected
        self._version: int | None = 0
        self.holds: dict[str, threading.Event] = {}
        self.fail_at: dict[int, int] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.update_started = threading.Event()
        self.received: dict[str, torch.Tensor] = {}
        self.calls: list[tuple[str, int | None]] = []
        self.connects: list[tuple[dict, int, int]] = []
        self._receiver = None

    @property
    def weight_version(self) -> int | None:
        return self._version

    async def start(self) -> None:
        return None

    async def generate(self, prompt: m.Prompt, stop_strings=()) -> tuple[m.Completion, ...]:
        prompt_id, prompt_token_ids = prompt.sample_id, [int(t) for t in prompt.token_ids]
        self.calls.append((prompt_id, self._version))
        if prompt_id.startswith("bad"):
            raise ValueError(f"prompt {prompt_id!r} refused by the fake")
        if self._version is None:
            raise RuntimeError("no whole version")
        version = self._version
        n = prompt.sampling.max_new_tokens
        stamps = []
        for j in range(n):
            if j == n // 2 and prompt_id in self.holds:
                while not self.holds[prompt_id].is_set():
                    await asyncio.sleep(0.01)
            await asyncio.sleep(self.step_s)
            stamps.append(self._version)
        spans = _spans(stamps)
        return tuple(
            completion(
                expected_tokens(prompt_token_ids, i, n),
                expected_logprobs(n),
                "length",
                spans,
                version,
            )  # fmt: skip
            for i in range(prompt.group_size)
        )

    async def connect_transport(self, transport: dict, rank_offset: int, world_size: int) -> None:
        self.connects.append((transport, rank_offset, world_size))
        cfg = TypeAdapter(TransportConfig).validate_python(transport)
        receiver = make_receiver(cfg, rank=rank_offset, world_size=world_size)
        connect = getattr(receiver, "connect", None)  # collective kinds join a group
        if connect is not None:
            await asyncio.to_thread(connect)
        self._receiver = receiver

    async def update_weights(self, manifest: Manifest) -> UpdateStats:
        self.update_started.set()
        await asyncio.to_thread(self.gate.wait, 30)
        t0 = time.perf_counter()
        if self.expected is not None:
            try:
                check_manifest(manifest, self.expected)
            except ValueError as e:
                await asyncio.to_thread(self._receiver.refuse, str(e))
        fail_at = self.fail_at.get(manifest.version)
        seen = [0]

        def on_bucket(bucket) -> None:
            if seen[0] == fail_at:
                self._version = None  # part of the version is loaded: no whole version now
                raise RuntimeError(f"injected failure at bucket {fail_at}")
            seen[0] += 1
            for name, tensor in bucket:
                self.received[name] = tensor.clone()

        try:
            await asyncio.to_thread(self._receiver.receive, manifest, on_bucket)
        except TransferError:
            raise
        self._version = manifest.version
        dt = time.perf_counter() - t0
        return UpdateStats(manifest.version, manifest.total_bytes, dt, dt)

    async def shutdown(self) -> None:
        return None


def _spans(stamps: list[int | None]) -> list[tuple[int, int, int]]:
    spans: list[tuple[int, int, int]] = []
    for j, v in enumerate(stamps):
        if spans and spans[-1][0] == v:
            spans[-1] = (spans[-1][0], spans[-1][1], j + 1)
        else:
            spans.append((int(v or 0), j, j + 1))
    return spans


class WorkerThread:
    """`EngineWorker(client, backend, spec, cfg).run()` on its own event loop and thread
    (`name`: the name it registers as)."""

    def __init__(
        self, client: GatewayClient, backend: RolloutBackend, name: str = "", **cfg
    ) -> None:
        spec = m.EngineSpec(
            backend="jax", model_family="llama", dtype="float32", transports=("gloo",), name=name
        )
        self.worker = EngineWorker(client, backend, spec, WorkerConfig(**cfg))
        self.reason: str | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.reason = asyncio.run(self.worker.run())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def wait_registered(self, timeout_s: float = 10.0) -> str:
        end = time.monotonic() + timeout_s
        while not self.worker.engine_id:
            assert time.monotonic() < end and self.error is None, f"no registration: {self.error}"
            time.sleep(0.01)
        return self.worker.engine_id

    def join(self, timeout_s: float = 20.0) -> str | None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "worker did not stop in time"
        if self.error is not None:
            raise self.error
        return self.reason


def prompt(sid: str, tokens: list[int], g: int = 2, n: int = 4, **kw) -> m.Prompt:
    """A prompt of G samples of `n` tokens each."""
    sampling = m.SamplingParams(temperature=1.0, max_new_tokens=n)
    return m.Prompt(sid, np.asarray(tokens, np.int32), g, sampling, **kw)


def check_group(group: m.RolloutGroup, p: m.Prompt, versions: tuple[int, int]) -> None:
    """The group holds the fake's exact completions of `p`, stamped `versions`."""
    n = p.sampling.max_new_tokens
    assert group.sample_id == p.sample_id
    assert len(group.completions) == p.group_size
    for i, c in enumerate(group.completions):
        assert c.token_ids.tolist() == expected_tokens(p.token_ids.tolist(), i, n)
        np.testing.assert_array_equal(c.logprobs, np.float32(expected_logprobs(n)))
        assert c.finish_reason == "length"
        assert (c.version_start, c.version_end) == versions
