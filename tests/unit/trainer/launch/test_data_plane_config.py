"""The data plane's host, port (or port range) and timeout come from the job config: the
trainer's sender listens on exactly that host and port."""

from __future__ import annotations

import os
import socket

import psutil
import pytest

from trainer.config import ConfigError
from trainer.launch.commands import data_plane_config
from trainer.launch.job_config import load_job_config
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
