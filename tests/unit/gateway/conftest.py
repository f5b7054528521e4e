"""Builders shared by the gateway unit tests (protos with exact, checkable contents), handed
to tests through the `gw` fixture, and a running in-process server (`server` fixture)."""

from __future__ import annotations

import types

import pytest

from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.server import GatewayServer
from gateway.state import GatewayState
from protos import gateway_pb2 as gpb
from protos import rollout_pb2 as rpb

TOKENS = {"trainer": "trainer-token-0123456789", "engine": "engine-token-0123456789"}


class FakeClock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def prompt(sid: str, g: int = 2, is_eval: bool = False, min_version: int = 0) -> rpb.Prompt:
    """A valid prompt whose tokens encode its id length: [1, 2, ..., len(sid)]."""
    return rpb.Prompt(
        sample_id=sid,
        token_ids=list(range(1, len(sid) + 2)),
        group_size=g,
        sampling=rpb.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8),
        is_eval=is_eval,
        min_version=min_version,
    )


def group(sid: str, g: int = 2, version: int = 0) -> rpb.RolloutGroup:
    """A valid group: completion i has tokens [i, i+1] with log-probs [-0.5, -0.25]."""
    return rpb.RolloutGroup(
        sample_id=sid,
        completions=[
            rpb.Completion(
                token_ids=[i, i + 1],
                logprobs=[-0.5, -0.25],
                finish_reason=rpb.FINISH_REASON_STOP,
                version_start=version,
                version_end=version,
            )
            for i in range(g)
        ],
    )


def register(family: str = "llama", name: str = "e", adapter: str = "") -> gpb.RegisterRequest:
    """A valid registration of a one-device JAX engine (`adapter`: the LoRA it serves)."""
    return gpb.RegisterRequest(
        name=name,
        backend="jax",
        device_count=1,
        tp_size=1,
        model_family=family,
        dtype="bfloat16",
        transports=["gloo"],
        adapter=adapter,
    )


@pytest.fixture
def gw() -> types.SimpleNamespace:
    """The builders of this module: prompt, group, register, FakeClock, TOKENS."""
    return types.SimpleNamespace(
        prompt=prompt, group=group, register=register, FakeClock=FakeClock, TOKENS=TOKENS
    )


class Running(types.SimpleNamespace):
    """A started server with a trainer and an engine client (see the `server` fixture)."""


def start_server(config: GatewayConfig, clock=None) -> Running:
    """Start an in-process server on a free loopback port with trainer and engine clients."""
    state = GatewayState(config, clock=clock) if clock else None
    srv = GatewayServer(config, TOKENS, state=state).start()
    trainer = GatewayClient(srv.address, TOKENS["trainer"], margin_s=5.0)
    engine = GatewayClient(srv.address, TOKENS["engine"], margin_s=5.0)
    return Running(server=srv, state=srv.state, trainer=trainer, engine=engine, clock=clock)


@pytest.fixture
def server():
    """A server (family "llama", fake clock, short timeouts) with trainer and engine clients."""
    run = start_server(
        GatewayConfig(
            settings=RunSettings(model_family="llama"),
            lease_seconds=30.0,
            heartbeat_timeout_s=10.0,
            rollout_capacity=64,
            max_pending_prompts=256,
            max_wait_s=5.0,
        ),
        clock=FakeClock(),
    )
    yield run
    run.trainer.close()
    run.engine.close()
    run.server.stop(0)
