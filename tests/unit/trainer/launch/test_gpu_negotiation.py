"""The launcher's real registration and negotiation for `launch.accelerator=gpu` (CPU code,
no GPU needed): the gateway runs with the config its launcher command line gives, the
trainer configures the settings the job configures (`run_settings`), and each engine
registers with the spec its launcher command line gives (`rollout_engine.cli.parse` then
`engine_spec`). vLLM engines on GPUs agree on NCCL, a run that mixes in a JAX engine on gloo;
an engine offering only a transport the run does not use is refused with the reason (the
job once configured gloo while GPU engines offered only nccl: every engine was refused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway import messages as m
from gateway.auth import load_tokens, write_tokens
from gateway.cli import serve_config
from gateway.client import GatewayClient, RegistrationRefused
from gateway.server import GatewayServer
from rollout_engine.cli import engine_spec, parse
from trainer.launch.commands import engine_argv, gateway_argv, resolve_data_plane, run_settings
from trainer.launch.job_config import load_job_config

REPO = Path(__file__).resolve().parents[4]


def _job(*overrides):
    return load_job_config(REPO / "configs" / "smoke.yaml", list(overrides))


def _stack(job, run_dir: Path):
    """The gateway of `gateway_argv` on a free loopback port, and trainer/engine clients."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    write_tokens(run_dir / "tokens.txt")
    argv = gateway_argv(job, run_dir, "llama")
    assert argv[1:4] == ["-m", "gateway", "serve"]
    config = serve_config(argv[3:])
    tokens = load_tokens(run_dir / "tokens.txt")
    server = GatewayServer(config, tokens, host="127.0.0.1", port=0).start()
    trainer = GatewayClient(server.address, tokens["trainer"], margin_s=5.0)
    engine = GatewayClient(server.address, tokens["engine"], margin_s=5.0)
    return server, trainer, engine


@pytest.mark.parametrize(
    ("backends", "transport"),
    [(["vllm"], "nccl"), (["vllm", "vllm"], "nccl"), (["vllm", "jax"], "gloo")],
)
def test_gpu_engines_register_on_the_transport_the_launcher_resolved(
    tmp_path, tiny_checkpoint, backends, transport
):
    model = tiny_checkpoint("llama", seed=0)
    job = _job("launch.accelerator=gpu", f"launch.num_engines={len(backends)}",
               f"launch.engine_backends=[{', '.join(backends)}]")  # fmt: skip
    assert resolve_data_plane(job) == transport
    server, trainer, engine = _stack(job, tmp_path)
    try:
        agreed = trainer.configure(run_settings(job, "llama"))
        assert agreed.transport == transport
        ids = []
        for i, backend in enumerate(backends):
            argv = engine_argv(job, i, server.address, tmp_path / "tokens.txt", model, 96)
            assert argv[1:3] == ["-m", "rollout_engine"]
            spec = engine_spec(parse(argv[3:]))
            assert (spec.backend, spec.transports) == (backend, (transport,))
            reg = engine.register_engine(spec)
            assert reg.settings.transport == transport
            ids.append(reg.engine_id)
        assert sorted(e.engine_id for e in trainer.status().engines) == sorted(ids)
    finally:
        trainer.close()
        engine.close()
        server.stop(0)


def test_an_engine_without_the_runs_transport_is_refused_with_the_reason(tmp_path):
    job = _job("launch.accelerator=gpu", "rollout.backend=vllm")
    server, trainer, engine = _stack(job, tmp_path)
    try:
        trainer.configure(run_settings(job, "llama"))
        spec = m.EngineSpec(backend="vllm", model_family="llama", dtype=job.engine_dtype,
                            transports=("gloo",))  # fmt: skip
        with pytest.raises(RegistrationRefused) as e:
            engine.register_engine(spec)
        assert str(e.value.reason) == (
            "transport unsupported: the run moves weights over 'nccl', the engine supports ['gloo']"
        )
        assert len(trainer.status().engines) == 0
    finally:
        trainer.close()
        engine.close()
        server.stop(0)
