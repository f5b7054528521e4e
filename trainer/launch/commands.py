"""Command lines and environments of the gateway and engine processes (pure functions).

Devices: on GPUs the engines take CUDA devices ``[i*k, (i+1)*k)`` (k = launch.devices_per_engine)
and the trainer the `trainer_devices` after them, each through ``CUDA_VISIBLE_DEVICES``. On CPU
each process gets its own XLA host-device count (``--xla_force_host_platform_device_count``); a
vLLM engine on CPU gets the variables vLLM's CPU backend needs: ``VLLM_CPU_KVCACHE_SPACE``
(GiB), ``VLLM_CPU_OMP_THREADS_BIND`` (its share of the cores) and
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path

from gateway import messages as m
from trainer.launch.job_config import JobConfig
from transport.adapter_spec import adapter_key
from transport.config import (
    DeltaStreamTransportConfig,
    FileTransportConfig,
    GlooTransportConfig,
    JaxTransferTransportConfig,
    NcclTransportConfig,
    ShmTransportConfig,
)


def resolve_accelerator(job: JobConfig) -> str:
    """The accelerator, "cpu" or "gpu" (launch.accelerator; auto: gpu if nvidia-smi is on PATH)."""
    acc = job.launch.accelerator
    if acc == "auto":
        return "gpu" if shutil.which("nvidia-smi") else "cpu"
    return acc


def resolve_data_plane(job: JobConfig) -> str:
    """The weight transport, "gloo", "nccl", "file", "shm", "jax_transfer" or "delta_stream"
    (launch.data_plane;
    auto: nccl
    when every engine is vLLM on GPUs, gloo otherwise: the JAX engine and every CPU run use
    gloo). The one
    answer for every side of the run: the gateway's `--transport`, the settings the trainer
    configures (`run_settings`), each engine's `--transports` and the trainer's sender.

    Raises:
        ValueError: nccl asked for without every engine being vLLM on GPUs, jax_transfer
            without every engine being a JAX engine, or auto where it would pick nccl beside
            far engines (launch.far_engines).
    """
    dp = job.launch.data_plane
    gpu_vllm = resolve_accelerator(job) == "gpu" and set(job.backends) == {"vllm"}
    if dp == "auto" and job.launch.far_engines and gpu_vllm:
        raise ValueError(
            "launch.far_engines on GPUs with vLLM engines: launch.data_plane=auto would pick "
            "nccl, which cannot sit beside far engines; set launch.data_plane=gloo (or shm)"
        )
    if dp == "auto":
        return "nccl" if gpu_vllm else "gloo"
    if dp == "nccl" and not gpu_vllm:
        raise ValueError(
            "launch.data_plane=nccl needs every engine to be vLLM on GPUs; got accelerator "
            f"{resolve_accelerator(job)} and engine backends {list(job.backends)}"
        )
    if dp == "jax_transfer" and set(job.backends) != {"jax"}:
        raise ValueError(
            "launch.data_plane=jax_transfer needs every engine to be a JAX engine; got engine "
            f"backends {list(job.backends)}"
        )
    return dp


def run_settings(job: JobConfig, family: str) -> m.RunSettings:
    """The run settings the trainer configures at the gateway: the model's mapping family,
    the engines' dtype, the data plane (`resolve_data_plane`) and the backends allowed.

    Raises:
        ValueError: as `resolve_data_plane`.
    """
    lora = job.run.lora
    return m.RunSettings(
        model_family=family, dtype=job.engine_dtype, transport=resolve_data_plane(job),
        backends=job.backends,
        adapter=adapter_key(lora.rank, lora.targets) if job.run.sync.lora_only else "",
    )  # fmt: skip


def data_plane_config(
    job: JobConfig,
) -> (
    GlooTransportConfig
    | NcclTransportConfig
    | FileTransportConfig
    | ShmTransportConfig
    | JaxTransferTransportConfig
    | DeltaStreamTransportConfig
):
    """The trainer's data-plane settings: launch.data_plane_host, _port, _port_count,
    _timeout_s and tp_shards; NCCL (its buffers on the trainer's first GPU) when
    `resolve_data_plane` says so, else gloo; with launch.data_plane=file the folder
    (launch.data_plane_root, default RUN_DIR/weights), the receivers' wait (_timeout_s) and
    launch.file_delta / file_full_every; with launch.data_plane=shm the segments' folder
    (launch.data_plane_root, default a new /dev/shm/jaxrl-PID-HEX: a name no other run
    holds) and the receivers' wait; with launch.data_plane=jax_transfer the transfer
    servers' host (data_plane_host) and the receivers' wait (each trainer process's server
    address is filled in at the start, `trainer.leader.with_transfer_servers`); with
    launch.data_plane=delta_stream the sender's address (data_plane_host, data_plane_port),
    each version's wait (_timeout_s), launch.delta_keep and delta_full_every.

    Raises:
        ValueError: as `resolve_data_plane`.
    """
    launch = job.launch
    if resolve_data_plane(job) == "jax_transfer":
        return JaxTransferTransportConfig(
            host=launch.data_plane_host, timeout_s=launch.data_plane_timeout_s
        )
    if resolve_data_plane(job) == "delta_stream":
        return _delta_stream(job, launch.data_plane_port)
    if resolve_data_plane(job) == "shm":
        root = launch.data_plane_root or f"/dev/shm/jaxrl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        return ShmTransportConfig(root=root, timeout_s=launch.data_plane_timeout_s)
    if resolve_data_plane(job) == "file":
        root = launch.data_plane_root or str(job.run_dir.absolute() / "weights")
        return FileTransportConfig(
            root=root, timeout_s=launch.data_plane_timeout_s, delta=launch.file_delta,
            full_every=launch.file_full_every,
        )  # fmt: skip
    where = {
        "host": launch.data_plane_host,
        "port": launch.data_plane_port,
        "port_count": launch.data_plane_port_count,
        "timeout_s": launch.data_plane_timeout_s,
        "tp_shards": launch.tp_shards,
    }
    if resolve_data_plane(job) == "nccl":
        return NcclTransportConfig.model_validate({**where, "device": "cuda:0"})
    return GlooTransportConfig.model_validate(where)


def far_engine_names(job: JobConfig) -> tuple[str, ...]:
    """The registered names of the far engines (launch.far_engines: ``engine{i}``, as
    `engine_argv` names engine i; `transport.sync_plan.is_far_name` also takes
    ``engine{i}-HOST``)."""
    return tuple(f"engine{i}" for i in job.launch.far_engines)


def far_data_plane_config(job: JobConfig) -> DeltaStreamTransportConfig | None:
    """The far engines' delta stream (launch.far_engines): the sender on
    launch.data_plane_host:far_port, each version's wait (data_plane_timeout_s),
    launch.delta_keep and delta_full_every; None without far engines."""
    return _delta_stream(job, job.launch.far_port) if job.launch.far_engines else None


def _delta_stream(job: JobConfig, port: int) -> DeltaStreamTransportConfig:
    launch = job.launch
    return DeltaStreamTransportConfig(
        host=launch.data_plane_host, port=port, timeout_s=launch.data_plane_timeout_s,
        keep=launch.delta_keep, full_every=launch.delta_full_every,
    )  # fmt: skip


def tp_bind(cores: str, tp_size: int) -> str:
    """An engine's cores ("first-last") split among its `tp_size` vLLM TP ranks, as
    `VLLM_CPU_OMP_THREADS_BIND` takes it: "0-1|2-3" (ranks share a core when there are fewer
    cores than ranks)."""
    first, last = (int(x) for x in cores.split("-"))
    return "|".join(cpu_bind(r, tp_size, last - first + 1, first) for r in range(tp_size))


def _xla_flags(base: str | None, devices: int) -> str:
    kept = [f for f in (base or "").split() if "xla_force_host_platform_device_count" not in f]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def cpu_bind(index: int, count: int, cores: int, offset: int = 0) -> str:
    """Engine `index`'s share of `cores` CPU cores (numbered from `offset`) as "first-last"
    (every engine at least one).

    Raises:
      ValueError: index outside [0, count) or count/cores < 1.
    """
    if count < 1 or cores < 1 or not 0 <= index < count:
        raise ValueError(f"need 0 <= index < count and cores >= 1; got {index}, {count}, {cores}")
    if count >= cores:
        core = offset + index % cores
        return f"{core}-{core}"
    per = cores // count
    first = index * per
    last = cores - 1 if index == count - 1 else first + per - 1
    return f"{offset + first}-{offset + last}"


def xla_cache_env(job: JobConfig, base: Mapping[str, str]) -> dict[str, str]:
    """JAX's persistent compilation cache for a process of the run:
    ``JAX_COMPILATION_CACHE_DIR`` = launch.xla_cache_dir (empty: ``$JAXRL_CACHE_DIR/xla``),
    unless `base` names one already or launch.xla_cache is false (then nothing). JAX keeps
    there every program that took at least 1 s to compile (its default threshold), keyed by
    the program, JAX version, flags and devices, so a restarted JAX engine (issue "Runs that
    survive") and a rerun load their prefill, decode and train programs instead of compiling
    them again."""
    launch = job.launch
    if not launch.xla_cache or base.get("JAX_COMPILATION_CACHE_DIR"):
        return {}
    from models.checkpoints.smollm2 import cache_dir

    return {"JAX_COMPILATION_CACHE_DIR": launch.xla_cache_dir or str(cache_dir() / "xla")}


def trainer_env(job: JobConfig, base: Mapping[str, str]) -> dict[str, str]:
    """Variables the trainer process must set before importing JAX: its own devices, and
    the compilation cache (`xla_cache_env`)."""
    cache = xla_cache_env(job, base)
    if resolve_accelerator(job) == "gpu":
        first = job.launch.num_engines * job.launch.devices_per_engine
        ids = range(first, first + job.launch.trainer_devices)
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))} | cache
    return {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": _xla_flags(base.get("XLA_FLAGS"), job.launch.trainer_devices),
    } | cache


def engine_env(job: JobConfig, index: int, base: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of engine `index`: `base` plus its devices, backend variables and
    the compilation cache (`xla_cache_env`), then launch.engine_env."""
    launch = job.launch
    env = dict(base) | xla_cache_env(job, base)
    k = launch.devices_per_engine
    if resolve_accelerator(job) == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(index * k, (index + 1) * k))
        env.pop("JAX_PLATFORMS", None)
    else:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = _xla_flags(base.get("XLA_FLAGS"), k)
        if job.backend_of(index) == "vllm":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(launch.vllm_kv_cache_gib)
            env["VLLM_CPU_OMP_THREADS_BIND"] = tp_bind(
                cpu_bind(index, launch.num_engines, os.cpu_count() or 1), k
            )
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env.update(launch.engine_env)
    return env


def gateway_argv(job: JobConfig, run_dir: Path, family: str) -> list[str]:
    """``python -m gateway serve ...`` for this run (tokens and port file in `run_dir`)."""
    launch = job.launch
    return [
        sys.executable, "-m", "gateway", "serve",
        "--host", launch.host, "--port", str(launch.port),
        "--token-file", str(run_dir / "tokens.txt"),
        "--port-file", str(run_dir / "gateway.port"),
        "--family", family, "--dtype", job.engine_dtype,
        "--transport", resolve_data_plane(job),
        "--backends", ",".join(job.backends),
        "--adapter", run_settings(job, family).adapter,
        "--events-file", str(run_dir / "logs" / "gateway_events.jsonl"),
        "--heartbeat-timeout", str(float(launch.engine_heartbeat_timeout_s)),
        "--max-workers", str(max(64, 8 * launch.num_engines + 16)),
        "--log-level", "WARNING",
    ]  # fmt: skip


def engine_argv(
    job: JobConfig, index: int, address: str, token_file: Path, model: Path, max_model_len: int
) -> list[str]:
    """``python -m rollout_engine ...`` of engine `index` (`max_model_len`: prompt + new tokens
    positions the engine must hold), under ``taskset -c CPUS`` when launch.engine_cpus is set.

    Raises:
        ValueError: launch.engine_cpus is set and no ``taskset`` is on PATH.
    """
    launch, rollout = job.launch, job.run.rollout
    backend = job.backend_of(index)
    transports = resolve_data_plane(job)  # the gateway's; a far engine also takes deltas
    if index in launch.far_engines:
        transports += ",delta_stream"
    pin: list[str] = []
    if launch.engine_cpus:
        taskset = shutil.which("taskset")
        if taskset is None:
            raise ValueError("launch.engine_cpus needs taskset (util-linux) on PATH; found none")
        pin = [taskset, "-c", launch.engine_cpus]
    argv = [
        *pin, sys.executable, "-m", "rollout_engine", "--backend", backend,
        "--gateway", address, "--token-file", str(token_file), "--model", str(model),
        "--dtype", job.engine_dtype, "--transports", transports,
        "--name", f"engine{index}",
        "--log-level", "WARNING",
        "--max-concurrent-prompts", str(launch.max_concurrent_prompts),
        "--rejoin-s", str(float(launch.engine_rejoin_s)),
    ]  # fmt: skip
    if job.run.sync.lora_only:  # the engine serves adapters of exactly this rank and targets
        lora = job.run.lora
        argv += ["--lora-rank", str(lora.rank), "--lora-targets", ",".join(lora.targets)]
    if backend == "vllm":
        argv += [
            "--vllm-tensor-parallel-size", str(launch.devices_per_engine),
            "--vllm-max-model-len", str(max_model_len),
            "--vllm-kv-cache-gib", str(launch.vllm_kv_cache_gib),
            "--vllm-block-size", str(launch.vllm_block_size),
            "--vllm-seed", str(job.run.trainer.seed + index),
            "--vllm-return-routes", str(job.run.wants_routes).lower(),
        ]  # fmt: skip
    else:
        argv += [
            "--jax-num-slots", str(launch.jax_num_slots),
            "--jax-max-model-len", str(max_model_len),
            "--jax-prefill-batch", str(launch.jax_prefill_batch),
            "--jax-steps-per-call", str(launch.jax_steps_per_call),
            "--jax-devices-per-replica", str(launch.devices_per_engine),
            "--jax-tp", str(launch.jax_tp),
            "--jax-kv-cache-dtype", launch.jax_kv_cache_dtype,
            "--jax-temperature", str(rollout.temperature),
            "--jax-top-k", str(rollout.top_k),
            "--jax-top-p", str(rollout.top_p),
            "--jax-seed", str(job.run.trainer.seed + index),
        ]  # fmt: skip
    return argv
