"""The sweep of dead engines' shared-memory segments: it removes an old, unmapped vLLM-named
segment and nothing else (a segment a living process maps or holds open, a young one, a file of
another name), on a private folder standing in for /dev/shm and the real /proc."""

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_engine.vllm.shm_sweep import segments_in_use, sweep_stale_segments


def _segment(root: Path, name: str, age_s: float = 3600.0, size: int = 4096) -> Path:
    path = root / name
    path.write_bytes(b"\0" * size)
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_removes_only_old_unmapped_segments_with_vllm_names(tmp_path):
    dead = _segment(tmp_path, "psm_0badc0de")
    dist = _segment(tmp_path, "vllm_dist_abc-tp:0-[0-1]-cpushm_0")
    sem = _segment(tmp_path, "sem.mp-xq53e4ab", size=32)
    young = _segment(tmp_path, "psm_young", age_s=1.0)
    other = _segment(tmp_path, "postgres_segment")
    mapped = _segment(tmp_path, "psm_mapped")
    opened = _segment(tmp_path, "psm_opened")
    # a living child process maps one segment and holds the other open (as an engine would)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys, time\n"
            f"f = open({str(mapped)!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()\n"
            f"g = open({str(opened)!r}, 'rb')\n"
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        assert {"psm_mapped", "psm_opened"} <= segments_in_use(shm_root=tmp_path)
        removed = sweep_stale_segments(shm_root=tmp_path, min_age_s=600)
    finally:
        holder.kill()
        holder.wait()
    assert removed == sorted([dead.name, dist.name, sem.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [young.name, other.name, mapped.name, opened.name]
    )
    # once its holder is gone, the mapped one is stale too
    assert sweep_stale_segments(shm_root=tmp_path, min_age_s=600) == ["psm_mapped", "psm_opened"]


def test_this_process_mapping_counts_as_in_use(tmp_path):
    path = _segment(tmp_path, "psm_self")
    with open(path, "r+b") as f:
        view = mmap.mmap(f.fileno(), 0)
    try:
        assert sweep_stale_segments(shm_root=tmp_path, min_age_s=0) == []
    finally:
        view.close()
    assert sweep_stale_segments(shm_root=tmp_path, min_age_s=0) == ["psm_self"]


def test_missing_root_and_bad_arguments(tmp_path):
    assert sweep_stale_segments(shm_root=tmp_path / "absent") == []
    with pytest.raises(ValueError, match="min_age_s"):
        sweep_stale_segments(shm_root=tmp_path, min_age_s=-1)
    with pytest.raises(ValueError, match="prefixes"):
        sweep_stale_segments(shm_root=tmp_path, prefixes=("",))
    with pytest.raises(ValueError, match="prefixes"):
        sweep_stale_segments(shm_root=tmp_path, prefixes=())
