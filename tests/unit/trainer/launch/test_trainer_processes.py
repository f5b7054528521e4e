"""The launcher's side of ``launch.trainer_processes``: config, command lines and
environments, the checkpoint progress's JSON form, and the wait that names a lost process
(real child processes, no JAX)."""

from __future__ import annotations

import signal
import sys
import time

import jax
import pytest

from trainer.checkpointing import Progress
from trainer.config import ConfigError
from trainer.launch.job_config import load_job_config
from trainer.launch.processes import ProcessSet
from trainer.launch.trainer_processes import (
    TrainerProcessLost,
    _wait,
    worker_argv,
    worker_env,
)


def test_trainer_processes_key():
    assert load_job_config(None, []).launch.trainer_processes == 1
    job = load_job_config(None, ["launch.trainer_processes=3"])
    assert job.launch.trainer_processes == 3
    with pytest.raises(ConfigError, match="launch.trainer_processes"):
        load_job_config(None, ["launch.trainer_processes=0"])
    with pytest.raises(ConfigError, match="W&B logs from a single trainer process only"):
        load_job_config(None, ["launch.trainer_processes=2", "logging.wandb.mode=offline"])
    with pytest.raises(ConfigError, match="adapter-only pushes go from one trainer process"):
        load_job_config(None, ["launch.trainer_processes=2", "lora.rank=4", "sync.lora_only=true"])


def test_worker_argv_and_env(tmp_path):
    job = load_job_config(
        None,
        [f"run_dir={tmp_path}", "launch.trainer_processes=2", "launch.trainer_devices=2",
         "launch.num_engines=2", "launch.devices_per_engine=3"],
    )  # fmt: skip
    argv = worker_argv(
        job, 1, "127.0.0.1:5000", "127.0.0.1:6000", tmp_path / "t", tmp_path / "m", tmp_path / "r"
    )
    assert argv[:3] == [sys.executable, "-m", "trainer.launch.trainer_worker"]
    assert argv[-1] == "launch.stop_joined=false"  # the launcher ends a joined gateway
    flags = dict(zip(argv[3:-1:2], argv[4:-1:2], strict=True))
    assert flags["--process-id"] == "1" and flags["--num-processes"] == "2"
    assert flags["--coordinator"] == "127.0.0.1:5000" and flags["--gateway"] == "127.0.0.1:6000"
    assert flags["--config"] == str(tmp_path / "config.yaml")
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PATH": "/bin"}
    cpu = worker_env(job, 1, base)
    assert cpu["JAX_PLATFORMS"] == "cpu" and "XLA_FLAGS" not in cpu and cpu["PATH"] == "/bin"
    gpu_job = job.model_copy(
        update={"launch": job.launch.model_copy(update={"accelerator": "gpu"})}
    )
    # engines hold CUDA 0..5 (2 x 3); trainer process 1 the 2 after process 0's 6, 7
    assert worker_env(gpu_job, 1, base)["CUDA_VISIBLE_DEVICES"] == "8,9"
    assert worker_env(gpu_job, 0, base)["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_progress_meta_round_trip():
    p = Progress(7, 12, 7, jax.random.key(3), consumed_beyond=(14, 19), attempt=2)
    q = Progress.from_meta(p.to_meta())
    assert (q.step, q.data_position, q.weight_version, q.consumed_beyond, q.attempt) == (
        7, 12, 7, (14, 19), 2,
    )  # fmt: skip
    assert jax.random.key_data(q.rng).tolist() == jax.random.key_data(p.rng).tolist()


def _sleeper() -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(120)"]


def test_wait_names_the_lost_process(tmp_path):
    """trainer1 SIGKILLed, trainer0 then aborted (as JAX ends a survivor): the error names
    process 1 and its signal, and the other's fate."""
    with ProcessSet(tmp_path / "logs", 5.0) as procs:
        names = ["trainer0", "trainer1"]
        for n in names:
            procs.start(n, _sleeper(), {})
        procs.child("trainer1").proc.send_signal(signal.SIGKILL)
        procs.child("trainer1").proc.wait(10)
        procs.child("trainer0").proc.send_signal(signal.SIGABRT)
        procs.child("trainer0").proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(TrainerProcessLost) as err:
            _wait(procs, names, None, 1)
        assert time.monotonic() - t0 < 10
    msg = str(err.value)
    pid = procs.child("trainer1").proc.pid
    assert f"trainer process 1 (pid {pid}) was lost: killed by SIGKILL" in msg
    assert "'trainer0': 'killed by SIGABRT'" in msg


def test_wait_returns_when_all_exit_zero(tmp_path):
    with ProcessSet(tmp_path / "logs", 5.0) as procs:
        names = ["trainer0", "trainer1"]
        for n in names:
            procs.start(n, [sys.executable, "-c", "pass"], {})
        _wait(procs, names, None, 1)
        assert [procs.child(n).proc.returncode for n in names] == [0, 0]
