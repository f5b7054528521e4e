"""Engine and gateway command lines and environments (devices, vLLM's CPU variables)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from models.checkpoints.smollm2 import cache_dir
from trainer.config import ConfigError
from trainer.launch.commands import (
    cpu_bind,
    engine_argv,
    engine_env,
    gateway_argv,
    resolve_data_plane,
    tp_bind,
    trainer_env,
    xla_cache_env,
)
from trainer.launch.job_config import load_job_config

REPO = Path(__file__).resolve().parents[4]


def _job(*overrides):
    return load_job_config(REPO / "configs" / "smoke.yaml", list(overrides))


def test_cpu_bind_splits_the_cores():
    assert [cpu_bind(i, 1, 2) for i in range(1)] == ["0-1"]
    assert [cpu_bind(i, 2, 8) for i in range(2)] == ["0-3", "4-7"]
    assert [cpu_bind(i, 3, 8) for i in range(3)] == ["0-1", "2-3", "4-7"]
    assert [cpu_bind(i, 3, 2) for i in range(3)] == ["0-0", "1-1", "0-0"]
    with pytest.raises(ValueError, match="index < count"):
        cpu_bind(2, 2, 4)


def test_cpu_engines_get_their_own_host_devices():
    job = _job("launch.accelerator=cpu", "launch.devices_per_engine=2", "launch.trainer_devices=3")
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1", "PATH": "/bin"}
    env = engine_env(job, 0, base)
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=2"
    assert env["JAX_PLATFORMS"] == "cpu" and env["PATH"] == "/bin"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # jax backend
    assert trainer_env(job, base)["XLA_FLAGS"].endswith("device_count=3")


def test_vllm_cpu_engine_env():
    job = _job("launch.accelerator=cpu", "rollout.backend=vllm", "launch.vllm_kv_cache_gib=2")
    env = engine_env(job, 0, {})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")


def test_gpu_devices_are_disjoint():
    job = _job("launch.accelerator=gpu", "launch.num_engines=2", "launch.devices_per_engine=2",
               "launch.trainer_devices=4", "launch.engine_env={FOO: bar}")  # fmt: skip
    envs = [engine_env(job, i, {"JAX_PLATFORMS": "cpu"}) for i in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"]
    assert all("JAX_PLATFORMS" not in e and e["FOO"] == "bar" for e in envs)
    assert trainer_env(job, {}) == {
        "CUDA_VISIBLE_DEVICES": "4,5,6,7", "JAX_COMPILATION_CACHE_DIR": str(cache_dir() / "xla"),
    }  # fmt: skip


def test_every_process_of_the_run_shares_one_compilation_cache(tmp_path):
    key = "JAX_COMPILATION_CACHE_DIR"
    default = _job("launch.accelerator=cpu")
    assert xla_cache_env(default, {}) == {key: str(cache_dir() / "xla")}
    assert trainer_env(default, {})[key] == engine_env(default, 0, {})[key]
    mine = _job("launch.accelerator=cpu", f"launch.xla_cache_dir={tmp_path}")
    assert engine_env(mine, 0, {})[key] == trainer_env(mine, {})[key] == str(tmp_path)
    # the user's own variable wins; launch.xla_cache=false sets none
    assert engine_env(mine, 0, {key: "/theirs"})[key] == "/theirs"
    assert key not in trainer_env(mine, {key: "/theirs"})
    off = _job("launch.accelerator=cpu", "launch.xla_cache=false")
    assert key not in engine_env(off, 0, {}) and key not in trainer_env(off, {})


def test_engine_argv_switches_backend_only(tmp_path):
    jax_argv = engine_argv(_job(), 0, "h:1", tmp_path / "t", tmp_path, 96)
    vllm_job = _job("rollout.backend=vllm", "launch.vllm_block_size=32")
    vllm_argv = engine_argv(vllm_job, 0, "h:1", tmp_path / "t", tmp_path, 96)
    assert jax_argv[jax_argv.index("--backend") + 1] == "jax"
    assert vllm_argv[vllm_argv.index("--backend") + 1] == "vllm"
    assert jax_argv[jax_argv.index("--jax-max-model-len") + 1] == "96"
    assert vllm_argv[vllm_argv.index("--vllm-max-model-len") + 1] == "96"
    assert vllm_argv[vllm_argv.index("--vllm-block-size") + 1] == "32"
    assert jax_argv[jax_argv.index("--jax-temperature") + 1] == "1.0"
    common = ["--gateway", "h:1", "--token-file", str(tmp_path / "t"), "--model", str(tmp_path)]
    assert all(" ".join(common) in " ".join(a) for a in (jax_argv, vllm_argv))
    assert "--lora-rank" not in jax_argv  # full-weight pushes: any engine serves them
    assert jax_argv[jax_argv.index("--jax-kv-cache-dtype") + 1] == "auto"
    tp_job = _job("launch.devices_per_engine=4", "launch.jax_tp=2",
                  "launch.jax_kv_cache_dtype=bfloat16")  # fmt: skip
    tp_argv = engine_argv(tp_job, 0, "h:1", tmp_path / "t", tmp_path, 96)
    assert tp_argv[tp_argv.index("--jax-tp") + 1] == "2"
    assert tp_argv[tp_argv.index("--jax-kv-cache-dtype") + 1] == "bfloat16"
    assert tp_argv[tp_argv.index("--jax-devices-per-replica") + 1] == "4"


def test_an_adapter_only_run_starts_engines_for_its_adapter(tmp_path):
    job = _job("lora.rank=4", "lora.targets=[q_proj,v_proj]", "sync.lora_only=true")
    argv = engine_argv(job, 0, "h:1", tmp_path / "t", tmp_path, 96)
    assert argv[argv.index("--lora-rank") + 1 :][:3] == ["4", "--lora-targets", "q_proj,v_proj"]


def test_gateway_argv(tmp_path):
    argv = gateway_argv(_job(), tmp_path, "llama")
    assert argv[argv.index("--token-file") + 1] == str(tmp_path / "tokens.txt")
    assert argv[argv.index("--family") + 1] == "llama"
    assert argv[argv.index("--backends") + 1] == "jax"


def test_engines_rejoin_and_the_gateway_drops_after_the_launch_settings(tmp_path):
    """launch.engine_rejoin_s reaches every engine (`--rejoin-s`, and parses back into its
    worker config), launch.engine_heartbeat_timeout_s the gateway (`--heartbeat-timeout`)."""
    from rollout_engine.cli import parse

    def value(argv, flag):
        return argv[argv.index(flag) + 1]

    job = _job("launch.engine_rejoin_s=45", "launch.engine_heartbeat_timeout_s=4")
    for backend in ("jax", "vllm"):
        argv = engine_argv(
            _job(f"rollout.backend={backend}"), 0, "h:1", tmp_path / "t", tmp_path, 96
        )
        assert value(argv, "--rejoin-s") == "300.0"
    argv = engine_argv(job, 0, "h:1", tmp_path / "t", tmp_path, 96)
    assert value(argv, "--rejoin-s") == "45.0"
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert parse(argv[argv.index("--backend") :]).worker.rejoin_s == 45.0
    assert value(gateway_argv(_job(), tmp_path, "llama"), "--heartbeat-timeout") == "30.0"
    assert value(gateway_argv(job, tmp_path, "llama"), "--heartbeat-timeout") == "4.0"


def test_cpu_vllm_tp_ranks_get_their_own_cores():
    assert tp_bind("0-3", 2) == "0-1|2-3"
    assert tp_bind("4-7", 4) == "4-4|5-5|6-6|7-7"
    assert tp_bind("0-0", 2) == "0-0|0-0"  # fewer cores than ranks: they share
    job = _job("launch.accelerator=cpu", "rollout.backend=vllm", "launch.devices_per_engine=2")
    bind = engine_env(job, 0, {})["VLLM_CPU_OMP_THREADS_BIND"]
    assert bind.count("|") == 1 and bind.startswith("0-")


def test_data_plane_is_nccl_for_vllm_on_gpus_only(tmp_path):
    cases = {
        ("gpu", "vllm", "auto"): "nccl",
        ("gpu", "jax", "auto"): "gloo",
        ("cpu", "vllm", "auto"): "gloo",
        ("gpu", "vllm", "gloo"): "gloo",
        ("gpu", "vllm", "nccl"): "nccl",
    }
    for (acc, backend, dp), want in cases.items():
        job = _job(f"launch.accelerator={acc}", f"rollout.backend={backend}",
                   f"launch.data_plane={dp}")  # fmt: skip
        assert resolve_data_plane(job) == want, (acc, backend, dp)
        gw = gateway_argv(job, tmp_path, "llama")
        eng = engine_argv(job, 0, "h:1", tmp_path / "t", tmp_path, 96)
        assert gw[gw.index("--transport") + 1] == want
        assert eng[eng.index("--transports") + 1] == want
    with pytest.raises(ValueError, match="every engine to be vLLM on GPUs; got accelerator cpu"):
        resolve_data_plane(_job("launch.accelerator=cpu", "launch.data_plane=nccl"))


def test_engine_cpus_pin_the_engine_command(tmp_path):
    plain = engine_argv(_job(), 0, "h:1", tmp_path / "t", tmp_path, 96)
    pinned = engine_argv(_job("launch.engine_cpus=0"), 0, "h:1", tmp_path / "t", tmp_path, 96)
    assert Path(pinned[0]).name == "taskset" and pinned[1:3] == ["-c", "0"]
    assert pinned[3:] == plain and plain[0] == sys.executable
    assert _job("launch.engine_cpus='0-3,6'").launch.engine_cpus == "0-3,6"
    with pytest.raises(ConfigError, match="engine_cpus"):
        _job("launch.engine_cpus=zero")
