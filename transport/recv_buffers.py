"""Receive buffers kept across buckets and versions, handed out again only when nothing else
holds a view of them.

A receiver that allocates a fresh buffer per bucket pays the page faults of every byte it
receives (on CPU about as much as the wire itself: `benchmarks/weight_sync.py`). A receiver
cannot simply reuse its buffers either: vLLM's layerwise reload keeps the views of a layer's
tensors until the layer is complete, which may be after the next bucket arrived (a layer cut
by a bucket boundary), and a test's or a loader's own reference may outlive the load. So each
slot's buffer is reused only when its storage has no other holder (torch's storage use count:
the pool's own tensor and its cached storage object, nothing else); otherwise the slot gets a
fresh buffer and the old one lives on, untouched, for as long as its holders keep it. The
bytes a loader was handed are never overwritten under it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from transport.base import BufferPool

if TYPE_CHECKING:
    import torch


RELEASE_WAIT_S = 0.002
"""Seconds `get` waits for a buffer's other holders to let go before it allocates a fresh one:
a finished gloo work is dropped by gloo's worker thread a moment after `wait` returns."""


def held_elsewhere(buf: torch.Tensor) -> bool:
    """Whether any tensor besides `buf` (a view, a slice, a reshape, a collective's pending
    work) shares its storage."""
    import torch

    storage = buf.untyped_storage()  # torch caches this object: it holds one reference
    return int(torch._C._storage_Use_Count(storage._cdata)) > 2


def _released(buf: torch.Tensor) -> bool:
    """Whether `buf` has no other holder, waiting up to `RELEASE_WAIT_S` for them to go."""
    deadline = time.monotonic() + RELEASE_WAIT_S
    while held_elsewhere(buf):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0001)
    return True


class ReceiveBuffers(BufferPool):
    """One uint8 buffer per key on `device`, reused while nobody else holds it.

    `get(key, n)` returns a uint8 `[n]` view of the key's buffer; the buffer is replaced by a
    fresh one when it is too small or when a view of it from an earlier `get` is still alive
    anywhere (see the module docstring). `reused` and `allocated` count the two cases (for
    tests and benchmarks). `nbytes` counts what the pool holds (buffers left to their
    holders not counted), `clear` drops every buffer (holders keep theirs).

    Args:
        device: where the buffers live ("cpu", "cuda:0", ...).
    """

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self.reused = 0
        self.allocated = 0

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        """A uint8 `[nbytes]` view of buffer `key`; its contents are undefined."""
        import torch

        buf = self._buffers.get(key)
        if buf is not None and buf.numel() >= nbytes and _released(buf):
            self.reused += 1
            return buf[:nbytes]
        self._buffers.pop(key, None)  # its holders, if any, keep it alive
        del buf
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._buffers[key] = buf
        self.allocated += 1
        return buf[:nbytes]
