"""The job config's elastic-engine fields: defaults, per-engine backends into the engine and
gateway command lines, and the checks that name the bad key."""

from pathlib import Path

import pytest

from trainer.config import ConfigError
from trainer.launch.commands import engine_argv, engine_env, gateway_argv
from trainer.launch.job_config import load_job_config


def test_defaults_restart_engines_with_backoff():
    launch = load_job_config("configs/smoke.yaml").launch
    assert (launch.min_engines, launch.restart_engines, launch.max_restarts) == (1, True, 5)
    assert (launch.restart_backoff_s, launch.restart_backoff_max_s) == (1.0, 60.0)
    assert launch.engine_backends == ()


def test_mixed_backends_reach_each_engine_and_the_gateway():
    job = load_job_config(
        "configs/smoke.yaml",
        ["launch.num_engines=3", "launch.engine_backends=[jax, jax, vllm]"],
    )
    assert job.backends == ("jax", "vllm")
    argvs = [engine_argv(job, i, "h:1", Path("t"), Path("m"), 64) for i in range(3)]
    assert [a[a.index("--backend") + 1] for a in argvs] == ["jax", "jax", "vllm"]
    assert "--vllm-max-model-len" in argvs[2] and "--jax-num-slots" in argvs[0]
    assert [("VLLM_CPU_KVCACHE_SPACE" in engine_env(job, i, {})) for i in range(3)] == [
        False, False, True,
    ]  # fmt: skip
    gw = gateway_argv(job, Path("/run"), "llama")
    assert gw[gw.index("--backends") + 1] == "jax,vllm"
    assert gw[gw.index("--events-file") + 1] == "/run/logs/gateway_events.jsonl"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["launch.engine_backends=[jax]", "launch.num_engines=2"], "expected 2 entries"),
        (["launch.min_engines=2"], "launch.min_engines: expected <= num_engines=1, got 2"),
        (["launch.max_restarts=-1"], "launch.max_restarts"),
        (["launch.engine_backends=[sglang]"], "launch.engine_backends"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config("configs/smoke.yaml", overrides)
