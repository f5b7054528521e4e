"""Remove the shared-memory segments that killed vLLM engines leave in ``/dev/shm``.

vLLM's processes talk through POSIX shared memory: its message queues and object stores
(`multiprocessing.shared_memory`, names ``psm_<hex>``, 160–240 MB each, sparse), the CPU
tensor-parallel communicator (``vllm_dist_<id>-...``) and multiprocessing's named semaphores
(``sem.mp-<id>``). A process that exits cleanly unlinks them; one that is SIGKILLed (a dead
engine, a fault test, an out-of-memory kill) cannot, and the segments stay until reboot. On a
host that starts engines for weeks (and on a CI machine) they pile up.

`sweep_stale_segments` removes a segment only when all three hold: its name is one of those
patterns, no living process maps it or holds it open (every ``/proc/<pid>/maps`` and
``/proc/<pid>/fd`` is read), and it was last modified at least `min_age_s` ago (a segment
another engine is creating this second is young). The vLLM backend sweeps before it starts
its engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

#: Name prefixes of the segments vLLM 0.32 and Python's multiprocessing create.
VLLM_SEGMENT_PREFIXES: tuple[str, ...] = ("psm_", "vllm_dist_", "sem.mp-")


def segments_in_use(proc: Path = Path("/proc"), shm_root: Path = Path("/dev/shm")) -> set[str]:
    """Names of the files under `shm_root` that some living process maps or holds open.

    Reads every readable ``/proc/<pid>/maps`` and ``/proc/<pid>/fd/*``; a process that exits
    while being read, or whose files this user cannot read, is skipped (as root, none is).

    Returns:
        File names (not paths) directly under `shm_root`.
    """
    prefix = str(shm_root).rstrip("/") + "/"
    used: set[str] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for line in (entry / "maps").read_text().splitlines():
                at = line.find(prefix)
                if at >= 0:
                    used.add(line[at + len(prefix) :].removesuffix(" (deleted)").split("/")[0])
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target[len(prefix) :].split("/")[0])
        except OSError:
            continue
    return used


def sweep_stale_segments(
    shm_root: Path = Path("/dev/shm"),
    min_age_s: float = 600.0,
    prefixes: Sequence[str] = VLLM_SEGMENT_PREFIXES,
    proc: Path = Path("/proc"),
) -> list[str]:
    """Unlink the segments under `shm_root` that dead processes left (see the module doc).

    Args:
        shm_root: the tmpfs of POSIX shared memory.
        min_age_s: seconds since a segment's last modification below which it is kept.
        prefixes: the name prefixes that may be removed; any other file is never touched.
        proc: the proc filesystem to read the living processes' maps and open files from.

    Returns:
        The names removed, sorted. A file that vanishes meanwhile, or that cannot be removed,
        is left out (never raises for one segment).

    Raises:
        ValueError: `min_age_s` < 0, or `prefixes` empty or holding an empty string (which
            would match every file).
    """
    if min_age_s < 0:
        raise ValueError(f"min_age_s must be >= 0, got {min_age_s}")
    if not prefixes or any(not p for p in prefixes):
        raise ValueError(f"prefixes must be non-empty strings, got {list(prefixes)}")
    if not shm_root.is_dir():
        return []
    candidates = [p for p in shm_root.iterdir() if p.name.startswith(tuple(prefixes))]
    if not candidates:
        return []
    used = segments_in_use(proc, shm_root)
    now = time.time()
    removed = []
    for path in candidates:
        if path.name in used:
            continue
        try:
            if now - path.stat().st_mtime < min_age_s or not path.is_file():
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    return sorted(removed)
