"""The shared-memory data plane alone against a memcpy of the same bytes, in the same run.

`shm_reference` moves versions of tensors already in the wire dtype and the engine's layout
(what the trainer hands the data plane once it has cast them) through `transport.shm`: the
sender writes each bucket once into a segment (a retired one, rewritten in place once the
receiver moved on: `transport.shm_lease`), the receiver maps it and hands out views (its
callback drops them: no engine). Imported by `weight_sync.py`.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

from common import memcpy_gb_per_s


def shm_reference(
    manifest_of: Callable[[int], Any],
    ready: Callable[[], Iterable[tuple[str, Any]]],
    repeats: int = 3,
    root: str = "/dev/shm",
) -> dict[str, float]:
    """Seconds and GB/s of the shm data plane alone, and its ratio to a memcpy.

    Args:
        manifest_of: version -> the `Manifest` of that version (same layout every time).
        ready: a callable returning the (name, tensor) pairs of one version in manifest
            order, in the manifest's dtype and shape, contiguous (nothing to cast).
        repeats: timed versions, after 2 untimed ones (which create the 2 kept segments).
        root: the tmpfs the segments go to (a fresh folder under it, removed at the end).

    Returns:
        `shm_transfer_s`: median seconds of one version, the sender's write of every bucket
        and commit plus the receiver's mapping, checks and views; `shm_gb_per_s`: payload
        GB/s (1e9 bytes) over it; `shm_memcpy_gb_per_s`: `common.memcpy_gb_per_s` of the same
        bytes right after; `shm_over_memcpy` the ratio of the two; `shm_reused`: versions
        written into a retired segment.
    """
    from transport.shm import ShmReceiver, ShmSender

    seconds = []
    with tempfile.TemporaryDirectory(dir=root, prefix="jaxrl-shm-ref-") as tmp:
        sender, receiver = ShmSender(tmp, keep=2), ShmReceiver(tmp, timeout_s=60)
        try:
            for v in range(repeats + 2):
                manifest = manifest_of(v)
                t0 = time.perf_counter()
                sender.send(manifest, ready())
                receiver.receive(manifest, lambda bucket: None)
                if v >= 2:
                    seconds.append(time.perf_counter() - t0)
        finally:
            receiver.close()
            sender.close()
    num_bytes = manifest_of(0).total_bytes
    secs = statistics.median(seconds)
    memcpy = memcpy_gb_per_s(num_bytes)
    gb_per_s = num_bytes / secs / 1e9
    return {
        "shm_transfer_s": secs,
        "shm_gb_per_s": gb_per_s,
        "shm_memcpy_gb_per_s": memcpy,
        "shm_over_memcpy": gb_per_s / memcpy,
        "shm_reused": float(sender.reused),
    }
