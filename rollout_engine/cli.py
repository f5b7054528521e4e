"""`python -m rollout_engine --backend vllm|jax --gateway HOST:PORT --token-file F --model DIR`.

Parses and validates the config (`rollout_engine.config`, no ML import) before anything heavy,
so `--help` and a bad flag answer at once; then holds the model folder against its family's
mapping (`rollout_engine.model_check`: a folder missing a tensor is refused before the engine
contacts the gateway), checks the gateway, the token and the run's
settings (`rollout_engine.precheck`, seconds) before it starts the backend (minutes for vLLM),
runs the worker loop until the gateway shuts down, SIGTERM/SIGINT, or a gateway lost for
good, and shuts the backend down. An engine that loses the gateway (dropped, or unreachable)
registers again for up to `--rejoin-s` seconds (`rollout_engine.rejoin`). A SIGTERM ends the
process within `WorkerConfig.stop_s` plus the backend's shutdown, whatever the gateway's state.
Exit status (`exit_status`): 0 after a shutdown or a stop; 3 when no registration succeeded
within `--rejoin-s` after a loss; 1 after a refusal, an error, or a loss with `--rejoin-s 0`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING

from pydantic import ValidationError

from rollout_engine.config import EngineProcessConfig, JaxOptions, VllmOptions, WorkerConfig

if TYPE_CHECKING:
    from gateway.messages import EngineSpec

log = logging.getLogger("rollout_engine")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rollout_engine", description=__doc__)
    p.add_argument("--backend", required=True, choices=("vllm", "jax"))
    p.add_argument("--gateway", required=True, help="the gateway's HOST:PORT")
    p.add_argument("--token-file", required=True, help="token file with an engine= line")
    p.add_argument("--ca-file", help="PEM certificate to trust (TLS)")
    p.add_argument("--model", required=True, help="HF checkpoint folder to start from")
    p.add_argument("--family", default="", help="model family (default: from config.json)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--initial-version", type=int, default=0)
    p.add_argument("--lora-rank", type=int, default=0, help="> 0: serve adapter-only versions")
    p.add_argument("--lora-targets", default="", help="comma-separated PEFT target names")
    p.add_argument("--name", default="", help="engine name in the gateway status")
    p.add_argument(
        "--transports",
        default="gloo,file,shm,delta_stream",
        help="comma-separated, preferred first",
    )
    p.add_argument("--log-level", default="INFO")
    w = p.add_argument_group("worker loop")
    for name, field in WorkerConfig.model_fields.items():
        w.add_argument(
            f"--{name.replace('_', '-')}", type=_flag_type(field.default), help=field.description
        )
    v = p.add_argument_group("vllm backend")
    for name, field in VllmOptions.model_fields.items():
        v.add_argument(f"--vllm-{name.replace('_', '-')}", type=_flag_type(field.default))
    j = p.add_argument_group("jax backend")
    for name, field in JaxOptions.model_fields.items():
        j.add_argument(f"--jax-{name.replace('_', '-')}", type=_flag_type(field.default))
    return p


def _flag_type(default: object):
    """The argparse type of an option with this default; a bool reads true/false, 1/0, yes/no
    (argparse's `bool` would take any non-empty text, "false" too, as True)."""
    if isinstance(default, bool):

        def boolean(text: str) -> bool:
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError(f"expected true or false, got {text!r}")

        return boolean
    return type(default)


def parse(argv: list[str] | None = None) -> EngineProcessConfig:
    """The validated config of a command line.

    Raises:
        SystemExit: a bad flag or a config that does not validate (message on stderr).
    """
    parser = _parser()
    a = vars(parser.parse_args(argv))

    def group(cls, prefix: str) -> dict:
        out = {}
        for name in cls.model_fields:
            value = a.get(prefix + name)
            if value is not None:
                out[name] = value
        return out

    try:
        return EngineProcessConfig(
            backend=a["backend"],
            gateway=a["gateway"],
            token_file=a["token_file"],
            ca_file=a["ca_file"],
            model=a["model"],
            family=a["family"],
            dtype=a["dtype"],
            initial_version=a["initial_version"],
            lora_rank=a["lora_rank"],
            lora_targets=tuple(t for t in a["lora_targets"].split(",") if t),
            name=a["name"],
            transports=tuple(t for t in a["transports"].split(",") if t),
            log_level=a["log_level"],
            worker=WorkerConfig(**group(WorkerConfig, "")),
            vllm=VllmOptions(**group(VllmOptions, "vllm_")),
            jax=JaxOptions(**group(JaxOptions, "jax_")),
        )
    except ValidationError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def make_backend(cfg: EngineProcessConfig):
    """The backend `cfg.backend` names (imports vLLM or JAX here, not before)."""
    if cfg.backend == "vllm":
        from rollout_engine.vllm.backend import VllmBackend, VllmBackendConfig

        return VllmBackend(
            VllmBackendConfig(
                model=str(cfg.model),
                dtype=cfg.dtype,
                initial_version=cfg.initial_version,
                lora_rank=cfg.lora_rank,
                lora_targets=cfg.lora_targets,
                **cfg.vllm.model_dump(),
            )
        )
    from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig

    return JaxBackend(
        JaxBackendConfig(
            model=str(cfg.model),
            dtype=cfg.dtype,
            initial_version=cfg.initial_version,
            lora_rank=cfg.lora_rank,
            lora_targets=cfg.lora_targets,
            **cfg.jax.model_dump(),
        )
    )


def device_counts(cfg: EngineProcessConfig) -> tuple[int, int]:
    """(devices, TP size) the engine registers with."""
    if cfg.backend == "vllm":
        tp = cfg.vllm.tensor_parallel_size
        return tp, tp
    return cfg.jax.replicas * cfg.jax.devices_per_replica, 1


def engine_spec(cfg: EngineProcessConfig) -> EngineSpec:
    """What the engine process of `cfg` registers with: backend, family, dtype, transports
    (preferred first), its devices and TP size (`device_counts`), name and host."""
    from gateway import messages as m
    from transport.adapter_spec import adapter_key

    devices, tp = device_counts(cfg)
    return m.EngineSpec(
        backend=cfg.backend,
        model_family=cfg.family,
        dtype=cfg.dtype,
        transports=cfg.transports,
        device_count=devices,
        tp_size=tp,
        name=cfg.name,
        host=socket.gethostname(),
        adapter=adapter_key(cfg.lora_rank, cfg.lora_targets),
    )


async def serve(cfg: EngineProcessConfig) -> str:
    """Check the gateway (`precheck`), start the backend, run the worker until it stops, shut
    the backend down; returns the worker's stop reason. An engine that lost the gateway (it
    was dropped, or the gateway stayed unreachable) registers again with the version it
    holds, for up to `cfg.worker.rejoin_s` seconds, without restarting the backend (the
    gateway then hands it the current version before any lease): `rollout_engine.rejoin`.

    Raises:
        ModelRefused: the model folder does not match its family's mapping (before the
            gateway is contacted: `rollout_engine.model_check`).
        GatewayError: the precheck or the registration failed (a dead gateway, a refused
            token, a run this engine cannot serve); raised before the backend starts when the
            precheck finds it.
        ModelUnsupported: the backend cannot run the checkpoint (before it starts).
    """
    from gateway.client import GatewayClient
    from rollout_engine.model_check import check_model
    from rollout_engine.precheck import precheck
    from rollout_engine.rejoin import run_worker

    await asyncio.to_thread(check_model, cfg.model, cfg.family)
    spec = engine_spec(cfg)
    client = GatewayClient.from_token_file(cfg.gateway, cfg.token_file, "engine", cfg.ca_file)
    try:
        found = await asyncio.to_thread(
            precheck, client, spec, cfg.worker.gateway_retry_s, str(cfg.token_file)
        )
    except BaseException:
        client.close()
        raise
    if cfg.backend == "vllm":  # a model vLLM cannot run: refused before it starts
        from rollout_engine.vllm.limits import check_model as check_vllm_limits

        try:
            check_vllm_limits(cfg.model)
        except BaseException:
            client.close()
            raise
    log.info("gateway %s answered (run %s); starting the %s backend", cfg.gateway, found,
             cfg.backend)  # fmt: skip
    backend = make_backend(cfg)
    try:
        await backend.start()
        return await run_worker(client, backend, spec, cfg.worker)
    finally:
        await backend.shutdown()
        client.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    from gateway.lifeline import hold_to_launcher

    hold_to_launcher()  # a launcher that started this engine takes it along when it dies
    cfg = parse(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    from gateway.errors import GatewayError
    from rollout_engine.model_check import ModelRefused
    from rollout_engine.precheck import ModelUnsupported

    try:
        reason = asyncio.run(serve(cfg))
    except (GatewayError, ModelRefused, ModelUnsupported) as e:
        log.error("%s", e)
        return 1
    finally:
        settle_stop_signals()
    log.info("engine stopped: %s", reason)
    return exit_status(reason)


def settle_stop_signals() -> None:
    """Ignore SIGTERM and SIGINT from here to the process's exit.

    The worker's stop handlers live on the event loop (`rollout_engine.rejoin`), and closing
    the loop puts SIGTERM back to its default action. A launcher that stops the gateway and
    this engine together (`trainer.launch.processes.ProcessSet.stop_all`) can have the engine
    end its worker on the gateway's shutdown first; its own SIGTERM, landing while the process
    exits (the backend's teardown, the interpreter's), then killed it with -15 instead of its
    status 0 (seen in CI). Once the worker has stopped, a stop request asks for what is already
    under way; the launcher's SIGKILL after its timeout still bounds a hung exit.
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def exit_status(reason: str) -> int:
    """The process's exit status for a worker stop reason: 0 for "shutdown" and "stopped",
    3 for "rejoin_failed" (`rollout_engine.rejoin.REJOIN_FAILED`), 1 for any other."""
    if reason in ("shutdown", "stopped"):
        return 0
    return 3 if reason == "rejoin_failed" else 1


if __name__ == "__main__":
    sys.exit(main())
