"""Errors a user causes in `python -m trainer train` print one or two plain lines (the
traceback goes to RUN_DIR/logs/trainer_error.log), and a joined gateway left at an earlier
run's weight version is refused before anything runs.

Each test runs the real command line in this process against a real in-process gateway (no
engine: every refusal comes before the trainer waits for one)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gateway.auth import write_tokens
from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.server import GatewayServer
from trainer.__main__ import main
from trainer.launch.job_config import load_job_config
from trainer.launch.model_source import resolve_model

CONFIG = "configs/smoke.yaml"


@pytest.fixture(autouse=True)
def _keep_jax_devices(monkeypatch) -> None:
    """run_job sets the trainer's JAX device count in os.environ before JAX starts: keep this
    test process's (8 CPU devices, tests/conftest.py) for the tests after these."""
    monkeypatch.setattr("trainer.launch.job.trainer_env", lambda job, base: {})


@pytest.fixture(scope="module", autouse=True)
def _tiny_model() -> None:
    """The smoke config's tiny model, made before any test captures stderr (transformers draws
    a progress bar while it writes it)."""
    job = load_job_config(Path(CONFIG), [])
    resolve_model(job.run.model.path, job.run.trainer.seed)


def _run(capsys, run_dir: Path, *overrides: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["train", "--config", CONFIG, f"run_dir={run_dir}", *overrides])
    return code, capsys.readouterr().err.splitlines()


def _traceback_line(run_dir: Path) -> str:
    log = run_dir / "logs" / "trainer_error.log"
    assert log.read_text().startswith("Traceback (most recent call last):")
    return f"(traceback: {log})"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gateway(tmp_path):
    """A gateway on a free loopback port and its token file."""
    tokens = tmp_path / "tokens.txt"
    srv = GatewayServer(
        GatewayConfig(settings=RunSettings(model_family="llama")), write_tokens(tokens)
    ).start()
    yield srv, tokens
    srv.stop(0)


def test_missing_model_folder_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    code, err = _run(capsys, run, "model.path=/nonexistent")
    assert code == 2
    assert err == [
        "error: model.path '/nonexistent': no such folder; give an HF folder with config.json, "
        "'smollm2' or 'tiny:VARIANT'",
        _traceback_line(run),
    ]


def test_gateway_nobody_listens_on_is_one_line(tmp_path, capsys):
    run, port = tmp_path / "run", _free_port()
    tokens = tmp_path / "tokens.txt"
    write_tokens(tokens)
    code, err = _run(
        capsys, run, f"launch.gateway=127.0.0.1:{port}", f"launch.token_file={tokens}",
        "launch.gateway_wait_s=1",
    )  # fmt: skip
    assert code == 2
    assert err == [
        f"error: launch.gateway=127.0.0.1:{port}: no gateway answered within 1 s "
        "(launch.gateway_wait_s); start `python -m gateway serve` there or fix the address",
        _traceback_line(run),
    ]


def test_wrong_token_is_one_line(tmp_path, capsys, gateway):
    srv, _ = gateway
    run, other = tmp_path / "run", tmp_path / "other_tokens.txt"
    write_tokens(other)
    code, err = _run(capsys, run, f"launch.gateway={srv.address}", f"launch.token_file={other}")
    assert code == 2
    assert err == [
        f"error: the gateway at {srv.address} refused the trainer token of {other} "
        "(launch.token_file): expected a valid token, got one matching no role",
        _traceback_line(run),
    ]


def test_short_token_is_one_line(tmp_path, capsys, gateway):
    srv, _ = gateway
    run, short = tmp_path / "run", tmp_path / "short.txt"
    short.write_text("trainer=abc\nengine=engine-token-0123456789\n")
    code, err = _run(capsys, run, f"launch.gateway={srv.address}", f"launch.token_file={short}")
    assert code == 2
    assert err == [
        f"error: launch.token_file: {short}:1: expected a token of >= 16 characters, got 3",
        _traceback_line(run),
    ]


def test_joined_gateway_at_a_finished_runs_version_is_refused(tmp_path, capsys, gateway):
    srv, tokens = gateway
    with GatewayClient.from_token_file(srv.address, tokens, "trainer") as earlier_run:
        for version in range(1, 5):  # a finished run left the gateway at version 4
            earlier_run.publish_version(version)
        assert earlier_run.status().current_version == 4
    run = tmp_path / "new_run"
    code, err = _run(capsys, run, f"launch.gateway={srv.address}", f"launch.token_file={tokens}")
    assert code == 2
    assert err == [
        f"error: the gateway at {srv.address} is at weight version 4 (its engines serve the "
        "weights of an earlier run) but this run starts at version 0; nothing was started: "
        "restart the gateway and its engines, or resume that run's run_dir",
        _traceback_line(run),
    ]
    assert not (run / "metrics.jsonl").exists()
    assert not (run / "checkpoints").exists()
