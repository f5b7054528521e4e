"""A real gateway process under 10,000 seeded random or malformed calls (10 MB fields and 200
concurrent long polls among them) while a well-behaved engine keeps its heartbeat.

The calls fall in five kinds, each with the codes it may get:
- oversize (a field one past its bound, or a 10 MB string): INVALID_ARGUMENT only;
- malformed values (group size 0, NaN timeouts, min_version out of reach, ...):
  INVALID_ARGUMENT only;
- bad tokens (none, unknown, the other role's): UNAUTHENTICATED or PERMISSION_DENIED only;
- random well-formed calls (unknown ids, keys of no engine, repeated sample ids, a full queue):
  OK or one of the refusals the gateway documents (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
  NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION, PERMISSION_DENIED);
- 200 long polls sent at once (FetchRollouts waiting for more groups than can ever be ready):
  OK after waiting, or RESOURCE_EXHAUSTED past the gateway's `max_long_polls` (128): exactly
  72 refused.
No call gets INTERNAL, UNKNOWN or UNAVAILABLE; every refusal's message is under 1 KB; the
engine's heartbeat thread sees no failure and the engine is never dropped; the gateway answers
status and serves a prompt end to end after the flood, and logged no traceback.
"""

from __future__ import annotations

import collections
import math
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from gateway import messages as m
from gateway.auth import write_tokens
from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.heartbeat import HeartbeatThread
from protos import gateway_pb2 as gpb
from protos import gateway_pb2_grpc
from protos import rollout_pb2 as rpb
from tests.unit.gateway.oversize import cases

pytestmark = pytest.mark.slow

SEED = 11
N_CALLS = 10_000
N_LONG_POLLS = 200  # among the N_CALLS
N_WORKERS = 8
LONG_POLL_CAP = 128
HEARTBEAT_TIMEOUT_S = 6.0  # 12 beats of 0.5 s: room for a loaded machine
HUGE = 10_000_000  # characters of a "10 MB field"
TRAINER_ONLY = {
    "Configure",
    "SubmitPrompts",
    "FetchRollouts",
    "PublishVersion",
    "WaitSync",
    "Shutdown",
}
BOTH = {"ReportMetrics", "GetStatus"}
DOCUMENTED = {
    "OK",
    "INVALID_ARGUMENT",
    "RESOURCE_EXHAUSTED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "FAILED_PRECONDITION",
    "PERMISSION_DENIED",
}
ALLOWED = {
    "oversize": {"INVALID_ARGUMENT"},
    "malformed": {"INVALID_ARGUMENT"},
    "bad_token": {"UNAUTHENTICATED", "PERMISSION_DENIED"},
    "random": DOCUMENTED,
    "long_poll": {"OK", "RESOURCE_EXHAUSTED"},
}
# The bounds the gateway runs with (lists kept short so that building a request one past its
# bound stays cheap; strings keep their defaults).
BOUNDS = dict(
    max_long_polls=LONG_POLL_CAP,
    max_heartbeat_polls=32,
    max_prompts_per_call=512,
    max_prompt_tokens=4096,
    max_new_tokens=4096,
    max_group_size=64,
)
CONFIG = GatewayConfig(
    settings=RunSettings(model_family="llama"),
    heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    max_concurrent_rpcs=384,
    **BOUNDS,
)


def _role(method: str, rng: random.Random) -> str:
    if method in BOTH:
        return rng.choice(("trainer", "engine"))
    return "trainer" if method in TRAINER_ONLY else "engine"


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcxyz-/0189é") for _ in range(n))


def _oversize(rng: random.Random, all_cases) -> tuple[str, tuple]:
    """(method, (case, n)): the request is built when sent (10 MB ones are not kept)."""
    case = rng.choice(all_cases)
    n = case.limit + 1
    if case.unit == "characters" and rng.random() < 0.012:
        n = max(n, HUGE)  # a 10 MB field
    return case.method, (case, n)


def _prompt(sid: str, **kw) -> rpb.Prompt:
    p = rpb.Prompt(
        sample_id=sid,
        token_ids=[1, 2, 3],
        group_size=2,
        sampling=rpb.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8),
    )
    for k, v in kw.items():
        if k in ("top_p", "temperature", "max_new_tokens"):
            setattr(p.sampling, k, v)
        else:
            setattr(p, k, v)
    return p


def _malformed(rng: random.Random, i: int) -> tuple[str, object]:
    nan = float("nan")
    choices = [
        ("SubmitPrompts", gpb.SubmitRequest(prompts=[_prompt(f"m{i}", group_size=0)])),
        ("SubmitPrompts", gpb.SubmitRequest(prompts=[_prompt(f"m{i}", top_p=0.0)])),
        ("SubmitPrompts", gpb.SubmitRequest(prompts=[_prompt(f"m{i}", temperature=nan)])),
        ("SubmitPrompts", gpb.SubmitRequest(prompts=[_prompt(f"m{i}", max_new_tokens=0)])),
        ("SubmitPrompts", gpb.SubmitRequest(prompts=[_prompt(f"m{i}", min_version=1 << 40)])),
        ("SubmitPrompts", gpb.SubmitRequest(prompts=[_prompt("")])),
        ("SubmitPrompts", gpb.SubmitRequest(timeout_s=-1.0)),
        ("FetchRollouts", gpb.FetchRequest(max_groups=0)),
        ("FetchRollouts", gpb.FetchRequest(max_groups=2, min_groups=3)),
        ("FetchRollouts", gpb.FetchRequest(max_groups=1, timeout_s=nan)),
        ("LeasePrompts", gpb.LeaseRequest(engine_id="jax-1", max_prompts=0)),
        ("LeasePrompts", gpb.LeaseRequest(engine_id="jax-1", max_prompts=1, timeout_s=-5.0)),
        ("Heartbeat", gpb.HeartbeatRequest(engine_id="jax-1", wait_s=nan)),
        ("WaitSync", gpb.WaitSyncRequest(version=0, phase=gpb.SYNC_PHASE_FAILED)),
        ("WaitSync", gpb.WaitSyncRequest(version=0, phase=2, timeout_s=math.inf)),
        ("PublishVersion", gpb.PublishRequest(version=-rng.randint(1, 1 << 40))),
        ("ReportMetrics", gpb.MetricsRequest(source="")),
        ("ReturnRollouts", gpb.ReturnRequest(engine_id="jax-1", lease_id="")),
        (
            "RegisterEngine",
            gpb.RegisterRequest(
                backend="jax", model_family="llama", dtype="bf16", transports=["gloo"]
            ),
        ),  # device_count 0
        (
            "RegisterEngine",
            gpb.RegisterRequest(
                backend="jax",
                model_family="llama",
                dtype="bf16",
                transports=["gloo"],
                device_count=3,
                tp_size=2,
            ),
        ),
    ]
    return choices[rng.randrange(len(choices))]


def _random(rng: random.Random, i: int, keys: list[tuple[str, str]]) -> tuple[str, object]:
    eid, key = rng.choice(keys)
    if rng.random() < 0.5:
        eid = f"jax-{rng.randint(1, 400)}"  # most of them unknown or dropped by now
    if rng.random() < 0.3:
        key = _text(rng, 32)
    kind = rng.randrange(13)
    if kind == 0:
        return "RegisterEngine", gpb.RegisterRequest(
            name=_text(rng, rng.randint(0, 256)),
            backend="jax",
            model_family=rng.choice(("llama", "qwen2")),
            dtype="bf16",
            transports=["gloo"],
            device_count=1,
            tp_size=1,
            host=_text(rng, rng.randint(0, 40)),
        )
    if kind == 1:
        return "Heartbeat", gpb.HeartbeatRequest(
            engine_id=eid, engine_key=key, active_prompts=rng.randint(-5, 99)
        )
    if kind == 2:
        return "LeasePrompts", gpb.LeaseRequest(
            engine_id=eid, engine_key=key, max_prompts=rng.randint(1, 1 << 30)
        )
    if kind == 3:
        return "ReturnRollouts", gpb.ReturnRequest(
            engine_id=eid,
            engine_key=key,
            lease_id=f"L{rng.randint(0, 99)}",
            released_sample_ids=[f"s{rng.randint(0, 9)}"],
        )
    if kind == 4:
        return "AckVersion", gpb.AckRequest(
            engine_id=eid,
            engine_key=key,
            version=rng.randint(-2, 5),
            phase=rng.randint(0, 5),
            error=_text(rng, rng.randint(0, 300)),
        )
    if kind == 5:
        return "Deregister", gpb.DeregisterRequest(engine_id=eid, engine_key=key)
    if kind == 6:
        n = rng.randint(1, 4)
        return "SubmitPrompts", gpb.SubmitRequest(
            prompts=[
                _prompt(f"r{rng.randint(0, 3000)}", is_eval=rng.random() < 0.2) for _ in range(n)
            ]
        )
    if kind == 7:
        return "FetchRollouts", gpb.FetchRequest(max_groups=rng.randint(1, 1 << 30))
    if kind == 8:
        return "PublishVersion", gpb.PublishRequest(
            version=rng.randint(0, 40), params={"manifest": _text(rng, rng.randint(0, 2000))}
        )
    if kind == 9:
        return "WaitSync", gpb.WaitSyncRequest(version=rng.randint(0, 3), phase=rng.randint(1, 2))
    if kind == 10:
        values = {_text(rng, rng.randint(1, 200)): rng.random() for _ in range(rng.randint(0, 256))}
        return "ReportMetrics", gpb.MetricsRequest(
            source=rng.choice(("trainer", eid, _text(rng, rng.randint(1, 256)))),
            step=rng.randint(-9, 1 << 40),
            values=values,
            engine_key=key,
        )
    if kind == 11:
        return "Configure", gpb.ConfigureRequest(
            settings=gpb.RunSettings(model_family=rng.choice(("llama", "qwen2")), dtype="bf16")
        )
    return "GetStatus", gpb.StatusRequest()


def _bad_token(rng: random.Random, i: int, keys) -> tuple[str, object, tuple]:
    method, request = _random(rng, i, keys)
    choice = rng.randrange(3)
    if choice == 0:
        metadata: tuple = ("none",)
    elif choice == 1:
        token = "".join(rng.choice("abcXYZ-_09") for _ in range(rng.randint(0, 300)))
        metadata = (("authorization", f"Bearer {token}"),)
    else:  # the other role's token
        metadata = ("other",)
    if choice == 2 and (method in BOTH or method == "Deregister"):
        # both roles may make these calls (the trainer drops a dead engine without its key):
        # an engine token on a trainer call instead
        method, request = "Configure", gpb.ConfigureRequest()
        metadata = ("engine",)
    return method, request, metadata


def _plan(rng: random.Random, keys) -> list[tuple[str, str, object, tuple]]:
    """(kind, method, request, metadata spec) for each of the N_CALLS - N_LONG_POLLS calls."""
    all_cases = cases(CONFIG)
    out = []
    for i in range(N_CALLS - N_LONG_POLLS):
        r = rng.random()
        if r < 0.3:
            out.append(("oversize", *_oversize(rng, all_cases), ()))
        elif r < 0.5:
            out.append(("malformed", *_malformed(rng, i), ()))
        elif r < 0.6:
            out.append(("bad_token", *_bad_token(rng, i, keys)))
        else:
            out.append(("random", *_random(rng, i, keys), ()))
    return out


def _metadata(spec: tuple, method: str, rng: random.Random, tokens: dict[str, str]) -> tuple:
    if spec == ("other",):
        role = _role(method, rng)
        return (
            ("authorization", f"Bearer {tokens['engine' if role == 'trainer' else 'trainer']}"),
        )
    if spec == ("none",):
        return ()
    if spec == ("engine",):
        return (("authorization", f"Bearer {tokens['engine']}"),)
    if spec:
        return spec
    return (("authorization", f"Bearer {tokens[_role(method, rng)]}"),)


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, "the gateway exited at start"
        assert time.monotonic() < end, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.02)


def test_gateway_holds_under_10000_random_and_malformed_calls(tmp_path):
    tokens_file, port_file, log_path = tmp_path / "tokens", tmp_path / "port", tmp_path / "gw.log"
    tokens = write_tokens(tokens_file)
    log = open(log_path, "w")
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", "0", "--port-file", str(port_file),
         "--token-file", str(tokens_file), "--family", "llama",
         "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--heartbeat-interval", "0.5",
         "--max-wait", "10", "--rollout-capacity", "64", "--max-pending", "2000",
         "--max-workers", str(CONFIG.max_concurrent_rpcs),
         *[a for k, v in BOUNDS.items() for a in ("--set", f"{k}={v}")],
         "--log-level", "WARNING"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait_for(port_file, gateway, 15)
        address = f"127.0.0.1:{port_file.read_text()}"
        trainer = GatewayClient(address, tokens["trainer"], margin_s=10.0)
        engine = GatewayClient(address, tokens["engine"], margin_s=10.0)
        trainer.wait_ready(10)
        spec = m.EngineSpec("jax", "llama", "bf16", ("gloo",), name="steady")
        reg = engine.register_engine(spec)
        beat = HeartbeatThread(engine, reg.engine_id, reg.heartbeat_interval_s).start()
        keys = [(reg.engine_id, "")]  # the steady engine's id, never its key
        for i in range(4):
            r = engine.register_engine(
                m.EngineSpec("jax", "llama", "bf16", ("gloo",), name=f"f{i}")
            )
            keys.append((r.engine_id, r.engine_key))

        rng = random.Random(SEED)
        plan = _plan(rng, keys)
        channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", CONFIG.max_message_bytes),
                ("grpc.max_receive_message_length", CONFIG.max_message_bytes),
            ],
        )
        stub = gateway_pb2_grpc.GatewayStub(channel)
        meta_rng = random.Random(SEED + 1)
        metadata = [_metadata(spec_, method, meta_rng, tokens) for _, method, _, spec_ in plan]
        outcomes: list[tuple[str, str, str, int]] = []  # kind, method, code, message bytes

        def call(i: int) -> tuple[str, str, str, int]:
            kind, method, request, _ = plan[i]
            if kind == "oversize":
                case, n = request
                request = case.build(n)
            try:
                getattr(stub, method)(request, timeout=30, metadata=metadata[i])
                return kind, method, "OK", 0
            except grpc.RpcError as e:
                return kind, method, e.code().name, len((e.details() or "").encode())

        def long_polls() -> list:
            trainer_meta = (("authorization", f"Bearer {tokens['trainer']}"),)
            futures = []
            req = gpb.FetchRequest(max_groups=1000, min_groups=1000, timeout_s=8.0)
            for _ in range(N_LONG_POLLS):  # never 1000 ready (capacity 64): each waits 8 s
                futures.append(stub.FetchRollouts.future(req, timeout=30, metadata=trainer_meta))
            return futures

        t0 = time.monotonic()
        half = len(plan) // 2
        with ThreadPoolExecutor(N_WORKERS) as pool:
            outcomes += pool.map(call, range(half))
            polls = long_polls()  # 200 at once, while the second half runs
            outcomes += pool.map(call, range(half, len(plan)))
        for f in polls:
            try:
                f.result()
                outcomes.append(("long_poll", "poll", "OK", 0))
            except grpc.RpcError as e:
                outcomes.append(
                    ("long_poll", "poll", e.code().name, len((e.details() or "").encode()))
                )
        flood_s = time.monotonic() - t0

        tally = collections.Counter((kind, code) for kind, _, code, _ in outcomes)
        print(f"flood of {len(outcomes)} calls in {flood_s:.1f} s: {sorted(tally.items())}")
        assert len(outcomes) == N_CALLS
        kinds = collections.Counter(kind for kind, *_ in outcomes)
        assert kinds == collections.Counter([k for k, *_ in plan] + ["long_poll"] * N_LONG_POLLS)
        for kind, method, code, size in outcomes:
            assert code in ALLOWED[kind], (kind, method, code)
            assert size < 1024, (kind, method, code, size)
        assert tally[("long_poll", "RESOURCE_EXHAUSTED")] == N_LONG_POLLS - LONG_POLL_CAP
        huge = sum(1 for kind, _, req, _ in plan if kind == "oversize" and req[1] >= HUGE)
        assert huge >= 10, huge  # 10 MB fields among them

        # the steady engine missed no heartbeat and was never dropped
        assert beat.alive and beat.failures == 0 and beat.error is None, beat.error
        assert beat.beats >= 1
        status = trainer.status()
        assert reg.engine_id in [e.engine_id for e in status.engines]
        assert engine.heartbeat(reg.engine_id).current_version == status.current_version
        assert gateway.poll() is None

        # and it still serves work end to end (after whatever the flood queued)
        v = status.current_version
        engine.ack_version(reg.engine_id, v, "loaded")
        sampling = m.SamplingParams(max_new_tokens=2)
        assert trainer.submit_prompts([m.Prompt("after", np.array([1, 2]), 1, sampling)]) == 1
        got: list[m.RolloutGroup] = []
        for _ in range(500):
            lease = engine.lease_prompts(reg.engine_id, 64, timeout_s=0.2)
            if lease.lease_id:
                done = [
                    m.RolloutGroup(
                        p.sample_id,
                        tuple(
                            m.Completion(np.array([5, 6]), np.array([-0.5, -0.5], np.float32),
                                         "stop", v, v)
                            for _ in range(p.group_size)
                        ),
                    )
                    for p in lease.prompts
                ]  # fmt: skip
                result = engine.return_rollouts(reg.engine_id, lease.lease_id, done)
                assert result.accepted == len(done)
            got += [g for g in trainer.fetch_rollouts(64, timeout_s=0.0) if g.sample_id == "after"]
            if got:
                break
        assert got and got[0].completions[0].token_ids.tolist() == [5, 6]
        beat.stop()
        channel.close()
        trainer.shutdown("flood test done")
        assert gateway.wait(20) == 0
        log.flush()
        assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
        log.close()
