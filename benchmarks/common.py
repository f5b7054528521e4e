"""Pieces several benchmarks share: the model folder by name and the memcpy reference.

Imported by the scripts beside it (`python benchmarks/<name>.py` puts this folder first on
`sys.path`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def model_path(name: str, tmp: Path) -> Path:
    """The HF folder of ``name``: "tiny" (a random tiny llama), "smollm2", or a folder."""
    if name == "tiny":
        from trainer.checkpoints.tiny import make_tiny_checkpoint

        return make_tiny_checkpoint(tmp / "tiny", "llama", vocab_size=320)
    if name == "smollm2":
        from trainer.checkpoints.smollm2 import ensure_smollm2

        return ensure_smollm2()
    return Path(name)


def memcpy_gb_per_s(num_bytes: int, repeats: int = 3) -> float:
    """Median GB/s (1e9 bytes) of copying `num_bytes` between two preallocated torch buffers
    (pages touched once before timing): the host-memory reference of the weight benchmarks."""
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times) / 1e9
