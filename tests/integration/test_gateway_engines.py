"""The real gateway process with 3 engine processes: 1,000 prompts x G=4, one engine killed
mid-lease (SIGKILL) and one frozen mid-lease (SIGSTOP past the heartbeat timeout, then
SIGCONT): every prompt's 4 completions reach the trainer exactly once, late returns are
refused, and the queues end empty.

Run as a script (`python tests/integration/test_gateway_engines.py engine ...`) this file is
the engine process: it generates deterministic completions through the real client.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from gateway import messages as m
from gateway.auth import write_tokens
from gateway.client import GatewayClient
from gateway.errors import NOT_FOUND, GatewayError
from gateway.heartbeat import HeartbeatThread

G = 4
N_PROMPTS = 1000
TOKENS_PER_COMPLETION = 4
LEASE_SIZE = 4


def expected_completion(sample_id: str, j: int) -> tuple[list[int], list[float]]:
    """Completion j of a sample: tokens [b+j, b+j+1, ...] with b = crc32(id) % 1000, and
    log-probs -(j+1)/8 per token (exact in float32)."""
    base = zlib.crc32(sample_id.encode()) % 1000 + j
    return list(range(base, base + TOKENS_PER_COMPLETION)), [-(j + 1) / 8] * TOKENS_PER_COMPLETION


def _complete(prompt: m.Prompt) -> m.RolloutGroup:
    completions = []
    for j in range(prompt.group_size):
        ids, lps = expected_completion(prompt.sample_id, j)
        completions.append(
            m.Completion(np.array(ids, np.int32), np.array(lps, np.float32), "length", 0, 0)
        )
    return m.RolloutGroup(prompt.sample_id, tuple(completions))


def engine_main(address: str, token_file: str, mode: str, out_dir: str) -> int:
    """One engine: register, heartbeat, lease, complete, return until the gateway stops.

    mode "normal" works; "victim" holds its 1st lease forever (to be SIGKILLed); "stall"
    holds its 1st lease until `out_dir/go` appears, then returns it late.
    """
    out = Path(out_dir)
    client = GatewayClient.from_token_file(address, token_file, "engine", margin_s=5.0)
    spec = m.EngineSpec("jax", "llama", "float32", ("gloo",), name=mode)
    reg = client.register_engine(spec, wait_s=10.0)
    hb = HeartbeatThread(client, reg.engine_id, reg.heartbeat_interval_s).start()
    leases = accepted = late = 0
    try:
        while True:
            try:
                lease = client.lease_prompts(reg.engine_id, LEASE_SIZE, timeout_s=0.5)
            except GatewayError as e:
                if e.code == "UNAVAILABLE":
                    break
                raise
            if lease.shutting_down:
                break
            if not lease.prompts:
                continue
            leases += 1
            groups = [_complete(p) for p in lease.prompts]
            if mode != "normal" and leases == 1:
                (out / f"holding-{mode}").write_text(lease.lease_id)
                while mode == "victim" or not (out / "go").exists():
                    time.sleep(0.05)
            try:
                result = client.return_rollouts(reg.engine_id, lease.lease_id, groups)
                accepted += result.accepted
                late += result.dropped
            except GatewayError as e:
                if e.code != NOT_FOUND:
                    raise
                late += len(groups)  # dropped as dead while frozen: join again
                hb.stop()
                reg = client.register_engine(spec, wait_s=10.0)
                hb = HeartbeatThread(client, reg.engine_id, reg.heartbeat_interval_s).start()
    finally:
        hb.stop()
        (out / f"result-{mode}-{os.getpid()}").write_text(f"{accepted} {late}")
    return 0


def _wait_for(path: Path, timeout_s: float, proc: subprocess.Popen) -> None:
    """Wait for `path` while `proc` (which writes it) is alive; `timeout_s` ends a hung run."""
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the process writing {path} exited ({proc.poll()})"
        assert time.monotonic() < end, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.02)


def test_three_engines_one_killed_one_frozen_exactly_once(tmp_path):
    tokens = tmp_path / "tokens"
    write_tokens(tokens)
    port_file = tmp_path / "port"
    logs = [open(tmp_path / f"{n}.log", "w") for n in ("gateway", "normal", "victim", "stall")]
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", "0", "--port-file", str(port_file),
         "--token-file", str(tokens), "--family", "llama", "--lease-seconds", "30",
         "--heartbeat-timeout", "1.5", "--heartbeat-interval", "0.3",
         "--rollout-capacity", "256", "--log-level", "WARNING"],
        stdout=logs[0], stderr=subprocess.STDOUT,
    )  # fmt: skip
    engines = {}
    try:
        _wait_for(port_file, 1800, gateway)
        address = f"127.0.0.1:{port_file.read_text()}"
        trainer = GatewayClient.from_token_file(address, tokens, "trainer")
        trainer.wait_ready(10)
        for mode, log in zip(("normal", "victim", "stall"), logs[1:], strict=True):
            engines[mode] = subprocess.Popen(
                [sys.executable, __file__, "engine", address, str(tokens), mode, str(tmp_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        # all three compete for the first leases; a loaded machine may take long to start them:
        # wait while they are alive (the ceiling ends a hung run only)
        end = time.monotonic() + 1800
        while len(trainer.status().engines) < 3:
            assert all(p.poll() is None for p in engines.values()), "an engine exited"
            assert time.monotonic() < end, "the engines did not register within 1800 s"
            time.sleep(0.05)
        sampling = m.SamplingParams(max_new_tokens=TOKENS_PER_COMPLETION)
        ids = [f"q{i}" for i in range(N_PROMPTS)]
        for start in range(0, N_PROMPTS, 100):
            batch = [
                m.Prompt(s, np.array([1, 2, 3]), G, sampling) for s in ids[start : start + 100]
            ]
            assert trainer.submit_prompts(batch, timeout_s=10) == 100

        got: dict[str, m.RolloutGroup] = {}
        frozen_at = None
        end = time.monotonic() + 45
        go = tmp_path / "go"
        while (len(got) < N_PROMPTS or not go.exists()) and time.monotonic() < end:
            for g in trainer.fetch_rollouts(256, timeout_s=0.2):
                assert g.sample_id not in got, f"{g.sample_id} delivered twice"
                got[g.sample_id] = g
            if engines["victim"].returncode is None and (tmp_path / "holding-victim").exists():
                engines["victim"].send_signal(signal.SIGKILL)
                engines["victim"].wait()
            if frozen_at is None and (tmp_path / "holding-stall").exists():
                engines["stall"].send_signal(signal.SIGSTOP)
                frozen_at = time.monotonic()
            if frozen_at and time.monotonic() - frozen_at > 2.5 and not go.exists():
                engines["stall"].send_signal(signal.SIGCONT)  # past the 1.5 s heartbeat timeout
                go.touch()
        assert engines["victim"].returncode == -signal.SIGKILL, "the victim never held a lease"
        assert go.exists(), "the staller never held a lease"
        assert sorted(got) == sorted(ids)
        for sid, g in got.items():
            assert len(g.completions) == G and g.prompt.sample_id == sid
            for j, c in enumerate(g.completions):
                ids_j, lps_j = expected_completion(sid, j)
                assert c.token_ids.tolist() == ids_j
                assert c.logprobs.tolist() == lps_j
                assert (c.finish_reason, c.version_start, c.version_end) == ("length", 0, 0)
        assert trainer.fetch_rollouts(10, timeout_s=0.5) == []
        status = trainer.status()
        q = status.queues
        assert (q.pending_eval, q.pending_train, q.leased_prompts, q.ready_groups) == (0, 0, 0, 0)
        assert status.counters.groups_fetched == N_PROMPTS
        assert status.counters.groups_returned == N_PROMPTS
        assert status.counters.engines_lost >= 2 and status.counters.leases_expired >= 2

        trainer.shutdown("test done")
        for mode in ("normal", "stall"):
            assert engines[mode].wait(1800) == 0, (tmp_path / f"{mode}.log").read_text()
        assert gateway.wait(1800) == 0
        results = {p.name.split("-")[1]: p.read_text().split() for p in tmp_path.glob("result-*")}
        assert set(results) == {"normal", "stall"}  # the victim never wrote one
        assert int(results["stall"][1]) >= 1, "the frozen engine's late return was not refused"
        assert sum(int(r[0]) for r in results.values()) == N_PROMPTS  # all from survivors
    finally:
        for proc in [*engines.values(), gateway]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


if __name__ == "__main__" and sys.argv[1:2] == ["engine"]:
    sys.exit(engine_main(*sys.argv[2:6]))
