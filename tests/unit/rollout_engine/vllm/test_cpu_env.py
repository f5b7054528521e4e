"""`cpu_env_defaults`: the vLLM CPU variables `VllmBackend.start` sets when they are missing."""

import pytest

from rollout_engine.vllm.backend import VllmBackendConfig, cpu_env_defaults


def cfg(tp: int = 1, kv: int = 1, block: int = 0) -> VllmBackendConfig:
    return VllmBackendConfig(model="m", tensor_parallel_size=tp, kv_cache_gib=kv, block_size=block)


def test_one_rank_takes_every_cpu_and_none_is_reserved():
    env = cpu_env_defaults(cfg(kv=2), [1, 0])
    assert env == {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    assert cpu_env_defaults(cfg(), [0])["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert cpu_env_defaults(cfg(), [0, 1, 2, 5, 7, 8])["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5,7-8"


def test_ranks_split_the_cpus_and_share_when_too_few():
    bind = "VLLM_CPU_OMP_THREADS_BIND"
    assert cpu_env_defaults(cfg(tp=2), [0, 1])[bind] == "0|1"
    assert cpu_env_defaults(cfg(tp=2), range(5))[bind] == "0-1|2-4"
    assert cpu_env_defaults(cfg(tp=3), [0, 1])[bind] == "0|1|0"
    with pytest.raises(ValueError, match="no CPU"):
        cpu_env_defaults(cfg(), [])


def test_a_block_size_the_cpu_kernels_cannot_take_is_refused_before_start():
    assert cpu_env_defaults(cfg(block=32), [0])["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert cpu_env_defaults(cfg(block=0), [0])  # vLLM's own
    for bad in (16, 48):
        with pytest.raises(ValueError, match=f"block_size {bad}: .* multiples of 32"):
            cpu_env_defaults(cfg(block=bad), [0, 1])
