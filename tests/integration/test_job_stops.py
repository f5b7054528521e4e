"""The main job stops what it started, on every path, and only that; and refuses early.

- A trainer that fails after its gateway and engine started stops both (each exits by SIGTERM
  cleanly, status 0, none SIGKILLed), and no process of the run is left.
- A trainer that joined a gateway (`launch.gateway`) leaves it and its engine serving when it
  fails and when it finishes; with `launch.stop_joined=true` even a failing one shuts them down.
- A launcher SIGKILLed mid-run takes its gateway and engine (and their children) along.
- A checkpoint that lacks a tensor, and a data file that does not exist, fail before any
  process starts (no log of a child in the run folder).

`run_job` runs in the test process with the training part replaced by a stub that fails or
returns (the training itself is covered by test_main_job.py).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from safetensors.numpy import load_file, save_file

from gateway.client import GatewayClient
from tests.integration.smoke_job import child_env, smoke_command
from trainer.launch.job import run_job
from trainer.launch.job_config import load_job_config
from trainer.launch.stack import wait_for_engines
from trainer.user_error import UserError

_spec = importlib.util.spec_from_file_location("waits", Path(__file__).with_name("waits.py"))
waits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(waits)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch):
    """run_job sets the trainer's JAX variables in os.environ: restore them afterwards."""
    for key in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(key, os.environ.get(key, ""))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS")


def _job(tmp_path: Path, model: Path, *overrides: str):
    return load_job_config(
        REPO / "configs/smoke.yaml",
        [f"run_dir={tmp_path / 'run'}", f"model.path={model}", "launch.progress=false",
         "launch.stop_timeout_s=60", "data.size=8", *overrides],
    )  # fmt: skip


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (an IPv4-mapped IPv6
    address, as gRPC binds, read as the IPv4 one)."""
    conns = psutil.Process(pid).net_connections("tcp")
    return sorted(
        (c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)
        for c in conns
        if c.status == psutil.CONN_LISTEN
    )


def _failing(seen: dict):
    def train_and_evaluate(job, client, procs, *args, **kwargs):
        if not job.launch.gateway:  # wait until the engine started here registered
            seen["engines"] = wait_for_engines(client, 1, waits.CEILING_S, procs)
            seen["children"] = list(procs.children)
            seen["listening"] = {c.name: _listening(c.proc.pid) for c in procs.children}
        raise RuntimeError("injected trainer failure")

    return train_and_evaluate


@pytest.mark.slow
def test_failed_trainer_stops_the_gateway_and_engines_it_started(
    tmp_path, tiny_checkpoint, monkeypatch, clean_env
):
    seen: dict = {}
    monkeypatch.setattr("trainer.launch.training.train_and_evaluate", _failing(seen))
    with pytest.raises(RuntimeError, match="injected trainer failure"):
        run_job(_job(tmp_path, tiny_checkpoint("llama")))
    children = seen["children"]
    assert [c.name for c in children] == ["gateway", "engine0"]
    assert len(seen["engines"]) == 1
    # launch.host=127.0.0.1: the gateway listens on its one port there, the engine on nothing
    (gateway_port,) = [p for _, p in seen["listening"]["gateway"]]
    assert seen["listening"] == {"gateway": [("127.0.0.1", gateway_port)], "engine0": []}
    # each stopped by SIGTERM and exited by itself (a SIGKILL would read -9)
    assert {c.name: c.proc.returncode for c in children} == {"gateway": 0, "engine0": 0}
    for c in children:  # nothing of their process groups is left
        with pytest.raises(ProcessLookupError):
            os.killpg(c.proc.pid, 0)


def _serving_side(tmp_path: Path, model: Path) -> tuple[list[subprocess.Popen], str, Path]:
    tokens, port_file = tmp_path / "tokens.txt", tmp_path / "gateway.port"
    subprocess.run([sys.executable, "-m", "gateway", "make-tokens", str(tokens)], check=True)
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--token-file", str(tokens),
         "--port-file", str(port_file), "--family", "llama", "--dtype", "float32",
         "--transport", "gloo", "--backends", "jax", "--log-level", "WARNING"],
        start_new_session=True,
    )  # fmt: skip
    waits.wait_for(
        lambda: port_file.exists() and port_file.read_text().strip(), [gateway], "the port file"
    )
    address = f"127.0.0.1:{port_file.read_text().strip()}"
    env = child_env()
    engine = subprocess.Popen(
        [sys.executable, "-m", "rollout_engine", "--backend", "jax", "--gateway", address,
         "--token-file", str(tokens), "--model", str(model), "--dtype", "float32",
         "--transports", "gloo", "--log-level", "WARNING", "--jax-num-slots", "8",
         "--jax-max-model-len", "64"],
        env=env, start_new_session=True,
    )  # fmt: skip
    return [gateway, engine], address, tokens


@pytest.mark.slow
def test_joined_gateway_and_engine_keep_running_unless_asked(
    tmp_path, tiny_checkpoint, monkeypatch, clean_env
):
    model = tiny_checkpoint("llama")
    procs, address, tokens = _serving_side(tmp_path, model)
    client = GatewayClient.from_token_file(address, tokens, "trainer", margin_s=5.0)
    try:
        waits.wait_for(lambda: client.status().engines, procs, "the engine's registration")
        (engine_id,) = [e.engine_id for e in client.status().engines]
        joined = (f"launch.gateway={address}", f"launch.token_file={tokens}")

        monkeypatch.setattr("trainer.launch.training.train_and_evaluate", _failing({}))
        with pytest.raises(RuntimeError, match="injected trainer failure"):
            run_job(_job(tmp_path, model, *joined))
        assert [p.poll() for p in procs] == [None, None]
        assert [e.engine_id for e in client.status().engines] == [engine_id]

        monkeypatch.setattr("trainer.launch.training.train_and_evaluate", lambda *a, **k: {})
        run_job(_job(tmp_path, model, *joined))
        assert [p.poll() for p in procs] == [None, None]
        assert [e.engine_id for e in client.status().engines] == [engine_id]
        assert not client.status().shutting_down

        monkeypatch.setattr("trainer.launch.training.train_and_evaluate", _failing({}))
        with pytest.raises(RuntimeError, match="injected trainer failure"):
            run_job(_job(tmp_path, model, *joined, "launch.stop_joined=true"))
        assert [waits.exit_status(p, "a joined process's exit") for p in procs] == [0, 0]
    finally:
        client.close()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_missing_tensor_and_missing_data_fail_before_any_process_starts(
    tmp_path, tiny_checkpoint, clean_env
):
    model = tiny_checkpoint("llama")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(f))
    dropped = "model.layers.0.mlp.up_proj.weight"
    del tensors[dropped]
    save_file(tensors, broken / "model.safetensors")

    logs = tmp_path / "run" / "logs"
    with pytest.raises(UserError, match=f"nothing was started:\n  missing: {dropped}"):
        run_job(_job(tmp_path, broken))
    # the trainer's own logs only: no child ever started
    assert sorted(p.name for p in logs.iterdir()) == ["trainer.log", "trainer_error.log"]

    with pytest.raises(UserError, match="GSM8K file not found"):
        run_job(_job(tmp_path, model, "data.source=gsm8k", f"data.path={tmp_path / 'no.jsonl'}"))
    assert sorted(p.name for p in logs.iterdir()) == ["trainer.log", "trainer_error.log"]


@pytest.mark.slow
def test_sigkill_of_the_launcher_ends_every_child(tmp_path):
    """Issue 25 item 1: the smoke job (JAX engine) SIGKILLed after its first step (no Python
    code runs in the launcher, no `stop_all`): its gateway and engine (each in its own session)
    and anything they started are gone within 60 s (PDEATHSIG and `gateway.lifeline`)."""
    run_dir = tmp_path / "run"
    job = subprocess.Popen(
        smoke_command(run_dir, "rollout.backend=jax", "trainer.steps=1000", "eval.size=0"),
        cwd=REPO, env=child_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        metrics = run_dir / "metrics.jsonl"
        waits.wait_for(lambda: metrics.exists() and metrics.read_text(), [job], "the 1st step")
        started = psutil.Process(job.pid).children(recursive=True)
        names = sorted(" ".join(p.cmdline()[1:4]) for p in started if p.ppid() == job.pid)
        assert names == ["-m gateway serve", "-m rollout_engine --backend"]
        job.send_signal(signal.SIGKILL)
        job.wait()
        deadline = time.monotonic() + 60  # a bound on the wait, not a measured figure
        while _live(started) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    left = _live(started)
    for p in left:
        p.kill()
    assert [p.pid for p in left] == []


def _live(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes of `procs` still running (zombies count as gone)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out
