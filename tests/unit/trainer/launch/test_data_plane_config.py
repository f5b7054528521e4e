"""The data plane's host, port (or port range) and timeout come from the job config: the
trainer's sender listens on exactly that host and port."""

from __future__ import annotations

import os
import socket

import psutil
import pytest
from pydantic import TypeAdapter

from trainer.config import ConfigError
from trainer.launch.commands import data_plane_config, run_settings
from trainer.launch.job_config import load_job_config
from transport.config import TransportConfig
from transport.factory import make_sender


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sender_listens_on_the_configured_host_and_port():
    port = _free_port()
    job = load_job_config(
        None,
        [f"launch.data_plane_port={port}", "launch.data_plane_port_count=4",
         "launch.data_plane_timeout_s=42", "launch.data_plane_host=127.0.0.1"],
    )  # fmt: skip
    cfg = data_plane_config(job)
    assert (cfg.kind, cfg.host, cfg.port, cfg.port_count, cfg.timeout_s) == (
        "gloo", "127.0.0.1", port, 4, 42.0,
    )  # fmt: skip
    sender = make_sender(cfg, num_receivers=1)
    try:
        assert sender.port == port
        conns = psutil.Process(os.getpid()).net_connections("tcp")
        on_port = [
            c.laddr for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
        assert [(a.ip, a.port) for a in on_port] == [("127.0.0.1", port)]
    finally:
        sender.close()


def test_a_port_range_past_65535_is_refused():
    with pytest.raises(ConfigError, match="runs past port 65535"):
        load_job_config(None, ["launch.data_plane_port=65535", "launch.data_plane_port_count=2"])


def test_the_file_data_plane_takes_its_folder_and_delta_settings(tmp_path):
    job = load_job_config(
        None,
        [f"run_dir={tmp_path / 'run'}", "launch.data_plane=file", "launch.file_delta=true",
         "launch.file_full_every=4", "launch.data_plane_timeout_s=30"],
    )  # fmt: skip
    cfg = data_plane_config(job)
    assert (cfg.kind, cfg.root, cfg.delta, cfg.full_every, cfg.timeout_s) == (
        "file", str((tmp_path / "run" / "weights").absolute()), True, 4, 30.0,
    )  # fmt: skip
    shared = load_job_config(None, ["launch.data_plane=file", "launch.data_plane_root=/mnt/w"])
    assert (data_plane_config(shared).root, data_plane_config(shared).delta) == ("/mnt/w", False)
    with pytest.raises(ConfigError, match="file_delta=true needs launch.data_plane=file"):
        load_job_config(None, ["launch.file_delta=true"])


def test_the_shm_data_plane_takes_a_fresh_tmpfs_folder_or_the_given_one():
    job = load_job_config(None, ["launch.data_plane=shm", "launch.data_plane_timeout_s=12"])
    a, b = data_plane_config(job), data_plane_config(job)
    assert (a.kind, a.timeout_s) == ("shm", 12.0)
    assert a.root.startswith(f"/dev/shm/jaxrl-{os.getpid()}-") and a.root != b.root  # no reuse
    given = load_job_config(None, ["launch.data_plane=shm", "launch.data_plane_root=/dev/shm/x"])
    assert data_plane_config(given).root == "/dev/shm/x"
    sender = make_sender(a)  # the sender makes the folder; closing it leaves nothing
    try:
        assert os.path.isdir(a.root)
    finally:
        sender.close()
    assert not os.path.exists(a.root)


def test_jax_transfer_takes_its_host_and_wait_and_serves_jax_engines_only():
    """launch.data_plane=jax_transfer: the transfer servers bind launch.data_plane_host, pulls
    wait launch.data_plane_timeout_s; the plan's addresses are filled in later (one process:
    its own server's); a run with a vLLM engine is refused naming the backends."""
    from trainer.leader import with_transfer_servers

    job = load_job_config(None, [
        "launch.data_plane=jax_transfer", "launch.data_plane_timeout_s=7", "rollout.backend=jax",
    ])  # fmt: skip
    cfg = data_plane_config(job)
    assert (cfg.kind, cfg.host, cfg.timeout_s, cfg.servers) == (
        "jax_transfer",
        "127.0.0.1",
        7.0,
        (),
    )
    filled = with_transfer_servers(cfg)
    (address,) = filled.servers
    assert address.startswith("127.0.0.1:") and int(address.rsplit(":", 1)[1]) > 0
    assert with_transfer_servers(cfg).servers == filled.servers  # one server per process
    vllm = load_job_config(None, ["launch.data_plane=jax_transfer", "rollout.backend=vllm"])
    with pytest.raises(ValueError, match=r"jax_transfer needs every engine to be a JAX engine; "
                                         r"got engine backends \['vllm'\]"):  # fmt: skip
        data_plane_config(vllm)


def test_the_delta_stream_data_plane_listens_where_engines_reach_the_trainer():
    job = load_job_config(
        None,
        ["launch.data_plane=delta_stream", "launch.data_plane_host=10.0.0.1",
         "launch.data_plane_port=29777", "launch.data_plane_timeout_s=40",
         "launch.delta_keep=3"],
    )  # fmt: skip
    cfg = data_plane_config(job)
    assert (cfg.kind, cfg.host, cfg.port, cfg.timeout_s, cfg.keep, cfg.full_every) == (
        "delta_stream", "10.0.0.1", 29777, 40.0, 3, 0,
    )  # fmt: skip
    assert run_settings(job, "llama").transport == "delta_stream"
    # the engines validate the plan's transport dict as any other kind
    plan_side = TypeAdapter(TransportConfig).validate_python(cfg.model_dump())
    assert plan_side == cfg
    every = load_job_config(None, ["launch.data_plane=delta_stream", "launch.delta_full_every=5"])
    assert data_plane_config(every).full_every == 5
    with pytest.raises(ConfigError, match="delta_full_every"):
        load_job_config(None, ["launch.data_plane=delta_stream", "launch.delta_full_every=-1"])


def test_far_engines_take_the_delta_stream_beside_the_near_data_plane():
    """launch.far_engines: the far sender listens on data_plane_host:far_port with the delta
    settings, the near engines keep data_plane (gloo here), the gateway's transport stays
    the near one, and a far engine's command line also offers the delta stream."""
    from pathlib import Path

    from trainer.launch.commands import engine_argv, far_data_plane_config, far_engine_names

    job = load_job_config(None, [
        "launch.num_engines=3", "launch.far_engines=[2, 0]", "launch.data_plane=gloo",
        "launch.data_plane_host=10.0.0.1", "launch.far_port=29601", "launch.delta_keep=3",
        "launch.data_plane_timeout_s=40",
    ])  # fmt: skip
    far = far_data_plane_config(job)
    assert far is not None
    assert (far.kind, far.host, far.port, far.timeout_s, far.keep) == (
        "delta_stream", "10.0.0.1", 29601, 40.0, 3,
    )  # fmt: skip
    assert data_plane_config(job).kind == "gloo" and run_settings(job, "llama").transport == "gloo"
    assert far_engine_names(job) == ("engine2", "engine0")

    def transports(i: int) -> str:
        argv = engine_argv(job, i, "gw:1", Path("t"), Path("m"), 64)
        return argv[argv.index("--transports") + 1]

    assert [transports(i) for i in range(3)] == ["gloo,delta_stream", "gloo", "gloo,delta_stream"]
    assert far_data_plane_config(load_job_config(None, [])) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["launch.far_engines=[2]"], r"distinct indices 0\.\.1 \(num_engines=2\), got \[2\]"),
        (["launch.far_engines=[1, 1]"], r"distinct indices 0\.\.1"),
        (["launch.far_engines=[0, 1]"], "lists every engine: a mixed plan needs a near engine"),
        (["launch.far_engines=[1]", "launch.data_plane=nccl"], "data_plane=nccl: near engines"),
        (["launch.far_engines=[1]", "launch.data_plane=delta_stream"], "gloo, shm or file"),
        (["launch.far_engines=[1]", "launch.min_engines=2"], "commits on near engines only"),
        (["launch.far_engines=[1]", "launch.trainer_processes=2", "launch.trainer_devices=1"],
         "trainer_processes=2: far engines are fed from trainer process 0"),
    ],
)  # fmt: skip
def test_far_engines_that_cannot_work_are_refused_at_config_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(None, ["launch.num_engines=2", *overrides])


def test_far_engines_on_gpus_with_vllm_refuse_auto_picking_nccl():
    from trainer.launch.commands import resolve_data_plane

    job = load_job_config(None, [
        "launch.num_engines=2", "launch.far_engines=[1]", "launch.accelerator=gpu",
        "rollout.backend=vllm",
    ])  # fmt: skip
    with pytest.raises(ValueError, match="would pick nccl, which cannot sit beside far engines"):
        resolve_data_plane(job)
    gloo = load_job_config(None, [
        "launch.num_engines=2", "launch.far_engines=[1]", "launch.accelerator=gpu",
        "rollout.backend=vllm", "launch.data_plane=gloo",
    ])  # fmt: skip
    assert resolve_data_plane(gloo) == "gloo"
