"""Who may rewrite a shared-memory segment: an engine holds a shared `flock` on each segment it
maps until it has moved on to a newer version; the sender rewrites a retired segment only
when it can take the exclusive lock at once, else it writes a fresh one.

Writing a version into a retired segment (same size, pages already in RAM and mapped) costs a
memcpy; a fresh segment costs the page faults of every byte on both sides besides. A segment
an engine still maps must never change under it (vLLM's layerwise reload reads the views
until it finalizes), hence the locks: `flock` locks belong to the open file, so an engine
that dies releases its own, and a sender never waits for one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


def claim_retired(path: Path, tmp: Path) -> int | None:
    """Take a retired segment for rewriting: lock it exclusively without waiting, then move
    it out of sight to `tmp` (an engine that opens `path` afterwards finds nothing; one that
    opened it before and waits for its shared lock finds, once it has it, another version in
    the header and refuses it as stale).

    Returns:
        An open read-write file descriptor of the segment, now at `tmp`, holding the
        exclusive lock (closing it releases the lock); None when an engine still holds the
        segment or it is gone.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(path, tmp)
    except OSError:  # held by an engine (BlockingIOError), or gone meanwhile
        os.close(fd)
        return None
    return fd


def hold_shared(fd: int) -> None:
    """Engine side: take the shared lock of an opened segment, waiting while the sender
    rewrites it (a rewrite is one pass of packing)."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def release(fd: int | None) -> None:
    """Close `fd` (releasing its lock); None or an already closed one is nothing."""
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
